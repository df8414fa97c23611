// The CUDA kernel of zeroscan.mark_nonfinite: a grid-stride walk of one
// tensor's layout in place, each thread folding the kinds of non-finite value
// (nonfinite.h) over its positions. A warp votes on each kind (__ballot_sync,
// every architecture) and one lane ORs the warp's kinds into the flag;
// nothing is read back.
#include "../dtypes.h"
#include "../nonfinite.h"
#include "nonfinite_cuda.h"

namespace zeroscan {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename S>
__global__ void __launch_bounds__(kThreads)
    mark_nonfinite_kernel(const S* data, Layout l, uint64_t finite_max, int32_t* flag) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int32_t kinds = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < l.numel; i += step) {
    int64_t offset = l.ndim == 1 ? i * l.strides[0] : 0;
    for (int64_t d = l.ndim - 1, rest = i; l.ndim > 1 && d >= 0; --d) {
      offset += (rest % l.sizes[d]) * l.strides[d];
      rest /= l.sizes[d];
    }
    kinds |= nonfinite_kinds(data + offset, 1, 1, finite_max);
  }
  const bool any_inf = __ballot_sync(0xffffffffu, (kinds & kHoldsInf) != 0) != 0;
  const bool any_nan = __ballot_sync(0xffffffffu, (kinds & kHoldsNan) != 0) != 0;
  const int32_t warp_kinds = (any_inf ? kHoldsInf : 0) | (any_nan ? kHoldsNan : 0);
  if (warp_kinds != 0 && (threadIdx.x % 32) == 0) atomicOr(flag, warp_kinds);
}

}  // namespace

template <typename S>
void launch_mark_nonfinite(const S* data, const Layout& layout, uint64_t finite_max, int32_t* flag,
                           int max_blocks, cudaStream_t stream) {
  const int64_t wanted = (layout.numel + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < max_blocks ? wanted : max_blocks);
  mark_nonfinite_kernel<S><<<blocks, kThreads, 0, stream>>>(data, layout, finite_max, flag);
}

// The floating storage types of the dtype table; integer tensors never hold
// a non-finite value, so the launcher does not launch for them.
#define ZEROSCAN_MARK_NONFINITE(S)                                                                         \
  template void launch_mark_nonfinite<S>(const S*, const Layout&, uint64_t, int32_t*, int, cudaStream_t);
ZEROSCAN_MARK_NONFINITE(float)
ZEROSCAN_MARK_NONFINITE(double)
ZEROSCAN_MARK_NONFINITE(f16_t)
ZEROSCAN_MARK_NONFINITE(bf16_t)
ZEROSCAN_MARK_NONFINITE(e4m3_t)
ZEROSCAN_MARK_NONFINITE(e5m2_t)
#undef ZEROSCAN_MARK_NONFINITE

}  // namespace cuda
}  // namespace zeroscan
