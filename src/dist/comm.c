/* The communicator of include/linmoe/dist.h: the self backend (one rank: copies) and,
 * when the build has MPI (LM_HAVE_MPI), the OpenMPI backend on host buffers. Every MPI
 * call goes through CHECK_MPI, which turns a failure into LM_ERR_IO naming the call. */
#include "linmoe/dist.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef LM_HAVE_MPI
#include <mpi.h>
#endif

/* The collective watchdog (lm_comm_set_timeout): shared by a world communicator and the
 * groups split from it; a thread that ends the process when one collective has been in
 * flight longer than `timeout` seconds. */
typedef struct {
    _Atomic int64_t enter_ns; /* monotonic start of the collective in flight, 0: none */
    _Atomic int kind;
    _Atomic int stop;
    _Atomic int64_t timeout_ns; /* 0: off */
    int rank, size;
    int running;
    pthread_t th;
} lm_watch;

struct lm_comm {
    lm_watch *watch; /* shared with the groups split from this one */
    int owns_watch;
    int rank, size, local_size, local_rank;
    int is_world;     /* from lm_comm_world_new */
    int owns_mpi;     /* it initialised MPI: finalise at free */
    lm_comm_stats st; /* per collective kind */
#ifdef LM_HAVE_MPI
    int mpi; /* 1: the MPI backend (comm is valid) */
    MPI_Comm comm;
    int *ic; /* [4 size] int counts / displacements of the v-collectives (made once:
                no allocation per call) */
#endif
};

static const char *const k_coll_names[LM_COLL_N] = {
    "allreduce", "reduce_scatter", "allgather", "gather", "alltoallv", "broadcast", "barrier"};

const char *lm_coll_name(lm_coll_kind k) {
    return (int)k >= 0 && k < LM_COLL_N ? k_coll_names[k] : "?";
}

int lm_dist_have_mpi(void) {
#ifdef LM_HAVE_MPI
    return 1;
#else
    return 0;
#endif
}

static lm_status check_dtype(lm_dtype dt, const char *what, lm_error *err) {
    switch (dt) {
    case LM_F32:
    case LM_F64:
    case LM_I32:
    case LM_I64:
    case LM_U8:
        return LM_OK;
    default:
        return lm_errorf(err, LM_ERR_INVALID, "dist: %s: dtype %s is not supported", what,
                         lm_dtype_name(dt));
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double coll_enter(lm_comm *c, lm_coll_kind k) {
    if (c->watch) {
        atomic_store(&c->watch->kind, (int)k);
        atomic_store(&c->watch->enter_ns, now_ns());
    }
    return lm_time_sec();
}

static void *watch_main(void *arg) {
    lm_watch *w = arg;
    const struct timespec tick = {0, 100 * 1000 * 1000};
    while (!atomic_load(&w->stop)) {
        nanosleep(&tick, NULL);
        const int64_t e = atomic_load(&w->enter_ns), lim = atomic_load(&w->timeout_ns);
        if (e && lim > 0 && now_ns() - e > lim) {
            /* a peer died or stopped answering: leave with a message instead of waiting
             * forever (mpirun then ends the other ranks) */
            fprintf(stderr,
                    "linmoe: rank %d of %d: a %s did not complete within %.0f s (another rank "
                    "died or stopped responding); exiting\n",
                    w->rank, w->size, lm_coll_name((lm_coll_kind)atomic_load(&w->kind)),
                    (double)lim * 1e-9);
            fflush(stderr);
            _exit(124);
        }
    }
    return NULL;
}

lm_status lm_comm_set_timeout(lm_comm *c, double seconds, lm_error *err) {
    if (!c || !c->watch)
        return lm_errorf(err, LM_ERR_INVALID, "dist: set_timeout: not a world communicator");
    if (!(seconds >= 0) || seconds > 1e7)
        return lm_errorf(err, LM_ERR_INVALID, "dist: collective timeout = %g s (want 0..1e7)",
                         seconds);
    atomic_store(&c->watch->timeout_ns, (int64_t)(seconds * 1e9));
    if (seconds > 0 && !c->watch->running) {
        c->watch->rank = c->rank;
        c->watch->size = c->size;
        if (pthread_create(&c->watch->th, NULL, watch_main, c->watch) != 0)
            return lm_errorf(err, LM_ERR_IO, "dist: cannot start the collective watchdog thread");
        c->watch->running = 1;
    }
    return LM_OK;
}

static void count_stat(lm_comm *c, lm_coll_kind k, int64_t bytes, double t0) {
    if (c->watch)
        atomic_store(&c->watch->enter_ns, 0);
    c->st.calls[k]++;
    c->st.bytes[k] += bytes;
    c->st.seconds[k] += lm_time_sec() - t0;
}

void lm_comm_get_stats(const lm_comm *c, lm_comm_stats *out) {
    if (c)
        *out = c->st;
    else
        memset(out, 0, sizeof *out);
}

void lm_comm_reset_stats(lm_comm *c) {
    if (c)
        memset(&c->st, 0, sizeof c->st);
}

int lm_comm_rank(const lm_comm *c) { return c ? c->rank : 0; }
int lm_comm_size(const lm_comm *c) { return c ? c->size : 1; }
int lm_comm_local_size(const lm_comm *c) { return c ? c->local_size : 1; }
int lm_comm_local_rank(const lm_comm *c) { return c ? c->local_rank : 0; }

const char *lm_comm_backend(const lm_comm *c) {
#ifdef LM_HAVE_MPI
    if (c && c->mpi)
        return "mpi";
#else
    (void)c;
#endif
    return "self";
}

static lm_comm *comm_alloc(void) {
    lm_comm *c = LM_CALLOC(1, sizeof *c);
    c->size = c->local_size = 1;
    return c;
}

/* a root communicator (world or self) owns the watchdog state */
static lm_comm *comm_alloc_root(void) {
    lm_comm *c = comm_alloc();
    c->watch = LM_CALLOC(1, sizeof *c->watch);
    c->owns_watch = 1;
    return c;
}

lm_status lm_comm_self_new(lm_comm **out, lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "dist: output pointer is required");
    *out = comm_alloc_root();
    return LM_OK;
}

/* The rank count a launcher announced in the environment (0: none). */
static int env_world_size(const char **var) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) {
            *var = vars[i];
            return atoi(v);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- MPI backend */

#ifdef LM_HAVE_MPI

#define CHECK_MPI(call)                                                                            \
    do {                                                                                           \
        int mpi_rc_ = (call);                                                                      \
        if (mpi_rc_ != MPI_SUCCESS) {                                                              \
            char mpi_msg_[MPI_MAX_ERROR_STRING];                                                   \
            int mpi_len_ = 0;                                                                      \
            if (MPI_Error_string(mpi_rc_, mpi_msg_, &mpi_len_) != MPI_SUCCESS)                     \
                snprintf(mpi_msg_, sizeof mpi_msg_, "error %d", mpi_rc_);                          \
            return lm_errorf(err, LM_ERR_IO, "dist: %s failed (%s:%d): %s", #call, __FILE__,       \
                             __LINE__, mpi_msg_);                                                  \
        }                                                                                          \
    } while (0)

static MPI_Datatype mpi_type(lm_dtype dt) {
    switch (dt) {
    case LM_F32:
        return MPI_FLOAT;
    case LM_F64:
        return MPI_DOUBLE;
    case LM_I32:
        return MPI_INT32_T;
    case LM_I64:
        return MPI_INT64_T;
    default:
        return MPI_UINT8_T;
    }
}

static lm_status mpi_setup(lm_comm *c, MPI_Comm comm, lm_error *err) {
    c->mpi = 1;
    c->comm = comm;
    CHECK_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    CHECK_MPI(MPI_Comm_rank(comm, &c->rank));
    CHECK_MPI(MPI_Comm_size(comm, &c->size));
    MPI_Comm node;
    CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    CHECK_MPI(MPI_Comm_size(node, &c->local_size));
    CHECK_MPI(MPI_Comm_rank(node, &c->local_rank));
    CHECK_MPI(MPI_Comm_free(&node));
    c->ic = LM_MALLOC(sizeof(int) * 4 * (size_t)c->size);
    return LM_OK;
}

/* int counts and displacements (MPI's) of a v-collective, checked. */
static lm_status int_counts(const lm_comm *c, const int64_t *counts, int *ic, int *id,
                            const char *what, lm_error *err) {
    int64_t off = 0;
    for (int q = 0; q < c->size; q++) {
        if (counts[q] < 0 || counts[q] > INT_MAX || off > INT_MAX)
            return lm_errorf(err, LM_ERR_INVALID,
                             "dist: %s: count %lld for rank %d (offset %lld) is outside [0, "
                             "2^31 - 1]",
                             what, (long long)counts[q], q, (long long)off);
        ic[q] = (int)counts[q];
        id[q] = (int)off;
        off += counts[q];
    }
    return LM_OK;
}
#endif

lm_status lm_comm_world_new(lm_comm **out, lm_error *err) {
    if (!out)
        return lm_errorf(err, LM_ERR_INVALID, "dist: output pointer is required");
    *out = NULL;
    const char *var = NULL;
    const int env_n = env_world_size(&var);
#ifdef LM_HAVE_MPI
    int inited = 0;
    if (MPI_Initialized(&inited) != MPI_SUCCESS)
        return lm_errorf(err, LM_ERR_IO, "dist: MPI_Initialized failed");
    if (env_n == 0 && !inited) {
        /* not started by a launcher: one process, and no MPI singleton start-up */
        lm_comm *c = comm_alloc_root();
        c->is_world = 1;
        *out = c;
        return LM_OK;
    }
    lm_comm *c = comm_alloc_root();
    c->is_world = 1;
    if (!inited) {
        int provided = 0;
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
            free(c);
            return lm_errorf(err, LM_ERR_IO, "dist: MPI_Init_thread failed");
        }
        c->owns_mpi = 1;
    }
    lm_status st = mpi_setup(c, MPI_COMM_WORLD, err);
    if (st != LM_OK) {
        lm_comm_free(c);
        return st;
    }
    *out = c;
    return LM_OK;
#else
    if (env_n > 1)
        return lm_errorf(err, LM_ERR_UNSUPPORTED,
                         "dist: this process is one of %d ranks (%s=%d) but linmoe was built "
                         "without MPI (no MPI found at configure time): install libopenmpi-dev "
                         "(scripts/install-deps.sh) and rebuild, or run a single process",
                         env_n, var, env_n);
    lm_comm *c = comm_alloc_root();
    c->is_world = 1;
    *out = c;
    return LM_OK;
#endif
}

lm_status lm_comm_split_grid(lm_comm *world, int ep, lm_comm **dp_out, lm_comm **ep_out,
                             lm_error *err) {
    if (!world || !dp_out || !ep_out)
        return lm_errorf(err, LM_ERR_INVALID, "dist: split_grid: NULL argument");
    *dp_out = *ep_out = NULL;
    if (ep < 1 || world->size % ep != 0)
        return lm_errorf(err, LM_ERR_INVALID,
                         "dist: expert_parallel = %d does not divide the world size %d", ep,
                         world->size);
    lm_comm *d = comm_alloc(), *e = comm_alloc();
    d->watch = e->watch = world->watch;
#ifdef LM_HAVE_MPI
    if (world->mpi) {
        MPI_Comm dc, ec;
        lm_status st = LM_OK;
        if (MPI_Comm_split(world->comm, world->rank % ep, world->rank, &dc) != MPI_SUCCESS ||
            MPI_Comm_split(world->comm, world->rank / ep, world->rank, &ec) != MPI_SUCCESS)
            st = lm_errorf(err, LM_ERR_IO, "dist: MPI_Comm_split failed (world size %d, ep %d)",
                           world->size, ep);
        if (st == LM_OK)
            st = mpi_setup(d, dc, err);
        if (st == LM_OK)
            st = mpi_setup(e, ec, err);
        if (st != LM_OK) {
            lm_comm_free(d);
            lm_comm_free(e);
            return st;
        }
    }
#endif
    *dp_out = d;
    *ep_out = e;
    return LM_OK;
}

void lm_comm_free(lm_comm *c) {
    if (!c)
        return;
    if (c->owns_watch) {
        if (c->watch->running) {
            atomic_store(&c->watch->stop, 1);
            pthread_join(c->watch->th, NULL);
        }
        free(c->watch);
    }
#ifdef LM_HAVE_MPI
    if (c->mpi && !c->is_world)
        MPI_Comm_free(&c->comm); /* nothing to report at teardown */
    free(c->ic);
    if (c->owns_mpi) {
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin)
            MPI_Finalize();
    }
#endif
    free(c);
}

/* ---------------------------------------------------------------- collectives */

static int64_t sum_counts(const lm_comm *c, const int64_t *counts) {
    int64_t s = 0;
    for (int q = 0; q < c->size; q++)
        s += counts[q];
    return s;
}

lm_status lm_comm_allreduce(lm_comm *c, void *buf, int64_t n, lm_dtype dt, lm_dist_op op,
                            lm_error *err) {
    if (!c || n < 0 || (n > 0 && !buf))
        return lm_errorf(err, LM_ERR_INVALID, "dist: allreduce: bad arguments (n = %lld)",
                         (long long)n);
    LM_TRY(check_dtype(dt, "allreduce", err));
    const double t0 = coll_enter(c, LM_COLL_ALLREDUCE);
#ifdef LM_HAVE_MPI
    if (c->mpi && c->size > 1) {
        const size_t es = lm_dtype_size(dt);
        for (int64_t o = 0; o < n; o += INT_MAX) {
            const int m = n - o < INT_MAX ? (int)(n - o) : INT_MAX;
            CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + (size_t)o * es, m, mpi_type(dt),
                                    op == LM_DIST_MAX ? MPI_MAX : MPI_SUM, c->comm));
        }
    }
#else
    (void)op;
#endif
    count_stat(c, LM_COLL_ALLREDUCE, n * (int64_t)lm_dtype_size(dt), t0);
    return LM_OK;
}

lm_status lm_comm_reduce_scatter(lm_comm *c, const void *send, void *recv, const int64_t *counts,
                                 lm_dtype dt, lm_error *err) {
    if (!c || !counts)
        return lm_errorf(err, LM_ERR_INVALID, "dist: reduce_scatter: NULL argument");
    LM_TRY(check_dtype(dt, "reduce_scatter", err));
    const size_t es = lm_dtype_size(dt);
    const int64_t tot = sum_counts(c, counts);
    const double t0 = coll_enter(c, LM_COLL_REDUCE_SCATTER);
#ifdef LM_HAVE_MPI
    if (c->mpi && c->size > 1) {
        int *ic = c->ic, *id = ic + c->size;
        lm_status st = int_counts(c, counts, ic, id, "reduce_scatter", err);
        if (st == LM_OK &&
            MPI_Reduce_scatter(send, recv, ic, mpi_type(dt), MPI_SUM, c->comm) != MPI_SUCCESS)
            st = lm_errorf(err, LM_ERR_IO, "dist: MPI_Reduce_scatter failed (%lld elements)",
                           (long long)tot);
        LM_TRY(st);
        count_stat(c, LM_COLL_REDUCE_SCATTER, tot * (int64_t)es, t0);
        return LM_OK;
    }
#endif
    if (counts[0] > 0)
        memmove(recv, send, (size_t)counts[0] * es);
    count_stat(c, LM_COLL_REDUCE_SCATTER, tot * (int64_t)es, t0);
    return LM_OK;
}

lm_status lm_comm_allgather(lm_comm *c, const void *send, void *recv, const int64_t *counts,
                            lm_dtype dt, lm_error *err) {
    if (!c || !counts)
        return lm_errorf(err, LM_ERR_INVALID, "dist: allgather: NULL argument");
    LM_TRY(check_dtype(dt, "allgather", err));
    const size_t es = lm_dtype_size(dt);
    int64_t off = 0;
    for (int q = 0; q < c->rank; q++)
        off += counts[q];
    const int64_t mine = counts[c->rank];
    const int in_place = send == (const void *)((const char *)recv + (size_t)off * es);
    const double t0 = coll_enter(c, LM_COLL_ALLGATHER);
#ifdef LM_HAVE_MPI
    if (c->mpi && c->size > 1) {
        int *ic = c->ic, *id = ic + c->size;
        lm_status st = int_counts(c, counts, ic, id, "allgather", err);
        if (st == LM_OK && MPI_Allgatherv(in_place ? MPI_IN_PLACE : send, (int)mine, mpi_type(dt),
                                          recv, ic, id, mpi_type(dt), c->comm) != MPI_SUCCESS)
            st = lm_errorf(err, LM_ERR_IO, "dist: MPI_Allgatherv failed (%lld elements)",
                           (long long)mine);
        LM_TRY(st);
        count_stat(c, LM_COLL_ALLGATHER, mine * (int64_t)es, t0);
        return LM_OK;
    }
#endif
    if (!in_place && mine > 0)
        memmove(recv, send, (size_t)mine * es);
    count_stat(c, LM_COLL_ALLGATHER, mine * (int64_t)es, t0);
    return LM_OK;
}

lm_status lm_comm_gather(lm_comm *c, const void *send, void *recv, const int64_t *counts,
                         lm_dtype dt, int root, lm_error *err) {
    if (!c || !counts || root < 0 || root >= c->size)
        return lm_errorf(err, LM_ERR_INVALID, "dist: gather: bad arguments (root %d)", root);
    LM_TRY(check_dtype(dt, "gather", err));
    const size_t es = lm_dtype_size(dt);
    const int64_t mine = counts[c->rank];
    const double t0 = coll_enter(c, LM_COLL_GATHER);
#ifdef LM_HAVE_MPI
    if (c->mpi && c->size > 1) {
        int *ic = c->ic, *id = ic + c->size;
        lm_status st = int_counts(c, counts, ic, id, "gather", err);
        if (st == LM_OK && MPI_Gatherv(send, (int)mine, mpi_type(dt), recv, ic, id, mpi_type(dt),
                                       root, c->comm) != MPI_SUCCESS)
            st = lm_errorf(err, LM_ERR_IO, "dist: MPI_Gatherv failed (%lld elements)",
                           (long long)mine);
        LM_TRY(st);
        count_stat(c, LM_COLL_GATHER, mine * (int64_t)es, t0);
        return LM_OK;
    }
#endif
    if (mine > 0 && recv != send)
        memmove(recv, send, (size_t)mine * es);
    count_stat(c, LM_COLL_GATHER, mine * (int64_t)es, t0);
    return LM_OK;
}

lm_status lm_comm_alltoallv(lm_comm *c, const void *send, const int64_t *send_counts, void *recv,
                            const int64_t *recv_counts, lm_dtype dt, lm_error *err) {
    if (!c || !send_counts || !recv_counts)
        return lm_errorf(err, LM_ERR_INVALID, "dist: alltoallv: NULL argument");
    LM_TRY(check_dtype(dt, "alltoallv", err));
    const size_t es = lm_dtype_size(dt);
    const int64_t ns = sum_counts(c, send_counts);
    const double t0 = coll_enter(c, LM_COLL_ALLTOALLV);
#ifdef LM_HAVE_MPI
    if (c->mpi && c->size > 1) {
        int *ic = c->ic, *id = ic + c->size, *rc = id + c->size, *rd = rc + c->size;
        lm_status st = int_counts(c, send_counts, ic, id, "alltoallv (send)", err);
        if (st == LM_OK)
            st = int_counts(c, recv_counts, rc, rd, "alltoallv (recv)", err);
        if (st == LM_OK && MPI_Alltoallv(send, ic, id, mpi_type(dt), recv, rc, rd, mpi_type(dt),
                                         c->comm) != MPI_SUCCESS)
            st = lm_errorf(err, LM_ERR_IO, "dist: MPI_Alltoallv failed (%lld elements sent)",
                           (long long)ns);
        LM_TRY(st);
        count_stat(c, LM_COLL_ALLTOALLV, ns * (int64_t)es, t0);
        return LM_OK;
    }
#endif
    if (send_counts[0] != recv_counts[0])
        return lm_errorf(err, LM_ERR_INVALID,
                         "dist: alltoallv: one rank sends %lld elements to itself but expects %lld",
                         (long long)send_counts[0], (long long)recv_counts[0]);
    if (ns > 0 && recv != send)
        memmove(recv, send, (size_t)ns * es);
    count_stat(c, LM_COLL_ALLTOALLV, ns * (int64_t)es, t0);
    return LM_OK;
}

lm_status lm_comm_broadcast(lm_comm *c, void *buf, int64_t n, lm_dtype dt, int root,
                            lm_error *err) {
    if (!c || n < 0 || (n > 0 && !buf) || root < 0 || root >= c->size)
        return lm_errorf(err, LM_ERR_INVALID, "dist: broadcast: bad arguments (n %lld, root %d)",
                         (long long)n, root);
    LM_TRY(check_dtype(dt, "broadcast", err));
    const double t0 = coll_enter(c, LM_COLL_BROADCAST);
#ifdef LM_HAVE_MPI
    if (c->mpi && c->size > 1) {
        const size_t es = lm_dtype_size(dt);
        for (int64_t o = 0; o < n; o += INT_MAX) {
            const int m = n - o < INT_MAX ? (int)(n - o) : INT_MAX;
            CHECK_MPI(MPI_Bcast((char *)buf + (size_t)o * es, m, mpi_type(dt), root, c->comm));
        }
    }
#endif
    count_stat(c, LM_COLL_BROADCAST, c->rank == root ? n * (int64_t)lm_dtype_size(dt) : 0, t0);
    return LM_OK;
}

void lm_comm_abort(lm_comm *c, int code) {
#ifdef LM_HAVE_MPI
    if (c && c->mpi && c->size > 1) {
        fflush(stdout);
        fflush(stderr);
        MPI_Abort(c->comm, code);
    }
#else
    (void)c;
    (void)code;
#endif
}

lm_status lm_comm_barrier(lm_comm *c, lm_error *err) {
    if (!c)
        return lm_errorf(err, LM_ERR_INVALID, "dist: barrier: NULL communicator");
    const double t0 = coll_enter(c, LM_COLL_BARRIER);
#ifdef LM_HAVE_MPI
    if (c->mpi && c->size > 1)
        CHECK_MPI(MPI_Barrier(c->comm));
#endif
    count_stat(c, LM_COLL_BARRIER, 0, t0);
    return LM_OK;
}

lm_status lm_comm_agree(lm_comm *c, lm_status mine, lm_error *err) {
    int32_t s = (int32_t)mine;
    lm_error e2;
    const lm_status r = lm_comm_allreduce(c, &s, 1, LM_I32, LM_DIST_MAX, &e2);
    if (r != LM_OK) {
        if (err)
            *err = e2;
        return r;
    }
    if (s != LM_OK && mine == LM_OK)
        return lm_errorf(err, (lm_status)s, "dist: another rank failed (%s); see its message",
                         lm_status_str((lm_status)s));
    return (lm_status)s;
}
