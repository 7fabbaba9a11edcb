/* Next-token sampling (sample.h): temperature, top-k, top-p over one row of logits,
 * drawn with a seeded Philox stream. */
#include "linmoe/sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double s;   /* scaled logit */
    int32_t id; /* token */
} item;

struct lm_sampler {
    lm_sampler_config c;
    int V;
    lm_rng rng;
    item *it;  /* [V] sorted candidates */
    double *p; /* [V] probabilities of it[0 .. n) */
    int n;     /* candidates kept */
};

void lm_sampler_config_default(lm_sampler_config *c) {
    c->temperature = 1.0f;
    c->top_k = 0;
    c->top_p = 1.0f;
}

lm_status lm_sampler_config_validate(const lm_sampler_config *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "sampler: NULL config");
    if (!isfinite(c->temperature) || c->temperature < 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "sampler: temperature = %g (want a finite value >= 0)",
                         (double)c->temperature);
    if (c->top_k < 0)
        return lm_errorf(err, LM_ERR_INVALID, "sampler: top_k = %d (want >= 0; 0 = off)", c->top_k);
    if (!(c->top_p > 0 && c->top_p <= 1))
        return lm_errorf(err, LM_ERR_INVALID, "sampler: top_p = %g (want a value in (0, 1])",
                         (double)c->top_p);
    return LM_OK;
}

lm_status lm_sampler_new(lm_sampler **out, const lm_sampler_config *c, int V, uint64_t seed,
                         lm_error *err) {
    *out = NULL;
    LM_TRY(lm_sampler_config_validate(c, err));
    if (V < 1)
        return lm_errorf(err, LM_ERR_INVALID, "sampler: vocabulary size %d (want >= 1)", V);
    lm_sampler *s = calloc(1, sizeof(*s));
    if (s) {
        s->it = malloc((size_t)V * sizeof(item));
        s->p = malloc((size_t)V * sizeof(double));
    }
    if (!s || !s->it || !s->p) {
        lm_sampler_free(s);
        return lm_errorf(err, LM_ERR_NOMEM, "sampler: cannot allocate scratch for %d tokens", V);
    }
    s->c = *c;
    s->V = V;
    lm_rng_init(&s->rng, seed);
    *out = s;
    return LM_OK;
}

void lm_sampler_free(lm_sampler *s) {
    if (!s)
        return;
    free(s->it);
    free(s->p);
    free(s);
}

/* descending score, ties: lower id first */
static int cmp_item(const void *a, const void *b) {
    const item *x = a, *y = b;
    if (x->s > y->s)
        return -1;
    if (x->s < y->s)
        return 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Fill it[0 .. n) and p[0 .. n) with the distribution of sample.h. */
static void prepare(lm_sampler *s, const float *logits) {
    const int V = s->V;
    if (s->c.temperature == 0) {
        int32_t best = -1;
        for (int v = 0; v < V; v++)
            if (!isnan(logits[v]) && (best < 0 || logits[v] > logits[best]))
                best = v;
        s->it[0].id = best < 0 ? 0 : best;
        s->it[0].s = 0;
        s->p[0] = 1;
        s->n = 1;
        return;
    }
    const double t = s->c.temperature;
    for (int v = 0; v < V; v++) {
        const double x = isnan(logits[v]) ? -INFINITY : (double)logits[v];
        s->it[v].s = x / t;
        s->it[v].id = v;
    }
    qsort(s->it, (size_t)V, sizeof(item), cmp_item);
    int n = V;
    if (s->c.top_k > 0 && s->c.top_k < n)
        n = s->c.top_k;
    const double mx = s->it[0].s;
    if (mx == -INFINITY) { /* nothing finite: token 0 (first after the id tie-break) */
        s->p[0] = 1;
        s->n = 1;
        return;
    }
    double z = 0;
    if (mx == INFINITY) {
        int m = 0;
        while (m < n && s->it[m].s == INFINITY)
            m++;
        n = m;
        for (int i = 0; i < n; i++)
            s->p[i] = 1;
        z = n;
    } else {
        for (int i = 0; i < n; i++)
            z += s->p[i] = exp(s->it[i].s - mx);
    }
    for (int i = 0; i < n; i++)
        s->p[i] /= z;
    if (s->c.top_p < 1) {
        const double tp = s->c.top_p;
        double cum = 0;
        int m = 0;
        while (m < n) {
            cum += s->p[m++];
            if (cum >= tp)
                break;
        }
        n = m;
        for (int i = 0; i < n; i++)
            s->p[i] /= cum;
    }
    s->n = n;
}

int32_t lm_sampler_sample(lm_sampler *s, const float *logits) {
    prepare(s, logits);
    if (s->c.temperature == 0)
        return s->it[0].id;
    const double u = lm_rng_uniform(&s->rng);
    double acc = 0;
    int last = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->p[i] <= 0)
            continue;
        last = i;
        acc += s->p[i];
        if (u < acc)
            return s->it[i].id;
    }
    return s->it[last].id;
}

int lm_sampler_probs(lm_sampler *s, const float *logits, double *probs) {
    prepare(s, logits);
    memset(probs, 0, (size_t)s->V * sizeof(double));
    int kept = 0;
    for (int i = 0; i < s->n; i++) {
        probs[s->it[i].id] = s->p[i];
        kept += s->p[i] > 0;
    }
    return kept;
}
