// The CUDA kernel of zeroscan.mark_nonfinite: a grid-stride walk of one
// tensor's layout in place, each thread folding the kinds of non-finite value
// (nonfinite.h) over its positions. A warp ORs its threads' kinds together
// and one lane ORs them into the flag; nothing is read back.
#include "../dtypes.h"
#include "../nonfinite.h"
#include "nonfinite_cuda.h"

namespace zeroscan {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename S>
__global__ void __launch_bounds__(kThreads)
    mark_nonfinite_kernel(const S* data, Layout l, uint64_t finite_max, uint64_t nonnan_max, int32_t* flag) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int32_t kinds = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < l.numel; i += step) {
    int64_t offset = l.ndim == 1 ? i * l.strides[0] : 0;
    for (int64_t d = l.ndim - 1, rest = i; l.ndim > 1 && d >= 0; --d) {
      offset += (rest % l.sizes[d]) * l.strides[d];
      rest /= l.sizes[d];
    }
    kinds |= nonfinite_kinds(data + offset, 1, 1, finite_max, nonnan_max);
  }
  kinds = __reduce_or_sync(0xffffffffu, static_cast<unsigned>(kinds));
  if (kinds != 0 && (threadIdx.x % 32) == 0) atomicOr(flag, kinds);
}

}  // namespace

template <typename S>
void launch_mark_nonfinite(const S* data, const Layout& layout, uint64_t finite_max, uint64_t nonnan_max,
                           int32_t* flag, int max_blocks, cudaStream_t stream) {
  const int64_t wanted = (layout.numel + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < max_blocks ? wanted : max_blocks);
  mark_nonfinite_kernel<S><<<blocks, kThreads, 0, stream>>>(data, layout, finite_max, nonnan_max, flag);
}

// The floating storage types of the dtype table; integer tensors never hold
// a non-finite value, so the launcher does not launch for them.
#define ZEROSCAN_MARK_NONFINITE(S)                                                                         \
  template void launch_mark_nonfinite<S>(const S*, const Layout&, uint64_t, uint64_t, int32_t*, int, \
                                         cudaStream_t);
ZEROSCAN_MARK_NONFINITE(float)
ZEROSCAN_MARK_NONFINITE(double)
ZEROSCAN_MARK_NONFINITE(f16_t)
ZEROSCAN_MARK_NONFINITE(bf16_t)
ZEROSCAN_MARK_NONFINITE(e4m3_t)
ZEROSCAN_MARK_NONFINITE(e5m2_t)
#undef ZEROSCAN_MARK_NONFINITE

}  // namespace cuda
}  // namespace zeroscan
