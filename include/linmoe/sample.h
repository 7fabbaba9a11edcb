/* linmoe sampling: the next-token distribution of `linmoe generate` from one row of
 * logits — temperature, top-k, top-p (nucleus) — and a seeded draw from it.
 *
 * For logits z [V] (fp32), in this order (the Hugging Face logits-warper order):
 *   temperature = 0: greedy, the argmax (ties: the lower id; NaN never wins); no
 *                    random number is used.
 *   else          : s_v = z_v / temperature (fp64), tokens sorted by s descending
 *                   (ties: lower id first);
 *   top_k > 0     : keep the top_k first (all when top_k >= V);
 *   softmax over the kept tokens: p_v = exp(s_v - max) / sum;
 *   top_p < 1     : keep the shortest prefix of the sorted kept tokens whose mass
 *                   reaches top_p (at least one token; Holtzman et al. 2020, "The
 *                   Curious Case of Neural Text Degeneration", §3.1), renormalised.
 * Draw: one u = lm_rng_uniform(rng) per sample, the first token (in sorted order)
 * whose cumulative probability exceeds u (the last kept one if rounding leaves u
 * above the total). So a sampler seeded with the same seed and fed the same logits
 * gives the same tokens.
 *
 * Non-finite logits: NaN and -Inf get probability 0; +Inf logits share the mass
 * equally. All logits NaN/-Inf: token 0.
 *
 * What this module does not do: repetition penalties, beam search, the model call.
 */
#ifndef LINMOE_SAMPLE_H
#define LINMOE_SAMPLE_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float temperature; /* >= 0; 0 = greedy */
    int top_k;         /* >= 0; 0 = off */
    float top_p;       /* (0, 1]; 1 = off */
} lm_sampler_config;

/* temperature 1, top_k 0, top_p 1 (plain sampling). */
void lm_sampler_config_default(lm_sampler_config *c);
/* Errors (LM_ERR_INVALID) name the field and value: temperature < 0 or not finite,
 * top_k < 0, top_p outside (0, 1]. */
lm_status lm_sampler_config_validate(const lm_sampler_config *c, lm_error *err);

typedef struct lm_sampler lm_sampler;

/* A sampler for vocabulary size V (>= 1) with its own Philox stream (lm_rng seeded
 * with `seed`) and scratch of V entries. */
lm_status lm_sampler_new(lm_sampler **out, const lm_sampler_config *c, int V, uint64_t seed,
                         lm_error *err);
void lm_sampler_free(lm_sampler *s);

/* Next token from logits [V]. */
int32_t lm_sampler_sample(lm_sampler *s, const float *logits);

/* The distribution the next lm_sampler_sample would draw from, without drawing:
 * probs [V] fp64 (0 for removed tokens, summing to 1). Returns the number of tokens
 * with probability > 0 (kept). */
int lm_sampler_probs(lm_sampler *s, const float *logits, double *probs);

#ifdef __cplusplus
}
#endif
#endif
