/* dev/: where passkey retrieval fails (issue 25). Runs the eval's passkey protocol
 * (src/eval/eval.c passkey_run: greedy decode of the answer's digit tokens from a fresh
 * cache) on a checkpoint and prints, per sample, the key's depth (key_pos / n_fill), the
 * distance from the key to the question, how many answer tokens matched and what the model
 * wrote; then the accuracy per depth quintile and the share of failures that got the first
 * digit right (a slip while copying) against those that did not (no retrieval).
 * Build: gcc -std=c11 -O3 -march=native -fopenmp -D_POSIX_C_SOURCE=200809L -Iinclude \
 *   dev/passkey_diag.c build/liblinmoe.a -lopenblas -lcjson -lpcre2-8 -lm $(pkg-config --libs ompi-c) \
 *   -o /tmp/passkey_diag
 * Run:   OMP_NUM_THREADS=1 /tmp/passkey_diag CKPT_DIR VAL_SHARD LENGTH [SAMPLES [SEED [-v]]]
 * (byte tokenizer; SAMPLES default 200, SEED default 1234: the eval's set). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linmoe/eval.h"
#include "linmoe/model.h"
#include "linmoe/params.h"
#include "linmoe/passkey.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"

#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fputc('\n', stderr);                                                                       \
        return 1;                                                                                  \
    } while (0)

static int32_t argmax(const float *x, int n) {
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

int main(int argc, char **argv) {
    if (argc < 4)
        DIE("usage: %s CKPT_DIR VAL_SHARD LENGTH [SAMPLES [SEED [-v]]]", argv[0]);
    const int length = atoi(argv[3]);
    const int samples = argc > 4 ? atoi(argv[4]) : 200;
    const unsigned long long seed = argc > 5 ? strtoull(argv[5], NULL, 10) : 1234;
    const int verbose = argc > 6 && strcmp(argv[6], "-v") == 0;
    lm_error err = {0};
    lm_params p;
    lm_tokenizer *tok = NULL;
    lm_shard val = {0};
    lm_model *m = NULL;
    lm_model_cache *c = NULL;
    if (lm_params_load(&p, argv[1], &err) != LM_OK ||
        lm_tokenizer_open(&tok, "byte", NULL, &err) != LM_OK ||
        lm_shard_open(&val, argv[2], &err) != LM_OK || lm_model_new(&m, &p, length, &err) != LM_OK ||
        lm_model_cache_new(&c, m, 1, length, &err) != LM_OK)
        DIE("%s", err.msg);
    const int V = p.cfg.vocab_size;
    float *logits = malloc((size_t)V * sizeof(float));
    enum { NB = 5 };
    int bin_n[NB] = {0}, bin_ok[NB] = {0}, fail_first_ok = 0, fail_first_bad = 0, correct = 0;
    for (int s = 0; s < samples; s++) {
        lm_passkey_doc d;
        if (lm_passkey_make(tok, &val, length, seed, (uint64_t)s, &d, &err) != LM_OK)
            DIE("%s", err.msg);
        lm_model_cache_reset(c);
        if (lm_model_infer(m, c, d.ids, (int)d.answer_pos, 1, logits, &err) != LM_OK)
            DIE("%s", err.msg);
        int ok = 1, prefix = 0;
        char got[16] = {0};
        int ng = 0;
        for (int64_t q = d.answer_pos; q < d.digits_end; q++) {
            int32_t pred = argmax(logits, V);
            if (ng < 15)
                got[ng++] = pred >= 32 && pred < 127 ? (char)pred : '?';
            if (pred != d.ids[q])
                ok = 0;
            else if (ok)
                prefix++;
            if (q + 1 < d.digits_end && lm_model_infer(m, c, &pred, 1, 1, logits, &err) != LM_OK)
                DIE("%s", err.msg);
        }
        const int64_t n_fill = length - 59 - 38 - 7; /* byte tokenizer: key 59, q 38, a 7 */
        const double depth = (double)d.key_pos / (double)(n_fill > 0 ? n_fill : 1);
        int b = (int)(depth * NB);
        b = b < 0 ? 0 : b >= NB ? NB - 1 : b;
        bin_n[b]++;
        bin_ok[b] += ok;
        correct += ok;
        if (!ok)
            *(prefix >= 2 ? &fail_first_ok : &fail_first_bad) += 1;
        if (verbose || !ok)
            printf("sample %3d key %s depth %.3f dist %4lld %s prefix %d got '%s'\n", s, d.key,
                   depth, (long long)(d.answer_pos - d.key_pos), ok ? "ok  " : "FAIL", prefix, got);
        lm_passkey_doc_free(&d);
    }
    printf("length %d: %d/%d = %.3f\n", length, correct, samples, (double)correct / samples);
    for (int b = 0; b < NB; b++)
        printf("  depth [%.1f, %.1f): %d/%d\n", (double)b / NB, (double)(b + 1) / NB, bin_ok[b],
               bin_n[b]);
    printf("  failures: %d with the space and first digit right (a slip), %d without\n",
           fail_first_ok, fail_first_bad);
    free(logits);
    lm_model_cache_free(c);
    lm_model_free(m);
    lm_shard_close(&val);
    lm_tokenizer_free(tok);
    lm_params_free(&p);
    return 0;
}
