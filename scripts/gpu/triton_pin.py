"""Triton autotuning for the peers' kernels (fla) within one device call.

A fresh GPU machine has no Triton cache, and fla's autotuners benchmark every config of every
kernel on first use: for the gpu-moe twin that took more than 400 s before its first step
ended (2026-12-02). Two ways to cut it, both applied by patching
triton.runtime.autotuner.Autotuner before fla is imported:

  first          every autotuner keeps only its first config (the peer may run slower than
                 tuned);
  pinned:FILE    every autotuner keeps the configs that its own autotuning selected on this
                 GPU type in an earlier run (FILE: JSON {kernel name: [config strings]},
                 made by `python3 scripts/gpu/triton_pin.py LOG > FILE` from a log written with
                 TRITON_PRINT_AUTOTUNING=1); a kernel the file does not name keeps its first
                 config. With one selected config Triton skips benchmarking it, so the peer runs
                 at its tuned configs without the tuning time.

Config strings are str(triton.Config) ("BS: 32, num_warps: 2, num_ctas: 1, num_stages: 3,
maxnreg: None"), compared literally: use a file made with the same Triton version.
"""
import inspect
import json
import re
import sys


def parse_log(text):
    """{kernel name: sorted unique best configs} from TRITON_PRINT_AUTOTUNING=1 output."""
    best = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"Triton autotuning for function (\S+?),?$", line.strip())
        if m:
            name = m.group(1)
            continue
        m = re.match(r"best config selected: (.*?);?$", line.strip())
        if m and name:
            best.setdefault(name, set()).add(m.group(1))
            name = None
    return {k: sorted(v) for k, v in sorted(best.items())}


def patch(mode):
    """Patch Triton's Autotuner for mode "first" or "pinned:FILE"; returns a one-line
    description, or None when Triton is not importable or mode is "full"."""
    if mode == "full":
        return None
    try:
        from triton.runtime import autotuner
    except ImportError:
        return None
    best = {}
    if mode.startswith("pinned:"):
        with open(mode[len("pinned:"):]) as f:
            best = json.load(f)
    elif mode != "first":
        raise ValueError(f"autotune mode {mode!r}: want full, first or pinned:FILE")
    orig = autotuner.Autotuner.__init__
    stats = {"pinned": 0, "first": 0}

    def init(self, fn, arg_names, configs, *args, **kwargs):
        configs = list(configs)
        base = fn  # the Python function under the JIT / heuristics wrappers (as Triton names it)
        while not inspect.isfunction(base) and hasattr(base, "fn"):
            base = base.fn
        name = getattr(base, "__name__", "")
        keep = [c for c in configs if str(c) in set(best.get(name, ()))]
        if keep:
            stats["pinned"] += 1
        else:
            keep = configs[:1]
            stats["first"] += 1
        orig(self, fn, arg_names, keep, *args, **kwargs)

    autotuner.Autotuner.__init__ = init
    if mode == "first":
        return "Triton autotuning limited to each kernel's first config (the peers may run " \
               "slower than tuned)"
    return (f"Triton autotuning pinned to the configs selected earlier on this GPU type "
            f"({mode[len('pinned:'):]}: {len(best)} kernels; others keep their first config)")


def main():
    if len(sys.argv) != 2:
        print("usage: triton_pin.py LOG  (prints the pinned-config JSON)", file=sys.stderr)
        return 2
    with open(sys.argv[1], errors="replace") as f:
        print(json.dumps(parse_log(f.read()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
