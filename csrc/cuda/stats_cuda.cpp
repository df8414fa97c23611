// The CUDA backend of zeroscan.stats, zeroscan.stats_many and
// zeroscan.stats_many_hist.
//
// Checks the inputs, plans each tensor's layout (csrc/layout.h), groups the
// tensors by dtype and launches the kernels of stats_cuda.cuh on the current
// stream of their device. Nothing here waits for the device: the result is an
// int64 [N, 16] buffer (csrc/stats_record.h) that the Python side reads when
// asked (with stats_many_hist also an int64 [N, B] histogram, zeroed on the
// same stream before the launches), the workspace comes from the caching
// allocator, and a whole call can be captured in a CUDA graph (tensor
// pointers travel as kernel arguments; nothing sized by values is allocated).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "../op_common.h"
#include "stats_cuda.cuh"

namespace zeroscan {
namespace cuda {
namespace {

// The grid is sized for this many 256-thread blocks per SM (a few waves);
// the kernels' grid-stride loop over tiles covers any remainder, and the
// results do not depend on the grid.
constexpr int kGridBlocksPerSm = 32;

// What the launches of one call share.
struct Call {
  LaunchHeader common;  // out, partials, counters, hist
  int64_t slot_cursor = 0;
  int max_grid = 1;
  cudaStream_t stream = nullptr;
};

// Launches the scan of `inputs`, all of storage type T, with the key limits
// of their dtype.
template <typename T>
void launch_as(const std::vector<ScanInput>& inputs, const Limits& limits,
               Call& call) {
  LaunchHeader h = call.common;
  h.limits = limits;
  h.fast = fast_limits_for<T>(limits);
  auto grid = [&](int tiles) { return std::min(tiles, call.max_grid); };
  plan_launches(
      inputs.data(), static_cast<int64_t>(inputs.size()), sizeof(T), h,
      call.slot_cursor,
      [&](const ContigBatch& b) {
        launch_contig<T>(b, grid(b.h.num_tiles), call.stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      },
      [&](const StridedBatch& b) {
        launch_strided<T>(b, grid(b.h.num_tiles), call.stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

void launch_dtype(const std::vector<ScanInput>& inputs, at::ScalarType dtype,
                  c10::optional<double> tol, Call& call) {
  const Limits limits = limits_of(dtype, tol);
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_as<T>(inputs, limits, call);
  });
}

// xs: N tensors on one CUDA device -> int64 [N, kNumFields] on that device.
// `as_list`: name inputs "xs[i]" in errors rather than "x".
// `hist`: null, or set to int64 [N, B] on that device, each tensor's
// histogram fields (csrc/histogram.h), B the most fields of xs's dtypes;
// the rows are the same either way.
at::Tensor scan_all(const char* op, at::TensorList xs,
                    c10::optional<double> tol, bool as_list,
                    at::Tensor* hist = nullptr) {
  check_tol(op, tol);
  const int64_t n = static_cast<int64_t>(xs.size());
  TORCH_CHECK(n > 0, op, ": got no tensors");
  TORCH_CHECK(n <= INT32_MAX, op, ": at most ", INT32_MAX,
              " tensors per call, got ", n);
  auto name = [&](int64_t t) {
    return as_list ? ArgName{"xs", t} : ArgName{"x", -1};
  };
  for (int64_t t = 0; t < n; ++t) check_input(op, name(t), xs[t]);
  const c10::Device device = xs[0].device();
  for (int64_t t = 1; t < n; ++t) {
    TORCH_CHECK(xs[t].device() == device, op,
                ": all tensors of one call must be on the same device; xs[0] "
                "is on ", device, " but xs[", t, "] is on ", xs[t].device());
  }

  const c10::cuda::CUDAGuard guard(device);
  Call call;
  call.stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  call.max_grid =
      at::cuda::getCurrentDeviceProperties()->multiProcessorCount *
      kGridBlocksPerSm;

  // Layouts the kernels cannot walk in place (more than kMaxStridedDims
  // dimensions that do not merge) are scanned from a contiguous copy.
  std::vector<at::Tensor> copies;
  std::vector<Layout> layouts(n);
  std::vector<const void*> data(n);
  int64_t total_tiles = 0;
  for (int64_t t = 0; t < n; ++t) {
    at::Tensor x = xs[t];
    layouts[t] = layout_of(x);
    if (!walkable(layouts[t])) {
      x = x.contiguous();
      copies.push_back(x);
      layouts[t] = layout_of(x);
    }
    data[t] = x.const_data_ptr();
    TORCH_CHECK(reinterpret_cast<uintptr_t>(data[t]) % x.element_size() == 0,
                op, ": ", name(t), "'s data pointer is not aligned to its ",
                x.element_size(), "-byte elements");
    TORCH_CHECK(hist == nullptr || hist_countable(layouts[t], x.element_size()),
                op, ": ", name(t), " has ", layouts[t].numel,
                " distinct positions, too many for the histogram's per-tile "
                "uint32 counts");
    total_tiles += tiles_of(layouts[t], x.element_size());
  }

  at::Tensor out = new_result(n, device);
  call.common.out = out.mutable_data_ptr<int64_t>();
  if (hist != nullptr) {
    // Zeroed on the current stream (the CUDAGuard above makes it the
    // device's), before the launches that add to it.
    *hist = new_histogram(op, xs, device);
    call.common.hist = hist->mutable_data_ptr<int64_t>();
    call.common.hist_width = hist->size(1);
  }
  at::Tensor workspace;
  if (total_tiles > n) {  // some tensor has several tiles
    const int64_t partial_bytes =
        total_tiles * static_cast<int64_t>(sizeof(Partial));
    workspace = at::empty(
        {partial_bytes + n * static_cast<int64_t>(sizeof(int32_t))},
        at::TensorOptions().dtype(at::kByte).device(device));
    uint8_t* base = workspace.mutable_data_ptr<uint8_t>();
    call.common.partials = reinterpret_cast<Partial*>(base);
    call.common.counters = reinterpret_cast<int32_t*>(base + partial_bytes);
    C10_CUDA_CHECK(cudaMemsetAsync(call.common.counters, 0,
                                   n * sizeof(int32_t), call.stream));
  }

  // One group per dtype, in order of first appearance.
  std::vector<bool> grouped(n, false);
  std::vector<ScanInput> inputs;
  for (int64_t i = 0; i < n; ++i) {
    if (grouped[i]) continue;
    const at::ScalarType dtype = xs[i].scalar_type();
    inputs.clear();
    for (int64_t j = i; j < n; ++j) {
      if (grouped[j] || xs[j].scalar_type() != dtype) continue;
      grouped[j] = true;
      inputs.push_back({data[j], &layouts[j], static_cast<int32_t>(j)});
    }
    launch_dtype(inputs, dtype, tol, call);
  }
  TORCH_INTERNAL_ASSERT(call.slot_cursor == total_tiles,
                        "zeroscan: launch plan covered ", call.slot_cursor,
                        " tiles of ", total_tiles);
  // `workspace` and `copies` are freed here; the caching allocator does not
  // hand their memory to other streams before the launches above finish.
  return out;
}

// x: any shape -> int64 [kNumFields]
at::Tensor stats_cuda(const at::Tensor& x, c10::optional<double> tol) {
  return scan_all("zeroscan.stats", {x}, tol, false).squeeze(0);
}

// xs: N tensors, all on one CUDA device -> int64 [N, kNumFields]
at::Tensor stats_many_cuda(at::TensorList xs, c10::optional<double> tol) {
  return scan_all("zeroscan.stats_many", xs, tol, true);
}

// xs: N tensors, all on one CUDA device -> (int64 [N, kNumFields],
// int64 [N, B]): the rows of stats_many and each tensor's histogram fields,
// B the most fields of any of xs's dtypes.
std::tuple<at::Tensor, at::Tensor> stats_many_hist_cuda(at::TensorList xs,
                                                        c10::optional<double> tol) {
  at::Tensor hist;
  at::Tensor rows = scan_all("zeroscan.stats_many_hist", xs, tol, true, &hist);
  return {rows, hist};
}

// rows: int64 [W, N, kNumFields] on one CUDA device -> int64 [N, kNumFields]
at::Tensor combine_rows_cuda(const at::Tensor& rows) {
  check_rows("zeroscan.combine_rows", rows);
  const c10::cuda::CUDAGuard guard(rows.device());
  // Combined in place in a copy: zeroscan never writes into its inputs.
  at::Tensor work = rows.clone(at::MemoryFormat::Contiguous);
  launch_combine_rows(work.mutable_data_ptr<int64_t>(), rows.size(0), rows.size(1),
                      at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return work[0].clone();
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroscan, CUDA, m) {
  m.impl("stats", &stats_cuda);
  m.impl("stats_many", &stats_many_cuda);
  m.impl("stats_many_hist", &stats_many_hist_cuda);
  m.impl("combine_rows", &combine_rows_cuda);
}

}  // namespace cuda
}  // namespace zeroscan
