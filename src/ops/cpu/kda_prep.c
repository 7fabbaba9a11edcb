/* Element-wise parts of the KDA/GDN op on the CPU: the gate activation, in-op
 * q/k L2 normalisation and beta sigmoid, forward and backward.
 * Math: reference/kda.md §1.3 (gates and their derivatives), fla's l2norm (eps
 * 1e-6 inside the square root). */
#include "ops/cpu/kda_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline float sigmoidf_(float z) { return 1.0f / (1.0f + lm_fexp(-z)); }
/* softplus with fla's threshold: z > 20 -> z */
static inline float softplusf_(float z) { return z > 20.0f ? z : log1pf(lm_fexp(z)); }

#include <omp.h>

lm_kda_workspace *lm_kda_workspace_new(void) { return LM_CALLOC(1, sizeof(lm_kda_workspace)); }

void lm_kda_workspace_free(lm_kda_workspace *ws) {
    if (!ws) return;
    for (int i = 0; i < LM_KDA_WS_SLOTS; i++)
        if (!ws->borrowed[i])
            free(ws->buf[i]);
    free(ws);
}

void *lm_kda_ws_get(lm_kda_workspace *ws, int slot, size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (!ws || slot < 0 || slot >= LM_KDA_WS_SLOTS) return LM_MALLOC(bytes);
    if (ws->cap[slot] < bytes) {
        if (!ws->borrowed[slot])
            free(ws->buf[slot]);
        /* 64-byte aligned, like the model's arena slices: the chunk kernels' rows are
         * multiples of 64 bytes, so every 512-bit load of the small GEMM then stays
         * within a cache line (malloc's 16-byte alignment splits each one in two,
         * which costs an extra load cycle on Intel cores) */
        ws->buf[slot] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        LM_CHECK(ws->buf[slot] != NULL);
        ws->cap[slot] = bytes;
        ws->borrowed[slot] = 0;
    }
    return ws->buf[slot];
}

void lm_kda_ws_bind(lm_kda_workspace *ws, int slot, void *p, size_t bytes) {
    if (!ws || slot < 0 || slot >= LM_KDA_WS_SLOTS || !p)
        return;
    if (!ws->borrowed[slot])
        free(ws->buf[slot]);
    ws->buf[slot] = p;
    ws->cap[slot] = bytes;
    ws->borrowed[slot] = 1;
}

void lm_kda_ws_plan(const lm_kda_config *c, int threads, size_t *bytes) {
    for (int i = 0; i < LM_KDA_WS_SLOTS; i++)
        bytes[i] = 0;
    const int64_t BT = (int64_t)c->B * c->T, H = c->H, HV = c->HV, K = c->K, V = c->V;
    const int64_t C = c->chunk_size, maxnt = (c->T + C - 1) / C;
    const int64_t nb = c->kind == LM_GDN ? 1 : K;
    /* prep (forward and backward): the document table sized for BT documents (the
     * most a packed batch of BT tokens has without empty documents) */
    bytes[LM_WS_BOS] = sizeof(int64_t) * (size_t)(2 * BT + 1);
    bytes[LM_WS_QS] = bytes[LM_WS_KN] = sizeof(float) * (size_t)(BT * H * K);
    bytes[LM_WS_BETA] = sizeof(float) * (size_t)(BT * HV);
    bytes[LM_WS_GK] = sizeof(float) * (size_t)(BT * HV * K);
    /* backward */
    bytes[LM_WS_DQS] = bytes[LM_WS_DKN] = bytes[LM_WS_DGK] = sizeof(float) * (size_t)(BT * HV * K);
    bytes[LM_WS_DBETA] = sizeof(float) * (size_t)(BT * HV);
    bytes[LM_WS_DB] = sizeof(double) * (size_t)(HV * nb);
    if (threads > LM_KDA_WS_MAX_THREADS)
        threads = LM_KDA_WS_MAX_THREADS;
    for (int t = 0; t < threads; t++) {
        const int s = LM_WS_THREAD0 + 3 * t;
        bytes[s] = sizeof(float) * lm_kda_chunk_ws_floats((int)C, (int)K, (int)V, 1);
        bytes[s + 1] = sizeof(float) * (size_t)((maxnt + 1) * K * V); /* Hs (bwd) >= S (fwd) */
        const size_t ds = sizeof(float) * (size_t)(K * V), dq = sizeof(float) * (size_t)(2 * K);
        bytes[s + 2] = ds > dq ? ds : dq; /* dS (bwd), then the prologue's dq/dk rows */
    }
}

void lm_kda_ws_put(lm_kda_workspace *ws, int slot, void *p) {
    if (!ws || slot < 0 || slot >= LM_KDA_WS_SLOTS) free(p);
}

int lm_kda_ws_thread_slot(int j) {
    int t = omp_get_thread_num();
    return t < LM_KDA_WS_MAX_THREADS ? LM_WS_THREAD0 + 3 * t + j : -1;
}

void lm_kda_prep_free(lm_kda_prep *p) {
    lm_kda_ws_put(p->ws, LM_WS_QS, p->qs);
    lm_kda_ws_put(p->ws, LM_WS_KN, p->kn);
    lm_kda_ws_put(p->ws, LM_WS_BETA, p->beta);
    lm_kda_ws_put(p->ws, LM_WS_GK, p->gk);
    lm_kda_ws_put(p->ws, LM_WS_BOS, p->bos);
    memset(p, 0, sizeof(*p));
}

lm_status lm_kda_prep_forward(const lm_kda_config *c, const lm_kda_inputs *in, lm_kda_prep *p,
                              lm_error *err) {
    memset(p, 0, sizeof(*p));
    const int64_t BT = (int64_t)c->B * c->T;
    const int H = c->H, HV = c->HV, K = c->K;
    p->ws = c->ws;
    p->N = c->N;
    /* sized for max(N, B*T) documents, so that packed batches whose document count
     * varies from call to call do not grow the workspace (lm_kda_ws_plan) */
    const int64_t nbos = c->N > BT ? c->N : BT;
    p->bos = lm_kda_ws_get(p->ws, LM_WS_BOS, sizeof(int64_t) * (size_t)(2 * nbos + 1));
    p->len = p->bos + nbos;
    for (int n = 0; n < c->N; n++) {
        if (c->cu_seqlens) {
            p->bos[n] = c->cu_seqlens[n];
            p->len[n] = c->cu_seqlens[n + 1] - c->cu_seqlens[n];
        } else {
            p->bos[n] = (int64_t)n * c->T;
            p->len[n] = c->T;
        }
    }
    p->qs = lm_kda_ws_get(p->ws, LM_WS_QS, sizeof(float) * (size_t)(BT * H * K));
    p->kn = lm_kda_ws_get(p->ws, LM_WS_KN, sizeof(float) * (size_t)(BT * H * K));
    p->beta = lm_kda_ws_get(p->ws, LM_WS_BETA, sizeof(float) * (size_t)(BT * HV));
    p->gk = lm_kda_ws_get(p->ws, LM_WS_GK, sizeof(float) * (size_t)(BT * HV * K));

    const float scale = c->scale;
    const int l2 = c->use_qk_l2norm_in_kernel;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < BT * H; row++) {
        const float *q = in->q + row * K, *k = in->k + row * K;
        float *qs = p->qs + row * K, *kn = p->kn + row * K;
        float rq = 1.0f, rk = 1.0f;
        if (l2) {
            double sq = 0, sk = 0;
            for (int d = 0; d < K; d++) {
                sq += (double)q[d] * q[d];
                sk += (double)k[d] * k[d];
            }
            rq = (float)(1.0 / sqrt(sq + 1e-6));
            rk = (float)(1.0 / sqrt(sk + 1e-6));
        }
        for (int d = 0; d < K; d++) {
            qs[d] = q[d] * rq * scale;
            kn[d] = k[d] * rk;
        }
    }
    const int sig = c->use_beta_sigmoid_in_kernel;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < BT * HV; i++) p->beta[i] = sig ? sigmoidf_(in->beta[i]) : in->beta[i];

    /* gate -> per-channel log-decay gk [BT, HV, K] */
    const int gdn = c->kind == LM_GDN;
    const lm_gate_mode gm = c->gate;
    const float lb = c->lower_bound;
    /* the first row whose log-decay is not finite (finite inputs can overflow here: a
     * large A_log scales the gate's input), BT * HV when none */
    int64_t bad_row = BT * HV;
#pragma omp parallel for schedule(static) reduction(min : bad_row)
    for (int64_t row = 0; row < BT * HV; row++) {
        int hv = (int)(row % HV);
        float a = in->A_log ? expf(in->A_log[hv]) : 1.0f;
        float *gk = p->gk + row * K;
        if (gdn) {
            float x = in->g[row];
            float gv;
            if (gm == LM_GATE_NONE) {
                gv = x;
            } else {
                float z = x + (in->dt_bias ? in->dt_bias[hv] : 0.0f);
                gv = gm == LM_GATE_SOFTPLUS ? -a * softplusf_(z) : lb * sigmoidf_(a * z);
            }
            for (int d = 0; d < K; d++) gk[d] = gv;
        } else {
            const float *x = in->g + row * K;
            const float *bias = in->dt_bias ? in->dt_bias + (int64_t)hv * K : NULL;
            if (gm == LM_GATE_NONE) {
                memcpy(gk, x, sizeof(float) * (size_t)K);
            } else if (gm == LM_GATE_SOFTPLUS) {
                for (int d = 0; d < K; d++) gk[d] = -a * softplusf_(x[d] + (bias ? bias[d] : 0.0f));
            } else {
#pragma omp simd
                for (int d = 0; d < K; d++) gk[d] = lb * sigmoidf_(a * (x[d] + (bias ? bias[d] : 0.0f)));
            }
        }
        if (gm != LM_GATE_NONE) {
            float acc = 0.0f; /* inf or NaN in any channel makes the sum non-finite */
            for (int d = 0; d < K; d++) acc += gk[d] * 0.0f;
            if (!isfinite(acc) && row < bad_row) bad_row = row;
        }
        /* a huge finite log-decay is a full reset: the floor (kda.h) keeps it one (after
         * the check above: an overflow to -inf stays an error) */
        if (gm != LM_GATE_BOUNDED)
            for (int d = 0; d < K; d++)
                gk[d] = gk[d] < LM_KDA_LOG_DECAY_FLOOR ? LM_KDA_LOG_DECAY_FLOOR : gk[d];
    }
    if (bad_row < BT * HV) {
        const int hv = (int)(bad_row % HV);
        const double A = in->A_log ? (double)in->A_log[hv] : 0.0;
        lm_kda_prep_free(p); /* the buffers are the caller's only on success */
        return lm_errorf(err, LM_ERR_NONFINITE,
                         "kda: the %s gate's log-decay overflows fp32 at token %lld, value head %d "
                         "(A_log[%d] = %g, exp(A_log) = %g): finite inputs, but exp(A_log) times "
                         "the gate input exceeds fp32 (keep A_log well below 88)",
                         gm == LM_GATE_SOFTPLUS ? "softplus" : "bounded", (long long)(bad_row / HV),
                         hv, hv, A, in->A_log ? exp(A) : 1.0);
    }
    return LM_OK;
}

/* Backward of the element-wise prologue. Inputs: dqs/dkn [BT,HV,K] per value head
 * (GVA groups are summed here), dbeta_act [BT,HV], dgk [BT,HV,K]. */
void lm_kda_prep_backward(const lm_kda_config *c, const lm_kda_inputs *in, const lm_kda_prep *p,
                          const float *dqs_hv, const float *dkn_hv, const float *dbeta_act,
                          const float *dgk, lm_kda_grads *gr) {
    const int64_t BT = (int64_t)c->B * c->T;
    const int H = c->H, HV = c->HV, K = c->K, G = HV / H;
    const float scale = c->scale;
    const int l2 = c->use_qk_l2norm_in_kernel;
#pragma omp parallel
    {
        const unsigned fp = lm_kda_fp_enter();
        /* per-thread rows from the workspace: the backward allocates nothing once the
         * workspace has grown (lm_kda_ws_plan) */
        const int slot = lm_kda_ws_thread_slot(2);
        float *dqs = lm_kda_ws_get(p->ws, slot, sizeof(float) * (size_t)K * 2);
        float *dkn = dqs + K;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < BT * H; row++) {
            int64_t t = row / H;
            int h = (int)(row % H);
            for (int d = 0; d < K; d++) dqs[d] = dkn[d] = 0.0f;
            for (int j = 0; j < G; j++) {
                int64_t src = (t * HV + (int64_t)h * G + j) * K;
                for (int d = 0; d < K; d++) {
                    dqs[d] += dqs_hv[src + d];
                    dkn[d] += dkn_hv[src + d];
                }
            }
            const float *q = in->q + row * K, *k = in->k + row * K;
            float *dq = gr->dq ? gr->dq + row * K : NULL, *dk = gr->dk ? gr->dk + row * K : NULL;
            if (l2) {
                /* y = x r, r = (|x|^2 + eps)^-1/2:  dx = r (dy - y (y . dy)) */
                double sq = 0, sk = 0;
                for (int d = 0; d < K; d++) {
                    sq += (double)q[d] * q[d];
                    sk += (double)k[d] * k[d];
                }
                float rq = (float)(1.0 / sqrt(sq + 1e-6)), rk = (float)(1.0 / sqrt(sk + 1e-6));
                double yq = 0, yk = 0;
                for (int d = 0; d < K; d++) {
                    yq += (double)(q[d] * rq) * (dqs[d] * scale);
                    yk += (double)(k[d] * rk) * dkn[d];
                }
                for (int d = 0; d < K; d++) {
                    if (dq) dq[d] = rq * (dqs[d] * scale - q[d] * rq * (float)yq);
                    if (dk) dk[d] = rk * (dkn[d] - k[d] * rk * (float)yk);
                }
            } else {
                for (int d = 0; d < K; d++) {
                    if (dq) dq[d] = dqs[d] * scale;
                    if (dk) dk[d] = dkn[d];
                }
            }
        }
        lm_kda_ws_put(p->ws, slot, dqs);
        lm_kda_fp_leave(fp);
    }
    if (gr->dbeta) {
        /* sigma'(x) = sigma(x) sigma(-x): b (1 - b) cancels as beta saturates (0 from x = 17
         * on in fp32), as the bounded gate's did */
        for (int64_t i = 0; i < BT * HV; i++) {
            const float x = in->beta[i];
            gr->dbeta[i] = c->use_beta_sigmoid_in_kernel ? dbeta_act[i] * p->beta[i] * sigmoidf_(-x)
                                                         : dbeta_act[i];
        }
    }

    /* gate backward: dgk (per channel) -> dg (raw input), dA_log, ddt_bias */
    const int gdn = c->kind == LM_GDN;
    const lm_gate_mode gm = c->gate;
    const float lb = c->lower_bound;
    const int nb = gdn ? 1 : K; /* dt_bias entries per value head */
    if (gr->dA_log) memset(gr->dA_log, 0, sizeof(float) * (size_t)HV);
    if (gr->ddt_bias) memset(gr->ddt_bias, 0, sizeof(float) * (size_t)HV * nb);
    double *db_all = lm_kda_ws_get(p->ws, LM_WS_DB, sizeof(double) * (size_t)(HV * nb));
#pragma omp parallel for schedule(static)
    for (int hv = 0; hv < HV; hv++) {
        float a = in->A_log ? expf(in->A_log[hv]) : 1.0f;
        double dA = 0;
        double *db = db_all + (int64_t)hv * nb;
        for (int e = 0; e < nb; e++)
            db[e] = 0.0;
        for (int64_t t = 0; t < BT; t++) {
            int64_t row = t * HV + hv;
            const float *dgr = dgk + row * K;
            for (int e = 0; e < nb; e++) {
                /* dy: gradient w.r.t. the (per-channel or per-head) log-decay */
                float dy;
                if (gdn) {
                    double s = 0;
                    for (int d = 0; d < K; d++) s += dgr[d];
                    dy = (float)s;
                } else {
                    dy = dgr[e];
                }
                float x = gdn ? in->g[row] : in->g[row * K + e];
                float dx;
                if (gm == LM_GATE_NONE) {
                    dx = dy;
                } else {
                    float z = x + (in->dt_bias ? in->dt_bias[(int64_t)hv * nb + e] : 0.0f);
                    if (gm == LM_GATE_SOFTPLUS) {
                        /* g = -a sp(z): dz = -a sigma(z) dy (sp' = 1 above the threshold);
                         * dA_log += dy * g */
                        float sg = z > 20.0f ? 1.0f : sigmoidf_(z);
                        dx = -a * sg * dy;
                        dA += (double)dy * (-a * softplusf_(z));
                    } else {
                        /* g = lb sigma(a z): dz = dy lb s (1-s) a; dA_log += dz * z.
                         * 1 - s is sigma(-a z), computed as such: 1 - s in fp32 cancels
                         * as the gate saturates (1.3e-3 relative at a z = 10, 0 from 17) */
                        const float u = a * z, s = sigmoidf_(u), sm = sigmoidf_(-u);
                        dx = dy * lb * s * sm * a;
                        dA += (double)dx * z;
                    }
                }
                if (gr->dg) {
                    if (gdn)
                        gr->dg[row] = dx;
                    else
                        gr->dg[row * K + e] = dx;
                }
                db[e] += dx;
            }
        }
        if (gr->dA_log) gr->dA_log[hv] = in->A_log ? (float)dA : 0.0f;
        if (gr->ddt_bias)
            for (int e = 0; e < nb; e++)
                gr->ddt_bias[(int64_t)hv * nb + e] = (float)db[e];
    }
    lm_kda_ws_put(p->ws, LM_WS_DB, db_all);
}
