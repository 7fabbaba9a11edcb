/* The NCCL communicator (include/linmoe/dist_nccl.h) on world size 1 (one process, the
 * self host communicator: the ncclUniqueId made by rank 0 and "broadcast" to itself):
 * all-reduce (sum, max), reduce-scatter, all-gather (in place), all-to-all-v to
 * itself, broadcast, on device buffers, values checked on the host. Exit 77 (skipped)
 * without NCCL in the build or without a CUDA device. The multi-GPU paths are not
 * tested (no machine with several GPUs). */
#include "test_util.h"

#include <stdio.h>
#include <string.h>

#include "linmoe/dist_nccl.h"

#ifdef LM_HAVE_NCCL
#include <cuda_runtime.h>

static void test_world1(void **state) {
    (void)state;
    lm_error err;
    lm_comm *host;
    assert_int_equal(lm_comm_self_new(&host, &err), LM_OK);
    lm_nccl_comm *c = NULL;
    const lm_status st = lm_nccl_comm_new(&c, host, 0, &err);
    if (st != LM_OK)
        fail_msg("%s", err.msg);
    assert_int_equal(lm_nccl_comm_size(c), 1);
    enum { N = 1000 };
    float h[N], back[N];
    for (int i = 0; i < N; i++)
        h[i] = (float)(i % 97) * 0.25f - 3.0f;
    float *d = NULL, *d2 = NULL;
    assert_int_equal(cudaMalloc((void **)&d, sizeof h), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&d2, sizeof h), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(lm_nccl_allreduce(c, d, N, LM_F32, LM_DIST_SUM, &err), LM_OK);
    assert_int_equal(lm_nccl_allreduce(c, d, N, LM_F32, LM_DIST_MAX, &err), LM_OK);
    assert_int_equal(lm_nccl_reduce_scatter(c, d, d2, N, LM_F32, &err), LM_OK);
    assert_int_equal(lm_nccl_allgather(c, d2, d2, N, LM_F32, &err), LM_OK);
    assert_int_equal(lm_nccl_broadcast(c, d2, N, LM_F32, 0, &err), LM_OK);
    const int64_t cnt = N;
    assert_int_equal(cudaMemset(d, 0, sizeof h), cudaSuccess);
    assert_int_equal(lm_nccl_sync(c, &err), LM_OK); /* the memset is on the default stream */
    assert_int_equal(lm_nccl_alltoallv(c, d2, &cnt, d, &cnt, LM_F32, &err), LM_OK);
    assert_int_equal(lm_nccl_sync(c, &err), LM_OK);
    assert_int_equal(cudaMemcpy(back, d, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_memory_equal(back, h, sizeof h); /* one rank: every collective is the identity */
    assert_int_equal(lm_nccl_allreduce(c, d, N, (lm_dtype)LM_DTYPE_COUNT, LM_DIST_SUM, &err),
                     LM_ERR_INVALID);
    cudaFree(d);
    cudaFree(d2);
    lm_nccl_comm_free(c);
    lm_comm_free(host);
}
#endif

int main(void) {
#ifndef LM_HAVE_NCCL
    lm_error err;
    lm_nccl_comm *c = NULL;
    if (lm_nccl_comm_new(&c, NULL, 0, &err) != LM_ERR_UNSUPPORTED || lm_dist_have_nccl() != 0)
        return 1;
    printf("SKIPPED: this build has no NCCL (CUDA + NCCL at configure time)\n");
    return 77;
#else
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    const struct CMUnitTest t[] = {cmocka_unit_test(test_world1)};
    return cmocka_run_group_tests(t, NULL, NULL);
#endif
}
