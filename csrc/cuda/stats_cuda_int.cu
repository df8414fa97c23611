// The CUDA scan kernels for int16, int32 and int64
// (one file per dtype, so a build compiles them in parallel).
#include "stats_cuda.cuh"

ZEROSCAN_INSTANTIATE_CUDA(int16_t);
ZEROSCAN_INSTANTIATE_CUDA(int32_t);
ZEROSCAN_INSTANTIATE_CUDA(int64_t);
