#!/usr/bin/env python3
"""`linmoe bench ops` beside its peers in one process, on the GPU machine.

Loads build-gpu/liblinmoe_cuda.so (scripts/gpu/pack.sh builds it: the library plus
bench/bench_ops*.c), runs lm_bench_ops_run (linmoe's ops at the GPU configs' shapes, with
the bf16 matmul rate and copy bandwidth measured in the same run), then the PyTorch / fla
peers of scripts/gpu/ops_peers/<family>.py on the same shapes, and prints one table:
linmoe ms, peer ms, peer / linmoe (> 1: linmoe faster), linmoe's fraction of its floor.

usage: bench_ops.py [--ops LIST] [--quick] [--json FILE]
"""
import argparse
import ctypes
import importlib
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAMILIES = ["embedding", "norm", "swiglu", "short_conv", "gemm", "attention", "router", "moe",
            "attnres", "cross_entropy", "adamw"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_ops.json"))
    ap.add_argument("--lib", default=os.environ.get("LINMOE_CUDA_LIB", os.path.join(
        ROOT, os.environ.get("LINMOE_GPU_DIR", "build-gpu"), "liblinmoe_cuda.so")))
    a = ap.parse_args()
    fams = [f for f in (a.ops.split(",") if a.ops else FAMILIES) if f]

    import torch
    import triton.testing
    sys.path.insert(0, os.path.join(ROOT, "peers", "fla"))  # fla's source, git-ignored
    sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))
    torch.cuda.init()

    lib = ctypes.CDLL(a.lib)
    lib.lm_bench_ops_run.restype = ctypes.c_int
    lib.lm_bench_ops_run.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    tmp = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    rc = lib.lm_bench_ops_run(",".join(fams).encode(), tmp.encode(), int(a.quick))
    with open(tmp) as f:
        mine = json.load(f)
    torch.cuda.synchronize()

    def do_bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    order = ["attention", "moe", "cross_entropy", "norm", "adamw", "attnres", "swiglu", "gemm",
             "embedding", "short_conv", "router"]
    fams_peer = [f for f in order if f in fams] + [f for f in fams if f not in order]
    print()
    print(f"bf16 matmul {mine['matmul_tflops']:.0f} TFLOP/s, copy {mine['copy_gbs']:.0f} GB/s")
    print(f"{'op':<22} {'shape':<32} {'pass':<8} {'linmoe ms':>10} {'of floor':>8} "
          f"{'peer':<28} {'peer ms':>9} {'peer/linmoe':>11}")
    peers, rows = [], []

    def dump():
        with open(a.json, "w") as f:
            json.dump({"bench": "ops", "matmul_tflops": mine["matmul_tflops"],
                       "copy_gbs": mine["copy_gbs"], "records": rows, "peers": peers}, f, indent=1)

    # peers family by family, each table part printed (and the JSON rewritten) as soon as its
    # peers are done, so a run cut short keeps what it measured
    for fam in fams_peer:
        t0 = time.time()
        got = []
        try:
            mod = importlib.import_module("ops_peers." + fam)
            got = mod.run(do_bench, a.quick)
        except ModuleNotFoundError:
            got = []
        except Exception as e:  # a peer that cannot run is reported, not fatal
            got = [{"name": fam, "shape": "-", "pass": "-", "ms": None, "peer": "?",
                    "error": repr(e)[:200]}]
        torch.cuda.empty_cache()
        peers += got
        names = {g["name"] for g in got}
        for r in mine["records"]:
            if r.get("family") != fam:
                continue
            match = [p for p in got if (p["name"], p["shape"], p["pass"]) ==
                     (r["name"].split("/")[0], r["shape"], r["pass"])] or [None]
            for p in match:
                pm = p.get("ms") if p else None
                ratio = (pm / r["ms"]) if (pm and r["ms"] > 0) else None
                peer = (p.get("peer", "?") if p else "-")
                print(f"{r['name']:<22} {r['shape']:<32} {r['pass']:<8} {r['ms']:>10.4f} "
                      f"{r['ratio_to_limit']:>8.2f} {peer[:28]:<28} "
                      f"{(f'{pm:.4f}' if pm else '-'):>9} {(f'{ratio:.2f}x' if ratio else '-'):>11}")
                rows.append(dict(r, peer=peer, peer_ms=pm, ratio_to_peer=ratio,
                                 peer_error=p.get("error") if p else None))
        for p in got:
            if p.get("error"):
                print(f"  peer {p.get('peer', '?')} {p['name']} {p['shape']} {p['pass']}: "
                      f"{p['error'][:160]}")
        print(f"  ({fam} peers: {time.time() - t0:.0f} s)")
        dump()
    print(f"json: {a.json}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
