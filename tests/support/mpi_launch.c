/* tests/support/mpi_launch.h */
#include "mpi_launch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "linmoe/dist.h"

const char *lm_test_mpi_unavailable(void) {
    if (!lm_dist_have_mpi())
        return "this build has no MPI (libopenmpi-dev not found at configure time)";
    if (system("command -v mpirun >/dev/null 2>&1") != 0)
        return "mpirun is not on PATH (Debian: openmpi-bin)";
    return NULL;
}

int lm_test_ranks(void) {
    const char *v = getenv("LINMOE_TEST_RANKS");
    return v ? atoi(v) : 0;
}

const char *lm_test_mpirun_prefix(int np) {
    static char buf[128];
    snprintf(buf, sizeof buf, "mpirun --oversubscribe --bind-to none -np %d", np);
    return buf;
}

static int status_of(int rc) {
    if (rc == -1)
        return -1;
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + (WIFSIGNALED(rc) ? WTERMSIG(rc) : 0);
}

int lm_test_mpirun_cmd(int np, const char *cmd) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    /* the ranks share 2 cores in CI: one thread each unless the caller says otherwise */
    char *line = malloc(strlen(cmd) + 256);
    sprintf(line, "%s %s", lm_test_mpirun_prefix(np), cmd);
    fflush(stdout);
    fflush(stderr);
    const int rc = status_of(system(line));
    free(line);
    return rc;
}

int lm_test_mpirun_self(int np, const char *arg) {
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return -1;
    exe[n] = '\0';
    char cmd[4400], env[32];
    snprintf(env, sizeof env, "%d", np);
    setenv("LINMOE_TEST_RANKS", env, 1);
    snprintf(cmd, sizeof cmd, "-x LINMOE_TEST_RANKS -x OMP_NUM_THREADS=1 '%s'%s%s", exe,
             arg ? " " : "", arg ? arg : "");
    const int rc = lm_test_mpirun_cmd(np, cmd);
    unsetenv("LINMOE_TEST_RANKS");
    return rc;
}
