// The CUDA backend of zeroscan.mark_nonfinite: checks the inputs, plans each
// tensor's layout (csrc/layout.h) and queues one launch per floating tensor
// on the current stream of its device. Nothing here waits for the device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../nonfinite_check.h"
#include "nonfinite_cuda.h"

namespace zeroscan {
namespace cuda {
namespace {

constexpr int kBlocksPerSm = 8;  // enough to stream one tensor at full bandwidth

void mark_nonfinite_cuda(at::TensorList xs, const at::Tensor& flags, at::IntArrayRef slots) {
  check_mark_nonfinite(xs, flags, slots);
  if (xs.empty()) return;
  const c10::cuda::CUDAGuard guard(flags.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(flags.device().index()).stream();
  const int max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * kBlocksPerSm;
  int32_t* out = flags.mutable_data_ptr<int32_t>();
  for (size_t t = 0; t < xs.size(); ++t) {
    const at::Tensor& x = xs[t];
    const Layout layout = layout_of(x);
    if (layout.numel == 0 || !x.is_floating_point()) continue;
    const Limits lim = limits_of(x.scalar_type(), c10::nullopt);
    visit_dtype(x.scalar_type(), [&](auto tag) {
      using S = typename decltype(tag)::type;
      if constexpr (Format<S>::kFloating) {
        launch_mark_nonfinite<S>(static_cast<const S*>(x.const_data_ptr()), layout, lim.finite_max,
                                 out + slots[t], max_blocks, stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroscan, CUDA, m) {
  m.impl("mark_nonfinite", &mark_nonfinite_cuda);
}

}  // namespace cuda
}  // namespace zeroscan
