/* Tiled causal attention forward on the CPU (fp32): FlashAttention-2's online
 * softmax (Dao, arXiv 2307.08691, Algorithm 1). One task = (document, query head,
 * query block of 64 rows); it walks the key blocks 0..qb, keeping per row the
 * running max m and sum l of exp(s - m) and the unnormalised output acc:
 *   m' = max(m, rowmax S),  l = l e^{m - m'} + rowsum e^{S - m'},
 *   acc = acc e^{m - m'} + e^{S - m'} V,
 * then o = acc / l and lse = m + log l. S = scale Q K^T and P V are small matmuls
 * (gemm_small: AVX-512 micro-kernel or portable loop). */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "ops/cpu/attention_cpu.h"
#include "ops/cpu/gemm_small.h"
#include "ops/cpu/kda_internal.h" /* lm_fexp */

static void forward_task(const lm_attention_config *c, const lm_attn_prep *p,
                         const lm_attention_inputs *in, lm_attn_task tk, float *o, float *lse,
                         float *scr) {
    const int D = c->D, Hq = c->Hq, Hkv = c->Hkv, h = tk.h, g = h / (Hq / Hkv), h2 = D / 2;
    const int64_t ldT = p->ldT, bos = p->bos[tk.n], len = p->len[tk.n];
    const int64_t q0 = (int64_t)tk.b * LM_ATTN_BLK;
    const int nq = len - q0 < LM_ATTN_BLK ? (int)(len - q0) : LM_ATTN_BLK;
    float *restrict Qt = scr, *restrict acc = Qt + (size_t)LM_ATTN_BLK * D;
    float *restrict S = acc + (size_t)LM_ATTN_BLK * D;
    float *restrict m = S + (size_t)LM_ATTN_BLK * LM_ATTN_BLK, *restrict l = m + LM_ATTN_BLK;

    /* the query tile, rotated at its positions, contiguous */
    for (int i = 0; i < nq; i++) {
        const float *src = in->q + ((bos + q0 + i) * Hq + h) * D;
        if (p->rc)
            lm_attn_rope_rotate(src, Qt + (size_t)i * D, D, p->rc + (q0 + i) * h2,
                                p->rs + (q0 + i) * h2, 0);
        else
            memcpy(Qt + (size_t)i * D, src, sizeof(float) * (size_t)D);
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)nq * D);

    const float *kT = p->kT + (size_t)g * D * ldT;
    for (int kb = 0; kb <= tk.b; kb++) {
        const int64_t k0 = (int64_t)kb * LM_ATTN_BLK;
        const int nk = len - k0 < LM_ATTN_BLK ? (int)(len - k0) : LM_ATTN_BLK;
        const int diag = kb == tk.b;
        lm_gemm_small(nq, nk, D, c->scale, Qt, D, 1, kT + bos + k0, ldT, S, LM_ATTN_BLK, 0);
        for (int i = 0; i < nq; i++) {
            float *restrict s = S + (size_t)i * LM_ATTN_BLK;
            const int jn = diag ? i + 1 : nk; /* keys j < jn are visible to row i */
            float mx = m[i];
            for (int j = 0; j < jn; j++)
                mx = s[j] > mx ? s[j] : mx;
            const float alpha = lm_fexp(m[i] - mx); /* 0 on the first block (m = -inf) */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < jn; j++) {
                const float e = lm_fexp(s[j] - mx);
                s[j] = e;
                sum += e;
            }
            for (int j = jn; j < nk; j++)
                s[j] = 0.0f;
            l[i] = l[i] * alpha + sum;
            m[i] = mx;
            if (alpha != 1.0f) {
                float *restrict a = acc + (size_t)i * D;
#pragma omp simd
                for (int d = 0; d < D; d++)
                    a[d] *= alpha;
            }
        }
        lm_gemm_small(nq, D, nk, 1.0f, S, LM_ATTN_BLK, 1, in->v + ((bos + k0) * Hkv + g) * D,
                      (ptrdiff_t)Hkv * D, acc, D, 1);
    }
    for (int i = 0; i < nq; i++) {
        const int64_t r = (bos + q0 + i) * Hq + h;
        const float inv = 1.0f / l[i];
        float *restrict orow = o + r * D;
        const float *restrict a = acc + (size_t)i * D;
#pragma omp simd
        for (int d = 0; d < D; d++)
            orow[d] = a[d] * inv;
        if (lse)
            lse[r] = m[i] + logf(l[i]);
    }
}

void lm_attn_cpu_forward(const lm_attention_config *c, const lm_attn_prep *p,
                         const lm_attention_inputs *in, int ntasks, float *o, float *lse) {
#pragma omp parallel
    {
        float *scr = p->thr + p->thr_floats * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < ntasks; t++)
            forward_task(c, p, in, p->tasks[t], o, lse, scr);
    }
}
