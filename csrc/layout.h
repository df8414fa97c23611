// How a strided tensor is walked without copying it.
//
// The statistics do not depend on element order, so a tensor's dimensions can
// be reordered freely: sorting them by stride turns transposed, permuted and
// channels_last tensors back into one contiguous run, and merging adjacent
// dimensions leaves the fewest loops to walk. Stride-0 (expanded) dimensions
// are dropped and remembered as a repeat count, so an expanded view is read
// once, not once per repeat. Free of torch headers; the CUDA launcher uses
// the same plan.
#pragma once

#include <algorithm>
#include <cstdint>

namespace zeroscan {

constexpr int kMaxDims = 64;

struct Layout {
  int64_t numel = 0;   // distinct positions read: the product of sizes
  int64_t repeat = 1;  // how many times each position occurs in the tensor
  int ndim = 0;        // dims[0] outermost ... dims[ndim - 1] innermost
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];  // in elements

  bool contiguous() const { return ndim <= 1 && (ndim == 0 || strides[0] == 1); }
};

// sizes, strides: [ndim], strides in elements.
inline Layout plan_layout(const int64_t* sizes, const int64_t* strides,
                          int ndim) {
  Layout out;
  int64_t numel = 1;
  for (int d = 0; d < ndim; ++d) numel *= sizes[d];
  if (numel == 0) {
    out.numel = 0;
    return out;
  }

  int order[kMaxDims];
  int kept = 0;
  for (int d = 0; d < ndim; ++d) {
    if (sizes[d] == 1) continue;
    if (strides[d] == 0) {
      out.repeat *= sizes[d];
      continue;
    }
    order[kept++] = d;
  }
  // Outermost (largest stride) first, ties in their order: an insertion
  // sort, since std::stable_sort allocates a buffer, which for the few dims
  // of a tensor cost more than the sort (stats_many of small tensors).
  for (int i = 1; i < kept; ++i) {
    const int d = order[i];
    int j = i;
    for (; j > 0 && strides[order[j - 1]] < strides[d]; --j) order[j] = order[j - 1];
    order[j] = d;
  }

  out.numel = 1;
  for (int i = 0; i < kept; ++i) {
    const int d = order[i];
    out.numel *= sizes[d];
    // Merge into the previous (outer) dim when the outer one steps exactly
    // over the inner one: the two then walk one contiguous-stride range.
    if (out.ndim > 0 &&
        out.strides[out.ndim - 1] == strides[d] * sizes[d]) {
      out.sizes[out.ndim - 1] *= sizes[d];
      out.strides[out.ndim - 1] = strides[d];
      continue;
    }
    out.sizes[out.ndim] = sizes[d];
    out.strides[out.ndim] = strides[d];
    ++out.ndim;
  }
  if (out.ndim == 0) {  // a single element
    out.ndim = 1;
    out.sizes[0] = 1;
    out.strides[0] = 1;
  }
  return out;
}

// Walks positions [begin, end) of a layout in order, handing out runs of
// equal stride: `visit(offset, length, stride)` with offset in elements.
template <typename Visit>
inline void for_each_run(const Layout& l, int64_t begin, int64_t end,
                         Visit&& visit) {
  if (begin >= end) return;
  if (l.ndim == 1) {  // contiguous, or one stride: one run, and no division to find where it starts
    visit(begin * l.strides[0], end - begin, l.strides[0]);
    return;
  }
  const int inner = l.ndim - 1;
  int64_t index[kMaxDims];
  int64_t rest = begin;
  int64_t offset = 0;
  for (int d = inner; d >= 0; --d) {
    index[d] = rest % l.sizes[d];
    rest /= l.sizes[d];
    offset += index[d] * l.strides[d];
  }
  int64_t pos = begin;
  while (pos < end) {
    const int64_t run = std::min(l.sizes[inner] - index[inner], end - pos);
    visit(offset, run, l.strides[inner]);
    pos += run;
    offset += run * l.strides[inner];
    index[inner] += run;
    // Carry into the outer dims.
    for (int d = inner; d > 0 && index[d] == l.sizes[d]; --d) {
      offset -= index[d] * l.strides[d];
      index[d] = 0;
      index[d - 1] += 1;
      offset += l.strides[d - 1];
    }
  }
}

}  // namespace zeroscan
