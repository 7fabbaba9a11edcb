/* The NCCL communicator of include/linmoe/dist_nccl.h (CUDA + NCCL builds only:
 * CMakeLists.txt compiles this file when it finds both; src/dist/nccl_stub.c
 * otherwise). The unique id travels over the host communicator (dist.h). */
#include "linmoe/dist_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK_NCCL(call)                                                                           \
    do {                                                                                           \
        ncclResult_t nccl_rc_ = (call);                                                            \
        if (nccl_rc_ != ncclSuccess)                                                               \
            return lm_errorf(err, LM_ERR_IO, "dist: %s failed (%s:%d): %s", #call, __FILE__,       \
                             __LINE__, ncclGetErrorString(nccl_rc_));                              \
    } while (0)

#define CHECK_CUDA(call)                                                                           \
    do {                                                                                           \
        cudaError_t cuda_rc_ = (call);                                                             \
        if (cuda_rc_ != cudaSuccess)                                                               \
            return lm_errorf(err, LM_ERR_IO, "dist: %s failed (%s:%d): %s", #call, __FILE__,       \
                             __LINE__, cudaGetErrorString(cuda_rc_));                              \
    } while (0)

struct lm_nccl_comm {
    ncclComm_t comm;
    cudaStream_t stream;
    int rank, size, device;
};

int lm_dist_have_nccl(void) { return 1; }

static lm_status nccl_type(lm_dtype dt, ncclDataType_t *out, lm_error *err) {
    switch (dt) {
    case LM_F32:
        *out = ncclFloat32;
        return LM_OK;
    case LM_F64:
        *out = ncclFloat64;
        return LM_OK;
    case LM_BF16:
        *out = ncclBfloat16;
        return LM_OK;
    case LM_F16:
        *out = ncclFloat16;
        return LM_OK;
    case LM_I32:
        *out = ncclInt32;
        return LM_OK;
    case LM_I64:
        *out = ncclInt64;
        return LM_OK;
    case LM_U8:
        *out = ncclUint8;
        return LM_OK;
    default:
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl: dtype %s is not supported",
                         lm_dtype_name(dt));
    }
}

lm_status lm_nccl_comm_new(lm_nccl_comm **out, lm_comm *host, int device, lm_error *err) {
    if (!out || !host)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl: NULL argument");
    *out = NULL;
    const int rank = lm_comm_rank(host), size = lm_comm_size(host);
    lm_status st = LM_OK;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || device < 0 || device >= ndev)
        st = lm_errorf(err, LM_ERR_UNSUPPORTED, "dist: nccl: rank %d: CUDA device %d of %d", rank,
                       device, ndev);
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (st == LM_OK && rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
        st = lm_errorf(err, LM_ERR_IO, "dist: ncclGetUniqueId failed");
    LM_TRY(lm_comm_agree(host, st, err));
    LM_TRY(lm_comm_broadcast(host, &id, (int64_t)sizeof id, LM_U8, 0, err));
    lm_nccl_comm *c = LM_CALLOC(1, sizeof *c);
    c->rank = rank;
    c->size = size;
    c->device = device;
    cudaError_t ce = cudaSetDevice(device);
    if (ce == cudaSuccess)
        ce = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        free(c);
        return lm_errorf(err, LM_ERR_IO, "dist: nccl: rank %d device %d: %s", rank, device,
                         cudaGetErrorString(ce));
    }
    const ncclResult_t nr = ncclCommInitRank(&c->comm, size, id, rank);
    if (nr != ncclSuccess) {
        cudaStreamDestroy(c->stream);
        free(c);
        return lm_errorf(err, LM_ERR_IO, "dist: ncclCommInitRank (rank %d of %d) failed: %s", rank,
                         size, ncclGetErrorString(nr));
    }
    *out = c;
    return LM_OK;
}

void lm_nccl_comm_free(lm_nccl_comm *c) {
    if (!c)
        return;
    ncclCommDestroy(c->comm);
    cudaStreamDestroy(c->stream);
    free(c);
}

int lm_nccl_comm_rank(const lm_nccl_comm *c) { return c ? c->rank : 0; }
int lm_nccl_comm_size(const lm_nccl_comm *c) { return c ? c->size : 1; }
void *lm_nccl_comm_stream(lm_nccl_comm *c) { return c ? (void *)c->stream : NULL; }

lm_status lm_nccl_allreduce(lm_nccl_comm *c, void *buf, int64_t n, lm_dtype dt, lm_dist_op op,
                            lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || n < 0)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl allreduce: bad arguments");
    CHECK_NCCL(ncclAllReduce(buf, buf, (size_t)n, t, op == LM_DIST_MAX ? ncclMax : ncclSum, c->comm,
                             c->stream));
    return LM_OK;
}

lm_status lm_nccl_reduce_scatter(lm_nccl_comm *c, const void *send, void *recv, int64_t n,
                                 lm_dtype dt, lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || n < 0)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl reduce_scatter: bad arguments");
    CHECK_NCCL(ncclReduceScatter(send, recv, (size_t)n, t, ncclSum, c->comm, c->stream));
    return LM_OK;
}

lm_status lm_nccl_allgather(lm_nccl_comm *c, const void *send, void *recv, int64_t n, lm_dtype dt,
                            lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || n < 0)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl allgather: bad arguments");
    CHECK_NCCL(ncclAllGather(send, recv, (size_t)n, t, c->comm, c->stream));
    return LM_OK;
}

lm_status lm_nccl_alltoallv(lm_nccl_comm *c, const void *send, const int64_t *send_counts,
                            void *recv, const int64_t *recv_counts, lm_dtype dt, lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || !send_counts || !recv_counts)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl alltoallv: NULL argument");
    const size_t es = lm_dtype_size(dt);
    size_t so = 0, ro = 0;
    CHECK_NCCL(ncclGroupStart());
    for (int q = 0; q < c->size; q++) {
        if (send_counts[q] > 0) {
            const ncclResult_t r = ncclSend((const char *)send + so * es, (size_t)send_counts[q], t,
                                            q, c->comm, c->stream);
            if (r != ncclSuccess) {
                ncclGroupEnd();
                return lm_errorf(err, LM_ERR_IO, "dist: ncclSend to rank %d failed: %s", q,
                                 ncclGetErrorString(r));
            }
        }
        if (recv_counts[q] > 0) {
            const ncclResult_t r =
                ncclRecv((char *)recv + ro * es, (size_t)recv_counts[q], t, q, c->comm, c->stream);
            if (r != ncclSuccess) {
                ncclGroupEnd();
                return lm_errorf(err, LM_ERR_IO, "dist: ncclRecv from rank %d failed: %s", q,
                                 ncclGetErrorString(r));
            }
        }
        so += (size_t)send_counts[q];
        ro += (size_t)recv_counts[q];
    }
    CHECK_NCCL(ncclGroupEnd());
    return LM_OK;
}

lm_status lm_nccl_broadcast(lm_nccl_comm *c, void *buf, int64_t n, lm_dtype dt, int root,
                            lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || n < 0 || root < 0 || root >= c->size)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl broadcast: bad arguments");
    CHECK_NCCL(ncclBroadcast(buf, buf, (size_t)n, t, root, c->comm, c->stream));
    return LM_OK;
}

lm_status lm_nccl_sync(lm_nccl_comm *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl sync: NULL communicator");
    CHECK_CUDA(cudaStreamSynchronize(c->stream));
    return LM_OK;
}
