/* linmoe NCCL communicator (issue 24): the collectives of dist.h on CUDA device
 * buffers, for GPU ranks. Built only when the build has CUDA and NCCL (CMake:
 * LINMOE_CUDA on, nvcc and nccl.h / libnccl found: LM_HAVE_NCCL); otherwise every entry
 * point answers LM_ERR_UNSUPPORTED.
 *
 * Bootstrap (as karpathy/llm.c's multi-GPU path): rank 0 of the host communicator
 * (dist.h; MPI across processes, or self for one process) makes an ncclUniqueId, the
 * id is broadcast over the host communicator, and every rank calls ncclCommInitRank
 * with its host rank and size on its device. One NCCL rank per process and device.
 *
 * Streams: the communicator owns one non-blocking CUDA stream; every collective is
 * enqueued on it and returns when enqueued (NCCL semantics); lm_nccl_sync waits for
 * them. Ordering against the caller's compute stream is the caller's: lm_nccl_wait_for
 * (this stream waits for what the compute stream has enqueued so far: a CUDA event
 * recorded there) and lm_nccl_join (the compute stream waits for the collectives
 * enqueued so far), or lm_nccl_sync. The GPU trainer calls wait_for after a layer's
 * backward and enqueues that layer's gradient all-reduce, so the reduction overlaps the
 * backward of the layers below (docs/distributed.md "GPU ranks"). Neither call blocks
 * the host.
 *
 * Statistics (as dist.h's lm_comm_stats, per collective kind): calls and bytes are
 * counted when a collective is enqueued; its time comes from a pair of CUDA timing
 * events around it on this stream (the first LM_NCCL_MAX_TIMED collectives after
 * lm_nccl_reset_stats are timed, later ones counted only), read by lm_nccl_get_stats,
 * which waits for the events (cudaEventSynchronize): call it once the collectives are
 * complete (after a host synchronisation that follows lm_nccl_join or lm_nccl_sync),
 * where that wait returns at once, so the statistics add no synchronisation. Marks
 * (lm_nccl_mark) are LM_NCCL_MARKS more timing events the caller records on either
 * stream, read the same way (lm_nccl_mark_ms): the trainer's overlap measurement.
 *
 * Dtypes: LM_F32, LM_F64, LM_BF16, LM_F16, LM_I32, LM_I64, LM_U8. Counts are elements.
 * Reduce-scatter and all-gather take equal blocks per rank (NCCL's: pad the buffer to
 * a multiple of the world size). All-to-all-v is a group of ncclSend / ncclRecv per
 * peer, contiguous blocks in peer order as in dist.h.
 *
 * Status: compiled in CUDA + NCCL builds; its world-size-1 path is exercised by
 * tests/test_dist_nccl.c on a GPU machine (the collectives, and the trainer's NCCL path
 * against the plain GPU run); multi-GPU runs are not tested (no machine with several
 * GPUs was used). Errors: CHECK_NCCL / CHECK_CUDA turn a failing call
 * into LM_ERR_IO naming the call and NCCL's / CUDA's error string. */
#ifndef LINMOE_DIST_NCCL_H
#define LINMOE_DIST_NCCL_H

#include "linmoe/dist.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lm_nccl_comm lm_nccl_comm;

/* 1 when the build has the NCCL backend. */
int lm_dist_have_nccl(void);

/* Collective over `host` (borrowed for the call only): one NCCL rank per host rank on
 * CUDA device `device` (made current for the calling thread). */
lm_status lm_nccl_comm_new(lm_nccl_comm **out, lm_comm *host, int device, lm_error *err);
void lm_nccl_comm_free(lm_nccl_comm *c);
int lm_nccl_comm_rank(const lm_nccl_comm *c);
int lm_nccl_comm_size(const lm_nccl_comm *c);
/* The communicator's cudaStream_t (as a pointer). */
void *lm_nccl_comm_stream(lm_nccl_comm *c);

/* In place on device memory buf [n]. */
lm_status lm_nccl_allreduce(lm_nccl_comm *c, void *buf, int64_t n, lm_dtype dt, lm_dist_op op,
                            lm_error *err);
/* send [size * n] (block r for rank r), recv [n]: the sum of block rank over ranks. */
lm_status lm_nccl_reduce_scatter(lm_nccl_comm *c, const void *send, void *recv, int64_t n,
                                 lm_dtype dt, lm_error *err);
/* send [n], recv [size * n] (in place: send == recv + rank * n). */
lm_status lm_nccl_allgather(lm_nccl_comm *c, const void *send, void *recv, int64_t n, lm_dtype dt,
                            lm_error *err);
/* Host arrays of per-peer counts [size] (as dist.h lm_comm_alltoallv). */
lm_status lm_nccl_alltoallv(lm_nccl_comm *c, const void *send, const int64_t *send_counts,
                            void *recv, const int64_t *recv_counts, lm_dtype dt, lm_error *err);
lm_status lm_nccl_broadcast(lm_nccl_comm *c, void *buf, int64_t n, lm_dtype dt, int root,
                            lm_error *err);
/* Wait for every collective enqueued so far (cudaStreamSynchronize). */
lm_status lm_nccl_sync(lm_nccl_comm *c, lm_error *err);

/* The communicator's stream waits (on the device) for the work enqueued on `stream` (a
 * cudaStream_t as a pointer) so far: collectives enqueued next see its results. */
lm_status lm_nccl_wait_for(lm_nccl_comm *c, void *stream, lm_error *err);
/* `stream` waits (on the device) for the collectives enqueued so far. */
lm_status lm_nccl_join(lm_nccl_comm *c, void *stream, lm_error *err);

#define LM_NCCL_MAX_TIMED 256
#define LM_NCCL_MARKS 4
/* Per-kind calls, bytes (this rank's send payload) and seconds since the last reset
 * (see "Statistics" above: waits for the timed collectives when they are not complete). */
lm_status lm_nccl_get_stats(lm_nccl_comm *c, lm_comm_stats *out, lm_error *err);
void lm_nccl_reset_stats(lm_nccl_comm *c);
/* Record timing mark k in [0, LM_NCCL_MARKS) on `stream` (NULL: the communicator's
 * stream); a mark recorded again replaces the earlier record. */
lm_status lm_nccl_mark(lm_nccl_comm *c, int k, void *stream, lm_error *err);
/* Milliseconds from mark a to mark b (both recorded; waits for them as get_stats does;
 * negative when b ran first). */
lm_status lm_nccl_mark_ms(lm_nccl_comm *c, int a, int b, double *ms, lm_error *err);

#ifdef __cplusplus
}
#endif
#endif
