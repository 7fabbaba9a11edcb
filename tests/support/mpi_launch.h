/* Multi-rank tests (issue 24): a test program re-runs itself under `mpirun
 * --oversubscribe -np N` with LINMOE_TEST_RANKS=N in the environment, and the ranks
 * run the multi-rank cases. Skips (exit 77, CTest's SKIP_RETURN_CODE) are reported
 * by the caller when lm_test_mpi_available() says why not. Running as root (CI
 * containers) sets OMPI_ALLOW_RUN_AS_ROOT{,_CONFIRM}=1 for the child. */
#ifndef LINMOE_TEST_MPI_LAUNCH_H
#define LINMOE_TEST_MPI_LAUNCH_H

/* NULL when this build has MPI and mpirun is on PATH; else the reason (static). */
const char *lm_test_mpi_unavailable(void);
/* Under mpirun: the rank count this program was launched with (LINMOE_TEST_RANKS);
 * 0 in the parent process. */
int lm_test_ranks(void);
/* Run this program (/proc/self/exe) with argument `arg` (may be NULL) under mpirun
 * with np ranks and LINMOE_TEST_RANKS=np; returns mpirun's exit status (-1 when it
 * could not be started). The children's output goes to this process's stdout. */
int lm_test_mpirun_self(int np, const char *arg);
/* Run an arbitrary command line (sh -c) under `mpirun --oversubscribe -np np`;
 * returns the exit status. */
int lm_test_mpirun_cmd(int np, const char *cmd);
/* The mpirun command prefix (static buffer): "mpirun --oversubscribe -np N". */
const char *lm_test_mpirun_prefix(int np);

#endif
