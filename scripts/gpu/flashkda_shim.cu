// A C entry point to FlashKDA's forward (github.com/MoonshotAI/FlashKDA, CUTLASS,
// sm_90a) for Python ctypes, so scripts/gpu/bench_kda.py can time it in the same
// process as linmoe and fla without PyTorch's extension builder (the GPU machine
// has no network; building here needs only nvcc and the CUTLASS headers).
//
// This file is linmoe's; FlashKDA's own code stays in the git-ignored peers/FlashKDA
// and is compiled next to it by scripts/gpu/build_flashkda.sh: its
// csrc/smxx/fwd_launch.cu defines and explicitly instantiates launch_fwd<...>
// (csrc/fwd.h), a host function of raw device pointers. What FlashKDA's torch
// binding (csrc/flash_kda.cpp) does around that call is redone here:
//   * beta [B*T, H] is transposed to [H, B*T] (FlashKDA loads it with 1-D TMA);
//   * the gate scale handed to the kernels is lower_bound * log2(e) (base-2 gate);
//   * total_tiles = N * ceil(T/16) for a batch, ceil(T_total/16) + N for varlen;
//   * the workspace is H * total_tiles * WorkspaceSizes<16,128>::kPerTile bytes plus
//     the (N+1) int32 tile prefix rounded up to 128 bytes (flashkda_workspace_bytes).
//
// Input conventions (FlashKDA's README, tests/torch_ref.py): q, k, v, g, out bf16
// [B, T, H, 128]; g is the raw gate input, activated in-kernel as
// lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :])) (fla's safe_gate form);
// q and k are l2-normalised in-kernel (eps 1e-6); beta [B, T, H] bf16 logits, sigmoid
// in-kernel; A_log [H] fp32, dt_bias [H, 128] fp32; scale explicit; states
// [N, H, V, K] (value-major, fla's transpose_state_layout) bf16 or fp32; no GVA.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fwd.h"
#include "smxx/utils.cuh"

namespace lm_fkda {

constexpr int kChunk = 16;
constexpr int kD = 128;

__global__ void transpose_beta(const __nv_bfloat16 *__restrict__ in, __nv_bfloat16 *__restrict__ out,
                               int64_t rows, int cols) {
    // in [rows, cols] -> out [cols, rows]
    int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        int64_t r = i / cols;
        int c = int(i - r * cols);
        out[int64_t(c) * rows + r] = in[i];
    }
}

int64_t tiles_for(int64_t T_total, int64_t T_seq, int N, bool varlen) {
    return varlen ? (T_total + kChunk - 1) / kChunk + N : int64_t(N) * ((T_seq + kChunk - 1) / kChunk);
}

} // namespace lm_fkda
using lm_fkda::kChunk;
using lm_fkda::kD;
using lm_fkda::tiles_for;
using lm_fkda::transpose_beta;

extern "C" {

// Bytes of device workspace flashkda_fwd needs for B sequences of T tokens (or, with
// varlen != 0, N packed sequences of T tokens in total) and H heads.
int64_t flashkda_workspace_bytes(int64_t B, int64_t T, int H, int N, int varlen) {
    int64_t T_total = B * T;
    int64_t tiles = tiles_for(T_total, T, varlen ? N : int(B), varlen != 0);
    int64_t prefix = ((int64_t(N) + 1) * 4 + 127) / 128 * 128;
    return int64_t(H) * tiles * WorkspaceSizes<kChunk, kD>::kPerTile + prefix;
}

// FlashKDA forward. Device pointers: q, k, v, g, beta, out (bf16), beta_t (bf16 scratch
// of B*T*H elements), workspace (flashkda_workspace_bytes), A_log [H], dt_bias [H*128]
// (fp32), h0 / ht (NULL or [N, H, V, K], fp32 when state_fp32 else bf16), cu_seqlens
// (NULL, or device int64 [N+1] with B == 1). stream is a cudaStream_t (0 = legacy
// default). Asynchronous; returns 0, or a cudaError_t from the launches, or -1 for an
// unsupported shape (D != 128).
int flashkda_fwd(int B, int T, int H, int D, const void *q, const void *k, const void *v,
                 const void *g, const void *beta, void *beta_t, float scale, void *out,
                 void *workspace, const float *A_log, const float *dt_bias, float lower_bound,
                 const void *h0, void *ht, int state_fp32, const int64_t *cu_seqlens, int N,
                 void *stream) {
    if (D != kD || B < 1 || T < 1 || H < 1) return -1;
    bool varlen = cu_seqlens != nullptr;
    if (varlen && B != 1) return -1;
    if (!varlen) N = B;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    int64_t T_total = int64_t(B) * T;
    int64_t n = T_total * H;
    transpose_beta<<<unsigned((n + 255) / 256), 256, 0, st>>>(
        static_cast<const __nv_bfloat16 *>(beta), static_cast<__nv_bfloat16 *>(beta_t), T_total, H);
    using BF = cutlass::bfloat16_t;
    auto qp = static_cast<const BF *>(q), kp = static_cast<const BF *>(k);
    auto vp = static_cast<const BF *>(v), gp = static_cast<const BF *>(g);
    auto bp = static_cast<const BF *>(beta_t);
    auto op = static_cast<BF *>(out);
    int tiles = int(tiles_for(T_total, T, N, varlen));
    float gate_scale = float(double(lower_bound) * 1.4426950408889634);
    bool hi = h0 != nullptr, ho = ht != nullptr, f32 = state_fp32 != 0;
#define LM_FKDA(HI, HO, F32, VL)                                                                    \
    launch_fwd<kD, HI, HO, F32, VL>(qp, kp, vp, gp, bp, h0, scale, ht, op, workspace, tiles,       \
                                    int(T_total), H, N, cu_seqlens, A_log, dt_bias, gate_scale, st)
#define LM_FKDA_STATE(VL)                                                                           \
    if (!hi && !ho) LM_FKDA(false, false, false, VL);                                              \
    else if (hi && ho) { if (f32) LM_FKDA(true, true, true, VL); else LM_FKDA(true, true, false, VL); } \
    else if (ho) { if (f32) LM_FKDA(false, true, true, VL); else LM_FKDA(false, true, false, VL); }     \
    else { if (f32) LM_FKDA(true, false, true, VL); else LM_FKDA(true, false, false, VL); }
    if (varlen) {
        LM_FKDA_STATE(true)
    } else {
        LM_FKDA_STATE(false)
    }
#undef LM_FKDA_STATE
#undef LM_FKDA
    return int(cudaGetLastError());
}

} // extern "C"
