/* `linmoe info CKPT_DIR` / `linmoe info --config FILE`: print the model config
 * summary, the parameter counts (total and active per token), the tensor table
 * (name, shape, count, decay / buffer flags) and the training memory plan
 * (model.h lm_model_mem_plan). No math here (params.h, model.h). */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "linmoe/core.h"
#include "linmoe/model.h"
#include "linmoe/params.h"

/* T of the memory plan when the config has no seq_len (as `linmoe eval`). */
#define INFO_DEFAULT_SEQ_LEN 1024

void lm_cli_info_usage(FILE *f) {
    fprintf(f, "usage: linmoe info CKPT_DIR\n"
               "       linmoe info --config FILE\n"
               "\n"
               "Prints the model config, the parameter counts (total, and active per token:\n"
               "routed experts counted k/E of their size, buffers excluded) and the tensor list\n"
               "(name, shape, element count, flags: decay = weight decay applies, buffer = not a\n"
               "trained parameter), then the memory plan of a training step on one sequence of\n"
               "T tokens (B = 1; T = the config's seq_len, else 1024) at the current OpenMP\n"
               "thread count: parameters, gradients, optimizer state, saved activations and\n"
               "scratch, each one allocation. CKPT_DIR holds config.json and model.safetensors\n"
               "(both are loaded and checked); --config FILE prints the same for a config\n"
               "without weights.\n"
               "\n"
               "exit status: 0 success, 1 bad input, 2 usage error\n");
}

static void print_params(const lm_params *p) {
    lm_model_config_print(&p->cfg, stdout);
    int64_t total = 0, active = 0, buffers = 0;
    lm_params_count(p, &total, &active);
    for (int i = 0; i < p->n; i++)
        if (p->t[i].buffer)
            buffers += p->t[i].numel;
    printf("parameters: total %lld (%.3f M), active per token %lld (%.3f M), buffers %lld\n",
           (long long)total, total / 1e6, (long long)active, active / 1e6, (long long)buffers);
    printf("tensors: %d (Hugging Face names, numbered from 0: model.layers.0 is layer 1)\n", p->n);
    for (int i = 0; i < p->n; i++) {
        const lm_param_info *e = &p->t[i];
        char shape[96];
        size_t n = 0;
        for (int j = 0; j < e->ndim; j++)
            n += (size_t)snprintf(shape + n, sizeof shape - n, "%s%lld", j ? ", " : "[",
                                  (long long)e->shape[j]);
        snprintf(shape + n, sizeof shape - n, "]");
        printf("  %-52s %-16s %10lld%s%s\n", e->name, shape, (long long)e->numel,
               e->decay ? "  decay" : "", e->buffer ? "  buffer" : "");
    }
}

/* The memory plan for B = 1, T = seq_len (or the default): one line. */
static int print_plan(const lm_model_config *c) {
    const int T = c->seq_len > 1 ? c->seq_len : INFO_DEFAULT_SEQ_LEN;
    lm_mem_plan plan;
    lm_error err = {0};
    if (lm_model_mem_plan(c, 1, T, &plan, &err) != LM_OK) {
        fprintf(stderr, "linmoe info: %s\n", err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    char line[512];
    lm_mem_plan_format(&plan, line, sizeof line);
    printf("%s%s\n", line, c->seq_len > 1 ? "" : " (T: the config has no seq_len, default 1024)");
    return LM_EXIT_OK;
}

int lm_cli_info(int argc, char **argv) {
    /* argv[0] == "info" */
    const char *config = NULL, *dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            lm_cli_info_usage(stdout);
            return LM_EXIT_OK;
        }
    }
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "linmoe info: option --config needs a value\n");
                return LM_EXIT_USAGE;
            }
            config = argv[++i];
        } else if (strncmp(argv[i], "--config=", 9) == 0 && argv[i][9]) {
            config = argv[i] + 9;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "linmoe info: unknown option '%s' (see `linmoe info --help`)\n",
                    argv[i]);
            return LM_EXIT_USAGE;
        } else if (!dir) {
            dir = argv[i];
        } else {
            fprintf(stderr, "linmoe info: unexpected argument '%s' (see `linmoe info --help`)\n",
                    argv[i]);
            return LM_EXIT_USAGE;
        }
    }
    if ((config != NULL) == (dir != NULL)) {
        fprintf(stderr,
                "linmoe info: give either CKPT_DIR or --config FILE (see `linmoe info --help`)\n");
        return LM_EXIT_USAGE;
    }
    lm_error err = {0};
    lm_params p;
    if (config) {
        lm_model_config c;
        if (lm_model_config_load(&c, config, NULL, 0, &err) != LM_OK ||
            lm_params_init(&p, &c, &err) != LM_OK) {
            fprintf(stderr, "linmoe info: %s\n", err.msg);
            return LM_EXIT_BAD_INPUT;
        }
        printf("config: %s (no weights)\n", config);
    } else {
        char dir_buf[4096];
        char why[4200];
        if (lm_cli_resolve_ckpt_why(dir, dir_buf, sizeof dir_buf, why, sizeof why) != 0) {
            fprintf(stderr, "linmoe info: %s\n", why);
            return LM_EXIT_BAD_INPUT;
        }
        dir = dir_buf;
        if (lm_params_load(&p, dir, &err) != LM_OK) {
            fprintf(stderr, "linmoe info: %s\n", err.msg);
            return LM_EXIT_BAD_INPUT;
        }
        printf("checkpoint: %s\n", dir);
    }
    print_params(&p);
    const int rc = print_plan(&p.cfg);
    lm_params_free(&p);
    return rc;
}
