/* KDA / GDN chunked forward on the GPU (include/linmoe/kda_cuda.h has the contract).
 *
 * Notation per (sequence n, value head hv), chunk of L <= 64 tokens starting at t0,
 * rows i, j in [0, L), channels d in [0, K), c in [0, V) (reference/kda.md §2.1):
 *   G_i      = sum_{r <= i} g_r                      (per channel; <= 0, decreasing)
 *   Akk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)   (j < i)
 *   Aqk[i,j] = sum_d q_i k_j exp(G_i - G_j)          (j <= i; q already scaled)
 *   X        = (I + Akk)^-1                           (unit lower triangular)
 *   w        = X (beta k exp(G)),   u = X (beta v)
 *   per chunk, with S the state at its start:
 *   v'       = u - w S
 *   o        = (q exp(G)) S + Aqk v'
 *   S       <- exp(G_last) * S + (k exp(G_last - G))^T v'
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/kda_cuda.h"

#define BT 64   /* chunk */
#define BS 16   /* sub-tile */
#define KMAX 128
#define BV 32   /* V slice per CTA of the recurrence */
#define NTHR 256

namespace {

struct Params {
    const __nv_bfloat16 *q, *k, *v, *g, *beta;
    const float *A_log, *dt_bias, *h0;
    __nv_bfloat16 *o;
    float *ht;
    /* workspace, indexed by global chunk row (chunk*BT + i) and head */
    float *w, *u, *qg, *kg, *Aqk, *gl;
    const int2 *chunks;   /* [nchunks] (t0, L) in token rows of the flattened [B*T] */
    const int2 *seqs;     /* [N] (first chunk, number of chunks) */
    const int *seq_start; /* [N] first token row */
    int nchunks, N;
    int T, H, HV, K, V, gdn, gate, l2, sig;
    float lb, scale;
};

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

__device__ __forceinline__ float gate_act(const Params &p, float x, int hv, int d) {
    float a = p.A_log ? __expf(p.A_log[hv]) : 1.0f;
    float b = p.dt_bias ? p.dt_bias[p.gdn ? hv : hv * p.K + d] : 0.0f;
    if (p.gate == LM_GATE_SOFTPLUS) {
        float z = x + b;
        float sp = z > 20.0f ? z : log1pf(expf(z));
        return -a * sp;
    }
    if (p.gate == LM_GATE_BOUNDED)
        return p.lb * sigmoidf_(a * (x + b));
    return x;
}

/* ------------------------------------------------------------------ kernel 1 */
/* One CTA per (chunk, value head). Shared memory (fp32, rows padded by one word):
 *   sq, sk, sG [BT][KP]   q (scaled), k, cumulative log-decay G
 *   sF [2][BT-BS][KP]     per off-diagonal pass: q_i e^{G_i - G_e}, k_i e^{G_i - G_e}
 *   sT [BS][KP]           the earlier tile's k_j e^{G_e - G_j}
 *   sA, sQ [BT][BT+1]     Akk; Aqk
 *   sb [BT]               beta
 *   sX [BT][BT+1]         X = (I + Akk)^-1 (blocked inverse; sF is its scratch)
 * Later phases reuse sq for beta k e^{G} and sG for beta v. */
__global__ void __launch_bounds__(NTHR) kda_intra(Params p) {
    extern __shared__ float smem[];
    const int KP = KMAX + 1;
    float *sq = smem, *sk = sq + BT * KP, *sG = sk + BT * KP;
    float *sF = sG + BT * KP;          /* [2][BT - BS][KP] */
    float *sT = sF + 2 * (BT - BS) * KP;
    float *sA = sT + BS * KP, *sQ = sA + BT * (BT + 1);
    float *sb = sQ + BT * (BT + 1);
    float *sX = sb + BT; /* [BT][BT+1]: X = (I + Akk)^-1, unit diagonal stored */
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int2 ch = p.chunks[ci];
    const int t0 = ch.x, L = ch.y;
    const int K = p.K, V = p.V, H = p.H, HV = p.HV;
    const int h = hv / (HV / H);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t wrow0 = (int64_t)ci * BT;

    /* load q, k, g (zero rows past L) */
    for (int e = tid; e < BT * K; e += NTHR) {
        const int i = e / K, d = e % K;
        float qv = 0, kv = 0, gv = 0;
        if (i < L) {
            const int64_t row = (int64_t)(t0 + i);
            qv = __bfloat162float(p.q[(row * H + h) * K + d]);
            kv = __bfloat162float(p.k[(row * H + h) * K + d]);
            const float x = p.gdn ? __bfloat162float(p.g[row * HV + hv])
                                  : __bfloat162float(p.g[(row * HV + hv) * K + d]);
            gv = gate_act(p, x, hv, d);
        }
        sq[i * KP + d] = qv;
        sk[i * KP + d] = kv;
        sG[i * KP + d] = gv;
    }
    if (tid < BT) {
        float b = 0;
        if (tid < L) {
            b = __bfloat162float(p.beta[(int64_t)(t0 + tid) * HV + hv]);
            if (p.sig)
                b = sigmoidf_(b);
        }
        sb[tid] = b;
    }
    for (int e = tid; e < BT * (BT + 1); e += NTHR) {
        sA[e] = 0;
        sQ[e] = 0;
        sX[e] = 0;
    }
    __syncthreads();
    /* cumulative sum over rows per channel; l2norm per row (a warp per row) */
    for (int d = tid; d < K; d += NTHR) {
        float s = 0;
        for (int i = 0; i < BT; i++) {
            s += sG[i * KP + d];
            sG[i * KP + d] = s;
        }
    }
    for (int i = warp; i < BT; i += NTHR / 32) {
        float a = 0, b = 0;
        for (int d = lane; d < K; d += 32) {
            a += sq[i * KP + d] * sq[i * KP + d];
            b += sk[i * KP + d] * sk[i * KP + d];
        }
        for (int o = 16; o; o >>= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, o);
            b += __shfl_xor_sync(0xffffffffu, b, o);
        }
        const float fq = (p.l2 ? rsqrtf(a + 1e-6f) : 1.0f) * p.scale;
        const float fk = p.l2 ? rsqrtf(b + 1e-6f) : 1.0f;
        for (int d = lane; d < K; d += 32) {
            sq[i * KP + d] *= fq;
            sk[i * KP + d] *= fk;
        }
    }
    __syncthreads();

    /* diagonal 16x16 tiles: the per-pair exponent (never overflows, any gate) */
    for (int e = tid; e < 4 * BS * BS; e += NTHR) {
        const int J = e / (BS * BS), r = (e / BS) % BS, c = e % BS;
        const int i = J * BS + r, j = J * BS + c;
        if (j > i)
            continue;
        const float *qi = sq + i * KP, *ki = sk + i * KP, *kj = sk + j * KP;
        const float *Gi = sG + i * KP, *Gj = sG + j * KP;
        float aq = 0, ak = 0;
        for (int d = 0; d < K; d++) {
            const float f = __expf(Gi[d] - Gj[d]) * kj[d];
            aq += qi[d] * f;
            ak += ki[d] * f;
        }
        sQ[i * (BT + 1) + j] = aq;
        if (j < i)
            sA[i * (BT + 1) + j] = ak * sb[i];
    }
    /* off-diagonal tiles (rows of tile I > J): exp(G_i - G_j) = exp(G_i - G_e) exp(G_e - G_j)
     * with e the last row of tile J: both factors <= 1 */
    for (int J = 0; J < 3; J++) {
        const int e = J * BS + BS - 1, i0 = (J + 1) * BS, rows = BT - i0;
        __syncthreads();
        for (int x = tid; x < BS * K; x += NTHR) {
            const int c = x / K, d = x % K, j = J * BS + c;
            sT[c * KP + d] = sk[j * KP + d] * __expf(sG[e * KP + d] - sG[j * KP + d]);
        }
        for (int x = tid; x < rows * K; x += NTHR) {
            const int r = x / K, d = x % K, i = i0 + r;
            const float f = __expf(sG[i * KP + d] - sG[e * KP + d]);
            sF[r * KP + d] = sq[i * KP + d] * f;
            sF[(BT - BS + r) * KP + d] = sk[i * KP + d] * f;
        }
        __syncthreads();
        /* each thread: one column c of the 16 and rows r, r + 16, ... (register tile) */
        for (int x = tid; x < rows * BS; x += NTHR) {
            const int r = x / BS, c = x % BS, i = i0 + r, j = J * BS + c;
            const float *fq = sF + r * KP, *fk = sF + (BT - BS + r) * KP, *tj = sT + c * KP;
            float aq = 0, ak = 0;
            for (int d = 0; d < K; d++) {
                aq += fq[d] * tj[d];
                ak += fk[d] * tj[d];
            }
            sQ[i * (BT + 1) + j] = aq;
            sA[i * (BT + 1) + j] = ak * sb[i];
        }
    }
    __syncthreads();
    /* X = (I + A)^-1 (unit lower triangular) by 16x16 blocks: the four diagonal blocks
     * by forward substitution, one thread per (block, column); then block rows I = 1..3:
     * X_IJ = -X_II sum_{J <= K < I} A_IK X_KJ (reference/kda.md §3; fla's solve_tril) */
    if (tid < 4 * BS) {
        const int o = (tid / BS) * BS, c = tid % BS;
        sX[(o + c) * (BT + 1) + o + c] = 1.0f;
        for (int r = c + 1; r < BS; r++) {
            float acc = -sA[(o + r) * (BT + 1) + o + c];
            for (int j = c + 1; j < r; j++)
                acc -= sA[(o + r) * (BT + 1) + o + j] * sX[(o + j) * (BT + 1) + o + c];
            sX[(o + r) * (BT + 1) + o + c] = acc;
        }
    }
    __syncthreads();
    for (int I = 1; I < BT / BS; I++) {
        float *sTmp = sF; /* [I][BS][BS] */
        for (int e = tid; e < I * BS * BS; e += NTHR) {
            const int J = e / (BS * BS), r = (e / BS) % BS, c = e % BS;
            float acc = 0;
            for (int k = J * BS; k < I * BS; k++)
                acc += sA[(I * BS + r) * (BT + 1) + k] * sX[k * (BT + 1) + J * BS + c];
            sTmp[e] = acc;
        }
        __syncthreads();
        for (int e = tid; e < I * BS * BS; e += NTHR) {
            const int J = e / (BS * BS), r = (e / BS) % BS, c = e % BS;
            float acc = 0;
            for (int k = 0; k <= r; k++)
                acc += sX[(I * BS + r) * (BT + 1) + I * BS + k] * sTmp[J * BS * BS + k * BS + c];
            sX[(I * BS + r) * (BT + 1) + J * BS + c] = -acc;
        }
        __syncthreads();
    }
    /* per-row outputs qg = q e^{G}, kg = k e^{G_last - G}, gl = e^{G_last}; then
     * sq <- beta k e^{G} (w's right-hand side) */
    for (int x = tid; x < BT * K; x += NTHR) {
        const int i = x / K, d = x % K;
        const int64_t o = ((wrow0 + i) * HV + hv) * K + d;
        const float gi = sG[i * KP + d], glast = sG[(L - 1) * KP + d], eg = __expf(gi);
        p.qg[o] = i < L ? sq[i * KP + d] * eg : 0.0f;
        p.kg[o] = i < L ? sk[i * KP + d] * __expf(glast - gi) : 0.0f;
        if (i == 0)
            p.gl[((int64_t)ci * HV + hv) * K + d] = __expf(glast);
        sq[i * KP + d] = sb[i] * sk[i * KP + d] * eg;
    }
    __syncthreads();
    /* sG <- beta v (rows past L are zero) */
    for (int x = tid; x < BT * V; x += NTHR) {
        const int i = x / V, c = x % V;
        sG[i * KP + c] =
            i < L ? sb[i] * __bfloat162float(p.v[((int64_t)(t0 + i) * HV + hv) * V + c]) : 0.0f;
    }
    __syncthreads();
    /* w = X (beta k e^G), u = X (beta v) */
    for (int x = tid; x < BT * K; x += NTHR) {
        const int i = x / K, d = x % K;
        const float *xi = sX + i * (BT + 1);
        float s2 = sq[i * KP + d];
        for (int j = 0; j < i; j++)
            s2 += xi[j] * sq[j * KP + d];
        p.w[((wrow0 + i) * HV + hv) * K + d] = s2;
    }
    for (int x = tid; x < BT * V; x += NTHR) {
        const int i = x / V, c = x % V;
        const float *xi = sX + i * (BT + 1);
        float s2 = sG[i * KP + c];
        for (int j = 0; j < i; j++)
            s2 += xi[j] * sG[j * KP + c];
        p.u[((wrow0 + i) * HV + hv) * V + c] = s2;
    }
    for (int x = tid; x < BT * BT; x += NTHR) {
        const int i = x / BT, j = x % BT;
        p.Aqk[((wrow0 + i) * HV + hv) * BT + j] = (i < L && j <= i) ? sQ[i * (BT + 1) + j] : 0.0f;
    }
}

/* ------------------------------------------------------------------ kernel 2 */
/* One CTA per (V slice, sequence * HV): the state slice S [K][BV] stays in shared
 * memory across the sequence's chunks; each chunk's w, qg, kg [BT][K], u slice and
 * Aqk are staged in shared memory first (coalesced loads). */
__global__ void __launch_bounds__(NTHR) kda_inter(Params p) {
    extern __shared__ float smem[];
    const int KP = KMAX + 1;
    float *S = smem;                  /* [KMAX][BV] */
    float *vn = S + KMAX * BV;        /* [BT][BV+1] */
    float *sw = vn + BT * (BV + 1);   /* [BT][KP] */
    float *sqg = sw + BT * KP;        /* [BT][KP] */
    float *skg = sqg + BT * KP;       /* [BT][KP] */
    float *sa = skg + BT * KP;        /* [BT][BT+1] */
    float *sgl = sa + BT * (BT + 1);  /* [KMAX] */
    const int c0 = blockIdx.x * BV;
    const int n = blockIdx.y / p.HV, hv = blockIdx.y % p.HV;
    const int K = p.K, V = p.V, HV = p.HV;
    const int nc = V - c0 < BV ? V - c0 : BV;
    const int tid = threadIdx.x;
    for (int x = tid; x < K * BV; x += NTHR) {
        const int d = x / BV, c = x % BV;
        S[x] = (p.h0 && c < nc) ? p.h0[(((int64_t)n * HV + hv) * K + d) * V + c0 + c] : 0.0f;
    }
    const int2 sq = p.seqs[n];
    for (int cc = 0; cc < sq.y; cc++) {
        const int ci = sq.x + cc;
        const int2 ch = p.chunks[ci];
        const int t0 = ch.x, L = ch.y;
        const int64_t r0 = (int64_t)ci * BT;
        __syncthreads();
        for (int x = tid; x < BT * K; x += NTHR) {
            const int i = x / K, d = x % K;
            const int64_t o = ((r0 + i) * HV + hv) * K + d;
            sw[i * KP + d] = p.w[o];
            sqg[i * KP + d] = p.qg[o];
            skg[i * KP + d] = p.kg[o];
        }
        for (int x = tid; x < BT * BT; x += NTHR)
            sa[(x / BT) * (BT + 1) + x % BT] = p.Aqk[((r0 + x / BT) * HV + hv) * BT + x % BT];
        for (int x = tid; x < K; x += NTHR)
            sgl[x] = p.gl[((int64_t)ci * HV + hv) * K + x];
        for (int x = tid; x < BT * BV; x += NTHR) {
            const int i = x / BV, c = x % BV;
            vn[i * (BV + 1) + c] = (i < L && c < nc) ? p.u[((r0 + i) * HV + hv) * V + c0 + c] : 0.0f;
        }
        __syncthreads();
        /* v' = u - w S: thread (column c, rows i, i+8, ...) */
        {
            const int c = tid % BV, i0 = tid / BV; /* 8 row groups */
            float acc[BT / 8];
#pragma unroll
            for (int r = 0; r < BT / 8; r++)
                acc[r] = 0;
            for (int d = 0; d < K; d++) {
                const float sv = S[d * BV + c];
#pragma unroll
                for (int r = 0; r < BT / 8; r++)
                    acc[r] += sw[(i0 + 8 * r) * KP + d] * sv;
            }
#pragma unroll
            for (int r = 0; r < BT / 8; r++) {
                const int i = i0 + 8 * r;
                if (i < L && c < nc)
                    vn[i * (BV + 1) + c] -= acc[r];
            }
        }
        __syncthreads();
        /* o = qg S + Aqk v' */
        {
            const int c = tid % BV, i0 = tid / BV;
            float acc[BT / 8];
#pragma unroll
            for (int r = 0; r < BT / 8; r++)
                acc[r] = 0;
            for (int d = 0; d < K; d++) {
                const float sv = S[d * BV + c];
#pragma unroll
                for (int r = 0; r < BT / 8; r++)
                    acc[r] += sqg[(i0 + 8 * r) * KP + d] * sv;
            }
            for (int j = 0; j < BT; j++) {
                const float vj = vn[j * (BV + 1) + c];
#pragma unroll
                for (int r = 0; r < BT / 8; r++)
                    acc[r] += sa[(i0 + 8 * r) * (BT + 1) + j] * vj; /* Aqk is 0 for j > i */
            }
#pragma unroll
            for (int r = 0; r < BT / 8; r++) {
                const int i = i0 + 8 * r;
                if (i < L && c < nc)
                    p.o[((int64_t)(t0 + i) * HV + hv) * V + c0 + c] = __float2bfloat16(acc[r]);
            }
        }
        __syncthreads();
        /* S <- gl * S + kg^T v': thread (column c, channels d, d+8, ...) */
        {
            const int c = tid % BV, d0 = tid / BV;
            for (int d = d0; d < K; d += 8) {
                float s2 = S[d * BV + c] * sgl[d];
                for (int j = 0; j < L; j++)
                    s2 += skg[j * KP + d] * vn[j * (BV + 1) + c];
                S[d * BV + c] = s2;
            }
        }
    }
    __syncthreads();
    if (p.ht)
        for (int x = tid; x < K * BV; x += NTHR) {
            const int d = x / BV, c = x % BV;
            if (c < nc)
                p.ht[(((int64_t)n * HV + hv) * K + d) * V + c0 + c] = S[x];
        }
}

/* ------------------------------------------------------------------ host side */

struct Workspace {
    void *buf = nullptr;
    size_t cap = 0;
};
Workspace g_ws;

lm_status cuda_err(lm_error *err, cudaError_t e, const char *what) {
    return lm_errorf(err, LM_ERR_IO, "kda cuda: %s: %s", what, cudaGetErrorString(e));
}

} // namespace

#define CK(call)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess)                                                                    \
            return cuda_err(err, e_, #call);                                                      \
    } while (0)

extern "C" int lm_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" lm_status lm_cuda_alloc(void **ptr, size_t bytes, lm_error *err) {
    *ptr = nullptr;
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *ptr = nullptr;
        return lm_errorf(err, LM_ERR_NOMEM, "cuda: cudaMalloc(%zu bytes): %s", bytes,
                         cudaGetErrorString(e));
    }
    return LM_OK;
}

extern "C" void lm_cuda_free(void *ptr) {
    if (ptr)
        cudaFree(ptr);
}

extern "C" lm_status lm_cuda_upload(void *dst, const void *src, size_t bytes, lm_error *err) {
    CK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return LM_OK;
}

extern "C" lm_status lm_cuda_download(void *dst, const void *src, size_t bytes, lm_error *err) {
    CK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return LM_OK;
}

extern "C" void lm_kda_cuda_release(void) {
    if (g_ws.buf)
        cudaFree(g_ws.buf);
    g_ws.buf = nullptr;
    g_ws.cap = 0;
}

extern "C" lm_status lm_kda_cuda_chunk_forward(lm_kda_config *c, const lm_kda_cuda_inputs *in,
                                               lm_kda_cuda_outputs *out, lm_error *err) {
    if (!c || !in || !out || !in->q || !in->k || !in->v || !in->g || !in->beta || !out->o)
        return lm_errorf(err, LM_ERR_INVALID, "kda cuda: q, k, v, g, beta and o are required");
    if (c->B < 1 || c->T < 1 || c->H < 1 || c->HV < 1 || c->K < 1 || c->V < 1 || c->HV % c->H)
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda: bad dims B=%d T=%d H=%d HV=%d K=%d V=%d (HV must be a "
                         "multiple of H)",
                         c->B, c->T, c->H, c->HV, c->K, c->V);
    if (c->K > KMAX || c->V > KMAX)
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda: K = %d, V = %d (at most %d each)",
                         c->K, c->V, KMAX);
    if (c->gate == LM_GATE_BOUNDED && !(c->has_lower_bound && c->lower_bound >= -5.0f &&
                                        c->lower_bound < 0.0f))
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda cuda: the bounded gate needs lower_bound in [-5, 0), got %g",
                         c->has_lower_bound ? (double)c->lower_bound : 0.0);
    int N = c->B;
    if (c->cu_seqlens) {
        if (c->B != 1)
            return lm_errorf(err, LM_ERR_INVALID, "kda cuda: cu_seqlens needs B == 1, got B = %d",
                             c->B);
        if (c->n_cu_seqlens < 2 || c->cu_seqlens[0] != 0 ||
            c->cu_seqlens[c->n_cu_seqlens - 1] != c->T)
            return lm_errorf(err, LM_ERR_INVALID,
                             "kda cuda: cu_seqlens must start at 0 and end at T = %d", c->T);
        for (int i = 1; i < c->n_cu_seqlens; i++)
            if (c->cu_seqlens[i] < c->cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID,
                                 "kda cuda: cu_seqlens[%d] = %lld < cu_seqlens[%d]", i,
                                 (long long)c->cu_seqlens[i], i - 1);
        N = c->n_cu_seqlens - 1;
    }
    c->N = N;
    if (lm_cuda_device_count() < 1)
        return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda: no CUDA device");

    /* chunk table */
    int nchunks = 0;
    for (int n = 0; n < N; n++) {
        const int64_t a = c->cu_seqlens ? c->cu_seqlens[n] : (int64_t)n * c->T;
        const int64_t b = c->cu_seqlens ? c->cu_seqlens[n + 1] : (int64_t)(n + 1) * c->T;
        nchunks += (int)((b - a + BT - 1) / BT);
    }
    int2 *hch = (int2 *)malloc(sizeof(int2) * (size_t)(nchunks > 0 ? nchunks : 1));
    int2 *hsq = (int2 *)malloc(sizeof(int2) * (size_t)N);
    if (!hch || !hsq) {
        free(hch);
        free(hsq);
        return lm_errorf(err, LM_ERR_NOMEM, "kda cuda: chunk table");
    }
    int k = 0;
    for (int n = 0; n < N; n++) {
        const int64_t a = c->cu_seqlens ? c->cu_seqlens[n] : (int64_t)n * c->T;
        const int64_t b = c->cu_seqlens ? c->cu_seqlens[n + 1] : (int64_t)(n + 1) * c->T;
        hsq[n].x = k;
        for (int64_t t = a; t < b; t += BT) {
            hch[k].x = (int)t;
            hch[k].y = (int)(b - t < BT ? b - t : BT);
            k++;
        }
        hsq[n].y = k - hsq[n].x;
    }
    const int K = c->K, V = c->V, HV = c->HV;
    const size_t rows = (size_t)nchunks * BT;
    const size_t nW = rows * HV * K, nU = rows * HV * V, nA = rows * HV * BT,
                 nG = (size_t)nchunks * HV * K;
    const size_t bytes = sizeof(float) * (3 * nW + nU + nA + nG) + sizeof(int2) * (nchunks + N) + 256;
    if (bytes > g_ws.cap) {
        lm_kda_cuda_release();
        cudaError_t e = cudaMalloc(&g_ws.buf, bytes);
        if (e != cudaSuccess) {
            free(hch);
            free(hsq);
            return cuda_err(err, e, "cudaMalloc(workspace)");
        }
        g_ws.cap = bytes;
    }
    Params p;
    memset(&p, 0, sizeof p);
    float *f = (float *)g_ws.buf;
    p.w = f;
    p.qg = f + nW;
    p.kg = f + 2 * nW;
    p.u = f + 3 * nW;
    p.Aqk = p.u + nU;
    p.gl = p.Aqk + nA;
    int2 *dch = (int2 *)(p.gl + nG);
    int2 *dsq = dch + nchunks;
    cudaError_t e1 = nchunks ? cudaMemcpy(dch, hch, sizeof(int2) * nchunks, cudaMemcpyHostToDevice)
                             : cudaSuccess;
    cudaError_t e2 = cudaMemcpy(dsq, hsq, sizeof(int2) * N, cudaMemcpyHostToDevice);
    free(hch);
    free(hsq);
    CK(e1);
    CK(e2);
    p.chunks = dch;
    p.seqs = dsq;
    p.nchunks = nchunks;
    p.N = N;
    p.q = (const __nv_bfloat16 *)in->q;
    p.k = (const __nv_bfloat16 *)in->k;
    p.v = (const __nv_bfloat16 *)in->v;
    p.g = (const __nv_bfloat16 *)in->g;
    p.beta = (const __nv_bfloat16 *)in->beta;
    p.A_log = in->A_log;
    p.dt_bias = in->dt_bias;
    p.h0 = in->initial_state;
    p.o = (__nv_bfloat16 *)out->o;
    p.ht = out->final_state;
    p.T = c->T;
    p.H = c->H;
    p.HV = HV;
    p.K = K;
    p.V = V;
    p.gdn = c->kind == LM_GDN;
    p.gate = (int)c->gate;
    p.l2 = c->use_qk_l2norm_in_kernel;
    p.sig = c->use_beta_sigmoid_in_kernel;
    p.lb = c->lower_bound;
    p.scale = c->scale;

    const int KP = KMAX + 1;
    const size_t sm1 =
        sizeof(float) * (3 * BT * KP + 2 * (BT - BS) * KP + BS * KP + 3 * BT * (BT + 1) + BT);
    const size_t sm2 =
        sizeof(float) * (KMAX * BV + BT * (BV + 1) + 3 * BT * KP + BT * (BT + 1) + KMAX);
    CK(cudaFuncSetAttribute(kda_intra, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm1));
    CK(cudaFuncSetAttribute(kda_inter, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm2));
    /* LINMOE_KDA_CUDA_PROFILE=1: per-kernel times on stderr (docs/perf-notes.md) */
    static int prof = -1;
    if (prof < 0)
        prof = getenv("LINMOE_KDA_CUDA_PROFILE") != nullptr;
    cudaEvent_t ev[3];
    if (prof)
        for (int i = 0; i < 3; i++)
            CK(cudaEventCreate(&ev[i]));
    if (prof)
        CK(cudaEventRecord(ev[0]));
    if (nchunks > 0) {
        kda_intra<<<dim3(nchunks, HV), NTHR, sm1>>>(p);
        CK(cudaGetLastError());
    }
    if (prof)
        CK(cudaEventRecord(ev[1]));
    kda_inter<<<dim3((V + BV - 1) / BV, N * HV), NTHR, sm2>>>(p);
    CK(cudaGetLastError());
    if (prof)
        CK(cudaEventRecord(ev[2]));
    CK(cudaDeviceSynchronize());
    if (prof) {
        float t1 = 0, t2 = 0;
        cudaEventElapsedTime(&t1, ev[0], ev[1]);
        cudaEventElapsedTime(&t2, ev[1], ev[2]);
        fprintf(stderr, "kda cuda: intra %.3f ms (%d CTAs), inter %.3f ms (%d CTAs)\n", t1,
                nchunks * HV, t2, ((V + BV - 1) / BV) * N * HV);
        for (int i = 0; i < 3; i++)
            cudaEventDestroy(ev[i]);
    }
    return LM_OK;
}

extern "C" int lm_kda_cuda_forward_flat(int B, int T, int H, int HV, int K, int V,
                                        const int64_t *cu_seqlens, int n_cu_seqlens, int kind,
                                        int gate, float lower_bound, float scale,
                                        int use_qk_l2norm_in_kernel,
                                        int use_beta_sigmoid_in_kernel, const void *q,
                                        const void *k, const void *v, const void *g,
                                        const void *beta, const float *A_log,
                                        const float *dt_bias, const float *h0, void *o,
                                        float *ht, char *errbuf, int errlen) {
    lm_kda_config c; /* filled here, not by lm_kda_config_default: the FFI library is
                        built from this file and src/core/errors.c alone */
    memset(&c, 0, sizeof c);
    c.B = B;
    c.T = T;
    c.H = H;
    c.HV = HV;
    c.K = K;
    c.V = V;
    c.chunk_size = 64;
    c.scale = K > 0 ? 1.0f / sqrtf((float)K) : 1.0f;
    c.kind = (lm_kda_kind)kind;
    c.gate = (lm_gate_mode)gate;
    c.has_lower_bound = lower_bound != 0.0f;
    c.lower_bound = lower_bound;
    if (scale > 0)
        c.scale = scale;
    c.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel;
    c.use_beta_sigmoid_in_kernel = use_beta_sigmoid_in_kernel;
    c.cu_seqlens = cu_seqlens;
    c.n_cu_seqlens = n_cu_seqlens;
    lm_kda_cuda_inputs in = {q, k, v, g, beta, A_log, dt_bias, h0};
    lm_kda_cuda_outputs out = {o, ht};
    lm_error err;
    memset(&err, 0, sizeof err);
    lm_status st = lm_kda_cuda_chunk_forward(&c, &in, &out, &err);
    if (st != LM_OK && errbuf && errlen > 0)
        snprintf(errbuf, (size_t)errlen, "%s", err.msg);
    return (int)st;
}
