/* Monotonic wall-clock timer. */
#include "linmoe/core.h"

#include <time.h>

double lm_time_sec(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0.0;
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
