// The CPU's vector scan (csrc/cpu/vec_scan.h) of every build this machine
// runs, against the element-at-a-time reference (Tally::add), free of torch:
// tests/test_span_check.py builds it natively, and for AArch64 with a cross
// compiler, run under qemu-user.
//
// Every dtype of the table, every distribution below (the families of
// zeroscan.testing as bit patterns: ordinary, zero-heavy, subnormal, NaN and
// infinities, offset, values spanning the float range, subnormals among the
// smallest normal values; and, for the histogram's windows, magnitudes that
// climb or jump along the data, with and without infinities), lengths
// around the vector width, the run and the counter folds, start offsets
// that misalign the data, and shifts of zero, near the data and far from
// it. Counts and min/max keys must match exactly; the mean within 1e-9 of
// the data's scale plus 1e-9 relative, m2 within 1e-5 relative (the float32
// squares). The histogram's fields of the same data (counted as the scan
// reads, csrc/cpu/vec_scan.h, or after it, vec_fields.h; completed by
// count_fields.h) must match the fields counted one element at a time
// exactly, and so must those of a span long enough for every counter's
// widening (check_long_span).
//
//   span_check [--quick]    exit 0 when every case matches; prints each mismatch
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../csrc/cpu/count_fields.h"
#include "../csrc/cpu/scan_span.h"

namespace zs = zeroscan;
using zeroscan::cpu::VectorPath;

namespace {

std::mt19937_64 rng(20261129);

int failures = 0;
int cases = 0;

uint64_t uniform(uint64_t lo, uint64_t hi) {  // [lo, hi]
  return lo + rng() % (hi - lo + 1);
}

// Keys of S between two magnitudes.
template <typename S>
uint64_t key_at_most(double v) {
  return zs::largest_key<S>([v](double m) { return m <= v; });
}

// One element of S with magnitude key `key` and sign `negative` (floats), or
// the integer `value` (integers).
template <typename S>
S float_of(uint64_t key, bool negative) {
  using F = zs::Format<S>;
  using key_t = typename F::key_t;
  key_t bits = static_cast<key_t>(key);
  if (negative) bits = static_cast<key_t>(bits | F::kSignBit);
  S out;
  std::memcpy(&out, &bits, sizeof(S));
  return out;
}

template <typename S>
S int_of(int64_t value) {
  if constexpr (std::is_same_v<S, zs::bool_t>) {
    return zs::bool_t{static_cast<uint8_t>(value != 0)};
  } else {
    return static_cast<S>(value);
  }
}

const char* const kDistributions[] = {"ordinary", "zeros_50", "zeros_99", "all_zeros", "all_subnormal",
                                      "subnormal_0.1", "subnormal_3", "nonfinite_0.01", "nonfinite_1", "large_mean",
                                      "wide_range", "huge", "near_tiny", "rising", "rising_inf",
                                      "narrow_then_wide", "narrow_then_wide_inf", "tail", "tail_inf"};

template <typename S>
std::vector<S> make(const std::string& dist, int64_t n, const zs::Limits& lim) {
  using F = zs::Format<S>;
  std::vector<S> x(n);
  auto chance = [](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  if constexpr (F::kFloating) {
    const uint64_t lo = std::max<uint64_t>(key_at_most<S>(0.01), lim.sub_max + 1);
    const uint64_t hi = key_at_most<S>(8.0);
    const uint64_t sub = lim.sub_max;
    for (int64_t i = 0; i < n; ++i) {
      uint64_t key = uniform(lo, hi);
      bool negative = rng() & 1;
      if (dist == "zeros_50" && chance(0.5)) key = 0;
      if (dist == "zeros_99" && chance(0.99)) key = 0;
      if (dist == "all_zeros") key = 0;
      if (dist == "all_subnormal") key = sub > 0 ? uniform(1, sub) : 0;
      if (dist == "subnormal_0.1" && chance(0.001)) key = uniform(1, sub);
      // Subnormals near the density at which the subnormal passes stop
      // skipping clean vectors (scan_runs): at it on AVX2, above it on
      // AVX-512, below it on NEON, so runs of both kinds follow each other.
      if (dist == "subnormal_3" && chance(0.03)) key = uniform(1, sub);
      if (dist == "large_mean") {
        const uint64_t mid = key_at_most<S>(1000.0);
        key = uniform(mid, mid + 3);
        negative = false;
      }
      if (dist == "wide_range") key = uniform(1, lim.finite_max);
      // Subnormals among the smallest normal values, one sign: runs that
      // hold both, summed about a shift as small as they are.
      if (dist == "near_tiny") {
        key = sub > 0 ? uniform(sub / 2, 4 * sub) : uniform(0, 8);
        negative = false;
      }
      if (dist == "huge") key = uniform(lim.finite_max - 8, lim.finite_max);
      // Magnitudes that climb from the smallest normal value to the largest
      // along the data: each span holds values past the largest before it.
      if (dist == "rising" || dist == "rising_inf") {
        const uint64_t base = sub + 1, span = lim.finite_max - base;
        key = base + static_cast<uint64_t>(static_cast<double>(span) * static_cast<double>(i) / static_cast<double>(n));
        key = std::min<uint64_t>(lim.finite_max, key + uniform(0, 3));
      }
      // Ordinary values, then values across the whole range: spans with
      // values both above and below the window placed for the first half.
      if ((dist == "narrow_then_wide" || dist == "narrow_then_wide_inf") && 2 * i >= n) {
        key = uniform(1, lim.finite_max);
      }
      // Ordinary values and a rare one a few binades above them, as in the
      // tail of normally distributed data: spans past the first hold values
      // above the largest of its first elements.
      if ((dist == "tail" || dist == "tail_inf") && chance(1e-3)) key = key_at_most<S>(8.0 * (2 + uniform(0, 5)));
      // Infinities, which hide the largest finite value from the counter.
      if (F::kHasInf && (dist == "rising_inf" || dist == "narrow_then_wide_inf" || dist == "tail_inf") &&
          chance(1e-3)) {
        key = lim.nonnan_max;
      }
      const double p_nonfinite = dist == "nonfinite_0.01" ? 1e-4 : dist == "nonfinite_1" ? 1e-2 : 0.0;
      if (p_nonfinite > 0 && chance(p_nonfinite)) {
        key = F::kHasInf && (rng() & 1) ? lim.nonnan_max : uniform(lim.nonnan_max + 1, F::kMaxKey);
      }
      x[i] = float_of<S>(key, negative);
    }
  } else {
    const int64_t top = F::kSigned ? int64_t(F::kMaxKey / 2) : int64_t(std::min<uint64_t>(F::kMaxKey, 1ull << 62));
    for (int64_t i = 0; i < n; ++i) {
      int64_t v = static_cast<int64_t>(uniform(0, 200)) - (F::kSigned ? 100 : 0);
      if (dist == "zeros_50" && chance(0.5)) v = 0;
      if (dist == "zeros_99" && chance(0.99)) v = 0;
      if (dist == "all_zeros") v = 0;
      if (dist == "large_mean") v = std::min<int64_t>(top, 100) + static_cast<int64_t>(uniform(0, 3));
      if (dist == "wide_range" || dist == "huge") {
        v = static_cast<int64_t>(uniform(0, static_cast<uint64_t>(top)));
        if (F::kSigned && (rng() & 1)) v = -v - (dist == "huge" ? 1 : 0);  // reaches INT_MIN
      }
      x[i] = int_of<S>(v);
    }
  }
  return x;
}

double scale_of(const zs::Partial& p) {
  const double n = static_cast<double>(std::max<int64_t>(1, p.finite()));
  return std::sqrt(p.m2 / n + p.mean * p.mean);
}

template <typename S>
void compare(const char* dtype, VectorPath path, const std::string& dist, int64_t n, int64_t offset, double shift,
             const std::vector<S>& data, const zs::Limits& lim) {
  zs::Tally<S, int64_t> want, got;
  zs::cpu::scan_span_scalar(data.data() + offset, n, lim, shift, want);
  zs::cpu::scan_span_on(path, data.data() + offset, n, lim, shift, got);
  ++cases;
  std::string why;
  auto check = [&](const char* field, double a, double b) {
    if (!(a == b || (std::isnan(a) && std::isnan(b)))) {
      why += std::string(" ") + field + ": got " + std::to_string(a) + ", want " + std::to_string(b) + ";";
    }
  };
  check("numel", got.numel, want.numel);
  check("zeros", got.zeros, want.zeros);
  check("at_most_sub", got.at_most_sub, want.at_most_sub);
  for (int b = 0; b < zs::kNumBounds; ++b) {
    check(("at_most[" + std::to_string(b) + "]").c_str(), got.at_most[b], want.at_most[b]);
  }
  check("finite", got.finite, want.finite);
  check("non_nan", got.non_nan, want.non_nan);
  check("negative", got.negative, want.negative);
  check("neginf", got.neginf, want.neginf);
  check("lo_nonzero", static_cast<double>(got.lo_nonzero), static_cast<double>(want.lo_nonzero));
  check("hi", static_cast<double>(got.hi), static_cast<double>(want.hi));
  const zs::Partial g = got.finish(shift), w = want.finish(shift);
  const double scale = scale_of(w);
  if (std::isfinite(scale)) {
    if (!(std::fabs(g.mean - w.mean) <= 1e-9 * std::fabs(w.mean) + 1e-9 * scale)) {
      char buf[128];
      std::snprintf(buf, sizeof buf, " mean: got %.17g, want %.17g;", g.mean, w.mean);
      why += buf;
    }
    // The float32 squares hold ~1e-7 of the sum of squares about the shift,
    // which m2 can be a small difference of (stats_cpu.cpp scans such a
    // chunk again about its mean).
    const double about_shift = w.m2 + static_cast<double>(w.finite()) * (w.mean - shift) * (w.mean - shift);
    if (!(std::fabs(g.m2 - w.m2) <= 1e-5 * about_shift + 1e-300)) {
      char buf[128];
      std::snprintf(buf, sizeof buf, " m2: got %.17g, want %.17g;", g.m2, w.m2);
      why += buf;
    }
  }
  if (!why.empty()) {
    ++failures;
    if (failures <= 40) {
      std::printf("MISMATCH %s %s %s n=%lld offset=%lld shift=%g:%s\n", zs::cpu::vector_path_name(path), dtype,
                  dist.c_str(), static_cast<long long>(n), static_cast<long long>(offset), shift, why.c_str());
    }
  }
}

// The histogram's fields of p[0, n) one element at a time: [kFields].
template <typename S>
std::vector<int64_t> reference_fields(const S* p, int64_t n) {
  using B = zs::Binning<S>;
  std::vector<int64_t> fields(B::kFields);
  for (int64_t i = 0; i < n; ++i) ++fields[B::field(zs::Format<S>::key(p[i]))];
  return fields;
}

void report(const std::string& what, const std::string& why) {
  ++cases;
  if (why.empty()) return;
  ++failures;
  if (failures <= 40) std::printf("MISMATCH %s:%s\n", what.c_str(), why.c_str());
}

// Elements of S per vector of `path`'s build.
template <typename S>
int64_t lanes_on(VectorPath path) {
  return (path == VectorPath::kAvx512 ? 64 : path == VectorPath::kAvx2 ? 32 : 16) / static_cast<int64_t>(sizeof(S));
}

// count_window_on at window positions low, mid, at the top and past the end
// of the fields; then the scan on `path` with FieldCounter over the data as
// spans of `span` elements, the scan counting into the counter's window as
// tally_chunk has it, against the fields counted one element at a time.
template <typename S>
void compare_fields(const char* dtype, VectorPath path, const std::string& dist, int64_t n, int64_t offset,
                    const std::vector<S>& data, const zs::Limits& lim) {
  using B = zs::Binning<S>;
  const S* p = data.data() + offset;
  const std::string what = std::string(zs::cpu::vector_path_name(path)) + " " + dtype + " " + dist +
                           " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
  if constexpr (zs::cpu::kWindowedFields<S>) {
    for (int lo : {0, 1, B::kFields / 2, std::max(0, B::kFields - zs::cpu::kWindowFields), B::kFields - 1}) {
      int64_t window[zs::cpu::kWindowFields] = {};
      const int64_t counted = zs::cpu::count_window_on(path, p, n, lo, window);
      const std::vector<int64_t> want = reference_fields(p, counted);
      std::string why;
      const int64_t lanes = lanes_on<S>(path);
      if (counted != n / lanes * lanes) why += " counted " + std::to_string(counted) + ";";
      for (int j = 0; j < zs::cpu::kWindowFields; ++j) {
        const int64_t w = lo + j < B::kFields && lo + j >= 0 ? want[lo + j] : 0;
        if (window[j] != w) why += " field " + std::to_string(lo + j) + ": got " + std::to_string(window[j]) +
                                   ", want " + std::to_string(w) + ";";
      }
      report(what + " window lo=" + std::to_string(lo), why);
    }
  }
  for (int64_t span : {int64_t(2048), int64_t(65536)}) {
    zs::cpu::FieldCounter<S> counter(path);
    zs::Tally<S, int64_t> t;  // the spans so far, as tally_chunk keeps it
    for (int64_t begin = 0; begin < n; begin += span) {
      const int64_t len = std::min(span, n - begin);
      counter.scan(p + begin, len, lim, 0.0, t);
    }
    std::vector<int64_t> got(B::kFields);
    counter.write(got.data());
    const std::vector<int64_t> want = reference_fields(p, n);
    std::string why;
    for (int f = 0; f < B::kFields; ++f) {
      if (got[f] != want[f]) why += " field " + std::to_string(f) + ": got " + std::to_string(got[f]) +
                                    ", want " + std::to_string(want[f]) + ";";
    }
    // Data within a few binades of its bulk, infinities or not, is counted
    // by the windows: one element at a time only in each span's scalar tail.
    if (zs::cpu::kWindowedFields<S> && zs::Format<S>::kFloating &&
        (dist == "ordinary" || dist == "nonfinite_1" || dist == "tail" || dist == "tail_inf")) {
      const int64_t lanes = lanes_on<S>(path);
      int64_t tails = 0;
      for (int64_t begin = 0; begin < n; begin += span) tails += std::min(span, n - begin) % lanes;
      if (counter.counted_singly() != tails) {
        why += " counted " + std::to_string(counter.counted_singly()) + " elements one at a time, want " +
               std::to_string(tails) + " (the spans' tails);";
      }
    }
    report(what + " counter span=" + std::to_string(span), why);
  }
}

// One span of (1 << 21) + 37 elements in one field, on `path`: every lane
// adds to the same counter, so each counter's widening (WindowCounts,
// vec_scan.h) is reached at its fullest. First as the bulk of the window;
// then below it, the first element the largest finite value (the window is
// placed at the top, and the bulk counted by the windows below).
template <typename S>
void check_long_span(const char* dtype, VectorPath path, const zs::Limits& lim) {
  using B = zs::Binning<S>;
  const int64_t n = (int64_t(1) << 21) + 37;
  std::vector<S> data(n, float_of<S>(key_at_most<S>(1.0), false));
  for (bool top_first : {false, true}) {
    if (top_first) data[0] = float_of<S>(lim.finite_max, false);
    zs::cpu::FieldCounter<S> counter(path);
    zs::Tally<S, int64_t> t;
    counter.scan(data.data(), n, lim, 0.0, t);
    std::vector<int64_t> got(B::kFields);
    counter.write(got.data());
    const std::vector<int64_t> want = reference_fields(data.data(), n);
    std::string why;
    for (int f = 0; f < B::kFields; ++f) {
      if (got[f] != want[f]) why += " field " + std::to_string(f) + ": got " + std::to_string(got[f]) +
                                    ", want " + std::to_string(want[f]) + ";";
    }
    report(std::string(zs::cpu::vector_path_name(path)) + " " + dtype + " long span" +
               (top_first ? ", the largest value first" : ""),
           why);
  }
}

template <typename S>
void check_dtype(const char* dtype, double tiny, double eps, const std::vector<VectorPath>& paths, bool quick) {
  using F = zs::Format<S>;
  const zs::Limits lim = zs::limits_for<S>(tiny, F::kFloating ? 1e-3 : 2.0);
  (void)eps;
  const int64_t lanes = 64 / static_cast<int64_t>(sizeof(S));
  std::vector<int64_t> lengths = {0, 1, lanes - 1, lanes, lanes + 1, 3 * lanes + 5, 1000, 4099, 70001};
  if (!quick) lengths.push_back(300007);  // past every lane counter's fold
  for (const char* dist : kDistributions) {
    const std::vector<S> data = make<S>(dist, lengths.back() + 8, lim);
    for (int64_t n : lengths) {
      for (int64_t offset : {0, 3}) {
        // Shifts: none; one like the scan's (a float32 value near the data's
        // first values); and, for floats, one far from the data.
        std::vector<double> shifts = {0.0};
        zs::Tally<S, int64_t> first;
        zs::cpu::scan_span_scalar(data.data() + offset, std::min<int64_t>(n, 64), lim, 0.0, first);
        if (first.finite > 0) {
          double near = first.s1 / static_cast<double>(first.finite);
          if (!F::kFloating) near = std::nearbyint(near);
          if (F::kFloating && sizeof(S) <= 4) near = static_cast<double>(static_cast<float>(near));
          if (std::isfinite(near) && near != 0.0) shifts.push_back(near);
        }
        if (F::kFloating && sizeof(S) <= 4 && n == 1000) shifts.push_back(0.25);
        for (double shift : shifts) {
          for (VectorPath path : paths) compare<S>(dtype, path, dist, n, offset, shift, data, lim);
        }
        for (VectorPath path : paths) compare_fields<S>(dtype, path, dist, n, offset, data, lim);
      }
    }
  }
  if constexpr (zs::cpu::kWindowedFields<S> && F::kFloating) {
    for (VectorPath path : paths) check_long_span<S>(dtype, path, lim);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const std::vector<VectorPath> paths = zs::cpu::vector_paths_here();
  if (paths.empty()) {
    std::printf("span_check: this CPU runs no vector build\n");
    return 2;
  }
#define ZS_CHECK(name, S, value_t, tiny, eps) check_dtype<S>(#name, tiny, eps, paths, quick);
  ZEROSCAN_DTYPES(ZS_CHECK)
#undef ZS_CHECK
  std::printf("span_check:");
  for (VectorPath p : paths) std::printf(" %s", zs::cpu::vector_path_name(p));
  std::printf(": %d cases, %d mismatches\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
