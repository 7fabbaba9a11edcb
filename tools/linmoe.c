/* linmoe — the command-line front end (DESIGN.md "The CLI").
 *
 * Thin: parses flags and calls the library (op runner in tools/op_kda.c, benchmarks
 * in bench/). No math here. Subcommands so far: op, bench, version, help; the others
 * listed in DESIGN.md arrive with their issues.
 *
 * Exit codes: 0 success, 1 bad input / failure, 2 usage error (tools/cli.h).
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "bench_ops.h"
#include "cli.h"
#include "linmoe/core.h"

#define LINMOE_VERSION "0.1.0"

/* `linmoe op moe_router|moe` (tools/op_moe.c); exit codes as in cli.h. */
int lm_cli_op_moe_router(const char *prog, const char *in_path, const char *out_path);
int lm_cli_op_moe(const char *prog, const char *in_path, const char *out_path);
/* `linmoe op attnres` (tools/op_attnres.c); exit codes as in cli.h. */
int lm_cli_op_attnres(const char *prog, const char *in_path, const char *out_path);
/* `linmoe op attention` (tools/op_attention.c); exit codes as in cli.h. */
int lm_cli_op_attention(const char *prog, const char *in_path, const char *out_path);

/* `linmoe balance-sim` (tools/balance_sim.c); exit codes as in cli.h. */
int lm_cli_balance_sim(int argc, char **argv);
void lm_cli_balance_sim_usage(FILE *f);
/* `linmoe info` (tools/info.c); exit codes as in cli.h. */
int lm_cli_info(int argc, char **argv);
void lm_cli_info_usage(FILE *f);
/* Issue 5 subcommands, one file each (tools/<name>.c); exit codes as in cli.h. */
int lm_cli_tokenize(int argc, char **argv);
void lm_cli_tokenize_usage(FILE *f);
int lm_cli_train(int argc, char **argv);
void lm_cli_train_usage(FILE *f);
int lm_cli_eval(int argc, char **argv);
void lm_cli_eval_usage(FILE *f);
int lm_cli_generate(int argc, char **argv);
void lm_cli_generate_usage(FILE *f);
int lm_cli_serve(int argc, char **argv);
void lm_cli_serve_usage(FILE *f);
int lm_cli_plot(int argc, char **argv);
void lm_cli_plot_usage(FILE *f);
/* `linmoe export` (tools/export.c); exit codes as in cli.h. */
int lm_cli_export(int argc, char **argv);
void lm_cli_export_usage(FILE *f);

static const char *g_prog = "linmoe";

/* ---------------------------------------------------------------- help texts */

static void usage_main(FILE *f) {
    fprintf(
        f,
        "usage: %s <subcommand> [options]\n"
        "\n"
        "subcommands:\n"
        "  op       run one op on tensors from a safetensors file (kda, gdn, moe_router, moe)\n"
        "  bench    benchmark kernels and the model against the machine's limit\n"
        "           (kda, moe, attnres, model)\n"
        "  balance-sim  simulate expert load balancing on a synthetic skewed router\n"
        "  info     print a checkpoint's (or --config FILE's) config, parameter counts, tensors\n"
        "  tokenize turn text into token shards (byte or GPT-2 BPE tokenizer)\n"
        "  train    train a model from a training config (stages, checkpoints, --resume)\n"
        "  eval     evaluate a checkpoint: bits per byte, passkey accuracy, MoE balance (JSON)\n"
        "  generate sample text from a checkpoint (prefill + cached decode)\n"
        "  serve    OpenAI-compatible HTTP server with continuous batching and a chat page\n"
        "  plot     draw a run's loss, bits/byte, balance and passkey plots (gnuplot)\n"
        "  export   write a dense checkpoint in fla's KDAForCausalLM format (--format fla)\n"
        "  version  print the version\n"
        "  help     print this help, or `help SUBCOMMAND` for one subcommand\n"
        "\n"
        "Every subcommand takes --help.\n",
        g_prog);
}

static void usage_op(FILE *f) {
    fprintf(f,
            "usage: %s op kda|gdn|moe_router|moe --in IN.safetensors --out OUT.safetensors\n"
            "          [--device cpu|cuda]\n"
            "\n"
            "Runs KDA (per-channel gate) or GDN (per-head gate) on the tensors in IN and writes\n"
            "the results to OUT (F32, written to a temporary name and renamed: an existing OUT\n"
            "is left intact when the run fails).\n"
            "\n"
            "IN tensors (F32, F64 or BF16; shapes row-major):\n"
            "  q [B,T,H,K]  k [B,T,H,K]  v [B,T,HV,V]  beta [B,T,HV]          required\n"
            "  g            KDA: [B,T,HV,K]   GDN: [B,T,HV]                    required\n"
            "  A_log [HV]   dt_bias  KDA: [HV*K]  GDN: [HV]                    optional (gates)\n"
            "  initial_state [N,HV,K,V]   cu_seqlens [N+1] (I64 or I32, B == 1) optional\n"
            "  do [B,T,HV,V]   dht [N,HV,K,V]     upstream gradients; either one runs backward\n"
            "IN __metadata__ (strings):\n"
            "  gate = none|softplus|bounded (none)    lower_bound (in [-5, 0))\n"
            "  scale (K^-0.5)    chunk_size = 16|32|64 (64)    diag = auto|shared|safe (auto)\n"
            "  use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel = true|false (false)\n"
            "OUT tensors: o [B,T,HV,V], final_state [N,HV,K,V]; with do/dht also the gradients\n"
            "  of sum(o*do) + sum(final_state*dht): dq dk dv dg dbeta, dh0 (with initial_state),\n"
            "  dA_log and ddt_bias (with those inputs).\n"
            "\n"
            "options:\n"
            "  --in FILE      input safetensors file (required)\n"
            "  --out FILE     output safetensors file (required)\n"
            "  --device D     cpu (default) or cuda (kda / gdn forward on an NVIDIA GPU, bf16\n"
            "                 inputs and output, fp32 state; include/linmoe/kda_cuda.h)\n"
            "  --help         this help\n"
            "\n"
            "%s op moe_router: IN logits [T,E]; e_score_correction_bias [E] (optional, 0);\n"
            "  dtopk_weight [T,k] (optional: runs the backward). OUT topk_idx [T,k] I64,\n"
            "  topk_weight [T,k], keep [T,k] U8 (training), dlogits [T,E] (with dtopk_weight).\n"
            "%s op moe: the MoE layer. IN x [T,d], gate.weight [E,d], experts.gate_proj and\n"
            "  experts.up_proj [E,f,d], experts.down_proj [E,d,f], shared_experts.gate_proj and\n"
            "  .up_proj [n_shared*f,d], shared_experts.down_proj [d,n_shared*f] (optional, all\n"
            "  three), e_score_correction_bias [E] (optional), do [T,d] (optional: backward).\n"
            "  OUT out [T,d], topk_idx, topk_weight, keep (training); with do: dx and d<name>\n"
            "  for every weight given. Sizes come from the shapes.\n"
            "Both: __metadata__ num_experts_per_tok (required for moe), scoring_func =\n"
            "  sigmoid|softmax (sigmoid), norm_topk_prob (true), routed_scaling_factor (1.0),\n"
            "  n_group, topk_group (group-limited routing; off), training = true|false (false),\n"
            "  capacity_factor (0 = dropless; training only), drop_policy = probs|position.\n"
            "op attnres: AttnRes aggregation. IN query [D], rms_weight [D] (optional: ones),\n"
            "  residual_0 .. residual_{L-1} [N,D], do [N,D] (optional: backward); __metadata__\n"
            "  eps (1e-6), scale (1). OUT o [N,D]; with do: dquery, drms_weight, dresidual_i.\n"
            "op attention: causal GQA softmax attention. IN q [B,T,Hq,D], k, v [B,T,Hkv,D],\n"
            "  cu_seqlens [N+1] (optional, B == 1), do [B,T,Hq,D] (optional: backward);\n"
            "  __metadata__ scale (D^-0.5), causal (true), position = rope|nope (nope),\n"
            "  rope_theta (10000; with rope). RoPE is half-split (rotate_half), per document.\n"
            "  OUT o [B,T,Hq,D], lse [B,T,Hq]; with do: dq, dk, dv.\n"
            "\n"
            "exit status: 0 success, 1 bad input, 2 usage error\n",
            g_prog, g_prog, g_prog);
}

static void usage_bench(FILE *f) {
    fprintf(
        f,
        "usage: %s bench kda|moe|attnres|model|ops [--json FILE] [--threads N] [--quick]\n"
        "       %s bench serve --ckpt DIR [...]   (the HTTP server under concurrent streaming\n"
        "          clients: tokens/s, TTFT, TPOT, prefix-cache speed-up; `bench serve --help`)\n"
        "          [--device cpu|cuda] [--config FILE] [--no-peer] [--recompute] [--ops LIST]\n"
        "\n"
        "Measures the limit in the same run on the same threads, then the target:\n"
        "kda: the KDA recurrent forward, chunked forward and chunked forward+backward for\n"
        "  the bounded and the softplus gate at (B,T,H,D) = (1,4096,4,128) and\n"
        "  (4,2048,4,64); limit: OpenBLAS sgemm 2048x2048x2048.\n"
        "moe: the MoE layer forward and forward+backward at (T,d,E,k,f,shared) =\n"
        "  (4096,512,64,8,256,1) and (4096,256,16,2,256,1), active-FLOP GFLOP/s; limit sgemm.\n"
        "attnres: the AttnRes aggregation forward and backward (accumulating) at N = 4096,\n"
        "  D = 256 and 1024, L = 2, 5, 9, 17 sources; GB/s of the bytes it must move\n"
        "  against the copy bandwidth (256 MiB, OpenMP) as the limit.\n"
        "kda --device cuda: on an NVIDIA GPU (bf16 in/out): inference forward, training\n"
        "  forward and forward+backward for both gates at (B,T,H,D) = (1,8192,64,128),\n"
        "  (8,4096,16,128), (1,32768,16,128), and the decode step at B=64, H=32, D=128;\n"
        "  limits: cuBLAS bf16 GEMM 8192^3 TFLOP/s and device copy GB/s, same run; rows\n"
        "  whose kernels are missing print \"not built\" (scripts/gpu/bench-c.sh runs it on\n"
        "  the GPU machine; scripts/gpu/bench.sh has fla beside it for ratio_to_peer).\n"
        "model: one training step (forward with next-token labels + backward) of\n"
        "  configs/bench-cpu.json (or --config FILE) at its batch_size x seq_len; FLOPs of\n"
        "  lm_model_train_flops_per_token; limit sgemm; forward/backward split; and the\n"
        "  PyTorch reference step (scripts/reference/bench_step.py, first of python3 and\n"
        "  /usr/bin/python3 with torch) on the same threads as the peer: ratio_to_peer =\n"
        "  its step time / linmoe's (> 1: linmoe faster), null when it is unavailable.\n"
        "model --device cuda: one full training step (forward, backward, AdamW) of the GPU\n"
        "  model, configs/gpu-dense.json by default (gpu-moe.json: --config), at its\n"
        "  batch_size x seq_len: ms per step, tokens/s, MFU against the bf16 matmul rate\n"
        "  measured in the same run, peak device memory, each op class's share\n"
        "  (scripts/gpu/bench_model.sh runs it beside fla's KDAForCausalLM).\n"
        "ops --device cuda: every CUDA op of the model (embedding, norms, swiglu,\n"
        "  short_conv, gemm, attention, router, moe, attnres, cross_entropy, adamw; --ops\n"
        "  a comma-separated subset) forward and forward+backward at the GPU configs'\n"
        "  shapes (hidden 1024 / 2048, 32768 tokens), each against its floor: FLOPs at the\n"
        "  bf16 matmul rate and bytes at the copy bandwidth, both measured in the same run.\n"
        "  scripts/gpu/bench_ops.sh runs it beside the PyTorch / fla peers in one process.\n"
        "Prints a table (median of the repeats after one warmup).\n"
        "\n"
        "options:\n"
        "  --json FILE    also write the records as JSON to FILE\n"
        "  --threads N    threads for linmoe and OpenBLAS (default: number of cores)\n"
        "  --quick        fewer repeats (smoke test; numbers are noisier)\n"
        "  --device D     cpu (default); cuda: kda only (needs a CUDA build and a GPU)\n"
        "  --config FILE  model: the model config (default: configs/bench-cpu.json, looked\n"
        "                 up from the working directory and the binary upward)\n"
        "  --no-peer      model: skip the PyTorch reference step\n"
        "  --recompute    model --device cuda: activation recompute on every layer\n"
        "  --help         this help\n",
        g_prog, g_prog);
}

static void usage_version(FILE *f) {
    fprintf(f, "usage: %s version\n\nPrints the linmoe version.\n", g_prog);
}

/* ---------------------------------------------------------------- flag helpers */

static int is_help(const char *a) { return strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0; }

/* Matches `--name VALUE` or `--name=VALUE` at argv[*i]. Returns 1 and sets *val
 * (advancing *i past a separate value), 0 when argv[*i] is not this flag, and -1
 * (after printing an error) when the value is missing. */
static int flag_value(int argc, char **argv, int *i, const char *name, const char **val) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0)
        return 0;
    if (a[n] == '=') {
        *val = a + n + 1;
        if (**val == '\0')
            goto missing;
        return 1;
    }
    if (a[n] != '\0')
        return 0;
    if (*i + 1 >= argc)
        goto missing;
    *val = argv[++*i];
    return 1;
missing:
    fprintf(stderr, "%s: option %s needs a value\n", g_prog, name);
    return -1;
}

static int unknown_flag(const char *sub, const char *a) {
    if (a[0] == '-')
        fprintf(stderr, "%s %s: unknown option '%s' (see `%s %s --help`)\n", g_prog, sub, a, g_prog,
                sub);
    else
        fprintf(stderr, "%s %s: unexpected argument '%s' (see `%s %s --help`)\n", g_prog, sub, a,
                g_prog, sub);
    return LM_EXIT_USAGE;
}

/* Returns 0 for cpu, LM_EXIT_USAGE for an unknown device, LM_EXIT_BAD_INPUT for cuda
 * (callers that have a CUDA path check for "cuda" before calling this). */
static int check_device(const char *sub, const char *dev) {
    if (strcmp(dev, "cpu") == 0)
        return 0;
    if (strcmp(dev, "cuda") == 0) {
        if (strcmp(sub, "bench") == 0)
            fprintf(stderr,
                    "%s bench: --device cuda: `bench kda`, `bench model` and `bench ops` have CUDA "
                    "paths; the GPU "
                    "benchmarks run on the GPU machine: scripts/gpu/pack.sh here, then "
                    "scripts/gpu/bench-c.sh (the C table) or scripts/gpu/bench.sh (beside fla in "
                    "one process) there (docs/perf-notes.md)\n",
                    g_prog);
        else
            fprintf(stderr,
                    "%s %s: --device cuda: CUDA kernels exist for `op kda` / `op gdn` (forward) "
                    "only so far\n",
                    g_prog, sub);
        return LM_EXIT_BAD_INPUT;
    }
    fprintf(stderr, "%s %s: unknown device '%s' (expected cpu or cuda)\n", g_prog, sub, dev);
    return LM_EXIT_USAGE;
}

/* ---------------------------------------------------------------- subcommands */

static int cmd_op(int argc, char **argv) {
    /* argv[0] == "op" */
    if (argc < 2) {
        fprintf(stderr, "%s op: missing op name (kda, gdn, moe_router or moe)\n", g_prog);
        usage_op(stderr);
        return LM_EXIT_USAGE;
    }
    for (int i = 1; i < argc; i++)
        if (is_help(argv[i])) {
            usage_op(stdout);
            return LM_EXIT_OK;
        }
    const char *name = argv[1];
    lm_kda_kind kind = LM_KDA;
    const int moe = strcmp(name, "moe_router") == 0 ? 1 : strcmp(name, "moe") == 0 ? 2 : 0;
    if (moe || strcmp(name, "kda") == 0 || strcmp(name, "attnres") == 0 ||
        strcmp(name, "attention") == 0) {
        kind = LM_KDA;
    } else if (strcmp(name, "gdn") == 0) {
        kind = LM_GDN;
    } else {
        fprintf(
            stderr,
            "%s op: unknown op '%s' (available: kda, gdn, moe_router, moe, attnres, attention)\n",
            g_prog, name);
        return LM_EXIT_USAGE;
    }
    const char *in = NULL, *out = NULL, *device = "cpu";
    for (int i = 2; i < argc; i++) {
        int r;
        if ((r = flag_value(argc, argv, &i, "--in", &in)) != 0 ||
            (r = flag_value(argc, argv, &i, "--out", &out)) != 0 ||
            (r = flag_value(argc, argv, &i, "--device", &device)) != 0) {
            if (r < 0)
                return LM_EXIT_USAGE;
            continue;
        }
        return unknown_flag("op", argv[i]);
    }
    const int cuda =
        strcmp(device, "cuda") == 0 && (strcmp(name, "kda") == 0 || strcmp(name, "gdn") == 0);
    int rc = cuda ? 0 : check_device("op", device);
    if (rc != 0)
        return rc;
    if (!in || !out) {
        fprintf(stderr, "%s op %s: missing %s (see `%s op --help`)\n", g_prog, name,
                !in ? "--in FILE" : "--out FILE", g_prog);
        return LM_EXIT_USAGE;
    }
    char prog[64];
    snprintf(prog, sizeof(prog), "%s op %s", g_prog, name);
    if (moe)
        return moe == 1 ? lm_cli_op_moe_router(prog, in, out) : lm_cli_op_moe(prog, in, out);
    if (strcmp(name, "attnres") == 0)
        return lm_cli_op_attnres(prog, in, out);
    if (strcmp(name, "attention") == 0)
        return lm_cli_op_attention(prog, in, out);
    return lm_cli_op_kda(prog, kind, in, out, cuda);
}

static int parse_threads(const char *s, int *out) {
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < 1 || v > 4096) {
        fprintf(stderr, "%s bench: --threads '%s' is not an integer in [1, 4096]\n", g_prog, s);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* `linmoe bench serve` (bench/bench_serve.c): its own flags (--ckpt, --concurrency, ...). */
int lm_bench_serve(int argc, char **argv);

static int cmd_bench(int argc, char **argv) {
    /* argv[0] == "bench" */
    if (argc >= 2 && strcmp(argv[1], "serve") == 0)
        return lm_bench_serve(argc - 1, argv + 1);
    for (int i = 1; i < argc; i++)
        if (is_help(argv[i])) {
            usage_bench(stdout);
            return LM_EXIT_OK;
        }
    if (argc < 2) {
        fprintf(stderr, "%s bench: missing target (available: kda, moe, attnres, model)\n", g_prog);
        usage_bench(stderr);
        return LM_EXIT_USAGE;
    }
    static const char *const targets[] = {"kda", "moe", "attnres", "model", "ops"};
    int (*const runners[])(const lm_bench_opts *) = {lm_bench_kda, lm_bench_moe, lm_bench_attnres,
                                                     lm_bench_model, NULL};
    const char *target = argv[1];
    int ti = -1;
    for (int k = 0; k < (int)(sizeof(targets) / sizeof(targets[0])); k++)
        if (strcmp(target, targets[k]) == 0)
            ti = k;
    if (ti < 0) {
        fprintf(stderr,
                "%s bench: unknown target '%s' (available: kda, moe, attnres, model, ops)\n",
                g_prog, target);
        return LM_EXIT_USAGE;
    }
    lm_bench_opts o = {0, 0, NULL, NULL, 0, 0};
    const char *device = "cpu", *threads = NULL, *ops = NULL;
    for (int i = 2; i < argc; i++) {
        int r;
        if (strcmp(argv[i], "--quick") == 0) {
            o.quick = 1;
            continue;
        }
        if (strcmp(argv[i], "--no-peer") == 0) {
            o.no_peer = 1;
            continue;
        }
        if (strcmp(argv[i], "--recompute") == 0) {
            o.recompute = 1;
            continue;
        }
        if ((r = flag_value(argc, argv, &i, "--json", &o.json_path)) != 0 ||
            (r = flag_value(argc, argv, &i, "--config", &o.config_path)) != 0 ||
            (r = flag_value(argc, argv, &i, "--threads", &threads)) != 0 ||
            (r = flag_value(argc, argv, &i, "--device", &device)) != 0 ||
            (r = flag_value(argc, argv, &i, "--ops", &ops)) != 0) {
            if (r < 0)
                return LM_EXIT_USAGE;
            continue;
        }
        return unknown_flag("bench", argv[i]);
    }
    if ((o.config_path || o.no_peer || o.recompute) && strcmp(target, "model") != 0) {
        fprintf(stderr, "%s bench %s: %s applies only to `%s bench model`\n", g_prog, target,
                o.config_path ? "--config"
                : o.no_peer   ? "--no-peer"
                              : "--recompute",
                g_prog);
        return LM_EXIT_USAGE;
    }
    if (ops && strcmp(target, "ops") != 0) {
        fprintf(stderr, "%s bench %s: --ops applies only to `%s bench ops`\n", g_prog, target,
                g_prog);
        return LM_EXIT_USAGE;
    }
    if (strcmp(target, "ops") == 0) {
        lm_device d;
        lm_error e = {0};
        if (lm_device_parse(device, "--device", &d, &e) != LM_OK) {
            fprintf(stderr, "%s bench ops: %s\n", g_prog, e.msg);
            return LM_EXIT_USAGE;
        }
        if (d.type != LM_DEVICE_CUDA) {
            fprintf(stderr,
                    "%s bench ops: the op table is the CUDA backend's; use --device cuda "
                    "(the CPU ops have `bench kda|moe|attnres|model`)\n",
                    g_prog);
            return LM_EXIT_BAD_INPUT;
        }
        return lm_bench_ops_run(ops, o.json_path, o.quick);
    }
    if (strcmp(target, "model") == 0 && strncmp(device, "cuda", 4) == 0) {
        lm_device d;
        lm_error e = {0};
        if (lm_device_parse(device, "--device", &d, &e) != LM_OK) {
            fprintf(stderr, "%s bench model: %s\n", g_prog, e.msg);
            return LM_EXIT_USAGE;
        }
        return lm_bench_model_gpu(&o);
    }
    /* `bench kda --device cuda` is the C GPU table; other targets have no CUDA path */
    const int cuda = strcmp(device, "cuda") == 0 && strcmp(target, "kda") == 0;
    int rc = cuda ? 0 : check_device("bench", device);
    if (rc != 0)
        return rc;
    if (threads) {
        if (parse_threads(threads, &o.threads) != 0)
            return LM_EXIT_USAGE;
    } else {
        o.threads = omp_get_num_procs();
        if (o.threads < 1)
            o.threads = 1;
    }
    return cuda ? lm_bench_kda_cuda(&o) : runners[ti](&o);
}

static int cmd_version(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) {
            usage_version(stdout);
            return LM_EXIT_OK;
        }
        return unknown_flag("version", argv[i]);
    }
    printf("linmoe %s\n", LINMOE_VERSION);
    return LM_EXIT_OK;
}

static int cmd_help(int argc, char **argv) {
    if (argc < 2 || is_help(argv[1])) {
        usage_main(stdout);
        return LM_EXIT_OK;
    }
    if (argc > 2)
        return unknown_flag("help", argv[2]);
    const char *s = argv[1];
    if (strcmp(s, "op") == 0)
        usage_op(stdout);
    else if (strcmp(s, "bench") == 0)
        usage_bench(stdout);
    else if (strcmp(s, "version") == 0)
        usage_version(stdout);
    else if (strcmp(s, "balance-sim") == 0)
        lm_cli_balance_sim_usage(stdout);
    else if (strcmp(s, "info") == 0)
        lm_cli_info_usage(stdout);
    else if (strcmp(s, "tokenize") == 0)
        lm_cli_tokenize_usage(stdout);
    else if (strcmp(s, "train") == 0)
        lm_cli_train_usage(stdout);
    else if (strcmp(s, "eval") == 0)
        lm_cli_eval_usage(stdout);
    else if (strcmp(s, "generate") == 0)
        lm_cli_generate_usage(stdout);
    else if (strcmp(s, "plot") == 0)
        lm_cli_plot_usage(stdout);
    else if (strcmp(s, "serve") == 0)
        lm_cli_serve_usage(stdout);
    else if (strcmp(s, "export") == 0)
        lm_cli_export_usage(stdout);
    else if (strcmp(s, "help") == 0)
        usage_main(stdout);
    else {
        fprintf(stderr, "%s help: unknown subcommand '%s' (see `%s --help`)\n", g_prog, s, g_prog);
        return LM_EXIT_USAGE;
    }
    return LM_EXIT_OK;
}

/* OpenBLAS chose generic kernels on a CPU it does not know (core.h lm_blas_better_coretype):
 * run this program again with OPENBLAS_CORETYPE set, once. A user's own OPENBLAS_CORETYPE
 * is left alone; LINMOE_NO_BLAS_REEXEC=1 turns this off. Returns only when not re-executed. */
static void blas_coretype_reexec(char **argv) {
    if (getenv("OPENBLAS_CORETYPE") || getenv("LINMOE_NO_BLAS_REEXEC"))
        return;
    const char *want = lm_blas_better_coretype();
    if (!want)
        return;
    fprintf(stderr,
            "%s: OpenBLAS chose its %s kernels for this CPU (a model it does not know); "
            "running again with OPENBLAS_CORETYPE=%s\n",
            g_prog, lm_blas_corename(), want);
    setenv("OPENBLAS_CORETYPE", want, 1);
    setenv("LINMOE_NO_BLAS_REEXEC", "1", 1);
    execv("/proc/self/exe", argv);
    /* exec failed: go on with the generic kernels */
    unsetenv("OPENBLAS_CORETYPE");
}

int main(int argc, char **argv) {
    blas_coretype_reexec(argv);
    if (argc < 2) {
        usage_main(stderr);
        return LM_EXIT_USAGE;
    }
    const char *sub = argv[1];
    if (is_help(sub))
        return cmd_help(1, argv + 1);
    if (strcmp(sub, "--version") == 0)
        return cmd_version(1, argv + 1);
    if (strcmp(sub, "help") == 0)
        return cmd_help(argc - 1, argv + 1);
    if (strcmp(sub, "version") == 0)
        return cmd_version(argc - 1, argv + 1);
    if (strcmp(sub, "op") == 0)
        return cmd_op(argc - 1, argv + 1);
    if (strcmp(sub, "bench") == 0)
        return cmd_bench(argc - 1, argv + 1);
    if (strcmp(sub, "balance-sim") == 0)
        return lm_cli_balance_sim(argc - 1, argv + 1);
    if (strcmp(sub, "info") == 0)
        return lm_cli_info(argc - 1, argv + 1);
    if (strcmp(sub, "tokenize") == 0)
        return lm_cli_tokenize(argc - 1, argv + 1);
    if (strcmp(sub, "train") == 0)
        return lm_cli_train(argc - 1, argv + 1);
    if (strcmp(sub, "eval") == 0)
        return lm_cli_eval(argc - 1, argv + 1);
    if (strcmp(sub, "generate") == 0)
        return lm_cli_generate(argc - 1, argv + 1);
    if (strcmp(sub, "plot") == 0)
        return lm_cli_plot(argc - 1, argv + 1);
    if (strcmp(sub, "serve") == 0)
        return lm_cli_serve(argc - 1, argv + 1);
    if (strcmp(sub, "export") == 0)
        return lm_cli_export(argc - 1, argv + 1);
    if (sub[0] == '-')
        fprintf(stderr, "%s: unknown option '%s' (see `%s --help`)\n", g_prog, sub, g_prog);
    else
        fprintf(stderr, "%s: unknown subcommand '%s' (see `%s --help`)\n", g_prog, sub, g_prog);
    return LM_EXIT_USAGE;
}
