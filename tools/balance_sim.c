/* `linmoe balance-sim`: flags, the run (lm_balance_sim_run, src/ops/moe_balance_sim.c),
 * a short summary on stdout and the JSON record. No math here.
 *
 * JSON (written to a temporary name and renamed):
 *   {"config": {...},
 *    "steps": [{"step", "maxvio_batch", "maxvio_global", "n_dead", "dropped_frac",
 *               "dropped_token_frac", "bias_min", "bias_max", "n_clamped", "aux_loss"}, ...],
 *    "summary": {"first_step_maxvio_below_0_2" (1-based, null = never),
 *                "maxvio_batch_last100_mean", "maxvio_global_last100", "n_dead_final",
 *                "max_abs_bias", "seconds"}}
 * dropped_frac is the fraction of the step's assignments dropped by capacity.
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bench.h"
#include "cli.h"
#include "linmoe/core.h"
#include "linmoe/moe_router.h"

static const char *k_prog = "linmoe balance-sim";

void lm_cli_balance_sim_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe balance-sim [--experts E] [--topk K] [--tokens T] [--steps N]\n"
            "                          [--mode none|aux_loss|aux_free|quantile] [options]\n"
            "\n"
            "Simulates expert load balancing on the stationary skewed synthetic router of\n"
            "reference/moe.md §7.3: s_tj = sigmoid(z_tj + mu_j), z ~ N(0,1) iid per step, token\n"
            "and expert, mu_j linear in [-skew, skew]. Each step routes T tokens through the\n"
            "library router (training mode) and updates the bias once; prints a summary and\n"
            "optionally writes per-step metrics as JSON.\n"
            "\n"
            "modes:\n"
            "  none       no balancing (the bias stays 0)\n"
            "  aux_loss   the aux loss alpha*sum_i f_i P_i trained by SGD (rate --lr) on one\n"
            "             logit offset per expert: a pure score simulation has no router\n"
            "             weights, so this models the aux loss pulling the logits, alone\n"
            "  aux_free   b += u*sign(mean - demand) (or the linear rule), centred, clamped\n"
            "  quantile   per-micro-batch dual (quantile) solve, averaged, EMA, centred, clamped\n"
            "\n"
            "options:\n"
            "  --experts E          routed experts (64)\n"
            "  --topk K             experts per token (8)\n"
            "  --tokens T           tokens per step (4096)\n"
            "  --steps N            steps (1000)\n"
            "  --mode M             balancing mode (aux_free)\n"
            "  --rate U             aux_free bias update rate u (1e-3)\n"
            "  --rule R             aux_free rule: sign | linear (sign)\n"
            "  --clamp B            |bias| <= B after centring; 0 = no clamp (1.0)\n"
            "  --no-center          do not mean-centre the bias\n"
            "  --iters I            quantile alternations per micro-batch (1)\n"
            "  --ema L              quantile EMA: b = L*b + (1-L)*b_new (0)\n"
            "  --micro M            micro-batches per step (1)\n"
            "  --capacity-factor C  training capacity factor; 0 = dropless (0)\n"
            "  --drop P             drop policy: probs | position (probs)\n"
            "  --alpha A            aux_loss weight (0.01)\n"
            "  --lr L               aux_loss SGD rate on the logit offsets (100)\n"
            "  --skew R             mu_j linear in [-R, R] (2)\n"
            "  --seed S             noise seed (1234)\n"
            "  --threads N          OpenMP threads (default: OpenMP's)\n"
            "  --json FILE          write {config, steps, summary} to FILE\n"
            "  --help               this help\n"
            "\n"
            "exit status: 0 success, 1 bad configuration or I/O failure, 2 usage error\n");
}

/* `--name VALUE` / `--name=VALUE` at argv[*i]: 1 matched (value in *val), 0 not this
 * flag, -1 value missing. */
static int flag_val(int argc, char **argv, int *i, const char *name, const char **val) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0)
        return 0;
    if (a[n] == '=') {
        *val = a + n + 1;
        if (**val)
            return 1;
    } else if (a[n] == '\0') {
        if (*i + 1 < argc) {
            *val = argv[++*i];
            return 1;
        }
    } else {
        return 0;
    }
    fprintf(stderr, "%s: option %s needs a value\n", k_prog, name);
    return -1;
}

static int parse_int(const char *flag, const char *s, long lo, long hi, int *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < lo || v > hi) {
        fprintf(stderr, "%s: %s '%s' is not an integer in [%ld, %ld]\n", k_prog, flag, s, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_float(const char *flag, const char *s, double lo, double hi, float *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno != 0 || !isfinite(v) || v < lo || v > hi) {
        fprintf(stderr, "%s: %s '%s' is not a number in [%g, %g]\n", k_prog, flag, s, lo, hi);
        return -1;
    }
    *out = (float)v;
    return 0;
}

static const char *mode_name(lm_balance_mode m) {
    switch (m) {
    case LM_BAL_NONE:
        return "none";
    case LM_BAL_AUX_LOSS:
        return "aux_loss";
    case LM_BAL_AUX_FREE:
        return "aux_free";
    case LM_BAL_QUANTILE:
        return "quantile";
    }
    return "?";
}

static cJSON *num_or_null(cJSON *o, const char *key, double v) {
    if (!isfinite(v))
        return cJSON_AddNullToObject(o, key);
    return cJSON_AddNumberToObject(o, key, v);
}

static int write_json(const char *path, const lm_balance_sim_config *c, const lm_router_metrics *m,
                      const lm_balance_sim_summary *s) {
    cJSON *root = cJSON_CreateObject();
    int ok = root != NULL;
    cJSON *cfg = ok ? cJSON_AddObjectToObject(root, "config") : NULL;
    ok = ok && cfg;
    ok = ok && cJSON_AddNumberToObject(cfg, "experts", c->experts) &&
         cJSON_AddNumberToObject(cfg, "topk", c->topk) &&
         cJSON_AddNumberToObject(cfg, "tokens", c->tokens) &&
         cJSON_AddNumberToObject(cfg, "steps", c->steps) &&
         cJSON_AddNumberToObject(cfg, "micro", c->micro) &&
         cJSON_AddStringToObject(cfg, "mode", mode_name(c->mode)) &&
         cJSON_AddStringToObject(cfg, "rule", c->rule == LM_BIAS_SIGN ? "sign" : "linear") &&
         cJSON_AddNumberToObject(cfg, "rate", c->rate) &&
         cJSON_AddNumberToObject(cfg, "clamp", c->clamp) &&
         cJSON_AddBoolToObject(cfg, "center", c->center) &&
         cJSON_AddNumberToObject(cfg, "iters", c->iters) &&
         cJSON_AddNumberToObject(cfg, "ema", c->ema) &&
         cJSON_AddNumberToObject(cfg, "capacity_factor", c->capacity_factor) &&
         cJSON_AddStringToObject(cfg, "drop", c->drop == LM_DROP_PROBS ? "probs" : "position") &&
         cJSON_AddNumberToObject(cfg, "aux_alpha", c->aux_alpha) &&
         cJSON_AddNumberToObject(cfg, "aux_lr", c->aux_lr) &&
         cJSON_AddNumberToObject(cfg, "skew", c->skew) &&
         cJSON_AddNumberToObject(cfg, "seed", (double)c->seed);
    cJSON *steps = ok ? cJSON_AddArrayToObject(root, "steps") : NULL;
    ok = ok && steps;
    for (int i = 0; ok && i < c->steps; i++) {
        cJSON *o = cJSON_CreateObject();
        ok = o && cJSON_AddNumberToObject(o, "step", i + 1) &&
             num_or_null(o, "maxvio_batch", m[i].maxvio_batch) &&
             num_or_null(o, "maxvio_global", m[i].maxvio_global) &&
             cJSON_AddNumberToObject(o, "n_dead", m[i].n_dead) &&
             num_or_null(o, "dropped_frac", m[i].dropped_assign_frac) &&
             num_or_null(o, "dropped_token_frac", m[i].dropped_token_frac) &&
             num_or_null(o, "bias_min", m[i].bias_min) &&
             num_or_null(o, "bias_max", m[i].bias_max) &&
             cJSON_AddNumberToObject(o, "n_clamped", m[i].n_clamped) &&
             num_or_null(o, "aux_loss", m[i].aux_loss);
        if (!ok || !cJSON_AddItemToArray(steps, o)) {
            cJSON_Delete(o);
            ok = 0;
        }
    }
    cJSON *sum = ok ? cJSON_AddObjectToObject(root, "summary") : NULL;
    ok = ok && sum;
    ok = ok &&
         (s->first_step_maxvio_below_0_2 > 0
              ? cJSON_AddNumberToObject(sum, "first_step_maxvio_below_0_2",
                                        s->first_step_maxvio_below_0_2)
              : cJSON_AddNullToObject(sum, "first_step_maxvio_below_0_2")) &&
         num_or_null(sum, "maxvio_batch_last100_mean", s->maxvio_batch_last100_mean) &&
         num_or_null(sum, "maxvio_global_last100", s->maxvio_global_last100) &&
         cJSON_AddNumberToObject(sum, "n_dead_final", s->n_dead_final) &&
         num_or_null(sum, "max_abs_bias", s->max_abs_bias) &&
         num_or_null(sum, "seconds", s->seconds);
    if (!ok) {
        cJSON_Delete(root);
        fprintf(stderr, "%s: out of memory building the JSON\n", k_prog);
        return -1;
    }
    lm_bench_json j = {root, NULL};
    int rc = lm_bench_json_save(&j, path);
    cJSON_Delete(root);
    return rc;
}

/* argv[0] == "balance-sim". Returns an exit code. */
int lm_cli_balance_sim(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_balance_sim_usage(stdout);
            return LM_EXIT_OK;
        }
    lm_balance_sim_config c;
    lm_balance_sim_config_default(&c);
    const char *json = NULL;
    int threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int r;
        if (strcmp(argv[i], "--no-center") == 0) {
            c.center = 0;
            continue;
        }
#define FLAG(name) ((r = flag_val(argc, argv, &i, name, &v)) != 0)
        if (FLAG("--experts")) {
            if (r < 0 || parse_int("--experts", v, 1, 65536, &c.experts))
                return LM_EXIT_USAGE;
        } else if (FLAG("--topk")) {
            if (r < 0 || parse_int("--topk", v, 1, 65536, &c.topk))
                return LM_EXIT_USAGE;
        } else if (FLAG("--tokens")) {
            if (r < 0 || parse_int("--tokens", v, 1, 1 << 24, &c.tokens))
                return LM_EXIT_USAGE;
        } else if (FLAG("--steps")) {
            if (r < 0 || parse_int("--steps", v, 1, 10000000, &c.steps))
                return LM_EXIT_USAGE;
        } else if (FLAG("--micro")) {
            if (r < 0 || parse_int("--micro", v, 1, 1 << 24, &c.micro))
                return LM_EXIT_USAGE;
        } else if (FLAG("--iters")) {
            if (r < 0 || parse_int("--iters", v, 1, 1000, &c.iters))
                return LM_EXIT_USAGE;
        } else if (FLAG("--threads")) {
            if (r < 0 || parse_int("--threads", v, 1, 4096, &threads))
                return LM_EXIT_USAGE;
        } else if (FLAG("--rate")) {
            if (r < 0 || parse_float("--rate", v, 0, 1e6, &c.rate))
                return LM_EXIT_USAGE;
        } else if (FLAG("--clamp")) {
            if (r < 0 || parse_float("--clamp", v, 0, 1e6, &c.clamp))
                return LM_EXIT_USAGE;
        } else if (FLAG("--ema")) {
            if (r < 0 || parse_float("--ema", v, 0, 1, &c.ema))
                return LM_EXIT_USAGE;
        } else if (FLAG("--capacity-factor")) {
            if (r < 0 || parse_float("--capacity-factor", v, 0, 1e6, &c.capacity_factor))
                return LM_EXIT_USAGE;
        } else if (FLAG("--alpha")) {
            if (r < 0 || parse_float("--alpha", v, 0, 1e6, &c.aux_alpha))
                return LM_EXIT_USAGE;
        } else if (FLAG("--lr")) {
            if (r < 0 || parse_float("--lr", v, 0, 1e9, &c.aux_lr))
                return LM_EXIT_USAGE;
        } else if (FLAG("--skew")) {
            if (r < 0 || parse_float("--skew", v, 0, 100, &c.skew))
                return LM_EXIT_USAGE;
        } else if (FLAG("--seed")) {
            char *end = NULL;
            if (r < 0)
                return LM_EXIT_USAGE;
            errno = 0;
            unsigned long long sv = strtoull(v, &end, 10);
            if (end == v || *end != '\0' || errno != 0 || v[0] == '-') {
                fprintf(stderr, "%s: --seed '%s' is not a non-negative integer\n", k_prog, v);
                return LM_EXIT_USAGE;
            }
            c.seed = (uint64_t)sv;
        } else if (FLAG("--mode")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            int m = lm_balance_from_name(v);
            if (m < 0) {
                fprintf(stderr, "%s: unknown --mode '%s' (none, aux_loss, aux_free, quantile)\n",
                        k_prog, v);
                return LM_EXIT_USAGE;
            }
            c.mode = (lm_balance_mode)m;
        } else if (FLAG("--rule")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            int m = lm_bias_rule_from_name(v);
            if (m < 0) {
                fprintf(stderr, "%s: unknown --rule '%s' (sign, linear)\n", k_prog, v);
                return LM_EXIT_USAGE;
            }
            c.rule = (lm_bias_rule)m;
        } else if (FLAG("--drop")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            int m = lm_drop_policy_from_name(v);
            if (m < 0) {
                fprintf(stderr, "%s: unknown --drop '%s' (probs, position)\n", k_prog, v);
                return LM_EXIT_USAGE;
            }
            c.drop = (lm_drop_policy)m;
        } else if (FLAG("--json")) {
            if (r < 0)
                return LM_EXIT_USAGE;
            json = v;
        } else {
#undef FLAG
            fprintf(stderr, "%s: unknown %s '%s' (see `linmoe balance-sim --help`)\n", k_prog,
                    argv[i][0] == '-' ? "option" : "argument", argv[i]);
            return LM_EXIT_USAGE;
        }
    }
    if (json && (json[0] == '\0' || json[strlen(json) - 1] == '/')) {
        fprintf(stderr, "%s: --json '%s' does not name a file\n", k_prog, json);
        return LM_EXIT_USAGE;
    }
    if (json) { /* fail before a long run, not after it */
        char dir[4096];
        const char *slash = strrchr(json, '/');
        if (!slash)
            snprintf(dir, sizeof dir, ".");
        else if (slash == json)
            snprintf(dir, sizeof dir, "/");
        else
            snprintf(dir, sizeof dir, "%.*s", (int)(slash - json), json);
        if (access(dir, W_OK | X_OK) != 0) {
            fprintf(stderr, "%s: --json '%s': directory '%s' does not exist or is not writable\n",
                    k_prog, json, dir);
            return LM_EXIT_BAD_INPUT;
        }
    }
    if (threads > 0)
        lm_set_num_threads(threads);

    lm_router_metrics *m = calloc((size_t)c.steps, sizeof(*m));
    if (!m) {
        fprintf(stderr, "%s: out of memory for %d steps of metrics\n", k_prog, c.steps);
        return LM_EXIT_BAD_INPUT;
    }
    lm_balance_sim_summary s;
    lm_error err = {0};
    if (lm_balance_sim_run(&c, m, &s, &err) != LM_OK) {
        fprintf(stderr, "%s: %s\n", k_prog, err.msg);
        free(m);
        return LM_EXIT_BAD_INPUT;
    }
    printf("balance-sim: E=%d k=%d T=%d steps=%d micro=%d mode=%s", c.experts, c.topk, c.tokens,
           c.steps, c.micro, mode_name(c.mode));
    if (c.mode == LM_BAL_AUX_FREE)
        printf(" rule=%s rate=%g", c.rule == LM_BIAS_SIGN ? "sign" : "linear", (double)c.rate);
    if (c.mode == LM_BAL_QUANTILE)
        printf(" iters=%d ema=%g", c.iters, (double)c.ema);
    if (c.mode == LM_BAL_AUX_LOSS)
        printf(" alpha=%g lr=%g", (double)c.aux_alpha, (double)c.aux_lr);
    printf(" clamp=%g center=%s cf=%g skew=%g seed=%llu threads=%d\n", (double)c.clamp,
           c.center ? "on" : "off", (double)c.capacity_factor, (double)c.skew,
           (unsigned long long)c.seed, omp_get_max_threads());
    if (s.first_step_maxvio_below_0_2 > 0)
        printf("  first step with maxvio_batch < 0.2 : %d\n", s.first_step_maxvio_below_0_2);
    else
        printf("  first step with maxvio_batch < 0.2 : never\n");
    printf("  maxvio_batch, mean of last 100     : %.4f\n", s.maxvio_batch_last100_mean);
    printf("  maxvio_global, last 100 pooled     : %.4f\n", s.maxvio_global_last100);
    printf("  dead experts, final step           : %d\n", s.n_dead_final);
    printf("  max |bias| over the run            : %.4f (max clamped %d)\n", s.max_abs_bias,
           s.max_n_clamped);
    printf("  dropped assignments, final step    : %.4f\n", m[c.steps - 1].dropped_assign_frac);
    if (c.mode == LM_BAL_AUX_LOSS)
        printf("  aux loss, final step               : %.6g\n", m[c.steps - 1].aux_loss);
    printf("  time                               : %.2f s\n", s.seconds);
    int rc = LM_EXIT_OK;
    if (json) {
        if (write_json(json, &c, m, &s) != 0)
            rc = LM_EXIT_BAD_INPUT;
        else
            printf("wrote %s\n", json);
    }
    free(m);
    return rc;
}
