/* linmoe expert-parallel MoE layer on the CPU (issue 24): the layer of moe.h with its
 * routed experts split over the P ranks of an expert-parallel communicator
 * (dist.h). Rank p holds experts [p*E/P, (p+1)*E/P) (E_loc = E/P of them; P must
 * divide E); the router weight and the shared experts are replicated. Each rank
 * brings its own tokens; together the ranks compute what one process computes on the
 * concatenation of their tokens in rank order (the "global" batch of the group).
 *
 * The routed batch: by default the EP group's tokens. With a routing communicator
 * `route` (a group holding the EP group, e.g. the world of a DP x EP grid), the router
 * runs on the concatenation of all of route's ranks' tokens in route's rank order:
 * capacity per expert over that whole batch, one aux loss of it, every rank's router
 * state holding its demand (no reduction over DP needed). Only the dispatch and the
 * experts stay inside the EP group: each expert's segment holds the EP group's rows
 * (its gradient is then the group's part, which the DP reduction completes).
 *
 * Forward, per call (every rank of the group calls it, with its own T >= 0):
 *  1. token counts all-gathered (over route); router logits of the local tokens
 *     (x W_r^T);
 *  2. the logits (and cu_seqlens) all-gathered over route, and the router
 *     (moe_router.h) run on the routed batch on every rank: the same selection,
 *     the same capacity per expert over the routed batch's tokens (so the tokens
 *     dropped are those one process drops on that batch), the same aux loss, and
 *     the router state accumulates the routed batch's demand (identical on every
 *     rank of route);
 *  3. dispatch: the kept assignments of the local tokens, sorted by expert (stable:
 *     token, then slot order), so the rows for rank q are contiguous; the per-expert
 *     row counts exchanged first (all-to-all of E_loc counts per peer), then the
 *     token rows (all-to-all-v);
 *  4. on the expert's rank the received rows are ordered by (expert, source rank,
 *     token), which is the global token order: each expert's segment is the one a
 *     single process builds, and its SwiGLU runs the same GEMMs (moe.h);
 *  5. the expert outputs return by the reverse all-to-all-v and are combined:
 *     out_t = S(x_t) + sum_j keep w_tj E_j(x_t), the shared experts S computed
 *     locally.
 * Backward: the upstream rows dout_t (with the gate weight w) go to the experts'
 * ranks, which compute the expert gradients of their segments, the routed dx rows
 * and d w; those return; the d w of the routed batch are all-gathered (over route)
 * and the router backward runs on it (as in the forward); the local rows of dlogits
 * give dx and the local part of d gate.weight. Shared experts stay local. The aux
 * loss is the routed batch's, whole on every rank: its gradient on the local rows
 * (factor lm_moe_ep_set_aux_scale) is this rank's part of the routed batch's.
 *
 * Gradients: experts.* are this rank's E_loc experts, complete (the sums over the
 * group's tokens, in the single-process order). gate.weight and shared_experts.*
 * are the sums over this rank's tokens only: the caller sums them over the group
 * (with the rest of the replicated parameters' gradients).
 *
 * Layouts (fp32, row-major, as moe.h): x, out, dout, dx [T, d] (this rank's tokens);
 * gate.weight [E, d]; experts.gate_proj / up_proj [E_loc, f, d], experts.down_proj
 * [E_loc, d, f] (local expert l is global expert e0 + l); shared [fs, d] / [d, fs].
 * cu_seqlens [n_cu] of this rank's tokens, or NULL: this rank's tokens are one
 * sequence (only the sequence-wise aux loss reads them).
 *
 * Errors: LM_ERR_INVALID (E not divisible by P, a route size that is not a multiple
 * of P, T outside [0, max_tokens], bad pointers, backward before forward, the errors
 * of lm_moe_forward); every rank returns the worst status of route for step 0 of a
 * call (lm_comm_agree), so a rank's bad input does not leave the others waiting;
 * collective failures (LM_ERR_IO). Memory: one allocation at lm_moe_ep_new for
 * max_tokens tokens per rank (the receive side holds up to P * max_tokens * k rows;
 * the routed batch's logits R * max_tokens * E floats).
 *
 * What this module does not do: the trainer wiring (parameter sharding, the
 * gradient reduction of the replicated weights), overlap of the all-to-alls with
 * compute, GPUs.
 */
#ifndef LINMOE_MOE_EP_H
#define LINMOE_MOE_EP_H

#include "linmoe/dist.h"
#include "linmoe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lm_moe_ep lm_moe_ep;

/* Collective over `route` (NULL: ep). ep and route are borrowed and must outlive the
 * layer; every rank of route calls forward / backward together. max_tokens: the most
 * tokens this rank passes per call (the layer uses the largest over route's ranks). */
lm_status lm_moe_ep_new(lm_moe_ep **out, const lm_moe_config *c, lm_comm *ep, lm_comm *route,
                        int max_tokens, lm_error *err);
void lm_moe_ep_free(lm_moe_ep *l);
/* First global expert of this rank and the number of local experts. */
int lm_moe_ep_first_expert(const lm_moe_ep *l);
int lm_moe_ep_num_local(const lm_moe_ep *l);

lm_status lm_moe_ep_forward(lm_moe_ep *l, const lm_moe_weights *w, lm_router_state *st,
                            const float *x, int T, const int64_t *cu_seqlens, int n_cu,
                            int training, float *out, lm_error *err);
/* g: overwritten (NULL entries: not computed), as moe.h; dx may be NULL. */
lm_status lm_moe_ep_backward(lm_moe_ep *l, const lm_moe_weights *w, const float *x,
                             const float *dout, float *dx, lm_moe_grads *g, lm_error *err);
/* Factor on the aux loss's gradient (moe.h lm_moe_ctx_set_aux_scale). */
void lm_moe_ep_set_aux_scale(lm_moe_ep *l, float scale);
/* The routing of the last forward over the routed batch (T = its tokens, this
 * rank's rows from lm_moe_ep_token_offset); NULL before the first. */
const lm_route *lm_moe_ep_route(const lm_moe_ep *l);
/* Index of this rank's first token in the routed batch of the last forward. */
int64_t lm_moe_ep_token_offset(const lm_moe_ep *l);

#ifdef __cplusplus
}
#endif
#endif
