/* The model's memory plan (include/linmoe/model.h lm_model_mem_plan; DESIGN.md
 * "Devices, memory and scale", CONVENTIONS.md "Memory and errors"):
 *  - no allocation at all inside the training step: every allocator entry point
 *    (malloc, calloc, realloc, free, posix_memalign, aligned_alloc, memalign, valloc,
 *    pvalloc) and the mmap family (mmap, mmap64, munmap, mremap: OpenBLAS takes its
 *    buffers that way) are interposed in this executable (defined here; they forward
 *    to glibc's __libc_* entry points and to the system calls, so no linker flags are
 *    needed) and counted, whoever calls them (linmoe, the OpenMP runtime, OpenBLAS,
 *    libc), during optimizer steps 2..N of
 *      - the trainer's step (src/train/train.c train_step, mirrored: the loader's next
 *        micro-batch, model forward + backward with gradient accumulation over
 *        micro-batches, gradient norm, clipping, AdamW, the routers' bias update),
 *        packing mode with long-document, repeat and passkey rows, and
 *      - the model's own step with batches made here (unpacked, and packed with three
 *        documents whose split moves every step) + gradient norm + AdamW,
 *      - any batch layout of up to max_tokens tokens after a first step at max_tokens
 *        (one long document, many single-token and empty documents, rows, half
 *        size: test_no_alloc_any_layout),
 *    on configs/tiny.json (both gates, RoPE + NoPE, dense + MoE, Block AttnRes; also
 *    with quantile balancing + capacity dropping, and with the sequence-wise aux
 *    loss) and configs/bench-cpu.json (also at 1024 tokens). Step 1 may allocate
 *    (thread start-up, grow-only buffers, OpenBLAS buffers). The count must be
 *    exactly 0, with no allowance for any op or library: the OpenMP runtime allocates
 *    a team for every parallel region of one thread (libgomp caches only the last
 *    team of more than one thread), so the ops run small problems as plain loops
 *    outside any region, and these tests run on LM_MEM_PLAN_THREADS = 2 threads (set
 *    here, whatever OMP_NUM_THREADS says: with 1 thread every unconditional region of
 *    the engine would be such a team). The loader's passkey rows, the routers' bias
 *    update and the attention backward past 85 document x kv-head tasks (once glibc
 *    qsort's malloc) are in that count too; LM_MEM_PLAN_STRICT_EXTRAS=0 counts them
 *    apart and only prints them (for bisecting a regression). OpenBLAS maps one buffer per thread
 * inside a BLAS call at once, the first time that many are, for the life of the process; at 2
 *    threads step 1 always gets there, with more threads than cores a later step can
 *    map one (seen: 1 at 4 threads on 2 cores). test_counter_sees_allocations shows
 *    that the counting sees both linmoe's own allocations and the runtime's (caller
 *    attribution is by return address: a tail call can credit a library's free to
 *    its caller; the totals are what is asserted). With LM_MEM_PLAN_TRACE set in the
 *    environment, each counted call prints its backtrace to stderr;
 *  - the size table: every class > 0, totals add up, the table grows with B*T and
 *    the parameter / gradient / optimizer classes do not; `linmoe info` prints it;
 *  - gradients accumulate in place: two micro-batches of half the rows give the
 *    gradient of the whole batch (to fp32 summation order) and the model holds no
 *    second gradient buffer (the table's gradient class is exactly numel floats).
 */
#define _GNU_SOURCE /* mremap, syscall */
#include <execinfo.h>
#include <math.h>
#include <omp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cblas.h>
#include <cmocka.h>

#include "linmoe/layers.h"
#include "linmoe/loader.h"
#include "linmoe/model.h"
#include "linmoe/shard.h"
#include "linmoe/tokenizer.h"
#include "test_util.h"
#include "train/train_internal.h"

#ifndef LM_SOURCE_DIR
#define LM_SOURCE_DIR "."
#endif

/* The thread count of the step tests (> 1, see the top comment). */
#ifndef LM_MEM_PLAN_THREADS
#define LM_MEM_PLAN_THREADS 2
#endif

/* ---------------------------------------------------------------- interposition */

#if defined(__SANITIZE_ADDRESS__)
/* AddressSanitizer owns malloc: the counting below would fight its interceptors.
 * The sanitizer build skips this test (exit code 77). */
int main(void) {
    printf("test_mem_plan: skipped under AddressSanitizer\n");
    return 77;
}
#else

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);

/* Who called: code of this executable (linmoe is linked into it statically: the
 * library's own allocations, LM_MALLOC included) or a shared library (the OpenMP
 * runtime, OpenBLAS, libc). The executable's code lies between the linker-defined
 * __executable_start and etext. */
extern char __executable_start[], etext[];

enum { K_MALLOC, K_FREE, K_MMAP, K_MUNMAP, K_N };
static const char *const k_name[K_N] = {"allocations", "frees", "mmaps", "munmaps"};

/* g_counting: 0 off, COUNT_STEP the step (g_own / g_runtime), COUNT_EXTRA the
 * loader / bias update / last layout step when LM_MEM_PLAN_STRICT_EXTRAS = 0
 * (g_extra). */
enum { COUNT_STEP = 1, COUNT_EXTRA = 2 };
static atomic_int g_counting, g_trace;
static atomic_long g_own[K_N], g_runtime[K_N], g_extra[K_N];
static _Thread_local int t_in_trace;

static void note(int kind, const void *caller) {
    const int mode = atomic_load_explicit(&g_counting, memory_order_relaxed);
    if (!mode)
        return;
    const char *c = caller;
    atomic_long *k = mode == COUNT_EXTRA                    ? &g_extra[kind]
                     : c >= __executable_start && c < etext ? &g_own[kind]
                                                            : &g_runtime[kind];
    atomic_fetch_add_explicit(k, 1, memory_order_relaxed);
    if (atomic_load_explicit(&g_trace, memory_order_relaxed) && !t_in_trace) {
        t_in_trace = 1; /* backtrace() may allocate */
        void *bt[32];
        const int n = backtrace(bt, 32);
        char line[64];
        const int len = snprintf(line, sizeof line, "counted %s, from:\n", k_name[kind]);
        if (write(2, line, (size_t)len) < 0) {
        }
        backtrace_symbols_fd(bt + 1, n - 1, 2);
        t_in_trace = 0;
    }
}

static void counting_reset(void) {
    for (int k = 0; k < K_N; k++) {
        atomic_store(&g_own[k], 0);
        atomic_store(&g_runtime[k], 0);
        atomic_store(&g_extra[k], 0);
    }
}
/* Everything counted in the step (not g_extra). */
static long counted_total(void) {
    long n = 0;
    for (int k = 0; k < K_N; k++)
        n += atomic_load(&g_own[k]) + atomic_load(&g_runtime[k]);
    return n;
}
static void counted_print(const char *what) {
    printf("  %s:", what);
    for (int k = 0; k < K_N; k++)
        printf(" %s %ld by linmoe + %ld by shared libraries%s", k_name[k],
               (long)atomic_load(&g_own[k]), (long)atomic_load(&g_runtime[k]),
               k + 1 < K_N ? "," : "\n");
}

/* The trainer's step also runs the loader (passkey rows: src/data/passkey.c
 * lm_passkey_make_into with the loader's grow-only lm_passkey_ws) and the routers'
 * bias update (src/ops/moe_balance.c, reduce buffer in lm_router_state.reduce_buf),
 * and run_layouts' last step gives the attention backward more tasks than glibc
 * qsort sorts without malloc (it heap-sorts in place now: src/ops/cpu/attention_bwd.c;
 * the MoE task lists likewise, src/ops/cpu/moe_experts.c). All of these allocated per
 * step once; with LM_MEM_PLAN_STRICT_EXTRAS = 1 (the default) they are part of the
 * strict count; 0 counts them apart (g_extra) and only prints them. */
#ifndef LM_MEM_PLAN_STRICT_EXTRAS
#define LM_MEM_PLAN_STRICT_EXTRAS 1
#endif
static int extra_begin(void) {
    const int was = atomic_load(&g_counting);
    if (was && !LM_MEM_PLAN_STRICT_EXTRAS)
        atomic_store(&g_counting, COUNT_EXTRA);
    return was;
}
static void extra_end(int was) { atomic_store(&g_counting, was); }

#define CALLER __builtin_extract_return_addr(__builtin_return_address(0))
void *malloc(size_t n) {
    note(K_MALLOC, CALLER);
    return __libc_malloc(n);
}
void *calloc(size_t a, size_t b) {
    note(K_MALLOC, CALLER);
    return __libc_calloc(a, b);
}
void *realloc(void *p, size_t n) {
    note(K_MALLOC, CALLER);
    return __libc_realloc(p, n);
}
void free(void *p) {
    if (p)
        note(K_FREE, CALLER);
    __libc_free(p);
}
int posix_memalign(void **out, size_t al, size_t n) {
    note(K_MALLOC, CALLER);
    void *p = __libc_memalign(al, n);
    if (!p)
        return 12; /* ENOMEM */
    *out = p;
    return 0;
}
void *aligned_alloc(size_t al, size_t n) {
    note(K_MALLOC, CALLER);
    return __libc_memalign(al, n);
}
void *memalign(size_t al, size_t n) {
    note(K_MALLOC, CALLER);
    return __libc_memalign(al, n);
}
void *valloc(size_t n) {
    note(K_MALLOC, CALLER);
    return __libc_memalign((size_t)sysconf(_SC_PAGESIZE), n);
}
void *pvalloc(size_t n) {
    note(K_MALLOC, CALLER);
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return __libc_memalign(pg, (n + pg - 1) / pg * pg);
}
/* glibc's own calls (malloc's arenas, thread stacks) do not come through these. */
void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    note(K_MMAP, CALLER);
    return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
}
void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    note(K_MMAP, CALLER);
    return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
}
int munmap(void *addr, size_t len) {
    note(K_MUNMAP, CALLER);
    return (int)syscall(SYS_munmap, addr, len);
}
void *mremap(void *old, size_t old_len, size_t new_len, int flags, ...) {
    note(K_MMAP, CALLER);
    void *new_addr = NULL;
    if (flags & MREMAP_FIXED) {
        va_list ap;
        va_start(ap, flags);
        new_addr = va_arg(ap, void *);
        va_end(ap);
    }
    return (void *)syscall(SYS_mremap, old, old_len, new_len, flags, new_addr);
}

/* ---------------------------------------------------------------- helpers */

static void load_cfg(lm_model_config *c, const char *name) {
    lm_error err = {0};
    char warn[256], path[512];
    snprintf(path, sizeof path, "%s/configs/%s", LM_SOURCE_DIR, name);
    lm_status st = lm_model_config_load(c, path, warn, sizeof warn, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
}

static void fill_batch(int32_t *ids, int32_t *lab, int64_t n, int V, uint64_t seed) {
    lm_rng r;
    lm_rng_init(&r, seed);
    for (int64_t i = 0; i < n; i++)
        ids[i] = (int32_t)(lm_rng_u32(&r) % (uint32_t)V);
    for (int64_t i = 0; i < n; i++)
        lab[i] = i + 1 < n ? ids[i + 1] : LM_MODEL_IGNORE;
}

/* A config variant of a step test. */
typedef enum { VAR_BASE, VAR_QUANTILE_CAPACITY, VAR_AUX_LOSS_SEQ } variant;

static void load_variant(lm_model_config *c, const char *name, variant v) {
    load_cfg(c, name);
    if (v == VAR_QUANTILE_CAPACITY) {
        c->moe.router.balance = LM_BAL_QUANTILE;
        c->moe.router.quantile_iters = 2;
        c->moe.router.capacity_factor = 1.0f;
    } else if (v == VAR_AUX_LOSS_SEQ) {
        c->moe.router.balance = LM_BAL_AUX_LOSS;
        c->moe.router.aux_loss_seq = 1;
    }
}

/* The trainer's data: a shard of byte-tokenizer documents (lengths 1..~1100) in a
 * temporary directory, a loader in packing mode with long-document and repeat rows,
 * and passkey rows when S >= 128. */
typedef struct {
    char dir[64], path[128];
    lm_shard sh;
    lm_tokenizer *tok;
    lm_loader *ld;
    lm_loader_batch b;
} trainer_data;

static void data_open(trainer_data *d, int rows, int S) {
    memset(d, 0, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "/tmp/linmoe-memplan-XXXXXX");
    assert_non_null(mkdtemp(d->dir));
    snprintf(d->path, sizeof d->path, "%s/train.bin", d->dir);
    enum { NDOC = 64 };
    int32_t *tok = malloc(sizeof(int32_t) * NDOC * 1200);
    int64_t n = 0;
    for (int doc = 0; doc < NDOC; doc++) {
        const int len = doc % 8 == 0   ? 600 + 9 * doc
                        : doc % 5 == 0 ? 150 + 3 * doc
                                       : 1 + (doc * 37) % 90;
        for (int j = 0; j < len; j++)
            tok[n++] = (int32_t)((doc * 131 + j * 17) % 256);
        tok[n++] = 256; /* <|endoftext|> */
    }
    lm_error err = {0};
    assert_int_equal(lm_shard_write(d->path, 257, tok, (uint64_t)n, &err), LM_OK);
    free(tok);
    assert_int_equal(lm_shard_open(&d->sh, d->path, &err), LM_OK);
    assert_int_equal(lm_tokenizer_byte(&d->tok, &err), LM_OK);
    assert_int_equal(lm_loader_new(&d->ld, &d->sh, d->tok, 7, 0, 1, &err), LM_OK);
    assert_int_equal(lm_loader_batch_init(&d->b, rows, S, &err), LM_OK);
    /* passkey documents need >= ~120 tokens (key sentence, question, answer, filler) */
    const lm_loader_stage st = {S, 1, S >= 128 ? 0.2 : 0.0, 0.2, 0.2, 0};
    const lm_status r = lm_loader_set_stage(d->ld, &st, &err);
    if (r != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(r, LM_OK);
}

static void data_close(trainer_data *d) {
    lm_loader_batch_free(&d->b);
    lm_loader_free(d->ld);
    lm_tokenizer_free(d->tok);
    lm_shard_close(&d->sh);
    remove(d->path);
    rmdir(d->dir);
}

/* Steps of M micro-batches of B x T, the model's own step (trainer == 0: batches
 * made here; packed: B == 1 with 3 documents whose split moves every step; then
 * gradient norm + AdamW) or the trainer's (trainer == 1: train_step's sequence, the
 * loader's batches); returns the allocator and mmap calls counted in steps
 * 2..steps (all callers). */
static long run_steps(const char *cfg_name, variant var, int B, int T, int M, int packed,
                      int trainer, int steps) {
    lm_set_num_threads(LM_MEM_PLAN_THREADS);
    lm_model_config cfg;
    load_variant(&cfg, cfg_name, var);
    lm_error err = {0};
    lm_params p;
    assert_int_equal(lm_params_init(&p, &cfg, &err), LM_OK);
    lm_params_init_weights(&p, 5);
    lm_model *m;
    lm_status st = lm_model_new(&m, &p, (int64_t)B * T, &err);
    if (st != LM_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, LM_OK);
    lm_adamw opt;
    lm_adamw_init(&opt, &p);
    trainer_data d;
    if (trainer)
        data_open(&d, B, T);
    const int64_t N = (int64_t)B * T;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)N), *lab = malloc(sizeof(int32_t) * (size_t)N);
    int64_t cu[4];
    const int L = p.cfg.num_hidden_layers;
    /* steady state: what the last steps allocate (the last two, or one when
     * only three run) must be zero. Steps 2..N are all counted
     * and printed, but a runtime's one-time growth (OpenBLAS maps a buffer per thread the
     * first time that many threads are inside BLAS at once, which on an oversubscribed
     * machine can happen after step 1) does not recur, while an allocation made by a step
     * recurs in every step, so the last two steps tell them apart. */
    long before_last = 0;
    LM_CHECK(steps >= 3);
    const int window = steps >= 4 ? steps - 2 : steps - 1; /* first step of the window */
    for (int s = 0; s < steps; s++) {
        if (s == 1) {
            counting_reset();
            atomic_store(&g_counting, COUNT_STEP);
        }
        if (s == window)
            before_last = counted_total();
        for (int mi = 0; mi < M; mi++) {
            const lm_model_batch *bp;
            const int32_t *bi = ids, *bl = lab;
            lm_model_batch b = {B, T, NULL, 0};
            if (trainer) {
                const int was = extra_begin();
                st = lm_loader_next(d.ld, B, &d.b, &err);
                extra_end(was);
                if (st != LM_OK)
                    fprintf(stderr, "%s\n", err.msg);
                assert_int_equal(st, LM_OK);
                bp = &d.b.batch;
                bi = d.b.ids;
                bl = d.b.labels;
            } else {
                fill_batch(ids, lab, N, cfg.vocab_size, 100 + (uint64_t)(s * M + mi));
                if (packed) {
                    cu[0] = 0;
                    cu[1] = 1 + (s * 7 + mi) % (T / 2);
                    cu[2] = cu[1] + (s * 3 + 1) % (T - cu[1]);
                    cu[3] = T;
                    b.cu_seqlens = cu;
                    b.n_cu_seqlens = 4;
                    for (int j = 1; j < 3; j++)
                        lab[cu[j] - 1] = LM_MODEL_IGNORE;
                }
                bp = &b;
            }
            double loss = 0;
            int64_t nl = 0;
            st = lm_model_forward(m, bp, bi, bl, 1, NULL, &loss, &nl, &err);
            if (st == LM_OK)
                st = lm_model_backward(m, 1.0f / (float)M, mi > 0, &err);
            if (st != LM_OK)
                fprintf(stderr, "%s\n", err.msg);
            assert_int_equal(st, LM_OK);
            assert_true(isfinite(loss));
        }
        float *g = lm_model_grads(m);
        const double gn = lm_adamw_grad_norm(&opt, g);
        assert_true(isfinite(gn) && gn > 0);
        const double clip = 1.0, scale = trainer && gn > clip ? clip / (gn + 1e-6) : 1.0;
        lm_adamw_step(&opt, p.data, g, scale, 1e-3, 0.1, 0.9, 0.95, 1e-8, s + 1);
        if (trainer) /* train_step: every MoE layer's bias update and metrics */
            for (int i = 0; i < L; i++) {
                lm_router_state *rs = lm_model_router_state(m, i);
                if (!rs)
                    continue;
                lm_router_metrics met;
                const int was = extra_begin();
                st = lm_router_update_bias(&p.cfg.moe.router, rs, NULL, NULL, &met, &err);
                extra_end(was);
                assert_int_equal(st, LM_OK);
            }
    }
    atomic_store(&g_counting, 0);
    static const char *const vname[] = {"", ", quantile balancing + capacity 1.0",
                                        ", sequence-wise aux loss"};
    char what[256];
    snprintf(what, sizeof what, "%s%s, %s step, B=%d T=%d micro_batches=%d%s, steps 2..%d%s",
             cfg_name, vname[var], trainer ? "trainer's" : "model's", B, T, M,
             packed || trainer ? " packed" : "", steps,
             trainer && LM_MEM_PLAN_STRICT_EXTRAS ? ", loader and bias update included" : "");
counted_print(what);
    const long all_steps = counted_total();
    if (trainer && !LM_MEM_PLAN_STRICT_EXTRAS)
        printf("    the loader and the bias update, counted apart (LM_MEM_PLAN_STRICT_EXTRAS 0): "
               "%ld allocations, %ld frees, %ld mmaps, %ld munmaps\n",
               (long)atomic_load(&g_extra[K_MALLOC]), (long)atomic_load(&g_extra[K_FREE]),
               (long)atomic_load(&g_extra[K_MMAP]), (long)atomic_load(&g_extra[K_MUNMAP]));
    const long counted = all_steps - before_last;
    if (all_steps != counted)
        printf("    of these, %ld in steps 2..%d (not recurring) and %ld in steps %d..%d\n",
               all_steps - counted, window, counted, window + 1, steps);
    if (trainer)
        data_close(&d);
    free(ids);
    free(lab);
    lm_adamw_free(&opt);
    lm_model_free(m);
    lm_params_free(&p);
    return counted;
}

static void test_no_alloc_in_step(void **state) {
    (void)state;
    assert_int_equal(run_steps("tiny.json", VAR_BASE, 2, 24, 2, 0, 0, 4), 0);
    assert_int_equal(run_steps("tiny.json", VAR_BASE, 1, 40, 3, 1, 0, 4), 0);
    assert_int_equal(run_steps("tiny.json", VAR_QUANTILE_CAPACITY, 1, 40, 2, 1, 0, 4), 0);
    assert_int_equal(run_steps("tiny.json", VAR_AUX_LOSS_SEQ, 1, 40, 2, 1, 0, 4), 0);
}

static void test_no_alloc_in_trainer_step(void **state) {
    (void)state;
    assert_int_equal(run_steps("tiny.json", VAR_BASE, 2, 32, 2, 1, 1, 5), 0);
    assert_int_equal(run_steps("tiny.json", VAR_BASE, 1, 128, 2, 1, 1, 4), 0);
    assert_int_equal(run_steps("tiny.json", VAR_QUANTILE_CAPACITY, 1, 48, 2, 1, 1, 4), 0);
}

/* Documents the attention backward could be given per step before glibc's qsort of
 * its (document, kv head) tasks (12 bytes each) outgrew its 1 KiB stack buffer and
 * malloc'd a merge buffer; src/ops/cpu/attention_bwd.c heap-sorts in place now, and
 * the last step below goes past this (strict unless LM_MEM_PLAN_STRICT_EXTRAS = 0). */
#define QSORT_STACK_TASKS (1024 / 12)

/* Any batch of up to max_tokens tokens once a first step has run at max_tokens (the
 * trainer's steps all have the stage's B x S tokens): after a first step of one
 * document of max_tokens, steps of up to QSORT_STACK_TASKS / Hkv documents (single
 * tokens and one long one), rows, empty documents and a half-size batch allocate
 * nothing: every grow-only buffer (the attention op's workspace and RoPE table, the
 * router's per-sequence arrays, the capacity scratch) is at its worst case. The last
 * step, max_tokens documents of one token, gives the attention backward more tasks
 * than glibc qsort sorted without malloc (counted apart only with
 * LM_MEM_PLAN_STRICT_EXTRAS = 0). A first step smaller than max_tokens (a later,
 * larger stage) may still grow the MoE router's and the AttnRes op's workspaces once. */
static long run_layouts(const char *cfg_name, variant var, int64_t max_tokens) {
    lm_set_num_threads(LM_MEM_PLAN_THREADS);
    lm_model_config cfg;
    load_variant(&cfg, cfg_name, var);
    lm_error err = {0};
    lm_params p;
    assert_int_equal(lm_params_init(&p, &cfg, &err), LM_OK);
    lm_params_init_weights(&p, 11);
    lm_model *m;
    assert_int_equal(lm_model_new(&m, &p, max_tokens, &err), LM_OK);
    lm_adamw opt;
    lm_adamw_init(&opt, &p);
    const int Tm = (int)max_tokens;
    int ndoc = QSORT_STACK_TASKS / cfg.num_key_value_heads;
    ndoc = ndoc < Tm ? ndoc : Tm;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)Tm),
            *lab = malloc(sizeof(int32_t) * (size_t)Tm);
    int64_t *cu = malloc(sizeof(int64_t) * (size_t)(Tm + 1));
    enum { STEPS = 7 };
    for (int s = 0; s < STEPS; s++) {
        if (s == 1) {
            counting_reset();
            atomic_store(&g_counting, COUNT_STEP);
        }
        const int was = s == STEPS - 1 ? extra_begin() : 0;
        lm_model_batch b = {1, Tm, NULL, 0};
        int n = 0;
        switch (s) {
        case 0: /* one document of max_tokens */
        case 2:
            break;
        case 1: /* ndoc documents: ndoc - 1 single tokens, then the rest */
            for (n = 0; n < ndoc; n++)
                cu[n] = n;
            cu[n++] = Tm;
            break;
        case 3: /* rows */
            b.B = 2;
            b.T = Tm / 2;
            break;
        case 4: /* empty documents, a long one, single tokens */
            cu[n++] = 0;
            cu[n++] = 0;
            cu[n++] = 0;
            cu[n++] = Tm / 2;
            cu[n++] = Tm / 2;
            for (int j = Tm / 2 + 1; n < ndoc && j < Tm; j++)
                cu[n++] = j;
            cu[n++] = Tm;
            break;
        case 5: /* half the tokens, three documents */
            b.T = Tm / 2;
            cu[0] = 0, cu[1] = 5, cu[2] = Tm / 4, cu[3] = Tm / 2;
            n = 4;
            break;
        default: /* max_tokens documents of one token (apart when not strict) */
            for (n = 0; n <= Tm; n++)
                cu[n] = n;
            break;
        }
        if (n) {
            b.cu_seqlens = cu;
            b.n_cu_seqlens = n;
        }
        const int64_t N = (int64_t)b.B * b.T;
        fill_batch(ids, lab, N, cfg.vocab_size, 300 + (uint64_t)s);
        double loss = 0;
        lm_status st = lm_model_forward(m, &b, ids, lab, 1, NULL, &loss, NULL, &err);
        if (st == LM_OK)
            st = lm_model_backward(m, 1.0f, 0, &err);
        if (st != LM_OK)
            fprintf(stderr, "step %d: %s\n", s + 1, err.msg);
        assert_int_equal(st, LM_OK);
        const double gn = lm_adamw_grad_norm(&opt, lm_model_grads(m));
        assert_true(isfinite(gn));
        lm_adamw_step(&opt, p.data, lm_model_grads(m), 1.0, 1e-3, 0.1, 0.9, 0.95, 1e-8, s + 1);
        if (s == STEPS - 1)
            extra_end(was);
    }
    atomic_store(&g_counting, 0);
    static const char *const vname[] = {"", ", quantile balancing + capacity 1.0",
                                        ", sequence-wise aux loss"};
    char what[256];
    snprintf(what, sizeof what,
             "%s%s, max_tokens=%lld, after a step of one document, steps 2..%d: every layout of "
             "<= %d documents%s",
             cfg_name, vname[var], (long long)max_tokens,
             LM_MEM_PLAN_STRICT_EXTRAS ? STEPS : STEPS - 1, ndoc,
             LM_MEM_PLAN_STRICT_EXTRAS ? ", then max_tokens documents of one token" : "");
    counted_print(what);
    if (!LM_MEM_PLAN_STRICT_EXTRAS)
        printf(
            "    step %d, %d documents of one token, counted apart (LM_MEM_PLAN_STRICT_EXTRAS 0): "
            "%ld allocations, %ld frees\n",
            STEPS, Tm, (long)atomic_load(&g_extra[K_MALLOC]), (long)atomic_load(&g_extra[K_FREE]));
    const long counted = counted_total();
    free(ids);
    free(lab);
    free(cu);
    lm_adamw_free(&opt);
    lm_model_free(m);
    lm_params_free(&p);
    return counted;
}

static void test_no_alloc_any_layout(void **state) {
    (void)state;
    assert_int_equal(run_layouts("tiny.json", VAR_BASE, 96), 0);
    assert_int_equal(run_layouts("tiny.json", VAR_QUANTILE_CAPACITY, 96), 0);
    assert_int_equal(run_layouts("tiny.json", VAR_AUX_LOSS_SEQ, 96), 0);
    assert_int_equal(run_layouts("bench-cpu.json", VAR_BASE, 192), 0);
}

static void test_no_alloc_in_step_bench(void **state) {
    (void)state;
    assert_int_equal(run_steps("bench-cpu.json", VAR_BASE, 1, 128, 2, 0, 0, 3), 0);
    assert_int_equal(run_steps("bench-cpu.json", VAR_BASE, 1, 128, 2, 1, 1, 3), 0);
    /* an expert over capacity holds > 128 assignments: its sort would outgrow glibc
     * qsort's 1 KiB stack buffer (the router sorts in place) */
    assert_int_equal(run_steps("bench-cpu.json", VAR_QUANTILE_CAPACITY, 1, 1024, 1, 1, 0, 3), 0);
}

/* The counting sees what it must: linmoe's own allocations (the RMSNorm backward
 * without a workspace takes its partials by malloc) and the OpenMP runtime's (a
 * parallel region of one thread gets a new team), so a zero above means none. */
static void test_counter_sees_allocations(void **state) {
    (void)state;
    const int N = 64, D = 16;
    float *x = calloc((size_t)N * D, 4), *dy = calloc((size_t)N * D, 4);
    float *dx = calloc((size_t)N * D, 4), *w = calloc((size_t)D, 4), *dw = calloc((size_t)D, 4);
    for (int i = 0; i < N * D; i++)
        x[i] = dy[i] = 0.5f + 0.01f * (float)(i % 7);
    for (int i = 0; i < D; i++)
        w[i] = 1.0f;
    lm_error err = {0};
    void *ws = malloc((size_t)lm_rmsnorm_backward_ws_bytes(N, D));
    counting_reset();
    atomic_store(&g_counting, COUNT_STEP);
    assert_int_equal(lm_rmsnorm_backward_ws(N, D, 1e-6f, x, w, NULL, dy, dx, dw, ws, &err), LM_OK);
    atomic_store(&g_counting, 0);
    assert_int_equal(counted_total(), 0); /* with the workspace: none */
    float dw1[16];
    memcpy(dw1, dw, sizeof dw1);
    counting_reset();
    atomic_store(&g_counting, COUNT_STEP);
    assert_int_equal(lm_rmsnorm_backward(N, D, 1e-6f, x, w, NULL, dy, dx, dw, &err), LM_OK);
    atomic_store(&g_counting, 0);
    counted_print("lm_rmsnorm_backward without a workspace");
    assert_true(atomic_load(&g_own[K_MALLOC]) >= 1 && atomic_load(&g_own[K_FREE]) >= 1);
    assert_memory_equal(dw1, dw, sizeof dw1); /* the same bits either way */
    int one = 0;
    counting_reset();
    atomic_store(&g_counting, COUNT_STEP);
#pragma omp parallel num_threads(1)
    one = omp_get_num_threads();
    atomic_store(&g_counting, 0);
    counted_print("an OpenMP parallel region of one thread");
    assert_int_equal(one, 1);
    assert_true(atomic_load(&g_runtime[K_MALLOC]) >= 1);
    free(ws);
    free(x), free(dy), free(dx), free(w), free(dw);
}

/* The size table: classes, totals, scaling with B*T, the model's own plan. */
static void test_plan_table(void **state) {
    (void)state;
    lm_model_config cfg;
    load_cfg(&cfg, "bench-cpu.json");
    lm_error err = {0};
    lm_mem_plan a, b, c;
    assert_int_equal(lm_model_mem_plan(&cfg, 1, 128, &a, &err), LM_OK);
    assert_int_equal(lm_model_mem_plan(&cfg, 2, 128, &b, &err), LM_OK);
    assert_int_equal(lm_model_mem_plan(&cfg, 1, 256, &c, &err), LM_OK);
    char line[512];
    lm_mem_plan_format(&a, line, sizeof line);
    printf("  %s\n", line);
    lm_mem_plan_format(&b, line, sizeof line);
    printf("  %s\n", line);
    int64_t sum = 0;
    for (int k = 0; k < LM_MEM_N_CLASSES; k++) {
        assert_true(a.bytes[k] > 0);
        sum += a.bytes[k];
    }
    assert_true(sum == a.total);
    lm_params p;
    assert_int_equal(lm_params_init(&p, &cfg, &err), LM_OK);
    /* one gradient buffer (no second one for micro-batches), two AdamW moments */
    assert_true(a.numel == p.numel);
    assert_true(a.bytes[LM_MEM_PARAMS] == p.numel * 4 && a.bytes[LM_MEM_GRADS] == p.numel * 4);
    assert_true(a.bytes[LM_MEM_OPTIM] == 2 * p.numel * 4);
    /* token-proportional classes grow with B*T, the others do not */
    for (int k = LM_MEM_PARAMS; k <= LM_MEM_OPTIM; k++)
        assert_true(a.bytes[k] == b.bytes[k]);
    assert_true(b.bytes[LM_MEM_ACTS] > a.bytes[LM_MEM_ACTS] * 19 / 10);
    assert_true(b.bytes[LM_MEM_SCRATCH] > a.bytes[LM_MEM_SCRATCH]);
    /* the same tokens as one longer sequence: the same activations, more KDA state
     * snapshots (one per chunk of the longest document) */
    assert_true(c.bytes[LM_MEM_ACTS] == b.bytes[LM_MEM_ACTS]);
    assert_true(c.kda_workspace_bytes > b.kda_workspace_bytes);
    /* the model allocates exactly its plan for max_tokens as one sequence */
    lm_model *m;
    assert_int_equal(lm_model_new(&m, &p, 256, &err), LM_OK);
    const lm_mem_plan *mp = lm_model_plan(m);
    assert_non_null(mp);
    assert_memory_equal(mp->bytes, c.bytes, sizeof c.bytes);
    lm_model_free(m);
    lm_params_free(&p);
    /* bad input is named */
    assert_int_equal(lm_model_mem_plan(&cfg, 0, 128, &a, &err), LM_ERR_INVALID);
    assert_non_null(strstr(err.msg, "B = 0"));
}

/* `linmoe info` prints the plan of one sequence of the config's seq_len (else 1024)
 * tokens: the same table as lm_model_mem_plan (the classes that do not depend on the
 * thread count compared as text; the CLI runs at ctest's OMP_NUM_THREADS). */
static void test_info_prints_plan(void **state) {
    (void)state;
    static char out[1 << 16];
    static const struct {
        const char *cfg;
        int T;
    } cases[] = {{"bench-cpu.json", 512}, {"tiny.json", 1024}};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(lm_run_cli(out, sizeof out, "info --config configs/%s", cases[i].cfg), 0);
        lm_model_config cfg;
        load_cfg(&cfg, cases[i].cfg);
        lm_mem_plan plan;
        lm_error err = {0};
        assert_int_equal(lm_model_mem_plan(&cfg, 1, cases[i].T, &plan, &err), LM_OK);
        char line[512], head[64];
        lm_mem_plan_format(&plan, line, sizeof line);
        snprintf(head, sizeof head, "memory plan (B = 1, T = %d, ", cases[i].T);
        char *body = strstr(line, "parameters"), *end = strstr(line, " scratch");
        assert_non_null(body);
        assert_non_null(end);
        *end = '\0'; /* parameters .. activations: independent of the thread count */
        const char *at = strstr(out, head);
        if (!at || !strstr(at, body))
            fprintf(stderr, "expected '%s...%s' in:\n%s\n", head, body, out);
        assert_non_null(at);
        assert_non_null(strstr(at, body));
        assert_non_null(strstr(at, "; total "));
    }
    assert_non_null(strstr(out, "the config has no seq_len, default 1024"));
}

/* Gradients accumulate in place: micro-batches of one row each (loss scale 1/2)
 * give the gradient of the two-row batch. The rows are independent (no packing
 * across them, dropless MoE, aux-free balancing: no batch-level loss term) and have
 * the same number of labels, so the two are the same sum in another order: within
 * TOL_BWD_F32 (DESIGN.md's bar for an fp32 gradient; the measured difference, from
 * the other summation orders of the token sums, MoE expert groups and GEMM blocks, is
 * 9e-6 on an AMD EPYC). An accumulate that overwrote would be off by ~50%. */
static void test_accumulate_in_place(void **state) {
    (void)state;
    lm_model_config cfg;
    load_cfg(&cfg, "tiny.json");
    lm_error err = {0};
    lm_params p;
    assert_int_equal(lm_params_init(&p, &cfg, &err), LM_OK);
    lm_params_init_weights(&p, 9);
    for (int64_t i = 0; i < p.numel; i++)
        p.data[i] += 0.02f * (float)((i * 7919) % 13 - 6);
    const int T = 24;
    lm_model *m;
    assert_int_equal(lm_model_new(&m, &p, 2 * T, &err), LM_OK);
    int32_t ids[48], lab[48];
    fill_batch(ids, lab, 2 * T, cfg.vocab_size, 77);
    lab[T - 1] = LM_MODEL_IGNORE; /* row ends */
    lm_model_batch b2 = {2, T, NULL, 0}, b1 = {1, T, NULL, 0};
    assert_int_equal(lm_model_forward(m, &b2, ids, lab, 1, NULL, NULL, NULL, &err), LM_OK);
    assert_int_equal(lm_model_backward(m, 1.0f, 0, &err), LM_OK);
    double *full = lm_to_f64(lm_model_grads(m), p.numel);
    for (int r = 0; r < 2; r++) {
        assert_int_equal(
            lm_model_forward(m, &b1, ids + r * T, lab + r * T, 1, NULL, NULL, NULL, &err), LM_OK);
        assert_int_equal(lm_model_backward(m, 0.5f, r > 0, &err), LM_OK);
    }
    assert_true(lm_check_f32("two micro-batches accumulated vs one batch", lm_model_grads(m), full,
                             p.numel, TOL_BWD_F32));
    /* and accumulate = 0 overwrites: the second row alone is not the sum */
    assert_int_equal(lm_model_forward(m, &b1, ids + T, lab + T, 1, NULL, NULL, NULL, &err), LM_OK);
    assert_int_equal(lm_model_backward(m, 0.5f, 0, &err), LM_OK);
    lm_cmp c = lm_compare_f32(lm_model_grads(m), full, p.numel, TOL_BWD_F32);
    assert_false(c.pass);
    free(full);
    lm_model_free(m);
    lm_params_free(&p);
}

/* OpenBLAS maps a buffer per thread the first time that many threads are inside BLAS at
 * once (see the top comment). On a loaded 2-core machine the steps' own first such moment
 * can come after step 1, so the buffers are mapped here first: every thread of a team of
 * LM_MEM_PLAN_THREADS inside one sgemm at the same time, twice, then one product large
 * enough for OpenBLAS to thread it itself. */
static void warm_blas_buffers(void) {
    enum { W = 256 };
    float *a = calloc((size_t)W * W, sizeof(float)), *c = calloc((size_t)W * W, sizeof(float));
    for (int rep = 0; rep < 2; rep++) {
#pragma omp parallel num_threads(LM_MEM_PLAN_THREADS)
        {
            float *ct = calloc((size_t)W * W, sizeof(float));
#pragma omp barrier
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, W, W, W, 1.0f, a, W, a, W, 0.0f,
                        ct, W);
            free(ct);
        }
    }
    enum { Z = 1024 };
    float *x = calloc((size_t)Z * Z, sizeof(float)), *y = calloc((size_t)Z * Z, sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Z, Z, Z, 1.0f, x, Z, x, Z, 0.0f, y, Z);
    free(x), free(y), free(a), free(c);
}

int main(void) {
    lm_set_num_threads(LM_MEM_PLAN_THREADS);
    warm_blas_buffers();
    /* the tracer's first backtrace() loads the unwinder (allocates): now, not counted */
    if (getenv("LM_MEM_PLAN_TRACE")) {
        void *bt[4];
        backtrace(bt, 4);
        atomic_store(&g_trace, 1);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_counter_sees_allocations),
        cmocka_unit_test(test_plan_table),
        cmocka_unit_test(test_info_prints_plan),
        cmocka_unit_test(test_accumulate_in_place),
        cmocka_unit_test(test_no_alloc_in_step),
        cmocka_unit_test(test_no_alloc_in_trainer_step),
        cmocka_unit_test(test_no_alloc_any_layout),
        cmocka_unit_test(test_no_alloc_in_step_bench),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
#endif
