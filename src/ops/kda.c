/* KDA/GDN op: configuration defaults, validation of every input before any math,
 * the recurrent (token-by-token) forward that is also the decode step, and the
 * forward-only dispatcher. The chunked kernels are in cpu/kda_chunk.c. */
#include "linmoe/kda.h"

#include <math.h>
#include <string.h>

#include "ops/cpu/kda_cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

void lm_kda_config_default(lm_kda_config *c, int B, int T, int H, int HV, int K, int V) {
    memset(c, 0, sizeof(*c));
    c->kind = LM_KDA;
    c->B = B, c->T = T, c->H = H, c->HV = HV, c->K = K, c->V = V;
    c->N = B;
    c->gate = LM_GATE_NONE;
    c->scale = K > 0 ? (float)(1.0 / sqrt((double)K)) : 1.0f;
    c->chunk_size = 64;
    c->diag = LM_DIAG_AUTO;
}

static lm_status check_finite(const float *x, int64_t n, const char *name, lm_error *err) {
    const int64_t i = lm_f32_first_nonfinite(x, n);
    if (i >= 0)
        return lm_errorf(err, LM_ERR_NONFINITE,
                         "kda: input '%s' has a non-finite value (%g) at element %lld", name,
                         (double)x[i], (long long)i);
    return LM_OK;
}

lm_status lm_kda_validate(lm_kda_config *c, const lm_kda_inputs *in, lm_error *err) {
    if (!c || !in) return lm_errorf(err, LM_ERR_INVALID, "kda: config and inputs are required");
    const char *dn[] = {"B", "T", "H", "HV", "K", "V"};
    int dv[] = {c->B, c->T, c->H, c->HV, c->K, c->V};
    for (int i = 0; i < 6; i++)
        if (dv[i] < 1)
            return lm_errorf(err, LM_ERR_INVALID, "kda: dimension %s = %d must be >= 1", dn[i], dv[i]);
    if (c->K > 1024 || c->V > 1024)
        return lm_errorf(err, LM_ERR_INVALID, "kda: head dims K = %d, V = %d exceed the supported 1024", c->K, c->V);
    if (c->HV % c->H != 0)
        return lm_errorf(err, LM_ERR_INVALID, "kda: HV = %d value heads is not a multiple of H = %d q/k heads",
                         c->HV, c->H);
    if ((int64_t)c->B * c->T * c->HV * (c->K > c->V ? c->K : c->V) > ((int64_t)1 << 40))
        return lm_errorf(err, LM_ERR_INVALID, "kda: problem too large (B*T*HV*D > 2^40)");
    if (c->kind != LM_KDA && c->kind != LM_GDN)
        return lm_errorf(err, LM_ERR_INVALID, "kda: unknown kind %d", (int)c->kind);
    if (c->chunk_size != 16 && c->chunk_size != 32 && c->chunk_size != 64)
        return lm_errorf(err, LM_ERR_INVALID, "kda: chunk_size = %d (must be 16, 32 or 64)", c->chunk_size);
    if (c->gate != LM_GATE_NONE && c->gate != LM_GATE_SOFTPLUS && c->gate != LM_GATE_BOUNDED)
        return lm_errorf(err, LM_ERR_INVALID, "kda: unknown gate mode %d", (int)c->gate);
    if (c->diag != LM_DIAG_AUTO && c->diag != LM_DIAG_SHARED && c->diag != LM_DIAG_SAFE)
        return lm_errorf(err, LM_ERR_INVALID, "kda: unknown diag path %d", (int)c->diag);
    if (!isfinite(c->scale))
        return lm_errorf(err, LM_ERR_INVALID, "kda: scale = %g is not finite", (double)c->scale);
    if (c->has_lower_bound && !(c->lower_bound >= -5.0f && c->lower_bound < 0.0f))
        return lm_errorf(err, LM_ERR_INVALID, "kda: lower_bound = %g is outside [-5, 0)", (double)c->lower_bound);
    if (c->gate == LM_GATE_BOUNDED && !c->has_lower_bound)
        return lm_errorf(err, LM_ERR_INVALID, "kda: gate 'bounded' requires lower_bound");
    if (c->diag == LM_DIAG_SHARED && !(c->gate == LM_GATE_BOUNDED || (c->gate == LM_GATE_NONE && c->has_lower_bound)))
        return lm_errorf(err, LM_ERR_INVALID,
                         "kda: diag 'shared' needs a bounded log-decay (gate 'bounded', or gate 'none' with "
                         "lower_bound); gate is '%s'", c->gate == LM_GATE_SOFTPLUS ? "softplus" : "none");
    if (!in->q || !in->k || !in->v || !in->g || !in->beta)
        return lm_errorf(err, LM_ERR_INVALID, "kda: inputs q, k, v, g and beta are required");

    /* sequences */
    if (c->cu_seqlens) {
        if (c->B != 1)
            return lm_errorf(err, LM_ERR_INVALID, "kda: cu_seqlens needs B == 1 (packed), got B = %d", c->B);
        if (c->n_cu_seqlens < 2)
            return lm_errorf(err, LM_ERR_INVALID, "kda: cu_seqlens has %d entries (need >= 2)", c->n_cu_seqlens);
        if (c->cu_seqlens[0] != 0)
            return lm_errorf(err, LM_ERR_INVALID, "kda: cu_seqlens[0] = %lld (must be 0)",
                             (long long)c->cu_seqlens[0]);
        for (int i = 1; i < c->n_cu_seqlens; i++)
            if (c->cu_seqlens[i] < c->cu_seqlens[i - 1])
                return lm_errorf(err, LM_ERR_INVALID, "kda: cu_seqlens decreases at index %d (%lld < %lld)", i,
                                 (long long)c->cu_seqlens[i], (long long)c->cu_seqlens[i - 1]);
        if (c->cu_seqlens[c->n_cu_seqlens - 1] != c->T)
            return lm_errorf(err, LM_ERR_INVALID, "kda: cu_seqlens ends at %lld, not at T = %d",
                             (long long)c->cu_seqlens[c->n_cu_seqlens - 1], c->T);
        c->N = c->n_cu_seqlens - 1;
    } else {
        c->N = c->B;
    }

    const int64_t BT = (int64_t)c->B * c->T;
    const int64_t ng = c->kind == LM_KDA ? BT * c->HV * c->K : BT * c->HV;
    LM_TRY(check_finite(in->q, BT * c->H * c->K, "q", err));
    LM_TRY(check_finite(in->k, BT * c->H * c->K, "k", err));
    LM_TRY(check_finite(in->v, BT * c->HV * c->V, "v", err));
    LM_TRY(check_finite(in->g, ng, "g", err));
    LM_TRY(check_finite(in->beta, BT * c->HV, "beta", err));
    LM_TRY(check_finite(in->A_log, c->HV, "A_log", err));
    /* exp(A_log) scales the gate's input: beyond 88.72 it is inf in fp32, and the gate
     * and its gradients become inf * 0 = NaN */
    if (in->A_log && c->gate != LM_GATE_NONE)
        for (int hv = 0; hv < c->HV; hv++)
            if (!isfinite(expf(in->A_log[hv])))
                return lm_errorf(err, LM_ERR_INVALID,
                                 "kda: A_log[%d] = %g: exp(A_log) overflows fp32 (the gate's scale "
                                 "must stay below exp(88.7))",
                                 hv, (double)in->A_log[hv]);
    LM_TRY(check_finite(in->dt_bias, c->kind == LM_KDA ? (int64_t)c->HV * c->K : c->HV, "dt_bias", err));
    if (!c->trusted_state)
        LM_TRY(check_finite(in->initial_state, (int64_t)c->N * c->HV * c->K * c->V, "initial_state", err));
    if (c->gate == LM_GATE_NONE) {
        for (int64_t i = 0; i < ng; i++) {
            if (in->g[i] > 0.0f)
                return lm_errorf(err, LM_ERR_INVALID,
                                 "kda: gate 'none' takes g as the log-decay, which must be <= 0; g[%lld] = %g",
                                 (long long)i, (double)in->g[i]);
            if (c->has_lower_bound && in->g[i] < c->lower_bound)
                return lm_errorf(err, LM_ERR_INVALID,
                                 "kda: gate 'none' with lower_bound = %g promises g >= lower_bound for the "
                                 "shared-matmul path, but g[%lld] = %g (drop lower_bound to use the safe path)",
                                 (double)c->lower_bound, (long long)i, (double)in->g[i]);
        }
    }
    return LM_OK;
}

/* One block of JB value columns of the recurrent pass A over all K rows of the
 * state: x = e (S + kp up), optionally stored back, and p += k x, o' += q x with
 * the accumulators held in registers (JB is 32 at the main call site). */
static inline __attribute__((always_inline)) void
rec_pass_a(const int JB, int K, int V, const float *src, float *dst, const float *restrict e,
           const float *restrict k, const float *restrict q, const float *restrict kp,
           const float *restrict up, int store, float *restrict pv, float *restrict ov) {
    float ap[32], ao[32];
    for (int j = 0; j < JB; j++) ap[j] = ao[j] = 0.0f;
    for (int d = 0; d < K; d++) {
        const float ed = e[d], kd = k[d], qd = q[d], kpd = kp ? kp[d] : 0.0f;
        const float *srow = src + (size_t)d * V;
        float *drow = dst + (size_t)d * V;
        if (store) {
#pragma omp simd
            for (int j = 0; j < JB; j++) {
                float x = ed * (srow[j] + kpd * up[j]);
                drow[j] = x;
                ap[j] += kd * x;
                ao[j] += qd * x;
            }
        } else {
#pragma omp simd
            for (int j = 0; j < JB; j++) {
                float x = ed * (srow[j] + kpd * up[j]);
                ap[j] += kd * x;
                ao[j] += qd * x;
            }
        }
    }
    for (int j = 0; j < JB; j++) {
        pv[j] = ap[j];
        ov[j] = ao[j];
    }
}

#if defined(__AVX512F__)
/* One decode token of one (sequence, value head), V a multiple of 32, in place on the
 * state S [K, V] (the recurrent pass for a single token with no pending update):
 *   x = e^g S (row d scaled by e_d);  p = x^T k, o' = x^T q;  u = beta (v - p);
 *   o = o' + u (k . q);  S = x + k u^T.
 * Pass 1 reads S once with the p and o' accumulators of 32 columns in registers (even
 * and odd rows in separate ones, for two independent FMA chains), pass 2 writes it
 * once. */
static void rec_decode_token(int K, int V, float *S, const float *e, const float *k, const float *q,
                             const float *v, float b, float kq, float *u, float *o) {
    for (int j0 = 0; j0 < V; j0 += 32) {
        __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, o0 = p0, o1 = p0, o2 = p0,
               o3 = p0;
        int d = 0;
        for (; d + 2 <= K; d += 2) {
            const float *r0 = S + (size_t)d * V + j0, *r1 = r0 + V;
            const __m512 e0 = _mm512_set1_ps(e[d]), e1 = _mm512_set1_ps(e[d + 1]);
            const __m512 x0 = _mm512_mul_ps(e0, _mm512_loadu_ps(r0)),
                         x1 = _mm512_mul_ps(e0, _mm512_loadu_ps(r0 + 16)),
                         x2 = _mm512_mul_ps(e1, _mm512_loadu_ps(r1)),
                         x3 = _mm512_mul_ps(e1, _mm512_loadu_ps(r1 + 16));
            const __m512 k0 = _mm512_set1_ps(k[d]), k1 = _mm512_set1_ps(k[d + 1]),
                         q0 = _mm512_set1_ps(q[d]), q1 = _mm512_set1_ps(q[d + 1]);
            p0 = _mm512_fmadd_ps(k0, x0, p0);
            p1 = _mm512_fmadd_ps(k0, x1, p1);
            p2 = _mm512_fmadd_ps(k1, x2, p2);
            p3 = _mm512_fmadd_ps(k1, x3, p3);
            o0 = _mm512_fmadd_ps(q0, x0, o0);
            o1 = _mm512_fmadd_ps(q0, x1, o1);
            o2 = _mm512_fmadd_ps(q1, x2, o2);
            o3 = _mm512_fmadd_ps(q1, x3, o3);
        }
        if (d < K) {
            const float *r0 = S + (size_t)d * V + j0;
            const __m512 e0 = _mm512_set1_ps(e[d]);
            const __m512 x0 = _mm512_mul_ps(e0, _mm512_loadu_ps(r0)),
                         x1 = _mm512_mul_ps(e0, _mm512_loadu_ps(r0 + 16));
            p0 = _mm512_fmadd_ps(_mm512_set1_ps(k[d]), x0, p0);
            p1 = _mm512_fmadd_ps(_mm512_set1_ps(k[d]), x1, p1);
            o0 = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), x0, o0);
            o1 = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), x1, o1);
        }
        const __m512 bb = _mm512_set1_ps(b), kk = _mm512_set1_ps(kq);
        const __m512 u0 = _mm512_mul_ps(
                         bb, _mm512_sub_ps(_mm512_loadu_ps(v + j0), _mm512_add_ps(p0, p2))),
                     u1 = _mm512_mul_ps(
                         bb, _mm512_sub_ps(_mm512_loadu_ps(v + j0 + 16), _mm512_add_ps(p1, p3)));
        _mm512_storeu_ps(u + j0, u0);
        _mm512_storeu_ps(u + j0 + 16, u1);
        _mm512_storeu_ps(o + j0, _mm512_fmadd_ps(u0, kk, _mm512_add_ps(o0, o2)));
        _mm512_storeu_ps(o + j0 + 16, _mm512_fmadd_ps(u1, kk, _mm512_add_ps(o1, o3)));
    }
    for (int d = 0; d < K; d++) {
        float *r = S + (size_t)d * V;
        const __m512 ed = _mm512_set1_ps(e[d]), kd = _mm512_set1_ps(k[d]);
        for (int j = 0; j < V; j += 16)
            _mm512_storeu_ps(r + j, _mm512_fmadd_ps(kd, _mm512_loadu_ps(u + j),
                                                    _mm512_mul_ps(ed, _mm512_loadu_ps(r + j))));
    }
}
#endif

lm_status lm_kda_recurrent_forward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_outputs *out,
                                   lm_error *err) {
    LM_TRY(lm_kda_validate(c, in, err));
    if (!out || !out->o) return lm_errorf(err, LM_ERR_INVALID, "kda: output 'o' is required");
    lm_kda_prep p;
    LM_TRY(lm_kda_prep_forward(c, in, &p, err));
    const int K = c->K, V = c->V, H = c->H, HV = c->HV, grp = HV / H;
    const int ntask = c->N * HV;
#pragma omp parallel
    {
        const unsigned fp = lm_kda_fp_enter(); /* FTZ/DAZ (cpu/kda_cpu.h), restored below */
        float *local = out->final_state ? NULL : LM_MALLOC(sizeof(float) * (size_t)K * V);
        /* The state is carried in "pending" form between tokens: S holds the decayed
         * state without the last rank-1 update k u^T, which is folded into the next
         * token's single pass. Each token then reads and writes the state once; the
         * last token of a sequence reads it twice and writes it once. */
        float *pv = LM_MALLOC(sizeof(float) * (size_t)(V * 4 + K));
        float *u = pv + V, *ov = pv + 2 * V, *up = pv + 3 * V, *eb = pv + 4 * V;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < ntask; task++) {
            int n = task / HV, hv = task % HV, h = hv / grp;
            /* The state is read from `src` (the initial state, never copied) until the
             * first write, then lives in `S` (final_state itself, or a local buffer):
             * a decode step reads the state once from memory and writes it once. */
            float *S = out->final_state ? out->final_state + (size_t)task * K * V : local;
            const float *src = in->initial_state ? in->initial_state + (size_t)task * K * V : NULL;
            if (!src) {
                memset(S, 0, sizeof(float) * (size_t)K * V);
                src = S;
            }
#if defined(__AVX512F__)
            /* a decode step (one token, the state updated in place): the fused form */
            if (p.len[n] == 1 && src == S && V % 32 == 0) {
                const int64_t t = p.bos[n];
                const float *q = p.qs + (t * H + h) * K, *k = p.kn + (t * H + h) * K;
                const float *g = p.gk + (t * HV + hv) * K;
                double kq = 0;
                for (int d = 0; d < K; d++) {
                    eb[d] = lm_fexp(g[d]);
                    kq += (double)k[d] * q[d];
                }
                rec_decode_token(K, V, S, eb, k, q, in->v + (t * HV + hv) * V, p.beta[t * HV + hv],
                                 (float)kq, u, out->o + (t * HV + hv) * V);
                continue;
            }
#endif
            const float *kp = NULL; /* pending update k_prev u_prev^T (NULL: none) */
            memset(up, 0, sizeof(float) * (size_t)V);
            const int64_t t_end = p.bos[n] + p.len[n];
            for (int64_t t = p.bos[n]; t < t_end; t++) {
                const float *q = p.qs + (t * H + h) * K, *k = p.kn + (t * H + h) * K;
                const float *g = p.gk + (t * HV + hv) * K, *v = in->v + (t * HV + hv) * V;
                const float b = p.beta[t * HV + hv];
                const int last = t == t_end - 1;
                float *restrict o = out->o + (t * HV + hv) * V;
                /* pass A: x = e^g (S + k_prev u_prev^T) row by row; p = x^T k, o' = x^T q.
                 * Blocks of 32 value columns keep p and o' in registers across rows. */
                double kq = 0;
                for (int d = 0; d < K; d++) {
                    eb[d] = lm_fexp(g[d]);
                    kq += (double)k[d] * q[d];
                }
                for (int j0 = 0; j0 < V; j0 += 32) {
                    if (V - j0 >= 32)
                        rec_pass_a(32, K, V, src + j0, S + j0, eb, k, q, kp, up + j0, !last, pv + j0,
                                   ov + j0);
                    else
                        rec_pass_a(V - j0, K, V, src + j0, S + j0, eb, k, q, kp, up + j0, !last,
                                   pv + j0, ov + j0);
                }
                if (!last) src = S;
                /* u = beta (v - p);  o = o' + u (k . q) */
                for (int j = 0; j < V; j++) {
                    u[j] = b * (v[j] - pv[j]);
                    o[j] = ov[j] + u[j] * (float)kq;
                }
                if (last) {
                    /* pass B: S = e^g (S + k_prev u_prev^T) + k u^T, written once */
                    for (int d = 0; d < K; d++) {
                        const float e = eb[d], kd = k[d], kpd = kp ? kp[d] : 0.0f;
                        const float *srow = src + (size_t)d * V;
                        float *drow = S + (size_t)d * V;
#pragma omp simd
                        for (int j = 0; j < V; j++) drow[j] = e * (srow[j] + kpd * up[j]) + kd * u[j];
                    }
                } else {
                    memcpy(up, u, sizeof(float) * (size_t)V);
                    kp = k;
                }
            }
            if (p.len[n] == 0 && src != S) memcpy(S, src, sizeof(float) * (size_t)K * V);
        }
        free(pv);
        free(local);
        lm_kda_fp_leave(fp);
    }
    lm_kda_prep_free(&p);
    return LM_OK;
}

/* Crossover between the recurrent and the chunked forward, from `linmoe bench kda`
 * and dev/perf_kda.c (docs/perf-notes.md), on the 2-core AVX-512 machine:
 *  - shared-matmul diagonal (bounded log-decay): chunked is faster at every length
 *    measured, T = 1 (decode-shaped, with a state) to T = 4096 (1.1-1.5x);
 *  - safe diagonal (softplus / unbounded): chunked is 1.14-1.17x faster at D = 128,
 *    but the recurrent path is 1.05x faster at D = 64 (chunk/recurrent 0.947, 0.949,
 *    0.965 in three of four runs), where the per-pair exponentials of the safe
 *    diagonal tiles weigh more against the smaller state. */
static int lm_kda_prefer_recurrent(const lm_kda_config *c) {
    return !lm_kda_use_shared_diag(c) && (int64_t)c->K * c->V <= 64 * 64;
}

lm_status lm_kda_forward(lm_kda_config *c, const lm_kda_inputs *in, lm_kda_outputs *out,
                         lm_error *err) {
    int64_t maxlen = c->T;
    if (c->cu_seqlens && c->n_cu_seqlens >= 2) {
        maxlen = 0;
        for (int i = 1; i < c->n_cu_seqlens; i++) {
            int64_t l = c->cu_seqlens[i] - c->cu_seqlens[i - 1];
            maxlen = l > maxlen ? l : maxlen;
        }
    }
    if (maxlen == 0 || lm_kda_prefer_recurrent(c)) return lm_kda_recurrent_forward(c, in, out, err);
    return lm_kda_chunk_forward(c, in, out, err);
}
