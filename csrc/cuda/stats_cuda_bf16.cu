// The CUDA scan kernels for bfloat16
// (one file per dtype, so a build compiles them in parallel).
#include "stats_cuda.cuh"

ZEROSCAN_INSTANTIATE_CUDA(zeroscan::bf16_t);
