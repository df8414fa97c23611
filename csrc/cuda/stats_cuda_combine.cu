// The CUDA kernel of zeroscan.combine_rows: the cross-rank merge of result
// rows, one thread per tensor, in the same tree as every other backend
// (combine_in_tree, csrc/stats_record.h). It reads and writes a few hundred
// bytes per tensor, so it needs nothing cleverer.
#include "stats_cuda.cuh"

namespace zeroscan {
namespace cuda {
namespace {

// rows: int64 [w, n, kNumFields]
__global__ void combine_rows_kernel(int64_t* rows, int64_t w, int64_t n) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  RowArray column{rows + j * kNumFields, n * kNumFields};
  combine_in_tree(column, w);
  column.set(0, column.get(0));  // a record again: spare columns zero, as with w > 1
}

}  // namespace

void launch_combine_rows(int64_t* rows, int64_t w, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kThreads = 128;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  combine_rows_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(rows, w, n);
}

}  // namespace cuda
}  // namespace zeroscan
