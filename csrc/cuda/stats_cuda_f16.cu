// The CUDA scan kernels for float16
// (one file per dtype, so a build compiles them in parallel).
#include "stats_cuda.cuh"

ZEROSCAN_INSTANTIATE_CUDA(zeroscan::f16_t);
