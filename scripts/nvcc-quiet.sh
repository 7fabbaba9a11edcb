#!/usr/bin/env bash
# CMake's CUDA compiler launcher (CMakeLists.txt, LINMOE_CUDA_VERBOSE=OFF): runs the
# nvcc command line "$@" and drops ptxas's informational lines ("ptxas info    : ...",
# e.g. C7519 "warpgroup.arrive is injected ..."), which ptxas prints even without
# -Xptxas -v and which said nothing to a user building on a machine without a GPU.
# Warnings and errors pass through unchanged; the exit status is nvcc's.
# Configure with -DLINMOE_CUDA_VERBOSE=ON to see them (and the -v resource usage).
{ "$@" 2>&1 1>&3 3>&- | grep -v '^ptxas info' >&2; } 3>&1
exit "${PIPESTATUS[0]}"
