/* OpenMP thread-count control for linmoe ops. */
#include "linmoe/core.h"

#include <omp.h>

/* OpenMP's own default (OMP_NUM_THREADS or the core count), captured before the
 * first override so n <= 0 can restore it. */
static int g_default_threads = 0;
static int g_threads = 0; /* 0: default */

void lm_set_num_threads(int n) {
    if (g_default_threads == 0)
        g_default_threads = omp_get_max_threads();
    g_threads = n > 0 ? n : 0;
    omp_set_num_threads(n > 0 ? n : g_default_threads);
}

int lm_get_num_threads(void) { return g_threads > 0 ? g_threads : omp_get_max_threads(); }
