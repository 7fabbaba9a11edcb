"""Peer of bench/bench_ops_gemm.c: torch.matmul in bf16 on the same shapes.

The weight-gradient rows (linmoe: fp32 C, beta = 1, dW += dY^T X) are timed against
torch.matmul with a bf16 result, which is what autograd does for bf16 weights; the byte
counts differ (linmoe reads and writes the fp32 accumulator), so that ratio flatters torch.
"""

T = 32768
# (name, trans_a, trans_b, M, N, K, fp32 accumulate): exactly bench_ops_gemm.c's table
SHAPES = [
    ("gemm", 0, 1, T, 3072, 1024, False), ("gemm", 0, 1, T, 1024, 2688, False),
    ("gemm_wgrad", 1, 0, 3072, 1024, T, True), ("gemm_wgrad", 1, 0, 1024, 2688, T, True),
    ("gemm", 0, 1, T, 6144, 2048, False), ("gemm", 0, 1, T, 2048, 5376, False),
    ("gemm_wgrad", 1, 0, 6144, 2048, T, True), ("gemm_wgrad", 1, 0, 2048, 5376, T, True),
]


def shape_str(ta, tb, M, N, K, acc):
    tag = ("T" if ta else "N") + ("T" if tb else "N")
    return f"M={M} N={N} K={K} {tag}" + (" f32+=" if acc else "")


def run(do_bench, quick):
    import torch
    rows = []
    for name, ta, tb, M, N, K, acc in SHAPES:
        shape = shape_str(ta, tb, M, N, K, acc)
        peer = "torch.matmul bf16" + (" (bf16 out)" if acc else "")
        try:
            dev, bf = "cuda", torch.bfloat16
            a = torch.randn(K, M, device=dev, dtype=bf) if ta else torch.randn(M, K, device=dev,
                                                                                dtype=bf)
            b = (torch.randn(N, K, device=dev, dtype=bf) if tb else
                 torch.randn(K, N, device=dev, dtype=bf)) * 0.03
            oa = a.t() if ta else a
            ob = b.t() if tb else b
            ms = do_bench(lambda: torch.matmul(oa, ob))
            rows.append({"name": name, "shape": shape, "pass": "fwd", "ms": ms, "peer": peer})
            del a, b, oa, ob
        except Exception as e:  # noqa: BLE001 - report, do not stop the run
            rows.append({"name": name, "shape": shape, "pass": "fwd", "ms": None, "peer": peer,
                         "error": repr(e)[:200]})
        torch.cuda.empty_cache()
    return rows
