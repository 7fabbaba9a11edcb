/* KDA decode step on the GPU (include/linmoe/kda_cuda.h). Placeholder. */
#include "linmoe/kda_cuda.h"

extern "C" lm_status lm_kda_cuda_decode_step(lm_kda_config *c, const lm_kda_cuda_inputs *in,
                                             float *state, void *o, lm_error *err) {
    (void)c;
    (void)in;
    (void)state;
    (void)o;
    return lm_errorf(err, LM_ERR_UNSUPPORTED, "kda cuda decode: not built yet");
}
