// The CUDA scan kernels for float8_e5m2
// (one file per dtype, so a build compiles them in parallel).
#include "stats_cuda.cuh"

ZEROSCAN_INSTANTIATE_CUDA(zeroscan::e5m2_t);
