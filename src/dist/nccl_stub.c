/* include/linmoe/dist_nccl.h without NCCL in the build: every entry point answers
 * LM_ERR_UNSUPPORTED (src/dist/nccl/comm_nccl.c is the backend). */
#include "linmoe/dist_nccl.h"

#include <string.h>

#ifndef LM_HAVE_NCCL
static lm_status no_nccl(lm_error *err) {
    return lm_errorf(err, LM_ERR_UNSUPPORTED,
                     "dist: this linmoe was built without NCCL (needs CUDA and NCCL at "
                     "configure time)");
}

int lm_dist_have_nccl(void) { return 0; }
lm_status lm_nccl_comm_new(lm_nccl_comm **out, lm_comm *host, int device, lm_error *err) {
    (void)host, (void)device;
    if (out)
        *out = NULL;
    return no_nccl(err);
}
void lm_nccl_comm_free(lm_nccl_comm *c) { (void)c; }
int lm_nccl_comm_rank(const lm_nccl_comm *c) { return c ? 0 : 0; }
int lm_nccl_comm_size(const lm_nccl_comm *c) { return c ? 1 : 1; }
void *lm_nccl_comm_stream(lm_nccl_comm *c) { return (void)c, (void *)0; }
lm_status lm_nccl_allreduce(lm_nccl_comm *c, void *buf, int64_t n, lm_dtype dt, lm_dist_op op,
                            lm_error *err) {
    (void)c, (void)buf, (void)n, (void)dt, (void)op;
    return no_nccl(err);
}
lm_status lm_nccl_reduce_scatter(lm_nccl_comm *c, const void *send, void *recv, int64_t n,
                                 lm_dtype dt, lm_error *err) {
    (void)c, (void)send, (void)recv, (void)n, (void)dt;
    return no_nccl(err);
}
lm_status lm_nccl_allgather(lm_nccl_comm *c, const void *send, void *recv, int64_t n, lm_dtype dt,
                            lm_error *err) {
    (void)c, (void)send, (void)recv, (void)n, (void)dt;
    return no_nccl(err);
}
lm_status lm_nccl_alltoallv(lm_nccl_comm *c, const void *send, const int64_t *send_counts,
                            void *recv, const int64_t *recv_counts, lm_dtype dt, lm_error *err) {
    (void)c, (void)send, (void)send_counts, (void)recv, (void)recv_counts, (void)dt;
    return no_nccl(err);
}
lm_status lm_nccl_broadcast(lm_nccl_comm *c, void *buf, int64_t n, lm_dtype dt, int root,
                            lm_error *err) {
    (void)c, (void)buf, (void)n, (void)dt, (void)root;
    return no_nccl(err);
}
lm_status lm_nccl_sync(lm_nccl_comm *c, lm_error *err) {
    (void)c;
    return no_nccl(err);
}
lm_status lm_nccl_wait_for(lm_nccl_comm *c, void *stream, lm_error *err) {
    (void)c, (void)stream;
    return no_nccl(err);
}
lm_status lm_nccl_join(lm_nccl_comm *c, void *stream, lm_error *err) {
    (void)c, (void)stream;
    return no_nccl(err);
}
lm_status lm_nccl_get_stats(lm_nccl_comm *c, lm_comm_stats *out, lm_error *err) {
    (void)c;
    if (out)
        memset(out, 0, sizeof *out);
    return no_nccl(err);
}
void lm_nccl_reset_stats(lm_nccl_comm *c) { (void)c; }
lm_status lm_nccl_mark(lm_nccl_comm *c, int k, void *stream, lm_error *err) {
    (void)c, (void)k, (void)stream;
    return no_nccl(err);
}
lm_status lm_nccl_mark_ms(lm_nccl_comm *c, int a, int b, double *ms, lm_error *err) {
    (void)c, (void)a, (void)b;
    if (ms)
        *ms = 0;
    return no_nccl(err);
}
#endif
