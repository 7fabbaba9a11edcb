/* lm_backend_supports and op names (include/linmoe/backend.h): what each backend can run,
 * decided from the op's configuration alone, before any work starts. The CUDA limits here
 * are those of the kernels in src/ops/cuda/ (each header states them). */
#include "linmoe/backend.h"
#include "linmoe/attention.h"
#include "linmoe/attnres.h"
#include "linmoe/cuda_bench.h"
#include "linmoe/kda.h"
#include "linmoe/layers.h"
#include "linmoe/moe.h"

static const char *const OP_NAMES[LM_OP_COUNT] = {
    "embedding", "rmsnorm", "gated_rmsnorm", "short_conv",    "gemm",   "attention",
    "kda",       "moe",     "attnres",       "cross_entropy", "swiglu", "adamw"};

const char *lm_op_name(lm_op op) {
    return (op >= 0 && op < LM_OP_COUNT) ? OP_NAMES[op] : "(unknown op)";
}

static lm_status cuda_kda(const lm_kda_config *c, lm_error *err) {
    if (c->K > 128)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "kda on cuda: head_k_dim %d is not supported (at most 128)", c->K);
    if (c->V > 128)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "kda on cuda: head_v_dim %d is not supported (at most 128)", c->V);
    return LM_OK;
}

/* D = 64 and 128 run the FlashAttention-2 kernels (or cuDNN), other D up to 256 the simple
 * kernels (include/linmoe/cuda_attention.h). */
static lm_status cuda_attention(const lm_attention_config *c, lm_error *err) {
    if (c->D > 256)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention on cuda: head_dim %d is not supported (at most 256)", c->D);
    if (c->Hkv <= 0 || c->Hq % c->Hkv != 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attention on cuda: num_attention_heads %d is not a multiple of "
                         "num_key_value_heads %d",
                         c->Hq, c->Hkv);
    return LM_OK;
}

static lm_status cuda_attnres(const lm_attnres_config *c, lm_error *err) {
    if (c->L > 64)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attnres on cuda: %d sources are not supported (at most 64)", c->L);
    if (c->D > 8192)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "attnres on cuda: hidden_size %d is not supported (at most 8192)", c->D);
    return LM_OK;
}

static lm_status cuda_short_conv(const lm_short_conv_config *c, lm_error *err) {
    if (c->W > 8)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "short_conv on cuda: conv_size %d is not supported (at most 8)", c->W);
    return LM_OK;
}

static lm_status cuda_moe(const lm_moe_config *c, lm_error *err) {
    if (c->hidden_size % 8 != 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe on cuda: hidden_size %d is not supported (a multiple of 8)",
                         c->hidden_size);
    if (c->moe_intermediate_size % 8 != 0)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe on cuda: moe_intermediate_size %d is not supported (a multiple of 8)",
                         c->moe_intermediate_size);
    if (c->router.num_experts > 1024)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe on cuda: num_experts %d is not supported (at most 1024)",
                         c->router.num_experts);
    if (c->router.num_experts_per_tok > 32)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "moe on cuda: num_experts_per_tok %d is not supported (at most 32)",
                         c->router.num_experts_per_tok);
    return LM_OK;
}

lm_status lm_backend_supports(lm_device dev, lm_op op, const void *config, lm_error *err) {
    if (op < 0 || op >= LM_OP_COUNT)
        return lm_errorf(err, LM_ERR_INVALID, "backend: unknown op %d", (int)op);
    if (dev.type == LM_DEVICE_CPU)
        return LM_OK; /* the CPU runs every configuration its validators accept */
    if (dev.type != LM_DEVICE_CUDA)
        return lm_errorf(err, LM_ERR_INVALID, "backend: unknown device type %d", (int)dev.type);
    if (!lm_cuda_built())
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "%s on cuda: this linmoe was built without CUDA (no nvcc found by CMake)",
                         lm_op_name(op));
    switch (op) {
    case LM_OP_KDA:
        return config ? cuda_kda((const lm_kda_config *)config, err) : LM_OK;
    case LM_OP_ATTENTION:
        return config ? cuda_attention((const lm_attention_config *)config, err) : LM_OK;
    case LM_OP_SHORT_CONV:
        return config ? cuda_short_conv((const lm_short_conv_config *)config, err) : LM_OK;
    case LM_OP_MOE:
        return config ? cuda_moe((const lm_moe_config *)config, err) : LM_OK;
    case LM_OP_ATTNRES:
        return config ? cuda_attnres((const lm_attnres_config *)config, err) : LM_OK;
    default:
        return LM_OK;
    }
}
