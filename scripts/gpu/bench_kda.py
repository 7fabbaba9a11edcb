"""linmoe's CUDA KDA forward beside fla's chunk_kda, in one process, on the same
torch tensors (the GPU machine; run by scripts/gpu/bench.sh).

    python3 scripts/gpu/bench_kda.py [--quick] [--json OUT.json]

Needs: torch with CUDA, build-gpu/liblinmoe_cuda.so (scripts/gpu/pack.sh), and fla's
source in peers/fla (git-ignored; the device tool carries it). For each shape
(B, T, H, D) of issue 6 it draws one set of inputs (bf16 q, k, v, g raw, beta raw;
fp32 A_log, dt_bias), runs

  linmoe  lm_kda_cuda_forward_flat (bounded gate lower_bound -5, in-kernel l2norm and
          sigmoid, final state)
  fla     chunk_kda(..., use_gate_in_kernel=True, safe_gate=True, lower_bound=-5,
          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
          output_final_state=True)  -- the training forward

checks that linmoe's o and final_state are within 0.01 relative RMS of fla's, and
times both with CUDA events (triton.testing.do_bench, median of the repeats after
warm-up). It also measures the two ceilings in the same run: a bf16 matmul through
torch (cuBLAS) and a device-to-device copy. Prints a table and writes JSON.
"""

import argparse
import ctypes
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "peers", "fla"))

SHAPES = [(1, 8192, 64, 128), (8, 4096, 16, 128), (1, 32768, 16, 128)]
LB = -5.0


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def load_linmoe():
    lib = ctypes.CDLL(os.path.join(ROOT, "build-gpu", "liblinmoe_cuda.so"))
    f = lib.lm_kda_cuda_forward_flat
    P = ctypes.c_void_p
    f.argtypes = [ctypes.c_int] * 6 + [P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                       ctypes.c_float, ctypes.c_int, ctypes.c_int] + [P] * 10 + \
        [ctypes.c_char_p, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def linmoe_forward(f, q, k, v, g, beta, A_log, dt_bias, o, ht):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    buf = ctypes.create_string_buffer(512)
    st = f(B, T, H, HV, K, V, None, 0, 0, 2, ctypes.c_float(LB), ctypes.c_float(0.0), 1, 1,
           q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
           A_log.data_ptr(), dt_bias.data_ptr(), None, o.data_ptr(), ht.data_ptr(), buf, 512)
    if st != 0:
        raise RuntimeError(buf.value.decode())


def ceilings(do_bench):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    tflops = 2 * n ** 3 / (t * 1e-3) / 1e12
    x = torch.empty(2 ** 30, device="cuda", dtype=torch.uint8)  # 1 GiB
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=100, rep=500, return_mode="median")
    gbs = 2 * x.numel() / (t * 1e-3) / 1e9
    return tflops, gbs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter shapes (a smoke run)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from triton.testing import do_bench
    from fla.ops.kda import chunk_kda

    f = load_linmoe()
    tflops, gbs = ceilings(do_bench)
    print(f"ceilings: bf16 matmul {tflops:.0f} TFLOP/s, copy {gbs:.0f} GB/s", flush=True)
    rows = []
    shapes = [(B, T // 8, H, D) for B, T, H, D in SHAPES] if args.quick else SHAPES
    for B, T, H, D in shapes:
        torch.manual_seed(0)
        dev, bf = "cuda", torch.bfloat16
        q = torch.randn(B, T, H, D, device=dev, dtype=bf)
        k = torch.randn(B, T, H, D, device=dev, dtype=bf)
        v = torch.randn(B, T, H, D, device=dev, dtype=bf)
        g = torch.randn(B, T, H, D, device=dev, dtype=bf)
        beta = torch.randn(B, T, H, device=dev, dtype=bf)
        A_log = (0.3 * torch.randn(H, device=dev)).float()
        dt_bias = (0.5 * torch.randn(H * D, device=dev)).float()
        o = torch.empty(B, T, H, D, device=dev, dtype=bf)
        ht = torch.empty(B, H, D, D, device=dev, dtype=torch.float32)

        def run_fla():
            return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                             safe_gate=True, lower_bound=LB, use_qk_l2norm_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, output_final_state=True)

        def run_linmoe():
            linmoe_forward(f, q, k, v, g, beta, A_log, dt_bias, o, ht)

        with torch.no_grad():
            o_f, ht_f = run_fla()
            run_linmoe()
            torch.cuda.synchronize()
            eo, eh = rel_rms(o, o_f), rel_rms(ht, ht_f.float())
            t_l = do_bench(run_linmoe, warmup=50, rep=300, return_mode="median")
            t_f = do_bench(run_fla, warmup=50, rep=300, return_mode="median")
        r = dict(B=B, T=T, H=H, D=D, linmoe_ms=t_l, fla_ms=t_f, speedup_vs_fla=t_f / t_l,
                 o_vs_fla=eo, final_state_vs_fla=eh, ok=eo <= 0.01 and eh <= 0.01)
        rows.append(r)
        print(f"B={B} T={T} H={H} D={D}: linmoe {t_l:.3f} ms, fla {t_f:.3f} ms, "
              f"linmoe/fla speed {t_f / t_l:.2f}x; vs fla o {eo:.2e} final_state {eh:.2e}", flush=True)
    out = dict(peer="fla chunk_kda (training forward, safe_gate, lower_bound -5)",
               torch=torch.__version__, device=torch.cuda.get_device_name(),
               matmul_tflops=tflops, copy_gbs=gbs, rows=rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    print("\n| B | T | H | D | linmoe ms | fla ms | speed vs fla | o vs fla | state vs fla |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['T']} | {r['H']} | {r['D']} | {r['linmoe_ms']:.3f} | {r['fla_ms']:.3f} | "
              f"{r['speedup_vs_fla']:.2f}x | {r['o_vs_fla']:.1e} | {r['final_state_vs_fla']:.1e} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
