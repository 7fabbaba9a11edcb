/* `linmoe train`: parse the flags, load the training config and call lm_train_run
 * (include/linmoe/train.h). No math here. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "linmoe/train.h"

/* SIGINT / SIGTERM: the first asks the trainer to finish the step, write a checkpoint
 * and return (lm_train_options.stop); a second one kills the process at once. The one
 * piece of process state a signal handler needs lives here, in the CLI. */
static volatile sig_atomic_t g_stop;

static void on_stop_signal(int sig) {
    if (g_stop) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_stop = sig;
    static const char msg[] = "\nlinmoe train: interrupted: finishing the current step and "
                              "writing a checkpoint (interrupt again to abort at once)\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
}

static void catch_stop_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

void lm_cli_train_usage(FILE *f) {
    fprintf(f,
            "usage: linmoe train --config FILE --run-dir DIR [--resume] [--max-steps N]\n"
            "          [--threads N] [--device cpu|cuda[:N]] [--fail-checkpoint-at STEP]\n"
            "\n"
            "Trains the model of a training config (format: include/linmoe/train.h,\n"
            "docs/training.md) through its stages, with evals at every stage end, checkpoints\n"
            "and logs in DIR:\n"
            "  DIR/log.jsonl, evals.jsonl, stages.jsonl, train_config.json\n"
            "  DIR/ckpt/step-NNNNNNN/{model.safetensors, config.json, train_state.safetensors}\n"
            "  DIR/ckpt/latest (names the newest complete checkpoint)\n"
            "On a terminal a live progress line is shown; otherwise plain lines every\n"
            "train.log_every steps. The final summary is printed to stdout as JSON.\n"
            "Ctrl-C (SIGINT) or SIGTERM finishes the current step, writes a checkpoint, says\n"
            "so and exits with 128 + the signal (130, 143); a second one aborts at once.\n"
            "\n"
            "Several processes: `mpirun -np N linmoe train ...` (a build with MPI) trains one\n"
            "model data-parallel on N ranks: every global batch is split over the ranks (the\n"
            "same batches, losses and checkpoints as one process, up to fp32 summation order),\n"
            "the AdamW state is sharded (ZeRO-1); rank 0 prints and writes DIR. A run resumes\n"
            "on any number of ranks. With --device cuda, one GPU per rank (its index on the\n"
            "host): the gradients are all-reduced over NCCL, overlapped with the backward,\n"
            "and every rank runs the whole AdamW. docs/distributed.md.\n"
            "\n"
            "options:\n"
            "  --config FILE        training config (JSON); optional with --resume (the\n"
            "                       config saved in the checkpoint is used)\n"
            "  --run-dir DIR        run directory (created; must not hold a run unless --resume)\n"
            "  --resume             continue bit-exactly from DIR/ckpt/latest\n"
            "  --max-steps N        stop once N steps (counted from the start of the run) are\n"
            "                       done, writing a checkpoint; default: all stages\n"
            "  --threads N          threads (default: train.threads, else all cores)\n"
            "  --device D           cpu (default) or cuda / cuda:N: run the training steps on\n"
            "                       that GPU (bf16 activations, fp32 master weights; the evals\n"
            "                       run there too; the same checkpoints as on the CPU)\n"
            "  --fail-checkpoint-at STEP  test hook: the checkpoint at STEP fails while being\n"
            "                       written (the previous checkpoint must stay loadable)\n"
            "  --dist-timeout S     several ranks: a collective that waits longer than S\n"
            "                       seconds ends the job with a message (default 1800; it must\n"
            "                       outlast rank 0's checkpoint writes; 0 = off)\n"
            "  --diverge-at STEP    test hook (several ranks): rank 1 perturbs an MoE bias\n"
            "                       after STEP; the next checkpoint's replica check fails\n"
            "  --dist B             auto (default): GPU ranks (--device cuda, several ranks)\n"
            "                       reduce over NCCL, CPU ranks over MPI; nccl: the NCCL path\n"
            "                       even on one GPU (the same results as without it)\n"
            "  --bucket-mb X        NCCL gradient buckets: whole layers, at least X MiB each\n"
            "                       (default 25; 0 = one bucket per layer)\n"
            "  --help               this help\n"
            "\n"
            "exit status: 0 success, 1 bad input or failure, 2 usage error\n");
}

static int parse_i64(const char *flag, const char *s, int64_t lo, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || !end || *end || end == s || v < lo) {
        fprintf(stderr, "linmoe train: %s = '%s' is not an integer >= %lld\n", flag, s,
                (long long)lo);
        return -1;
    }
    *out = v;
    return 0;
}

int lm_cli_train(int argc, char **argv) {
    /* argv[0] == "train" */
    const char *config = NULL, *run_dir = NULL;
    int64_t dist_timeout = 1800;
    lm_train_options o;
    lm_train_options_default(&o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            lm_cli_train_usage(stdout);
            return LM_EXIT_OK;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = NULL;
        static const char *const with_value[] = {
            "--config", "--run-dir",    "--max-steps",    "--threads", "--fail-checkpoint-at",
            "--device", "--diverge-at", "--dist-timeout", "--dist",    "--bucket-mb",
            NULL};
        const char *flag = NULL;
        for (const char *const *f = with_value; *f && !flag; f++) {
            size_t n = strlen(*f);
            if (strncmp(a, *f, n) == 0 && (a[n] == '\0' || a[n] == '=')) {
                flag = *f;
                if (a[n] == '=') {
                    val = a + n + 1;
                } else if (i + 1 < argc) {
                    val = argv[++i];
                }
                if (!val || !*val) {
                    fprintf(stderr, "linmoe train: option %s needs a value\n", flag);
                    return LM_EXIT_USAGE;
                }
            }
        }
        int64_t v = 0;
        if (!flag && strcmp(a, "--resume") == 0) {
            o.resume = 1;
        } else if (!flag) {
            if (a[0] == '-')
                fprintf(stderr, "linmoe train: unknown option '%s' (see `linmoe train --help`)\n",
                        a);
            else
                fprintf(stderr,
                        "linmoe train: unexpected argument '%s' (see `linmoe train --help`)\n", a);
            return LM_EXIT_USAGE;
        } else if (strcmp(flag, "--config") == 0) {
            config = val;
        } else if (strcmp(flag, "--run-dir") == 0) {
            run_dir = val;
        } else if (strcmp(flag, "--max-steps") == 0) {
            if (parse_i64(flag, val, 1, &v))
                return LM_EXIT_USAGE;
            o.max_steps = v;
        } else if (strcmp(flag, "--threads") == 0) {
            if (parse_i64(flag, val, 1, &v) || v > 4096)
                return LM_EXIT_USAGE;
            o.threads = (int)v;
        } else if (strcmp(flag, "--device") == 0) {
            lm_error derr = {0};
            if (lm_device_parse(val, "--device", &o.device, &derr) != LM_OK) {
                fprintf(stderr, "linmoe train: %s\n", derr.msg);
                return LM_EXIT_USAGE;
            }
        } else if (strcmp(flag, "--fail-checkpoint-at") == 0) {
            if (parse_i64(flag, val, 1, &v))
                return LM_EXIT_USAGE;
            o.fail_checkpoint_at = v;
        } else if (strcmp(flag, "--dist-timeout") == 0) {
            if (parse_i64(flag, val, 0, &v))
                return LM_EXIT_USAGE;
            dist_timeout = v;
        } else if (strcmp(flag, "--dist") == 0) {
            if (strcmp(val, "nccl") == 0) {
                o.dist_nccl = 1;
            } else if (strcmp(val, "auto") != 0) {
                fprintf(stderr, "linmoe train: --dist = '%s' (want auto or nccl)\n", val);
                return LM_EXIT_USAGE;
            }
        } else if (strcmp(flag, "--bucket-mb") == 0) {
            char *end = NULL;
            errno = 0;
            const double mb = strtod(val, &end);
            if (errno || !end || *end || end == val || !(mb >= 0) || mb > 1e6) {
                fprintf(stderr, "linmoe train: --bucket-mb = '%s' is not a number in [0, 1e6]\n",
                        val);
                return LM_EXIT_USAGE;
            }
            o.bucket_bytes = mb > 0 ? (int64_t)(mb * (1 << 20)) : 1;
            if (o.bucket_bytes < 1)
                o.bucket_bytes = 1;
        } else if (strcmp(flag, "--diverge-at") == 0) {
            if (parse_i64(flag, val, 1, &v))
                return LM_EXIT_USAGE;
            o.diverge_at = v;
        }
    }
    if (!run_dir) {
        fprintf(stderr, "linmoe train: --run-dir DIR is required (see `linmoe train --help`)\n");
        return LM_EXIT_USAGE;
    }
    if (!config && !o.resume) {
        fprintf(stderr, "linmoe train: --config FILE is required (see `linmoe train --help`)\n");
        return LM_EXIT_USAGE;
    }
    o.run_dir = run_dir;
    lm_error err = {0};
    lm_train_config c;
    memset(&c, 0, sizeof c);
    if (config && lm_train_config_load(&c, config, &err) != LM_OK) {
        fprintf(stderr, "linmoe train: %s\n", err.msg);
        return LM_EXIT_BAD_INPUT;
    }
    /* the ranks of `mpirun -np N linmoe train ...` (include/linmoe/dist.h) */
    lm_comm *world = NULL;
    if (lm_comm_world_new(&world, &err) != LM_OK) {
        fprintf(stderr, "linmoe train: %s\n", err.msg);
        lm_train_config_free(&c);
        return LM_EXIT_BAD_INPUT;
    }
    const int rank = lm_comm_rank(world), nranks = lm_comm_size(world);
    if (nranks > 1 && lm_comm_set_timeout(world, (double)dist_timeout, &err) != LM_OK) {
        fprintf(stderr, "linmoe train: --dist-timeout: %s\n", err.msg);
        lm_train_config_free(&c);
        lm_comm_free(world);
        return LM_EXIT_USAGE;
    }
    o.comm = world;
    lm_train_summary s;
    o.stop = &g_stop;
    catch_stop_signals();
    lm_status st = lm_train_run(config ? &c : NULL, &o, &s, &err);
    lm_train_config_free(&c);
    if (st != LM_OK) {
        if (nranks > 1) {
            fprintf(stderr, "linmoe train (rank %d of %d): %s\n", rank, nranks, err.msg);
            lm_comm_abort(world, LM_EXIT_BAD_INPUT);
        } else {
            fprintf(stderr, "linmoe train: %s\n", err.msg);
        }
        lm_comm_free(world);
        return LM_EXIT_BAD_INPUT;
    }
    lm_comm_free(world);
    if (rank != 0)
        return LM_EXIT_OK;
    printf("{\"steps\": %lld, \"steps_run\": %lld, \"tokens\": %lld, \"bad_steps\": %lld, "
           "\"train_seconds\": %.3f, \"tok_per_s\": %.1f, \"mfu\": %.5f, \"sgemm_gflops\": %.2f, "
           "\"mfu_reference\": \"%s\", \"last_loss\": ",
           (long long)s.steps_done, (long long)s.steps_run, (long long)s.tokens,
           (long long)s.bad_steps, s.train_seconds, s.tokens_per_s, s.mfu, s.ref_flops / 1e9,
           s.ref_desc);
    if (isfinite(s.last_loss))
        printf("%.6f", s.last_loss);
    else
        printf("null");
    printf(", \"bits_per_byte\": ");
    if (isfinite(s.bits_per_byte))
        printf("%.6f", s.bits_per_byte);
    else
        printf("null");
    printf(", \"checkpoint\": \"");
    for (const char *q = s.checkpoint; *q; q++) {
        if (*q == '"' || *q == '\\')
            putchar('\\');
        putchar(*q);
    }
    printf("\", \"interrupted\": %s}\n", s.interrupted ? "true" : "false");
    /* interrupted: the shell's convention for a death by that signal (130 for SIGINT) */
    return s.interrupted ? 128 + (int)g_stop : LM_EXIT_OK;
}
