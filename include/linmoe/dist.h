/* linmoe distributed communicator: ranks, the data-parallel and expert-parallel groups,
 * and the collectives the trainer needs (all-reduce, reduce-scatter, all-gather, gather,
 * all-to-all with per-peer counts, broadcast, barrier), on host buffers.
 *
 * Backends:
 *   - self: one process (world size 1). Always built. Every collective is a copy (or
 *     nothing), so the single-process trainer runs the same code path as a 1-rank job.
 *   - OpenMPI (Debian libopenmpi-dev; `mpirun -np N linmoe train ...`): built in when
 *     CMake finds MPI at configure time (LM_HAVE_MPI). Ranks are discovered from the
 *     MPI environment. Without MPI in the build, a process launched as one of N > 1
 *     ranks (OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_SIZE above 1 in its environment)
 *     gets LM_ERR_UNSUPPORTED from lm_comm_world_new instead of silently training
 *     alone N times.
 *   - NCCL on device buffers: include/linmoe/dist_nccl.h (CUDA builds with NCCL only).
 *
 * Groups (lm_comm_split_grid): the world of W ranks is a grid of dp x ep ranks with
 * the expert-parallel index innermost: world rank r has ep_rank = r % ep and dp_rank
 * = r / ep. The EP group of r is the ep consecutive ranks {dp_rank*ep .. dp_rank*ep +
 * ep - 1} (the ranks that split one MoE layer's routed experts); the DP group is the
 * dp ranks with the same ep_rank (the replicas of the same expert shard).
 *
 * Collectives are blocking, called by every rank of the communicator in the same
 * order. Sums are element-wise; the order in which ranks' values are added is the
 * backend's (OpenMPI's tuned algorithms), fixed for a given world size and message
 * size, so a run is reproducible but not bitwise equal across world sizes. Counts are
 * elements (not bytes), int64; one call moves at most 2^31 - 1 elements per rank
 * block (MPI's int counts): larger all-reduces and broadcasts are split internally,
 * larger v-collective blocks are LM_ERR_INVALID naming the count.
 *
 * Dtypes: LM_F32, LM_F64, LM_I32, LM_I64, LM_U8 (others: LM_ERR_INVALID). Sums of
 * integer types are exact; LM_DIST_MAX is an element-wise maximum.
 *
 * Errors: every MPI call goes through CHECK_MPI (src/dist/comm.c): a failing call
 * returns LM_ERR_IO with the call's name and MPI's error string (communicators use
 * MPI_ERRORS_RETURN). A rank that dies is handled by the launcher: OpenMPI's mpirun
 * kills the remaining ranks and exits non-zero, naming the rank (see docs/distributed.md).
 *
 * Statistics: every communicator counts, per collective kind, the calls, the bytes
 * this rank sent (its payload into the collective) and the seconds spent inside
 * (lm_comm_get_stats), for the trainer's per-step log and the benchmark.
 *
 * Process-global state: MPI itself is per process; lm_comm_world_new initialises it
 * (MPI_Init_thread, MPI_THREAD_FUNNELED) when nobody has, and the world communicator
 * it returns finalises it at lm_comm_free. The library keeps no globals of its own.
 *
 * What this module does not do: device buffers (dist_nccl.h), non-blocking
 * collectives / overlap with compute, fault tolerance beyond the launcher's.
 */
#ifndef LINMOE_DIST_H
#define LINMOE_DIST_H

#include "linmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lm_comm lm_comm;

typedef enum { LM_DIST_SUM = 0, LM_DIST_MAX = 1 } lm_dist_op;

/* Collective kinds of lm_comm_stats. */
typedef enum {
    LM_COLL_ALLREDUCE = 0,
    LM_COLL_REDUCE_SCATTER,
    LM_COLL_ALLGATHER,
    LM_COLL_GATHER,
    LM_COLL_ALLTOALLV,
    LM_COLL_BROADCAST,
    LM_COLL_BARRIER,
    LM_COLL_N
} lm_coll_kind;

typedef struct {
    int64_t calls[LM_COLL_N];
    int64_t bytes[LM_COLL_N]; /* bytes this rank contributed (its send payload) */
    double seconds[LM_COLL_N];
} lm_comm_stats;

/* 1 when this build has the MPI backend (LM_HAVE_MPI). */
int lm_dist_have_mpi(void);

/* The world communicator of this process: MPI_COMM_WORLD when the build has MPI and
 * a launcher started this process (one of the variables above is set; MPI is
 * initialised unless someone did already), else the self backend (a process started
 * without mpirun is a world of 1 and never starts MPI). Errors: LM_ERR_UNSUPPORTED when the build
 * has no MPI but the environment says this process is one of N > 1 ranks (names the
 * variable and N); LM_ERR_IO when MPI_Init_thread fails. One per process. */
lm_status lm_comm_world_new(lm_comm **out, lm_error *err);

/* A one-rank communicator (self backend) that touches no MPI state. */
lm_status lm_comm_self_new(lm_comm **out, lm_error *err);

/* The data-parallel and expert-parallel groups of `world` for ep ranks per EP group
 * (layout in the top comment). Collective over `world`. Errors: LM_ERR_INVALID for
 * ep < 1 or a world size that ep does not divide (names both). *dp and *ep_out are
 * owned by the caller (lm_comm_free) and must be freed before `world`. */
lm_status lm_comm_split_grid(lm_comm *world, int ep, lm_comm **dp, lm_comm **ep_out, lm_error *err);

/* Frees a communicator (NULL: nothing). The world communicator from
 * lm_comm_world_new finalises MPI when it initialised it. */
void lm_comm_free(lm_comm *c);

int lm_comm_rank(const lm_comm *c);
int lm_comm_size(const lm_comm *c);
/* Ranks of this communicator on this host (MPI_COMM_TYPE_SHARED; 1 for self): the
 * trainer divides the cores among them. */
int lm_comm_local_size(const lm_comm *c);
/* This rank's index among the ranks on its host (0 .. local_size - 1; 0 for self): the
 * GPU trainer's CUDA device. */
int lm_comm_local_rank(const lm_comm *c);
/* "self" or "mpi". */
const char *lm_comm_backend(const lm_comm *c);

/* buf [n] of dtype dt, in place: every rank ends with the element-wise op over all
 * ranks. n >= 0. */
lm_status lm_comm_allreduce(lm_comm *c, void *buf, int64_t n, lm_dtype dt, lm_dist_op op,
                            lm_error *err);

/* send [sum(counts)] holds one block per rank in rank order (block r: counts[r]
 * elements); rank r receives into recv [counts[r]] the sum over ranks of block r.
 * counts [size] are the same on every rank. send and recv must not overlap. */
lm_status lm_comm_reduce_scatter(lm_comm *c, const void *send, void *recv, const int64_t *counts,
                                 lm_dtype dt, lm_error *err);

/* Rank r contributes counts[r] elements from send; every rank receives all blocks
 * in rank order into recv [sum(counts)]. send == recv + (sum of counts[q] for q <
 * rank) (this rank's block of recv) is the in-place form; any other overlap is an
 * error. */
lm_status lm_comm_allgather(lm_comm *c, const void *send, void *recv, const int64_t *counts,
                            lm_dtype dt, lm_error *err);

/* Like lm_comm_allgather, but only `root` receives (recv may be NULL elsewhere). */
lm_status lm_comm_gather(lm_comm *c, const void *send, void *recv, const int64_t *counts,
                         lm_dtype dt, int root, lm_error *err);

/* All-to-all with per-peer counts: send holds send_counts[q] elements for each peer
 * q, in peer order (contiguous); recv receives recv_counts[q] elements from each
 * peer q, in peer order. recv_counts must equal what the peers send (exchange the
 * counts first, e.g. with send_counts as an LM_I64 alltoallv of one element per
 * peer). send / recv may be NULL where their total is 0. */
lm_status lm_comm_alltoallv(lm_comm *c, const void *send, const int64_t *send_counts, void *recv,
                            const int64_t *recv_counts, lm_dtype dt, lm_error *err);

/* buf [n] from `root` to every rank. */
lm_status lm_comm_broadcast(lm_comm *c, void *buf, int64_t n, lm_dtype dt, int root, lm_error *err);

lm_status lm_comm_barrier(lm_comm *c, lm_error *err);

/* Collective timeout: from now on, when one collective of `c` (a communicator from
 * lm_comm_world_new or lm_comm_self_new) or of a group split from it has been in flight
 * for more than `seconds`, a watchdog thread prints "linmoe: rank r of N: a <kind> did
 * not complete within S s (another rank died or stopped responding); exiting" and ends
 * the process with status 124 (mpirun then ends the other ranks). 0 turns it off.
 * The thread is joined at lm_comm_free. Errors: LM_ERR_INVALID (a split group, seconds
 * outside [0, 1e7]), LM_ERR_IO (no thread). */
lm_status lm_comm_set_timeout(lm_comm *c, double seconds, lm_error *err);

/* A rank that cannot go on: MPI_Abort over c (mpirun then ends every rank and exits
 * non-zero) when c is an MPI communicator of more than one rank; returns otherwise
 * (the caller exits). */
void lm_comm_abort(lm_comm *c, int code);

/* The worst status over the ranks (max of the lm_status codes): each rank passes its
 * own; every rank gets the same answer, so ranks leave a phase together when one of
 * them failed (the others would otherwise wait in the next collective). A failure
 * of the collective itself is returned as such. */
lm_status lm_comm_agree(lm_comm *c, lm_status mine, lm_error *err);

void lm_comm_get_stats(const lm_comm *c, lm_comm_stats *out);
void lm_comm_reset_stats(lm_comm *c);
const char *lm_coll_name(lm_coll_kind k);

#ifdef __cplusplus
}
#endif
#endif
