// The input checks of zeroscan.mark_nonfinite, shared by its backends.
#pragma once

#include <ATen/ATen.h>

#include "op_common.h"

namespace zeroscan {

// xs: N tensors; flags: int32 [F], contiguous, on xs's device; slots: N
// indices into flags.
inline void check_mark_nonfinite(at::TensorList xs, const at::Tensor& flags, at::IntArrayRef slots) {
  const char* op = "zeroscan.mark_nonfinite";
  TORCH_CHECK(flags.scalar_type() == at::kInt && flags.dim() == 1 && flags.is_contiguous(), op,
              ": flags must be a contiguous int32 [F] tensor, got ", flags.scalar_type(), " of shape ",
              flags.sizes());
  TORCH_CHECK(slots.size() == xs.size(), op, ": slots must give one flag per tensor; got ", xs.size(),
              " tensors and ", slots.size(), " slots");
  for (size_t t = 0; t < xs.size(); ++t) {
    const ArgName name{"xs", static_cast<int64_t>(t)};
    check_input(op, name, xs[t]);
    TORCH_CHECK(xs[t].device() == flags.device(), op, ": ", name, " is on ", xs[t].device(),
                " but flags is on ", flags.device());
    TORCH_CHECK(slots[t] >= 0 && slots[t] < flags.numel(), op, ": slots[", t, "] is ", slots[t],
                ", outside flags of ", flags.numel(), " entries");
  }
}

}  // namespace zeroscan
