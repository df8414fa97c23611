// The CUDA scan kernels for the one-byte integer types and bool
// (one file per dtype, so a build compiles them in parallel).
#include "stats_cuda.cuh"

ZEROSCAN_INSTANTIATE_CUDA(zeroscan::bool_t);
ZEROSCAN_INSTANTIATE_CUDA(uint8_t);
ZEROSCAN_INSTANTIATE_CUDA(int8_t);
