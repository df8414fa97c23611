// The CUDA kernel of zeroscan.mark_nonfinite, as its host launcher
// (nonfinite_cuda.cpp) calls it. Free of torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../layout.h"

namespace zeroscan {
namespace cuda {

// ORs into *flag the kinds of non-finite value (kHoldsInf, kHoldsNan:
// nonfinite.h) at the positions of `layout` (from plan_layout, numel > 0)
// over `data`, of storage type S. Queued on `stream`; nothing waits.
template <typename S>
void launch_mark_nonfinite(const S* data, const Layout& layout, uint64_t finite_max, int32_t* flag,
                           int max_blocks, cudaStream_t stream);

}  // namespace cuda
}  // namespace zeroscan
