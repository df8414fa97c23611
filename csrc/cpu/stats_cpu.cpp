// The fused single-pass scan on the CPU, and its registration for CPU tensors.
//
// Work is split into fixed chunks of the tensor (the split depends on the
// tensor alone, never on the thread count), each chunk is reduced to a
// Partial, and the partials are combined in a fixed tree order, so results
// are bitwise identical whatever torch.set_num_threads says. The SIMD loop
// over one contiguous span is in scan_span.h.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>

#include "../op_common.h"
#include "scan_span.h"

namespace zeroscan {
namespace cpu {
namespace {

constexpr int64_t kMinChunk = 1 << 16;    // elements; small tensors: 1 chunk
constexpr int64_t kMaxChunks = 1024;      // bounds the partials' memory
constexpr int64_t kGather = 2048;         // elements widened per strided step
constexpr int64_t kShiftSample = 64;      // elements that pick a chunk's shift
constexpr int64_t kParallelMin = 1 << 19; // elements; less runs on one thread

// The type the SIMD loop reads for a storage dtype: bfloat16 and float16 as
// raw bits (scan_span.h widens them), float and double as they are.
template <typename scalar_t>
struct Direct {
  using type = void;  // not read directly: widened into a buffer first
};
template <>
struct Direct<float> {
  using type = float;
};
template <>
struct Direct<double> {
  using type = double;
};
template <>
struct Direct<c10::BFloat16> {
  using type = Bf16Bits;
};

// Every float8 value widened to float, indexed by its bit pattern.
template <typename fp8_t>
const float* fp8_table() {
  static const auto table = [] {
    std::array<float, 256> t;
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(fp8_t(static_cast<uint8_t>(b), fp8_t::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// Exact widening of any supported dtype, one element at a time.
template <typename acc_t, typename scalar_t>
ZS_INLINE acc_t widen_to(scalar_t x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return widen(Bf16Bits{x.x});
  } else if constexpr (std::is_same_v<scalar_t, c10::Float8_e4m3fn> ||
                       std::is_same_v<scalar_t, c10::Float8_e5m2>) {
    return fp8_table<scalar_t>()[x.x];
  } else {
    return static_cast<acc_t>(x);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) void half_to_float_f16c(
    const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

// src, dst: [n] contiguous. Exact; the hardware converter where there is one.
void half_to_float(const c10::Half* src, float* dst, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has_f16c = __builtin_cpu_supports("f16c");
  if (has_f16c) {
    half_to_float_f16c(src, dst, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// src: [n] with `stride` -> dst: [n] contiguous.
template <typename acc_t, typename scalar_t>
void widen_run(const scalar_t* src, int64_t stride, acc_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    if (stride == 1) return half_to_float(src, dst, n);
  }
  if (stride == 1) {
    for (int64_t t = 0; t < n; ++t) dst[t] = widen_to<acc_t>(src[t]);
  } else {
    for (int64_t t = 0; t < n; ++t) dst[t] = widen_to<acc_t>(src[t * stride]);
  }
}

// The shift is the mean of the first finite values of the chunk: close to the
// chunk's mean, so the shifted second moment barely cancels.
template <typename acc_t, typename scalar_t>
acc_t pick_shift(const Layout& l, const scalar_t* data, int64_t begin,
                 int64_t end) {
  double sum = 0.0;
  int64_t count = 0;
  const int64_t stop = std::min(end, begin + kShiftSample);
  for_each_run(l, begin, stop, [&](int64_t off, int64_t len, int64_t stride) {
    for (int64_t k = 0; k < len; ++k) {
      const acc_t x = widen_to<acc_t>(data[off + k * stride]);
      const auto a = to_bits(x) & FloatBits<acc_t>::kAbsMask;
      if (a < FloatBits<acc_t>::kInf) {
        sum += static_cast<double>(x);
        ++count;
      }
    }
  });
  return count == 0 ? acc_t(0) : static_cast<acc_t>(sum / count);
}

// Positions [begin, end) of one tensor, reduced to a Partial.
template <typename scalar_t, typename acc_t>
Partial scan_chunk(const Layout& l, const scalar_t* data, int64_t begin,
                   int64_t end, const Thresholds<acc_t>& th) {
  ScalarAccumulator<acc_t> acc;
  acc.shift = pick_shift<acc_t>(l, data, begin, end);
  Lanes<acc_t> lanes;
  acc_t buffer[kGather];
  int64_t filled = 0;
  auto flush = [&]() {
    scan_span(buffer, filled, th, lanes, acc);
    filled = 0;
  };
  for_each_run(l, begin, end, [&](int64_t off, int64_t len, int64_t stride) {
    using direct_t = typename Direct<scalar_t>::type;
    if constexpr (!std::is_void_v<direct_t>) {
      if (stride == 1 && len >= kGather) {
        scan_span(reinterpret_cast<const direct_t*>(data + off), len, th,
                  lanes, acc);
        return;
      }
    }
    // Short or strided runs, and dtypes the SIMD loop cannot read: widen
    // into a bounded buffer, never a copy of the tensor.
    for (int64_t k = 0; k < len;) {
      const int64_t take = std::min(len - k, kGather - filled);
      const scalar_t* src = data + off + k * stride;
      widen_run<acc_t>(src, stride, buffer + filled, take);
      filled += take;
      k += take;
      if (filled == kGather) flush();
    }
  });
  if (filled > 0) flush();
  lanes.fold_into(acc);
  return acc.finish();
}

// Combines partials[0..n) in a fixed pairwise order.
Partial combine_tree(std::vector<Partial>& parts) {
  if (parts.empty()) return empty_partial();
  for (size_t width = 1; width < parts.size(); width *= 2) {
    for (size_t i = 0; i + width < parts.size(); i += 2 * width) {
      combine(parts[i], parts[i + width]);
    }
  }
  return parts[0];
}

int64_t chunk_size(int64_t numel) {
  const int64_t by_count = (numel + kMaxChunks - 1) / kMaxChunks;
  return std::max(kMinChunk, by_count);
}

// One unit of parallel work: a chunk of one tensor.
struct Task {
  int64_t tensor;
  int64_t begin, end;
};

template <typename scalar_t, typename acc_t>
Partial scan_task_typed(const at::Tensor& x, const Layout& l,
                        c10::optional<double> tol, const Task& task) {
  const auto th = thresholds_for<acc_t>(x.scalar_type(), tol);
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  return scan_chunk<scalar_t, acc_t>(l, data, task.begin, task.end, th);
}

Partial scan_task(const at::Tensor& x, const Layout& l,
                  c10::optional<double> tol, const Task& task) {
  switch (x.scalar_type()) {
    case at::kFloat: return scan_task_typed<float, float>(x, l, tol, task);
    case at::kDouble: return scan_task_typed<double, double>(x, l, tol, task);
    case at::kBFloat16:
      return scan_task_typed<c10::BFloat16, float>(x, l, tol, task);
    case at::kHalf: return scan_task_typed<c10::Half, float>(x, l, tol, task);
    case at::kFloat8_e4m3fn:
      return scan_task_typed<c10::Float8_e4m3fn, float>(x, l, tol, task);
    case at::kFloat8_e5m2:
      return scan_task_typed<c10::Float8_e5m2, float>(x, l, tol, task);
    case at::kBool: return scan_task_typed<bool, double>(x, l, tol, task);
    case at::kByte: return scan_task_typed<uint8_t, double>(x, l, tol, task);
    case at::kChar: return scan_task_typed<int8_t, double>(x, l, tol, task);
    case at::kShort: return scan_task_typed<int16_t, double>(x, l, tol, task);
    case at::kInt: return scan_task_typed<int32_t, double>(x, l, tol, task);
    case at::kLong: return scan_task_typed<int64_t, double>(x, l, tol, task);
    default:
      TORCH_CHECK(false, "zeroscan: unsupported dtype ", x.scalar_type());
  }
}

// Scans xs (all on the CPU) into rows: int64 [N, kNumFields].
// `as_list`: name inputs "xs[i]" in errors rather than "x".
void scan_all(const char* op, at::TensorList xs, c10::optional<double> tol,
              bool as_list, int64_t* rows) {
  check_tol(op, tol);
  const int64_t n = static_cast<int64_t>(xs.size());
  // Layouts are ~1 KB each, so they are planned again where used rather than
  // kept for every tensor of a long list (planning costs nanoseconds).
  std::vector<int64_t> repeats(n);
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(n + 1);
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) {
    check_input(op, as_list ? ArgName{"xs", t} : ArgName{"x", -1}, xs[t]);
    const Layout layout = layout_of(xs[t]);
    repeats[t] = layout.repeat;
    first_task[t] = static_cast<int64_t>(tasks.size());
    const int64_t numel = layout.numel;
    const int64_t step = chunk_size(numel);
    for (int64_t b = 0; b < numel; b += step) {
      tasks.push_back({t, b, std::min(numel, b + step)});
    }
    total += numel;
  }
  first_task[n] = static_cast<int64_t>(tasks.size());

  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  std::vector<Partial> partials(n_tasks);
  auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Task& task = tasks[k];
      const Layout layout = layout_of(xs[task.tensor]);
      partials[k] = scan_task(xs[task.tensor], layout, tol, task);
    }
  };
  // Waking other threads costs more than scanning a few small tensors, so
  // little work stays on the calling thread, and each thread is handed at
  // least ~kMinChunk elements.
  if (n_tasks <= 1 || total < kParallelMin) {
    run(0, n_tasks);
  } else {
    const int64_t grain = std::max<int64_t>(1, kMinChunk * n_tasks / total);
    at::parallel_for(0, n_tasks, grain, run);
  }

  std::vector<Partial> own;
  for (int64_t t = 0; t < n; ++t) {
    own.assign(partials.begin() + first_task[t],
               partials.begin() + first_task[t + 1]);
    Partial p = combine_tree(own);
    repeat(p, repeats[t]);
    store(p, rows + t * kNumFields);
  }
}

// x: any shape -> int64 [kNumFields]
at::Tensor stats_cpu(const at::Tensor& x, c10::optional<double> tol) {
  at::Tensor out = at::empty({kNumFields}, at::TensorOptions().dtype(at::kLong));
  scan_all("zeroscan.stats", {x}, tol, false, out.mutable_data_ptr<int64_t>());
  return out;
}

// xs: N tensors, all on the CPU -> int64 [N, kNumFields]
at::Tensor stats_many_cpu(at::TensorList xs, c10::optional<double> tol) {
  for (size_t t = 0; t < xs.size(); ++t) {
    TORCH_CHECK(!xs[t].defined() || xs[t].device().is_cpu(),
                "zeroscan.stats_many: all tensors of one call must be on the "
                "same device; xs[0] is on cpu but xs[", t, "] is on ",
                xs[t].device());
  }
  at::Tensor out = new_result(static_cast<int64_t>(xs.size()), c10::kCPU);
  scan_all("zeroscan.stats_many", xs, tol, true, out.mutable_data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroscan, CPU, m) {
  m.impl("stats", &stats_cpu);
  m.impl("stats_many", &stats_many_cpu);
}

}  // namespace cpu
}  // namespace zeroscan
