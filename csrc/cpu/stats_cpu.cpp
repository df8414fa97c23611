// The fused single-pass scan on the CPU, and its registration for CPU tensors.
//
// Work is split into fixed chunks of the tensor (the split depends on the
// tensor alone, never on the thread count), each chunk is reduced to a
// Partial, and the partials are combined in a fixed tree order, so results
// are bitwise identical whatever torch.set_num_threads says. The vector loop
// over one contiguous span is in scan_span.h and vec_scan.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "../op_common.h"
#include "count_fields.h"
#include "fault_guard.h"
#include "scan_span.h"

namespace zeroscan {
namespace cpu {
namespace {

constexpr int64_t kMinChunk = 1 << 16;    // elements; small tensors: 1 chunk
constexpr int64_t kMaxChunks = 1024;      // bounds the partials' memory
constexpr int64_t kGather = 2048;         // elements gathered per strided step
constexpr int64_t kShiftSample = 64;      // elements that pick a chunk's shift
constexpr int kShiftChains = 8;           // independent sums over that sample
static_assert(kShiftSample % kShiftChains == 0, "the sample is whole groups of chains");
// Bytes below which a call runs on the calling thread: ~1-3 ms of work on
// one core. A parallel region waits for its slowest thread, and a thread
// whose core another process holds (a training run's data loaders) may wait
// a scheduler tick to start, far longer than such work takes: stats_many of
// 200 x 4K float32 tensors took 4-5x the time of 200 stats() calls that way.
constexpr int64_t kParallelBytes = int64_t(16) << 20;

// `mean` as a shift for dtype S: integer moments are then sums of whole
// numbers, exact, as are float8_e4m3fn's in units of 2^-9, and the float32
// runs of floats of up to 32 bits subtract a float32 shift exactly
// (cpu/vec_scan.h).
template <typename S>
double as_shift(double mean) {
  if (!std::isfinite(mean)) return 0.0;  // a float64 sum can overflow
  if (!Format<S>::kFloating) return std::nearbyint(mean);
  if (std::is_same_v<S, e4m3_t>) return std::ldexp(std::nearbyint(std::ldexp(mean, 9)), -9);
  return sizeof(S) <= 4 ? static_cast<double>(static_cast<float>(mean)) : mean;
}

// The total of kShiftChains partial sums, in a fixed order.
inline double chain_total(const double (&chains)[kShiftChains]) {
  double total = 0.0;
  for (double c : chains) total += c;
  return total;
}

// The shift is the mean of the finite values among the chunk's first
// kShiftSample, close to the chunk's mean, so the shifted second moment
// barely cancels; or 0 when that mean lies within one standard deviation of
// 0: such values need no shift to keep the second moment from cancelling,
// and with none every exact zero adds exactly nothing to the sums
// (mostly-zero data would otherwise add -shift once per zero and round at
// every add). With the sample's mean m and mean square q that test, m^2 >
// q - m^2, is 2 m^2 > q: one pass over the sample, nothing subtracted.
// float64 samples whose squares overflow take the mean whatever their
// spread (where it is wide, the chunk's sums overflow too, and
// downscaled_moments sums it again about its own mean).
template <typename S>
double pick_shift(const Layout& l, const S* data, int64_t begin, int64_t end) {
  // The sample's finite values and 1, or 0 and 0 (non-finite values and
  // the padding to whole groups of kShiftChains). The weights are summed in
  // chains with the values: an integer count of the finite values in this
  // loop took ~30 ns a sample longer.
  double value[kShiftSample], weight[kShiftSample];  // only as far as filled: zeroing all cost more than the sums
  int64_t n = 0;
  const int64_t stop = std::min(end, begin + kShiftSample);
  for_each_run(l, begin, stop, [&](int64_t off, int64_t len, int64_t stride) {
    for (int64_t k = 0; k < len; ++k, ++n) {
      const double x = static_cast<double>(Format<S>::value(data[off + k * stride]));
      const bool finite = std::fabs(x) <= std::numeric_limits<double>::max();
      value[n] = finite ? x : 0.0;
      weight[n] = finite ? 1.0 : 0.0;
    }
  });
  // Summed in kShiftChains independent chains: in one, each add waits on
  // the one before, and the sample of a small tensor took ~150 ns, a tenth
  // of its whole scan (stats_many of 4K-element tensors).
  const int64_t groups = (n + kShiftChains - 1) / kShiftChains;
  for (int64_t k = n; k < groups * kShiftChains; ++k) value[k] = weight[k] = 0.0;
  double sum[kShiftChains] = {}, squares[kShiftChains] = {}, count[kShiftChains] = {};
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 8
    for (int j = 0; j < kShiftChains; ++j) {
      const double v = value[g * kShiftChains + j];
      sum[j] += v;
      squares[j] += v * v;
      count[j] += weight[g * kShiftChains + j];
    }
  }
  const double finite_count = chain_total(count);
  if (finite_count == 0.0) return 0.0;
  const double mean = chain_total(sum) / finite_count;
  const double mean_square = chain_total(squares) / finite_count;
  const bool offset = !std::isfinite(mean_square) || 2.0 * mean * mean > mean_square;
  return offset ? as_shift<S>(mean) : 0.0;
}

// Positions [begin, end) of one tensor, summed with `shift`, and counted
// into `fields` (csrc/histogram.h) unless it is null.
template <typename S>
Tally<S, int64_t> tally_chunk(const Layout& l, const S* data, int64_t begin, int64_t end,
                              const Limits& lim, double shift, FieldCounter<S>* fields) {
  Tally<S, int64_t> tally;
  // Scans one span, counting its fields where the chunk has a counter.
  auto scan = [&](const S* p, int64_t n) {
    if (fields == nullptr) {
      scan_span(p, n, lim, shift, tally);
    } else {
      fields->scan(p, n, lim, shift, tally);
    }
  };
  S buffer[kGather];
  int64_t filled = 0;
  for_each_run(l, begin, end, [&](int64_t off, int64_t len, int64_t stride) {
    if (stride == 1 && len >= kGather) {
      scan(data + off, len);
      return;
    }
    // Short or strided runs are gathered into a bounded buffer of raw
    // elements, never a copy of the tensor.
    for (int64_t k = 0; k < len;) {
      const int64_t take = std::min(len - k, kGather - filled);
      const S* src = data + off + k * stride;
      for (int64_t t = 0; t < take; ++t) buffer[filled + t] = src[t * stride];
      filled += take;
      k += take;
      if (filled == kGather) {
        scan(buffer, filled);
        filled = 0;
      }
    }
  });
  if (filled > 0) scan(buffer, filled);
  return tally;
}

// Whether the shifted sums cancel: the shift lies more than sqrt(3) standard
// deviations from the chunk's mean (its first values were no sample of the
// rest: a zero or NaN row before an offset), so the sum of squares is
// mostly that offset and the variance its small difference. The float32
// squares of cpu/vec_scan.h hold ~1e-7 of the sum, which such a
// difference would magnify.
template <typename S>
bool cancels(const Tally<S, int64_t>& t) {
  return t.finite > 1 && t.s1 * t.s1 > 0.75 * t.s2 * static_cast<double>(t.finite);
}

// The moments of float64 positions [begin, end) whose sums overflowed, into
// `p`: their values times kDownscale summed again, one at a time, in two
// passes, the second about the mean the first gives. Only data far beyond
// 1e150 comes here, so the passes cost little.
void downscaled_moments(const Layout& l, const double* data, int64_t begin, int64_t end,
                        const Limits& lim, Partial& p) {
  auto tally_about = [&](double shift) {
    Tally<double, int64_t> tally;
    for_each_run(l, begin, end, [&](int64_t off, int64_t len, int64_t stride) {
      for (int64_t k = 0; k < len; ++k) tally.add(data[off + k * stride], lim, shift, kDownscale);
    });
    return tally;
  };
  const double mean = tally_about(0.0).s1 / static_cast<double>(p.finite());
  const Tally<double, int64_t> about_mean = tally_about(mean);
  set_moments(p, p.finite(), mean, about_mean.s1, about_mean.s2);
  upscale_moments(p);
}

// Positions [begin, end) of one tensor, reduced to a Partial, and added to
// `fields` (int64 [Binning<S>::kFields]) unless it is null. A chunk whose
// sums cancel is scanned once more, shifted by its mean, unless they were
// exact; one whose sums overflowed, downscaled. The histogram is counted in
// the first scan only, so the rows are those of a scan without it.
template <typename S>
Partial scan_chunk(const Layout& l, const S* data, int64_t begin, int64_t end,
                   const Limits& lim, int64_t* fields) {
  double shift = pick_shift(l, data, begin, end);
  Tally<S, int64_t> tally;
  if (fields != nullptr) {
    FieldCounter<S> counter;
    tally = tally_chunk(l, data, begin, end, lim, shift, &counter);
    counter.write(fields);
  } else {
    tally = tally_chunk<S>(l, data, begin, end, lim, shift, nullptr);
  }
  if (Format<S>::kFloating && cancels(tally)) {
    shift = as_shift<S>(shift + tally.s1 / static_cast<double>(tally.finite));
    tally = tally_chunk<S>(l, data, begin, end, lim, shift, nullptr);
  }
  Partial p = tally.finish(shift);
  if constexpr (std::is_same_v<S, double>) {
    // Only float64 values reach far enough to overflow the sums.
    if (!(finite_double(tally.s1) && finite_double(tally.s2))) {
      downscaled_moments(l, data, begin, end, lim, p);
    }
  }
  return p;
}

// Combines partials[0..n) in a fixed pairwise order.
Partial combine_tree(std::vector<Partial>& parts) {
  if (parts.empty()) return empty_partial();
  PartialArray array{parts.data()};
  combine_in_tree(array, static_cast<int64_t>(parts.size()));
  return parts[0];
}

int64_t chunk_size(int64_t numel) {
  const int64_t by_count = (numel + kMaxChunks - 1) / kMaxChunks;
  return std::max(kMinChunk, by_count);
}

// Subnormal values must keep their value while a thread scans: with
// torch.set_flush_denormal(True) the SSE unit reads subnormal inputs as zero
// (DAZ) and flushes subnormal results (FTZ), which would zero min |x| and
// the moments of underflowed data -- the very data zeroscan looks for. The
// guard clears both for its scope on the thread that runs it and restores
// the caller's mode after. (Elsewhere than x86-64 it does nothing.)
class ExactSubnormals {
 public:
#if defined(__x86_64__)
  ExactSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(kDaz | kFtz)); }
  ~ExactSubnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kDaz = 0x0040, kFtz = 0x8000;
  unsigned saved_;
#endif
};

// One unit of parallel work: a chunk of one tensor.
struct Task {
  int64_t tensor;
  int64_t begin, end;
};

// Everything from here to the reads is trivially destructible and allocates
// nothing, so that a guarded scan may jump out of it (fault_guard.h); the
// static initialisers it may run first (scan_span.h's CPU feature tests)
// read no mapped memory, so no fault interrupts one.
// `fields`: null, or the task's own int64 [Binning<S>::kFields], zeroed.
Partial scan_task(const at::Tensor& x, const Layout& l, const Limits& lim,
                  const Task& task, int64_t* fields) {
  return visit_dtype(x.scalar_type(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    // The storage types mirror torch's element types bit for bit.
    TORCH_INTERNAL_ASSERT(x.element_size() == static_cast<int64_t>(sizeof(S)));
    const S* data = reinterpret_cast<const S*>(x.const_data_ptr());
    return scan_chunk<S>(l, data, task.begin, task.end, lim, fields);
  });
}

// The bytes that x's elements span (x has at least one element).
std::pair<const char*, const char*> bytes_of(const at::Tensor& x) {
  int64_t first = 0, last = 0;  // element offsets from x's data pointer
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t reach = (x.size(d) - 1) * x.stride(d);
    (reach < 0 ? first : last) += reach;
  }
  const char* base = static_cast<const char*>(x.const_data_ptr());
  return {base + first * x.element_size(), base + (last + 1) * x.element_size()};
}

// Scans xs (all on the CPU) into rows: int64 [N, kNumFields].
// `as_list`: name inputs "xs[i]" in errors rather than "x".
// `faulted`: null, or [N]: each task then runs under a SIGBUS guard
// (fault_guard.h), and a tensor a fault hit gets true there and a row of
// zeros; the other rows are those of an unguarded scan.
// `hist`: null, or int64 [N, hist_width], zeroed: each tensor's histogram
// fields (csrc/histogram.h); a faulted tensor's stay zero.
void scan_all(const char* op, at::TensorList xs, c10::optional<double> tol,
              bool as_list, int64_t* rows, bool* faulted = nullptr,
              int64_t* hist = nullptr, int64_t hist_width = 0) {
  const ExactSubnormals exact;  // the combining below too; `run` on every thread
  check_tol(op, tol);
  TORCH_CHECK(capability_cap() != Capability::kInvalid, op,
              ": ZEROSCAN_CPU_CAPABILITY must be scalar, avx2, avx512 or native; got '",
              std::getenv("ZEROSCAN_CPU_CAPABILITY"), "'");
  const int64_t n = static_cast<int64_t>(xs.size());
  if (n == 1 && faulted == nullptr && hist == nullptr) {
    // One tensor of at most one chunk (a hot loop's small stats() call):
    // scanned here, without the bookkeeping of many tasks.
    check_input(op, as_list ? ArgName{"xs", 0} : ArgName{"x", -1}, xs[0]);
    const Layout layout = layout_of(xs[0]);
    if (layout.numel <= kMinChunk) {
      const Task task{0, 0, layout.numel};
      Partial p = layout.numel > 0 ? scan_task(xs[0], layout, limits_of(xs[0].scalar_type(), tol), task, nullptr)
                                   : empty_partial();
      repeat(p, layout.repeat);
      store(p, rows);
      return;
    }
  }
  // Layouts are ~1 KB each, so they are planned again where used rather than
  // kept for every tensor of a long list (planning costs nanoseconds).
  std::vector<int64_t> repeats(n);
  std::vector<Limits> limits(n);
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(n + 1);
  int64_t total = 0, total_bytes = 0;
  for (int64_t t = 0; t < n; ++t) {
    check_input(op, as_list ? ArgName{"xs", t} : ArgName{"x", -1}, xs[t]);
    const Layout layout = layout_of(xs[t]);
    repeats[t] = layout.repeat;
    limits[t] = limits_of(xs[t].scalar_type(), tol);
    first_task[t] = static_cast<int64_t>(tasks.size());
    const int64_t numel = layout.numel;
    const int64_t step = chunk_size(numel);
    for (int64_t b = 0; b < numel; b += step) {
      tasks.push_back({t, b, std::min(numel, b + step)});
    }
    total += numel;
    total_bytes += numel * xs[t].element_size();
  }
  first_task[n] = static_cast<int64_t>(tasks.size());

  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  std::vector<Partial> partials(n_tasks);
  // Each task counts into fields of its own, so that no two threads add to
  // one counter; they are summed per tensor below.
  std::vector<int64_t> field_start(hist != nullptr ? n_tasks + 1 : 0);
  for (int64_t k = 0; hist != nullptr && k < n_tasks; ++k) {
    field_start[k + 1] = field_start[k] + fields_of(xs[tasks[k].tensor].scalar_type());
  }
  std::vector<int64_t> task_fields(hist != nullptr ? field_start[n_tasks] : 0);
  // Per task, so that each is written by the one thread that runs the task.
  std::vector<uint8_t> task_faulted(faulted != nullptr ? n_tasks : 0);
  auto run = [&](int64_t lo, int64_t hi) {
    const ExactSubnormals exact;
    for (int64_t k = lo; k < hi; ++k) {
      const Task& task = tasks[k];
      const at::Tensor& x = xs[task.tensor];
      const Layout layout = layout_of(x);
      const Limits& lim = limits[task.tensor];
      int64_t* fields = hist != nullptr ? task_fields.data() + field_start[k] : nullptr;
      if (faulted == nullptr) {
        partials[k] = scan_task(x, layout, lim, task, fields);
        continue;
      }
      // Each task, not each thread's share, is guarded: a fault then costs
      // only the tensor it hit, and the tasks after it still run.
      const auto [first, last] = bytes_of(x);
      const bool done = run_guarded(first, last, [&] {
        partials[k] = scan_task(x, layout, lim, task, fields);
      });
      task_faulted[k] = !done;
    }
  };
  // Little work stays on the calling thread (kParallelBytes), and each
  // thread is handed at least ~kMinChunk elements.
  if (n_tasks <= 1 || total_bytes < kParallelBytes) {
    run(0, n_tasks);
  } else {
    const int64_t grain = std::max<int64_t>(1, kMinChunk * n_tasks / total);
    at::parallel_for(0, n_tasks, grain, run);
  }

  std::vector<Partial> own;
  for (int64_t t = 0; t < n; ++t) {
    if (faulted != nullptr) {
      faulted[t] = std::any_of(task_faulted.begin() + first_task[t],
                               task_faulted.begin() + first_task[t + 1],
                               [](uint8_t f) { return f != 0; });
      if (faulted[t]) {
        std::fill(rows + t * kNumFields, rows + (t + 1) * kNumFields, int64_t{0});
        continue;
      }
    }
    own.assign(partials.begin() + first_task[t],
               partials.begin() + first_task[t + 1]);
    Partial p = combine_tree(own);
    repeat(p, repeats[t]);
    store(p, rows + t * kNumFields);
    for (int64_t k = first_task[t]; hist != nullptr && k < first_task[t + 1]; ++k) {
      int64_t* out = hist + t * hist_width;
      for (int64_t f = field_start[k]; f < field_start[k + 1]; ++f) {
        out[f - field_start[k]] += task_fields[f] * repeats[t];
      }
    }
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
  check_same_device("zeroscan.stats_many", xs, c10::kCPU);
  at::Tensor out = new_result(static_cast<int64_t>(xs.size()), c10::kCPU);
  scan_all("zeroscan.stats_many", xs, tol, true, out.mutable_data_ptr<int64_t>());
  return out;
}

// The stats_many of CPU tensors that view a memory-mapped file, which
// another process may truncate meanwhile.
// xs: N tensors, all on the CPU -> (int64 [N, kNumFields], bool [N]): the rows
// of stats_many, and whether a SIGBUS hit while reading each tensor (its row
// is then zeros).
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_many_mapped_cpu(
    at::TensorList xs, c10::optional<double> tol, bool histogram) {
  const char* op = "zeroscan.stats_many_mapped";
  for (size_t t = 0; t < xs.size(); ++t) {
    TORCH_CHECK(!xs[t].defined() || xs[t].device().is_cpu(), op, ": xs[", t,
                "] is on ", xs[t].device(), "; it scans memory-mapped CPU tensors");
  }
  const int64_t n = static_cast<int64_t>(xs.size());
  at::Tensor rows = new_result(n, c10::kCPU);
  at::Tensor faulted = at::zeros({n}, at::TensorOptions().dtype(at::kBool));
  at::Tensor hist = histogram ? new_histogram(op, xs, c10::kCPU)
                              : at::zeros({n, 0}, at::TensorOptions().dtype(at::kLong));
  scan_all(op, xs, tol, true, rows.mutable_data_ptr<int64_t>(),
           faulted.mutable_data_ptr<bool>(),
           histogram ? hist.mutable_data_ptr<int64_t>() : nullptr, hist.size(1));
  return {rows, faulted, hist};
}

// xs: N tensors, all on the CPU -> (int64 [N, kNumFields], int64 [N, B]):
// the rows of stats_many and each tensor's histogram fields, B the most
// fields of any of xs's dtypes.
std::tuple<at::Tensor, at::Tensor> stats_many_hist_cpu(at::TensorList xs,
                                                       c10::optional<double> tol) {
  const char* op = "zeroscan.stats_many_hist";
  check_same_device(op, xs, c10::kCPU);
  const int64_t n = static_cast<int64_t>(xs.size());
  at::Tensor rows = new_result(n, c10::kCPU);
  at::Tensor hist = new_histogram(op, xs, c10::kCPU);
  scan_all(op, xs, tol, true, rows.mutable_data_ptr<int64_t>(), nullptr,
           hist.mutable_data_ptr<int64_t>(), hist.size(1));
  return {rows, hist};
}

// stats_many_mapped's tensors on any other device: one readable line rather
// than the dispatcher's list of backends. It is registered here, beside the
// only kernel, because CPU-only builds leave csrc/cuda/ out and can still be
// handed CUDA tensors by a CUDA build of torch.
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_many_mapped_elsewhere(
    at::TensorList xs, c10::optional<double> /*tol*/, bool /*histogram*/) {
  TORCH_CHECK(!xs.empty(), "zeroscan.stats_many_mapped: no tensors");
  size_t t = 0;
  while (t + 1 < xs.size() && (!xs[t].defined() || xs[t].device().is_cpu())) ++t;
  TORCH_CHECK(false, "zeroscan.stats_many_mapped: xs[", t, "] is on ",
              xs[t].defined() ? xs[t].device().str() : std::string("no device"),
              "; it scans memory-mapped CPU tensors");
}

// rows: int64 [W, N, kNumFields], W ranks' rows of the same N tensors
//   -> int64 [N, kNumFields], each tensor's rows combined in the fixed tree.
at::Tensor combine_rows_cpu(const at::Tensor& rows) {
  check_rows("zeroscan.combine_rows", rows);
  // Combined in place in a copy: zeroscan never writes into its inputs.
  at::Tensor work = rows.clone(at::MemoryFormat::Contiguous);
  const int64_t ranks = rows.size(0), n = rows.size(1);
  int64_t* base = work.mutable_data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    RowArray column{base + j * kNumFields, n * kNumFields};
    combine_in_tree(column, ranks);
    column.set(0, column.get(0));  // a record again: spare columns zero, as with W > 1
  }
  return work[0].clone();
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroscan, CPU, m) {
  m.impl("stats", &stats_cpu);
  m.impl("stats_many", &stats_many_cpu);
  m.impl("combine_rows", &combine_rows_cpu);
  m.impl("stats_many_mapped", &stats_many_mapped_cpu);
  m.impl("stats_many_hist", &stats_many_hist_cpu);
}

TORCH_LIBRARY_IMPL(zeroscan, CUDA, m) {
  m.impl("stats_many_mapped", &stats_many_mapped_elsewhere);
}

}  // namespace cpu
}  // namespace zeroscan
