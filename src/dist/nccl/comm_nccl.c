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
    cudaEvent_t order; /* wait_for / join (no timing): a wait uses the record current at
                          the call, so one event serves every wait */
    /* statistics: per kind calls and bytes; ev[2i], ev[2i+1] bracket timed collective i
     * (kind kinds[i]); the events are made on first use (n_ev of them exist) */
    lm_comm_stats st;
    int n_timed, n_ev;
    unsigned char kinds[LM_NCCL_MAX_TIMED];
    cudaEvent_t ev[2 * LM_NCCL_MAX_TIMED];
    cudaEvent_t mark[LM_NCCL_MARKS];
    int have_mark[LM_NCCL_MARKS];
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
    ce = cudaEventCreateWithFlags(&c->order, cudaEventDisableTiming);
    for (int k = 0; k < LM_NCCL_MARKS && ce == cudaSuccess; k++)
        ce = cudaEventCreate(&c->mark[k]);
    if (ce != cudaSuccess) {
        c->comm = NULL;
        lm_nccl_comm_free(c);
        return lm_errorf(err, LM_ERR_IO, "dist: nccl: rank %d device %d: events: %s", rank, device,
                         cudaGetErrorString(ce));
    }
    const ncclResult_t nr = ncclCommInitRank(&c->comm, size, id, rank);
    if (nr != ncclSuccess) {
        c->comm = NULL;
        lm_nccl_comm_free(c);
        return lm_errorf(err, LM_ERR_IO, "dist: ncclCommInitRank (rank %d of %d) failed: %s", rank,
                         size, ncclGetErrorString(nr));
    }
    *out = c;
    return LM_OK;
}

void lm_nccl_comm_free(lm_nccl_comm *c) {
    if (!c)
        return;
    if (c->comm)
        ncclCommDestroy(c->comm);
    for (int i = 0; i < c->n_ev; i++)
        cudaEventDestroy(c->ev[i]);
    for (int k = 0; k < LM_NCCL_MARKS; k++)
        if (c->mark[k])
            cudaEventDestroy(c->mark[k]);
    if (c->order)
        cudaEventDestroy(c->order);
    cudaStreamDestroy(c->stream);
    free(c);
}

/* ---------------------------------------------------------------- statistics */

/* Counts a collective of `kind` moving `bytes` and records the start event of its
 * timing pair (when one is left); *slot: the pair's index, or -1. */
static lm_status timed_begin(lm_nccl_comm *c, lm_coll_kind kind, int64_t bytes, int *slot,
                             lm_error *err) {
    c->st.calls[kind]++;
    c->st.bytes[kind] += bytes;
    *slot = -1;
    if (c->n_timed >= LM_NCCL_MAX_TIMED)
        return LM_OK;
    const int i = c->n_timed;
    while (c->n_ev < 2 * (i + 1)) {
        CHECK_CUDA(cudaEventCreate(&c->ev[c->n_ev]));
        c->n_ev++;
    }
    CHECK_CUDA(cudaEventRecord(c->ev[2 * i], c->stream));
    c->kinds[i] = (unsigned char)kind;
    c->n_timed++;
    *slot = i;
    return LM_OK;
}

static lm_status timed_end(lm_nccl_comm *c, int slot, lm_error *err) {
    if (slot >= 0)
        CHECK_CUDA(cudaEventRecord(c->ev[2 * slot + 1], c->stream));
    return LM_OK;
}

lm_status lm_nccl_get_stats(lm_nccl_comm *c, lm_comm_stats *out, lm_error *err) {
    if (!c || !out)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl get_stats: NULL argument");
    *out = c->st;
    for (int k = 0; k < LM_COLL_N; k++)
        out->seconds[k] = 0;
    /* complete already after the caller's synchronisation: these return at once */
    if (c->n_timed > 0)
        CHECK_CUDA(cudaEventSynchronize(c->ev[2 * c->n_timed - 1]));
    for (int i = 0; i < c->n_timed; i++) {
        float ms = 0;
        CHECK_CUDA(cudaEventSynchronize(c->ev[2 * i + 1]));
        CHECK_CUDA(cudaEventElapsedTime(&ms, c->ev[2 * i], c->ev[2 * i + 1]));
        out->seconds[c->kinds[i]] += (double)ms * 1e-3;
    }
    return LM_OK;
}

void lm_nccl_reset_stats(lm_nccl_comm *c) {
    if (!c)
        return;
    memset(&c->st, 0, sizeof c->st);
    c->n_timed = 0;
}

lm_status lm_nccl_mark(lm_nccl_comm *c, int k, void *stream, lm_error *err) {
    if (!c || k < 0 || k >= LM_NCCL_MARKS)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl mark %d (want 0 .. %d)", k,
                         LM_NCCL_MARKS - 1);
    CHECK_CUDA(cudaEventRecord(c->mark[k], stream ? (cudaStream_t)stream : c->stream));
    c->have_mark[k] = 1;
    return LM_OK;
}

lm_status lm_nccl_mark_ms(lm_nccl_comm *c, int a, int b, double *ms, lm_error *err) {
    if (!c || !ms || a < 0 || a >= LM_NCCL_MARKS || b < 0 || b >= LM_NCCL_MARKS ||
        !c->have_mark[a] || !c->have_mark[b])
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl mark_ms %d -> %d: not recorded", a, b);
    float f = 0;
    CHECK_CUDA(cudaEventSynchronize(c->mark[a]));
    CHECK_CUDA(cudaEventSynchronize(c->mark[b]));
    CHECK_CUDA(cudaEventElapsedTime(&f, c->mark[a], c->mark[b]));
    *ms = f;
    return LM_OK;
}

/* ---------------------------------------------------------------- ordering */

lm_status lm_nccl_wait_for(lm_nccl_comm *c, void *stream, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl wait_for: NULL communicator");
    CHECK_CUDA(cudaEventRecord(c->order, (cudaStream_t)stream));
    CHECK_CUDA(cudaStreamWaitEvent(c->stream, c->order, 0));
    return LM_OK;
}

lm_status lm_nccl_join(lm_nccl_comm *c, void *stream, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl join: NULL communicator");
    CHECK_CUDA(cudaEventRecord(c->order, c->stream));
    CHECK_CUDA(cudaStreamWaitEvent((cudaStream_t)stream, c->order, 0));
    return LM_OK;
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
    int slot = -1;
    LM_TRY(timed_begin(c, LM_COLL_ALLREDUCE, n * (int64_t)lm_dtype_size(dt), &slot, err));
    CHECK_NCCL(ncclAllReduce(buf, buf, (size_t)n, t, op == LM_DIST_MAX ? ncclMax : ncclSum, c->comm,
                             c->stream));
    return timed_end(c, slot, err);
}

lm_status lm_nccl_reduce_scatter(lm_nccl_comm *c, const void *send, void *recv, int64_t n,
                                 lm_dtype dt, lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || n < 0)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl reduce_scatter: bad arguments");
    int slot = -1;
    LM_TRY(timed_begin(c, LM_COLL_REDUCE_SCATTER, n * c->size * (int64_t)lm_dtype_size(dt), &slot,
                       err));
    CHECK_NCCL(ncclReduceScatter(send, recv, (size_t)n, t, ncclSum, c->comm, c->stream));
    return timed_end(c, slot, err);
}

lm_status lm_nccl_allgather(lm_nccl_comm *c, const void *send, void *recv, int64_t n, lm_dtype dt,
                            lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || n < 0)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl allgather: bad arguments");
    int slot = -1;
    LM_TRY(timed_begin(c, LM_COLL_ALLGATHER, n * (int64_t)lm_dtype_size(dt), &slot, err));
    CHECK_NCCL(ncclAllGather(send, recv, (size_t)n, t, c->comm, c->stream));
    return timed_end(c, slot, err);
}

lm_status lm_nccl_alltoallv(lm_nccl_comm *c, const void *send, const int64_t *send_counts,
                            void *recv, const int64_t *recv_counts, lm_dtype dt, lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || !send_counts || !recv_counts)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl alltoallv: NULL argument");
    const size_t es = lm_dtype_size(dt);
    size_t so = 0, ro = 0;
    int64_t sent = 0;
    for (int q = 0; q < c->size; q++)
        sent += send_counts[q] > 0 ? send_counts[q] : 0;
    int slot = -1;
    LM_TRY(timed_begin(c, LM_COLL_ALLTOALLV, sent * (int64_t)es, &slot, err));
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
    return timed_end(c, slot, err);
}

lm_status lm_nccl_broadcast(lm_nccl_comm *c, void *buf, int64_t n, lm_dtype dt, int root,
                            lm_error *err) {
    ncclDataType_t t = ncclFloat32;
    LM_TRY(nccl_type(dt, &t, err));
    if (!c || n < 0 || root < 0 || root >= c->size)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl broadcast: bad arguments");
    int slot = -1;
    LM_TRY(timed_begin(c, LM_COLL_BROADCAST, c->rank == root ? n * (int64_t)lm_dtype_size(dt) : 0,
                       &slot, err));
    CHECK_NCCL(ncclBroadcast(buf, buf, (size_t)n, t, root, c->comm, c->stream));
    return timed_end(c, slot, err);
}

lm_status lm_nccl_sync(lm_nccl_comm *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "dist: nccl sync: NULL communicator");
    CHECK_CUDA(cudaStreamSynchronize(c->stream));
    return LM_OK;
}
