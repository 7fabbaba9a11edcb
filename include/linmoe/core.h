/* linmoe core: status codes and error messages, always-on invariant checks, arenas,
 * strided tensor views, a counter-based RNG, bf16 rounding helpers, timers, thread
 * control and a single-threaded-or-threaded OpenBLAS sgemm wrapper.
 *
 * What this module does not do: file I/O (see safetensors.h), math of any op
 * (see kda.h and friends), or CUDA.
 */
#ifndef LINMOE_CORE_H
#define LINMOE_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

/* Status codes returned by every library entry point that can see bad input. */
typedef enum {
    LM_OK = 0,
    LM_ERR_INVALID = 1, /* an argument, shape, attribute or tensor value is invalid */
    LM_ERR_IO = 2,      /* a file could not be opened, read, written or renamed   */
    LM_ERR_FORMAT = 3,  /* a file's content is malformed (header, offsets, dtype)  */
    LM_ERR_NOMEM = 4,   /* an allocation failed                                    */
    LM_ERR_UNSUPPORTED = 5, /* valid request this build cannot serve (e.g. no CUDA) */
    /* A tensor value given to or computed by an op is NaN or +-Inf: the data, not the
     * configuration (a non-finite config scalar such as scale, eps or dloss is
     * LM_ERR_INVALID). Every CPU finiteness scan of tensor elements returns it, so a
     * caller (the trainer's bad-step skip) can tell a numeric blow-up from bad input
     * without reading the message. */
    LM_ERR_NONFINITE = 6,
    LM_ERR_RANGE = 7, /* a valid request beyond a configured limit (a prompt longer than
                         the model's context) */
    LM_ERR_BUSY = 8   /* a valid request refused for now (a full queue): retry later */
} lm_status;

/* Error context: the first failing call writes a message that names the input,
 * the field and the bad value. Pass NULL where the caller does not want it. */
typedef struct {
    lm_status status;
    char msg[1024];
} lm_error;

/* Record an error (printf-style) in `err` (may be NULL) and return `st`. */
lm_status lm_errorf(lm_error *err, lm_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
const char *lm_status_str(lm_status st);

/* Always-on invariant check for internal logic errors (not user input): prints
 * file:line and the expression, then aborts. */
#define LM_CHECK(cond)                                                                    \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            fprintf(stderr, "%s:%d: internal check failed: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                      \
        }                                                                                 \
    } while (0)

/* Propagate a non-OK status. */
#define LM_TRY(expr)                       \
    do {                                   \
        lm_status lm_try_st_ = (expr);     \
        if (lm_try_st_ != LM_OK) return lm_try_st_; \
    } while (0)

/* malloc/calloc that abort with file:line on failure (for internal scratch). */
void *lm_xmalloc(size_t n, const char *file, int line);
void *lm_xcalloc(size_t n, size_t sz, const char *file, int line);
#define LM_MALLOC(n) lm_xmalloc((n), __FILE__, __LINE__)
#define LM_CALLOC(n, sz) lm_xcalloc((n), (sz), __FILE__, __LINE__)

/* ---------------------------------------------------------------- arena */

/* One allocation carved into aligned pieces (64-byte alignment). Nothing is freed
 * individually; lm_arena_reset rewinds, lm_arena_free releases the buffer. */
typedef struct {
    uint8_t *base;
    size_t cap;  /* bytes */
    size_t used; /* bytes */
} lm_arena;

lm_status lm_arena_init(lm_arena *a, size_t cap_bytes, lm_error *err);
/* Returns NULL (and records an error) when the request does not fit. */
void *lm_arena_alloc(lm_arena *a, size_t bytes, lm_error *err);
void lm_arena_reset(lm_arena *a);
void lm_arena_free(lm_arena *a);

/* ---------------------------------------------------------------- tensors */

typedef enum {
    LM_F32 = 0, LM_F64, LM_BF16, LM_F16, LM_I32, LM_I64, LM_U8, LM_DTYPE_COUNT
} lm_dtype;

size_t lm_dtype_size(lm_dtype dt);
const char *lm_dtype_name(lm_dtype dt); /* safetensors spelling: "F32", "BF16", ... */
/* Returns 0 and sets *out on success, -1 for an unknown name. */
int lm_dtype_from_name(const char *name, lm_dtype *out);

/* Where memory lives: the host (`cpu`) or CUDA device `index` (`cuda:N`). Parsing and
 * printing: lm_device_parse / lm_device_name (include/linmoe/backend.h). Defined here so
 * that a tensor can carry its device without core.h depending on backend.h. */
typedef enum { LM_DEVICE_CPU = 0, LM_DEVICE_CUDA = 1 } lm_device_type;

typedef struct {
    lm_device_type type;
    int index; /* CUDA ordinal; 0 for the CPU */
} lm_device;

#define LM_MAX_DIMS 8
/* A non-owning strided view. Strides are in elements (not bytes). For sequence
 * ops the layout is [B, T, H, D] row-major (innermost D), as in fla. `device` says
 * where `data` lives (host memory for LM_DEVICE_CPU, device memory of that CUDA ordinal
 * otherwise); the dispatched ops of include/linmoe/ops.h check it against the backend. */
typedef struct {
    void *data;
    lm_dtype dtype;
    int ndim;
    int64_t shape[LM_MAX_DIMS];
    int64_t stride[LM_MAX_DIMS];
    lm_device device;
} lm_tensor;

/* Contiguous row-major view of host memory (device = cpu). */
lm_tensor lm_tensor_make(void *data, lm_dtype dt, int ndim, const int64_t *shape);
/* The same on `device` (data must be memory of that device; nothing is dereferenced). */
lm_tensor lm_tensor_make_on(void *data, lm_dtype dt, int ndim, const int64_t *shape,
                            lm_device device);
/* Index of the first NaN or Inf among x[0 .. n), or -1 when all are finite (x may be NULL
 * for n == 0). A branch-free scan by blocks (vectorised), then the first bad element of the
 * first bad block; the ops' input validation uses it. */
int64_t lm_f32_first_nonfinite(const float *x, int64_t n);
int64_t lm_tensor_numel(const lm_tensor *t);
int lm_tensor_is_contiguous(const lm_tensor *t);
/* Element offset of index idx[ndim]. */
int64_t lm_tensor_offset(const lm_tensor *t, const int64_t *idx);

/* ---------------------------------------------------------------- rng */

/* Counter-based RNG (Philox-4x32-10): the value at (key, counter) is a pure
 * function, so streams are reproducible and splittable across threads. */
typedef struct {
    uint64_t key;
    uint64_t counter;
} lm_rng;

void lm_rng_init(lm_rng *r, uint64_t seed);
uint32_t lm_rng_u32(lm_rng *r);
double lm_rng_uniform(lm_rng *r); /* [0, 1) with 53-bit resolution */
double lm_rng_normal(lm_rng *r);  /* standard normal (Box-Muller) */
/* Stateless: four 32-bit words for (key, counter). */
void lm_philox4x32(uint64_t key, uint64_t counter, uint32_t out[4]);
/* The full Philox-4x32-10 block function (Salmon et al., SC'11): 128-bit counter
 * ctr[4], 64-bit key key[2] -> out[4]. lm_philox4x32 is this with
 * ctr = {lo32(counter), hi32(counter), 0, 0} and key = {lo32(key), hi32(key)}. */
void lm_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* ---------------------------------------------------------------- bf16 / f16 */

/* Round-to-nearest-even fp32 -> bf16; NaN stays NaN (quiet), Inf stays Inf. */
uint16_t lm_f32_to_bf16(float x);
float lm_bf16_to_f32(uint16_t h);
/* Round fp32 to the nearest bf16 value and return it as fp32. */
float lm_bf16_round(float x);
uint16_t lm_f32_to_f16(float x); /* IEEE binary16, round to nearest even */
float lm_f16_to_f32(uint16_t h);

/* ---------------------------------------------------------------- timers */

double lm_time_sec(void); /* monotonic seconds */

/* ---------------------------------------------------------------- threads */

/* Number of OpenMP threads used by linmoe ops; n <= 0 restores the default. */
void lm_set_num_threads(int n);
int lm_get_num_threads(void);

/* ---------------------------------------------------------------- BLAS */

/* C[M,N] = alpha * op(A) * op(B) + beta * C, row-major, fp32, via OpenBLAS
 * cblas_sgemm. lda/ldb/ldc are row strides in elements. Uses OpenBLAS's own
 * thread count; call lm_blas_set_threads(1) inside parallel regions. */
void lm_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc);
void lm_blas_set_threads(int n);
int lm_blas_get_threads(void);
/* The kernel family OpenBLAS chose when it loaded ("Haswell", "SkylakeX", "Prescott", ...).
 * lm_blas_better_coretype: when that is a generic pre-AVX family on a CPU with AVX-512
 * (or AVX2 + FMA), the family to ask for instead ("SkylakeX", "Haswell"), else NULL.
 * OpenBLAS releases older than the CPU model (Debian 12's 0.3.21 on Sapphire / Emerald
 * Rapids Xeons) fall back to Prescott (SSE3): sgemm 54 GFLOP/s on 2 cores of an Emerald
 * Rapids Xeon against 156 with SkylakeX kernels. OpenBLAS reads OPENBLAS_CORETYPE once,
 * when it loads, so only a new process can switch (the CLI re-executes itself). */
const char *lm_blas_corename(void);
const char *lm_blas_better_coretype(void);

#ifdef __cplusplus
}
#endif
#endif
