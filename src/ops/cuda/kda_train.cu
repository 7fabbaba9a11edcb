/* KDA training forward and backward on the GPU (include/linmoe/kda_cuda.h).
 * Placeholder until the backward kernels land: both report LM_ERR_UNSUPPORTED. */
#include "linmoe/kda_cuda.h"

extern "C" lm_status lm_kda_cuda_forward_train(lm_kda_config *c, const lm_kda_cuda_inputs *in,
                                               lm_kda_cuda_outputs *out,
                                               lm_kda_cuda_saved **saved, lm_error *err) {
    (void)c;
    (void)in;
    (void)out;
    if (saved)
        *saved = nullptr;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda: the backward is not built yet");
}

extern "C" lm_status lm_kda_cuda_backward(lm_kda_cuda_saved *saved, const lm_kda_cuda_grads *gr,
                                          lm_error *err) {
    (void)saved;
    (void)gr;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda: the backward is not built yet");
}

extern "C" void lm_kda_cuda_saved_free(lm_kda_cuda_saved *saved) { (void)saved; }
