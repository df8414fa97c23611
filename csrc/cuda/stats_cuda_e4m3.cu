// The CUDA scan kernels for float8_e4m3fn
// (one file per dtype, so a build compiles them in parallel).
#include "stats_cuda.cuh"

ZEROSCAN_INSTANTIATE_CUDA(zeroscan::e4m3_t);
