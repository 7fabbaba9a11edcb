/* `linmoe bench model --device cuda`: one full training step of a model config on the GPU
 * (include/linmoe/gpu_model.h): forward, fused LM head + cross-entropy, backward, grad
 * norm, the step's one read of loss and norm, AdamW and the MoE bias updates.
 *
 * The step runs at B x T = the config's batch_size x seq_len (configs/gpu-dense.json,
 * gpu-moe.json: 8 x 4096) as one micro-batch of B rows, random ids ~ U[0, V) (seeded),
 * labels[b, t] = ids[b, t+1] and LM_MODEL_IGNORE at the last position of each row,
 * parameters from lm_params_init_weights(config seed). Two warm-up steps, then the median
 * wall time of 5 steps (--quick: 2), each ending in the step's synchronisation, so
 * ms per step is what a training loop sees. Then one more step with the per-class
 * profile on (CUDA events around every op class, a synchronisation each, so the classes'
 * sum exceeds the plain step time by the syncs): each class's share of the profiled step.
 *
 * Reported: ms per step, tokens per second, MFU = lm_model_train_flops_per_token(cfg, T) *
 * B*T / step time / the bf16 matmul rate measured in the same run (cuda_bench.h
 * lm_cuda_measure_limits), the FLOPs counting 6 x the matmul parameters touched per token
 * (routed experts at k/E: active parameters) + the KDA op + causal attention; peak device
 * memory (total - free after the steps, the CUDA context's own memory included; the
 * plan's classes are printed beside it). The JSON record: {"bench": "model_gpu", config,
 * B, T, ms_step, ms_steps, tokens_per_s, mfu, matmul_tflops, peak_mem_bytes, plan{class:
 * bytes}, profile{class: ms}}. The peers (fla's KDAForCausalLM, a PyTorch + fla twin) run
 * in scripts/gpu/bench_model.py, which calls lm_bench_model_gpu_run through the FFI in its
 * own process before timing them on the same shapes.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bench.h"
#include "linmoe/backend.h"
#include "linmoe/cuda_bench.h"
#include "linmoe/gpu_model.h"
#include "linmoe/model.h"
#include "linmoe/model_config.h"
#include "linmoe/params.h"

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One step; returns 0 or 1 after printing the error. */
static int one_step(lm_gpu_model *gm, const lm_model_batch *b, const int32_t *ids,
                    const int32_t *labels, int64_t t, double *loss) {
    lm_error e = {0};
    double l = 0, gn = 0;
    if (lm_gpu_model_micro_step(gm, b, ids, labels, 1.0f, 0, 0, &e) != LM_OK ||
        lm_gpu_model_grad_norm(gm, &e) != LM_OK ||
        lm_gpu_model_read_step(gm, 1, &l, NULL, &gn, &e) != LM_OK ||
        lm_gpu_model_optim_step(gm, 1e-4, 0.1, 0.9, 0.95, 1e-8, 1.0, t, NULL, NULL, &e) != LM_OK) {
        fprintf(stderr, "bench model cuda: %s\n", e.msg);
        return 1;
    }
    if (loss)
        *loss = l;
    return 0;
}

int lm_bench_model_gpu_run(const char *config_path, const char *json_path, int quick) {
    return lm_bench_model_gpu_run_opts(config_path, json_path, quick, 0);
}

int lm_bench_model_gpu_run_opts(const char *config_path, const char *json_path, int quick,
                                int recompute) {
    lm_error e = {0};
    lm_model_config cfg;
    if (!config_path)
        config_path = "configs/gpu-dense.json";
    if (lm_model_config_load(&cfg, config_path, NULL, 0, &e) != LM_OK) {
        fprintf(stderr, "bench model cuda: %s\n", e.msg);
        return 1;
    }
    const int B = cfg.batch_size > 0 ? cfg.batch_size : 8, T = cfg.seq_len > 0 ? cfg.seq_len : 4096;
    const int64_t N = (int64_t)B * T;
    lm_params p = {0};
    lm_cuda_ctx *ctx = NULL;
    lm_gpu_model *gm = NULL;
    int32_t *ids = NULL, *labels = NULL;
    int rc = 1;
    lm_cuda_limits lim = {0};
    if (lm_params_init(&p, &cfg, &e) != LM_OK || lm_cuda_ctx_new(&ctx, 0, &e) != LM_OK ||
        lm_cuda_measure_limits(ctx, quick ? 3 : 10, &lim, &e) != LM_OK) {
        fprintf(stderr, "bench model cuda: %s\n", e.msg);
        goto done;
    }
    fprintf(stderr, "bench model cuda: %s: initialising %lld parameters\n", config_path,
            (long long)p.numel);
    double t_setup = lm_time_sec();
    lm_params_init_weights(&p, cfg.seed);
    fprintf(stderr,
            "bench model cuda: initialised in %.1f s; building the GPU model for %lld tokens\n",
            lm_time_sec() - t_setup, (long long)N);
    t_setup = lm_time_sec();
    uint8_t rcl[LM_MAX_LAYERS];
    memset(rcl, recompute ? 1 : 0, sizeof rcl);
    const lm_gpu_model_opts go = {recompute ? rcl : NULL};
    if (lm_gpu_model_new_opts(&gm, ctx, &p, N, 1, &go, &e) != LM_OK) {
        fprintf(stderr, "bench model cuda: %s\n", e.msg);
        goto done;
    }
    fprintf(stderr, "bench model cuda: built in %.1f s\n", lm_time_sec() - t_setup);
    ids = malloc(sizeof(int32_t) * (size_t)N);
    labels = malloc(sizeof(int32_t) * (size_t)N);
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    for (int64_t n = 0; n < N; n++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[n] = (int32_t)((s >> 33) % (uint64_t)cfg.vocab_size);
    }
    for (int64_t n = 0; n < N; n++)
        labels[n] = (n % T == T - 1) ? LM_MODEL_IGNORE : ids[n + 1];
    lm_model_batch b = {B, T, NULL, 0};
    char name[128] = "";
    lm_cuda_device_info(name, sizeof name, NULL, NULL, &e);
    int64_t t = 0;
    double loss = 0;
    for (int w = 0; w < 2; w++) {
        const double t0 = lm_time_sec();
        if (one_step(gm, &b, ids, labels, ++t, &loss) || lm_cuda_ctx_sync(ctx, &e) != LM_OK)
            goto done;
        fprintf(stderr, "bench model cuda: warm-up step %d: %.1f ms, loss %.4f\n", w + 1,
                (lm_time_sec() - t0) * 1e3, loss);
    }
    const int reps = quick ? 2 : 5;
    double ms[8];
    for (int r = 0; r < reps; r++) {
        const double t0 = lm_time_sec();
        if (one_step(gm, &b, ids, labels, ++t, &loss) || lm_cuda_ctx_sync(ctx, &e) != LM_OK)
            goto done;
        ms[r] = (lm_time_sec() - t0) * 1e3;
    }
    double sorted[8];
    memcpy(sorted, ms, sizeof(double) * (size_t)reps);
    qsort(sorted, (size_t)reps, sizeof(double), cmp_d);
    const double med =
        (reps % 2) ? sorted[reps / 2] : 0.5 * (sorted[reps / 2 - 1] + sorted[reps / 2]);
    size_t fr = 0, tot = 0;
    lm_cuda_ctx_mem_info(ctx, &fr, &tot, &e);
    const double peak = (double)(tot - fr);
    double prof[LM_GPU_PROF_N];
    if (lm_gpu_model_set_profile(gm, 1, &e) != LM_OK || one_step(gm, &b, ids, labels, ++t, NULL))
        goto done;
    lm_gpu_model_profile(gm, prof);
    lm_gpu_model_set_profile(gm, 0, &e);
    const double fpt = lm_model_train_flops_per_token(&cfg, T);
    const double tok_s = (double)N / (med * 1e-3);
    const double mfu = fpt * tok_s / (lim.bf16_tflops * 1e12);
    int64_t tp = 0, ta = 0;
    lm_params_count(&p, &tp, &ta);
    printf("bench model --device cuda on %s: bf16 matmul %.0f TFLOP/s, copy %.0f GB/s (measured "
           "now)\n",
           name, lim.bf16_tflops, lim.copy_gbs);
    printf("config %s: %.1fM parameters (%.1fM active), B = %d, T = %d, %.2f GFLOP per token\n",
           config_path, tp / 1e6, ta / 1e6, B, T, fpt / 1e9);
    printf("step %.2f ms (median of %d), %.0f tokens/s, MFU %.1f %%, peak device memory %.2f GiB, "
           "loss %.4f\n",
           med, reps, tok_s, 100 * mfu, peak / (1 << 30), loss);
    char plan[512];
    lm_mem_plan_format(lm_gpu_model_mem_plan(gm), plan, sizeof plan);
    printf("plan%s: %s\n", recompute ? " (activation recompute on every layer)" : "", plan);
    double psum = 0;
    for (int k = 0; k < LM_GPU_PROF_N; k++)
        psum += prof[k];
    printf("profile (one step with events around every op class, %.2f ms in all):\n", psum);
    for (int k = 0; k < LM_GPU_PROF_N; k++)
        if (prof[k] > 0)
            printf("  %-14s %9.3f ms  %5.1f %%\n", lm_gpu_prof_name(k), prof[k],
                   100 * prof[k] / psum);
    if (json_path) {
        cJSON *d = cJSON_CreateObject();
        cJSON_AddStringToObject(d, "bench", "model_gpu");
        cJSON_AddStringToObject(d, "device", name);
        cJSON_AddStringToObject(d, "config", config_path);
        cJSON_AddNumberToObject(d, "B", B);
        cJSON_AddNumberToObject(d, "T", T);
        cJSON_AddNumberToObject(d, "params", (double)tp);
        cJSON_AddNumberToObject(d, "active_params", (double)ta);
        cJSON_AddNumberToObject(d, "flops_per_token", fpt);
        cJSON_AddNumberToObject(d, "ms_step", med);
        cJSON *arr = cJSON_AddArrayToObject(d, "ms_steps");
        for (int r = 0; r < reps; r++)
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(ms[r]));
        cJSON_AddNumberToObject(d, "tokens_per_s", tok_s);
        cJSON_AddNumberToObject(d, "mfu", mfu);
        cJSON_AddNumberToObject(d, "matmul_tflops", lim.bf16_tflops);
        cJSON_AddNumberToObject(d, "copy_gbs", lim.copy_gbs);
        cJSON_AddNumberToObject(d, "peak_mem_bytes", peak);
        cJSON_AddNumberToObject(d, "loss", loss);
        cJSON_AddBoolToObject(d, "recompute", recompute);
        cJSON *pl = cJSON_AddObjectToObject(d, "plan");
        const lm_mem_plan *mp = lm_gpu_model_mem_plan(gm);
        for (int k = 0; k < LM_MEM_N_CLASSES; k++)
            cJSON_AddNumberToObject(pl, lm_mem_class_name((lm_mem_class)k), (double)mp->bytes[k]);
        cJSON *pr = cJSON_AddObjectToObject(d, "profile_ms");
        for (int k = 0; k < LM_GPU_PROF_N; k++)
            cJSON_AddNumberToObject(pr, lm_gpu_prof_name(k), prof[k]);
        char *txt = cJSON_Print(d);
        FILE *f = fopen(json_path, "w");
        if (!f || fputs(txt, f) < 0)
            fprintf(stderr, "bench model cuda: cannot write %s\n", json_path);
        if (f)
            fclose(f);
        free(txt);
        cJSON_Delete(d);
    }
    rc = 0;
done:
    free(ids);
    free(labels);
    lm_gpu_model_free(gm);
    lm_cuda_ctx_free(ctx);
    lm_params_free(&p);
    return rc;
}

int lm_bench_model_gpu(const lm_bench_opts *opts) {
    return lm_bench_model_gpu_run_opts(opts->config_path, opts->json_path, opts->quick,
                                       opts->recompute);
}
