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
/* One CTA per (chunk, value head). Shared memory (fp32):
 *   sq, sk, sG [BT][KMAX+1], sA [BT][BT+1] (Akk, then X), sQ [BT][BT+1] (Aqk),
 *   sb [BT] (beta), sT [BS][KMAX+1] (the earlier tile's factored k). */
__global__ void __launch_bounds__(NTHR) kda_intra(Params p) {
    extern __shared__ float smem[];
    const int KP = KMAX + 1;
    float *sq = smem, *sk = sq + BT * KP, *sG = sk + BT * KP;
    float *sA = sG + BT * KP, *sQ = sA + BT * (BT + 1);
    float *sb = sQ + BT * (BT + 1);
    float *sT = sb + BT;
    const int ci = blockIdx.x, hv = blockIdx.y;
    const int2 ch = p.chunks[ci];
    const int t0 = ch.x, L = ch.y;
    const int K = p.K, V = p.V, H = p.H, HV = p.HV;
    const int h = hv / (HV / H);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

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
    for (int e = tid; e < BT * (BT + 1); e += NTHR) {
        sA[e] = 0;
        sQ[e] = 0;
    }
    __syncthreads();

    /* diagonal tiles: per-pair exponent */
    for (int e = tid; e < 4 * BS * BS; e += NTHR) {
        const int J = e / (BS * BS), r = (e / BS) % BS, s = e % BS;
        const int i = J * BS + r, j = J * BS + s;
        if (j > i)
            continue;
        float aq = 0, ak = 0;
        for (int d = 0; d < K; d++) {
            const float f = __expf(sG[i * KP + d] - sG[j * KP + d]) * sk[j * KP + d];
            aq += sq[i * KP + d] * f;
            ak += sk[i * KP + d] * f;
        }
        sQ[i * (BT + 1) + j] = aq;
        if (j < i)
            sA[i * (BT + 1) + j] = ak * sb[i];
    }
    /* off-diagonal tiles: exp(G_i - G_j) = exp(G_i - G_e) exp(G_e - G_j), e = end of J */
    for (int J = 0; J < 3; J++) {
        const int e = J * BS + BS - 1;
        __syncthreads();
        for (int x = tid; x < BS * K; x += NTHR) {
            const int s = x / K, d = x % K, j = J * BS + s;
            sT[s * KP + d] = sk[j * KP + d] * __expf(sG[e * KP + d] - sG[j * KP + d]);
        }
        __syncthreads();
        const int rows = BT - (J + 1) * BS; /* rows i in later tiles */
        for (int x = tid; x < rows * BS; x += NTHR) {
            const int i = (J + 1) * BS + x / BS, s = x % BS, j = J * BS + s;
            float aq = 0, ak = 0;
            for (int d = 0; d < K; d++) {
                const float f = __expf(sG[i * KP + d] - sG[e * KP + d]) * sT[s * KP + d];
                aq += sq[i * KP + d] * f;
                ak += sk[i * KP + d] * f;
            }
            sQ[i * (BT + 1) + j] = aq;
            sA[i * (BT + 1) + j] = ak * sb[i];
        }
    }
    __syncthreads();
    /* X = (I + A)^-1 in place of A's strict lower part: row i of X is
     * e_i - sum_{j<i} A[i,j] X[j,:] (rows of X computed in order; a warp per column
     * block would serialise badly, so one pass per row with all threads). X is kept
     * in sT-free storage: reuse sA with the diagonal implied. */
    for (int i = 1; i < BT; i++) {
        /* new row i: X[i][c] for c < i = -A[i][c] - sum_{c < j < i} A[i][j] X[j][c] */
        float val = 0;
        const int c = tid;
        if (c < i) {
            float s = -sA[i * (BT + 1) + c];
            for (int j = c + 1; j < i; j++)
                s -= sA[i * (BT + 1) + j] * sA[j * (BT + 1) + c];
            val = s;
        }
        __syncthreads();
        if (c < i)
            sA[i * (BT + 1) + c] = val;
        __syncthreads();
    }
    /* outputs: w = X (beta k exp(G)), u = X (beta v), qg = q exp(G), kg = k exp(Gl - G) */
    const int64_t wrow0 = (int64_t)ci * BT;
    for (int x = tid; x < BT * K; x += NTHR) {
        const int i = x / K, d = x % K;
        float s = 0;
        if (i < L) {
            s = sb[i] * sk[i * KP + d] * __expf(sG[i * KP + d]);
            for (int j = 0; j < i; j++)
                s += sA[i * (BT + 1) + j] * sb[j] * sk[j * KP + d] * __expf(sG[j * KP + d]);
        }
        const int64_t o = ((wrow0 + i) * HV + hv) * K + d;
        p.w[o] = s;
        const float gi = sG[i * KP + d], glast = sG[(L - 1) * KP + d];
        p.qg[o] = i < L ? sq[i * KP + d] * __expf(gi) : 0.0f;
        p.kg[o] = i < L ? sk[i * KP + d] * __expf(glast - gi) : 0.0f;
        if (i == 0)
            p.gl[((int64_t)ci * HV + hv) * K + d] = __expf(glast);
    }
    for (int x = tid; x < BT * V; x += NTHR) {
        const int i = x / V, c = x % V;
        float s = 0;
        if (i < L) {
            s = sb[i] * __bfloat162float(p.v[((int64_t)(t0 + i) * HV + hv) * V + c]);
            for (int j = 0; j < i; j++)
                s += sA[i * (BT + 1) + j] * sb[j] *
                     __bfloat162float(p.v[((int64_t)(t0 + j) * HV + hv) * V + c]);
        }
        p.u[((wrow0 + i) * HV + hv) * V + c] = s;
    }
    for (int x = tid; x < BT * BT; x += NTHR) {
        const int i = x / BT, j = x % BT;
        p.Aqk[((wrow0 + i) * HV + hv) * BT + j] = (i < L && j <= i) ? sQ[i * (BT + 1) + j] : 0.0f;
    }
}

/* ------------------------------------------------------------------ kernel 2 */
/* One CTA per (V slice, sequence * HV). State slice S [K][BV] in shared memory. */
__global__ void __launch_bounds__(NTHR) kda_inter(Params p) {
    extern __shared__ float smem[];
    float *S = smem;                  /* [KMAX][BV] */
    float *vn = S + KMAX * BV;        /* [BT][BV+1] */
    const int c0 = blockIdx.x * BV;
    const int n = blockIdx.y / p.HV, hv = blockIdx.y % p.HV;
    const int K = p.K, V = p.V, HV = p.HV;
    const int nc = V - c0 < BV ? V - c0 : BV;
    const int tid = threadIdx.x;
    for (int x = tid; x < K * BV; x += NTHR) {
        const int d = x / BV, c = x % BV;
        S[x] = (p.h0 && c < nc) ? p.h0[(((int64_t)n * HV + hv) * K + d) * V + c0 + c] : 0.0f;
    }
    __syncthreads();
    const int2 sq = p.seqs[n];
    for (int cc = 0; cc < sq.y; cc++) {
        const int ci = sq.x + cc;
        const int2 ch = p.chunks[ci];
        const int t0 = ch.x, L = ch.y;
        const int64_t r0 = (int64_t)ci * BT;
        /* v' = u - w S */
        for (int x = tid; x < BT * BV; x += NTHR) {
            const int i = x / BV, c = x % BV;
            float s = 0;
            if (i < L && c < nc) {
                const float *wr = p.w + ((r0 + i) * HV + hv) * K;
                s = p.u[((r0 + i) * HV + hv) * V + c0 + c];
                for (int d = 0; d < K; d++)
                    s -= wr[d] * S[d * BV + c];
            }
            vn[i * (BV + 1) + c] = s;
        }
        __syncthreads();
        /* o = qg S + Aqk v' */
        for (int x = tid; x < BT * BV; x += NTHR) {
            const int i = x / BV, c = x % BV;
            if (i >= L || c >= nc)
                continue;
            const float *qr = p.qg + ((r0 + i) * HV + hv) * K;
            const float *ar = p.Aqk + ((r0 + i) * HV + hv) * BT;
            float s = 0;
            for (int d = 0; d < K; d++)
                s += qr[d] * S[d * BV + c];
            for (int j = 0; j <= i; j++)
                s += ar[j] * vn[j * (BV + 1) + c];
            p.o[((int64_t)(t0 + i) * HV + hv) * V + c0 + c] = __float2bfloat16(s);
        }
        __syncthreads();
        /* S <- gl * S + kg^T v' */
        for (int x = tid; x < K * BV; x += NTHR) {
            const int d = x / BV, c = x % BV;
            float s = S[x] * p.gl[((int64_t)ci * HV + hv) * K + d];
            for (int j = 0; j < L; j++)
                s += p.kg[((r0 + j) * HV + hv) * K + d] * vn[j * (BV + 1) + c];
            S[x] = s;
        }
        __syncthreads();
    }
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
    const size_t sm1 = sizeof(float) * (3 * BT * KP + 2 * BT * (BT + 1) + BT + BS * KP);
    const size_t sm2 = sizeof(float) * (KMAX * BV + BT * (BV + 1));
    CK(cudaFuncSetAttribute(kda_intra, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm1));
    CK(cudaFuncSetAttribute(kda_inter, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm2));
    if (nchunks > 0) {
        kda_intra<<<dim3(nchunks, HV), NTHR, sm1>>>(p);
        CK(cudaGetLastError());
    }
    kda_inter<<<dim3((V + BV - 1) / BV, N * HV), NTHR, sm2>>>(p);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return LM_OK;
}
