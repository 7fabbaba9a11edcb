"""Time one full training step of the PyTorch reference on the CPU: the peer number that
linmoe's C benchmark compares itself with.

    python3 scripts/reference/bench_step.py --config configs/bench-cpu.json --threads N \\
        [--warmup 1] [--iters 3] [--batch B] [--seq T] [--seed S]

One step = forward of the model built from the config (random init as params.h describes,
fp32, the chunked "fast" KDA with chunk 64, dropless MoE) + cross-entropy on next-token
labels + loss.backward(). Gradients are cleared (set to None) before each step; no optimizer.
torch.set_num_threads(N) and torch.set_num_interop_threads(1). B and T default to the
config's batch_size and seq_len.

The LAST line of stdout is one JSON object (the C benchmark popens this script and parses it):
    {"peer": "pytorch <torch version>", "threads": N, "B": .., "T": .., "step_s_median": ..,
     "step_s": [..]}
Exit code 3 (message on stderr) when torch cannot be imported; 2 for bad arguments.
"""

import argparse
import json
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description="time one training step of linmoe_ref (CPU, fp32)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--batch", type=int, default=0, help="B (default: the config's batch_size)")
    ap.add_argument("--seq", type=int, default=0, help="T (default: the config's seq_len)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads < 1 or args.iters < 1 or args.warmup < 0:
        ap.error("--threads and --iters must be >= 1, --warmup >= 0")

    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        print(f"bench_step: cannot import torch: {e}", file=sys.stderr)
        sys.exit(3)
    # the inter-op pool must be sized before any parallel work starts
    torch.set_num_interop_threads(1)
    torch.set_num_threads(args.threads)

    sys.dont_write_bytecode = True  # no __pycache__ next to the sources
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import linmoe_ref as R

    cfg = R.Config.load(args.config)
    B = args.batch or cfg.batch_size or 1
    T = args.seq or cfg.seq_len or 512
    model = R.LinMoE(cfg, R.init_params(cfg, args.seed), dtype=torch.float32, kda_mode="chunk")
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = R.next_token_labels(ids)

    times = []
    for it in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _, loss, _ = model(ids, labels)
        loss.backward()
        dt = time.perf_counter() - t0
        phase = "warmup" if it < args.warmup else "step"
        print(f"{phase} {it}: {dt:.3f} s  loss {loss.item():.4f}", file=sys.stderr)
        if it >= args.warmup:
            times.append(dt)
    print(json.dumps({"peer": f"pytorch {torch.__version__}", "threads": args.threads, "B": B, "T": T,
                      "step_s_median": statistics.median(times), "step_s": times}))


if __name__ == "__main__":
    main()
