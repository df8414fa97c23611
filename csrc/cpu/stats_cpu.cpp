// The fused single-pass scan on the CPU, and its registration for CPU tensors.
//
// Work is split into fixed chunks of the tensor (the split depends on the
// tensor alone, never on the thread count), each chunk is reduced to a
// Partial, and the partials are combined in a fixed tree order, so results
// are bitwise identical whatever torch.set_num_threads says.
//
// Inside a chunk the hot loop keeps L independent lanes per statistic so the
// compiler turns it into SIMD code. It assumes the common case -- no zeros,
// no subnormals, no NaN/Inf -- and checks that assumption once per block of
// L * kIters elements. A block that breaks it is rescanned (it is still in
// L1) by the exact scalar classifier, so rare values cost little and the
// answer never depends on the assumption.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "../op_common.h"

#define ZS_INLINE __attribute__((always_inline)) inline
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZS_SIMD_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZS_SIMD_CLONES
#endif

namespace zeroscan {
namespace {

constexpr int kIters = 16;                // SIMD iterations per checked block
constexpr int64_t kMinChunk = 1 << 16;    // elements; small tensors: 1 chunk
constexpr int64_t kMaxChunks = 1024;      // bounds the partials' memory
constexpr int64_t kGather = 2048;         // elements gathered per strided step
constexpr int64_t kShiftSample = 256;     // elements that pick a chunk's shift

ZS_INLINE float widen(float x) { return x; }
ZS_INLINE double widen(double x) { return x; }
ZS_INLINE float widen(c10::BFloat16 x) {
  // bfloat16 is the top half of a float32: widening is a shift.
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Exact widening of any supported dtype, for the gathered path.
template <typename acc_t, typename scalar_t>
ZS_INLINE acc_t widen_to(scalar_t x) {
  return static_cast<acc_t>(x);
}
template <>
ZS_INLINE float widen_to<float, c10::BFloat16>(c10::BFloat16 x) {
  return widen(x);
}

// Chunk-level SIMD lanes of the fast path. Folded into a ScalarAccumulator
// (which shares the same shift) when the chunk is done.
template <typename acc_t>
struct Lanes {
  using B = FloatBits<acc_t>;
  using bits_t = typename B::bits_t;
  static constexpr int L = 64 / sizeof(acc_t);  // one 512-bit vector

  bits_t min_a[L], max_a[L], near_zero[L], negative[L];
  double s1[L], s2[L];
  int64_t numel = 0;

  Lanes() {
    for (int j = 0; j < L; ++j) {
      min_a[j] = B::kAbsMask;
      max_a[j] = 0;
      near_zero[j] = negative[j] = 0;
      s1[j] = s2[j] = 0.0;
    }
  }

  // The fast blocks hold no zero, subnormal or non-finite value, so their
  // near-zero count is the `<= tol` count and min |x| is also min nonzero.
  void fold_into(ScalarAccumulator<acc_t>& acc) const {
    acc.numel += numel;
    for (int j = 0; j < L; ++j) {
      acc.near_zero += near_zero[j];
      acc.negative += negative[j];
      acc.min_a = min_a[j] < acc.min_a ? min_a[j] : acc.min_a;
      acc.min_nonzero = min_a[j] < acc.min_nonzero ? min_a[j] : acc.min_nonzero;
      acc.max_a = max_a[j] > acc.max_a ? max_a[j] : acc.max_a;
      acc.s1 += s1[j];
      acc.s2 += s2[j];
    }
  }
};

// p: [n] contiguous.
template <typename Src, typename acc_t>
ZS_INLINE void scan_span_impl(const Src* p, int64_t n,
                              const Thresholds<acc_t>& th, Lanes<acc_t>& lanes,
                              ScalarAccumulator<acc_t>& acc) {
  using B = FloatBits<acc_t>;
  using bits_t = typename B::bits_t;
  constexpr int L = Lanes<acc_t>::L;
  constexpr int64_t kBlock = int64_t(L) * kIters;
  // A block whose smallest |x| is below this holds a zero or a subnormal.
  const bits_t floor = th.tiny > 1 ? th.tiny : bits_t(1);
  const acc_t shift = acc.shift;

  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const Src* q = p + i;
    bits_t mn[L], mx[L], nz[L], ng[L];
    // Short float sums (kIters terms per lane) keep the loop in SIMD width;
    // they are widened to double every block, so rounding stays at the level
    // of a 16-term float sum of values near the shift.
    acc_t f1[L], f2[L];
    for (int j = 0; j < L; ++j) {
      mn[j] = B::kAbsMask;
      mx[j] = 0;
      nz[j] = ng[j] = 0;
      f1[j] = f2[j] = acc_t(0);
    }
    for (int it = 0; it < kIters; ++it) {
      for (int j = 0; j < L; ++j) {
        const acc_t x = widen(q[it * L + j]);
        const bits_t a = to_bits(x) & B::kAbsMask;
        mn[j] = a < mn[j] ? a : mn[j];
        mx[j] = a > mx[j] ? a : mx[j];
        nz[j] += a <= th.tol;
        ng[j] += x < acc_t(0);
        const acc_t d = x - shift;
        f1[j] += d;
        f2[j] += d * d;
      }
    }
    bool special = false;
    for (int j = 0; j < L; ++j) special |= (mn[j] < floor) | (mx[j] >= B::kInf);
    if (special) {
      for (int64_t k = 0; k < kBlock; ++k) acc.push(widen(q[k]), th);
      continue;
    }
    for (int j = 0; j < L; ++j) {
      lanes.min_a[j] = mn[j] < lanes.min_a[j] ? mn[j] : lanes.min_a[j];
      lanes.max_a[j] = mx[j] > lanes.max_a[j] ? mx[j] : lanes.max_a[j];
      lanes.near_zero[j] += nz[j];
      lanes.negative[j] += ng[j];
      lanes.s1[j] += static_cast<double>(f1[j]);
      lanes.s2[j] += static_cast<double>(f2[j]);
    }
    lanes.numel += kBlock;
  }
  for (; i < n; ++i) acc.push(widen(p[i]), th);
}

// The instruction-set clones live on these non-template entry points; the
// template above is inlined into each clone and compiled for its ISA.
ZS_SIMD_CLONES void scan_span(const float* p, int64_t n,
                              const Thresholds<float>& th, Lanes<float>& lanes,
                              ScalarAccumulator<float>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}
ZS_SIMD_CLONES void scan_span(const c10::BFloat16* p, int64_t n,
                              const Thresholds<float>& th, Lanes<float>& lanes,
                              ScalarAccumulator<float>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}
ZS_SIMD_CLONES void scan_span(const double* p, int64_t n,
                              const Thresholds<double>& th,
                              Lanes<double>& lanes,
                              ScalarAccumulator<double>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}

// Types whose contiguous memory the SIMD loop reads directly; every other
// dtype is widened into a small buffer first.
template <typename scalar_t>
constexpr bool kReadsDirectly = std::is_same<scalar_t, float>::value ||
                                std::is_same<scalar_t, double>::value ||
                                std::is_same<scalar_t, c10::BFloat16>::value;

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
    if constexpr (kReadsDirectly<scalar_t>) {
      if (stride == 1 && len >= kGather) {
        scan_span(data + off, len, th, lanes, acc);
        return;
      }
    }
    // Short or strided runs, and dtypes the SIMD loop cannot read: widen
    // into a bounded buffer, never a copy of the tensor.
    for (int64_t k = 0; k < len;) {
      const int64_t take = std::min(len - k, kGather - filled);
      const scalar_t* src = data + off + k * stride;
      if (stride == 1) {
        for (int64_t t = 0; t < take; ++t)
          buffer[filled + t] = widen_to<acc_t>(src[t]);
      } else {
        for (int64_t t = 0; t < take; ++t)
          buffer[filled + t] = widen_to<acc_t>(src[t * stride]);
      }
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

// xs: N tensors on the CPU -> int64 [N, kNumFields]
at::Tensor scan_all(const char* op, at::TensorList xs,
                    c10::optional<double> tol) {
  check_tol(op, tol);
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<Layout> layouts(n);
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(n + 1);
  for (int64_t t = 0; t < n; ++t) {
    check_input(op, n == 1 ? "x" : "xs[" + std::to_string(t) + "]", xs[t]);
    layouts[t] = layout_of(xs[t]);
    first_task[t] = static_cast<int64_t>(tasks.size());
    const int64_t numel = layouts[t].numel;
    const int64_t step = chunk_size(numel);
    for (int64_t b = 0; b < numel; b += step) {
      tasks.push_back({t, b, std::min(numel, b + step)});
    }
  }
  first_task[n] = static_cast<int64_t>(tasks.size());

  std::vector<Partial> partials(tasks.size());
  auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Task& task = tasks[k];
      partials[k] = scan_task(xs[task.tensor], layouts[task.tensor], tol, task);
    }
  };
  if (tasks.size() <= 1) {
    run(0, static_cast<int64_t>(tasks.size()));  // no thread hand-off
  } else {
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, run);
  }

  at::Tensor out = new_result(n, c10::Device(c10::kCPU));
  int64_t* rows = out.mutable_data_ptr<int64_t>();
  std::vector<Partial> own;
  for (int64_t t = 0; t < n; ++t) {
    own.assign(partials.begin() + first_task[t],
               partials.begin() + first_task[t + 1]);
    Partial p = combine_tree(own);
    repeat(p, layouts[t].repeat);
    store(p, rows + t * kNumFields);
  }
  return out;
}

// x: any shape -> int64 [kNumFields]
at::Tensor stats_cpu(const at::Tensor& x, c10::optional<double> tol) {
  return scan_all("zeroscan.stats", {x}, tol).squeeze(0);
}

// xs: N tensors, all on the CPU -> int64 [N, kNumFields]
at::Tensor stats_many_cpu(at::TensorList xs, c10::optional<double> tol) {
  for (size_t t = 0; t < xs.size(); ++t) {
    TORCH_CHECK(!xs[t].defined() || xs[t].device().is_cpu(),
                "zeroscan.stats_many: all tensors of one call must be on the "
                "same device; xs[0] is on cpu but xs[", t, "] is on ",
                xs[t].device());
  }
  return scan_all("zeroscan.stats_many", xs, tol);
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroscan, CPU, m) {
  m.impl("stats", &stats_cpu);
  m.impl("stats_many", &stats_many_cpu);
}

}  // namespace zeroscan
