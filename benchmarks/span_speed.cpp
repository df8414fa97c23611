// What bounds the CPU scan on cached data: each vector build's span loop
// (csrc/cpu/vec_scan.h) alone, one thread, no torch, in nanoseconds per
// element over a 64K-element span that stays in the core's caches, beside a
// plain float32 sum of the same bytes. Built and run by bench_span.py.
//
//   span_speed    one line per build, dtype and distribution (and one for
//                 the same scan with the histogram's count, "BUILD+histogram"),
//                 then one per build and span size (float32 randn, ns per call)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../csrc/cpu/count_fields.h"
#include "../csrc/cpu/scan_span.h"

namespace zs = zeroscan;
using zeroscan::cpu::VectorPath;

namespace {

constexpr int64_t kElements = 1 << 16;

// The best of 7 batches of `calls` calls, in ns per element.
template <typename Fn>
double best_ns_per_element(Fn&& fn, int64_t elements, int64_t calls = 40) {
  double best = 1e30;
  for (int batch = 0; batch < 7; ++batch) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t call = 0; call < calls; ++call) fn();
    const auto stop = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(stop - start).count() / calls / elements);
  }
  return best;
}

// float32 values of a distribution.
float value(std::mt19937_64& rng, const char* dist) {
  static std::normal_distribution<float> normal;
  float v = normal(rng);
  if (std::strcmp(dist, "all_subnormal") == 0) v *= 1e-40f;
  if (std::strcmp(dist, "subnormal_0.1") == 0 && rng() % 1000 == 0) v *= 1e-40f;
  if (std::strcmp(dist, "subnormal_3") == 0 && rng() % 100 < 3) v *= 1e-40f;
  if (std::strcmp(dist, "subnormal_30") == 0 && rng() % 100 < 30) v *= 1e-40f;
  if (std::strcmp(dist, "nonfinite_0.01") == 0 && rng() % 10000 == 0) v = rng() % 2 ? NAN : INFINITY;
  if (std::strcmp(dist, "nonfinite_0.1") == 0 && rng() % 1000 == 0) v = rng() % 2 ? NAN : INFINITY;
  if (std::strcmp(dist, "nonfinite_1") == 0 && rng() % 100 == 0) v = rng() % 2 ? NAN : INFINITY;
  if (std::strcmp(dist, "zeros_50") == 0 && rng() % 2 == 0) v = 0.0f;
  return v;
}

// v as S: the largest magnitude of S at most |v| (NaN as NaN, infinities
// as infinities or, without them, NaN), with v's sign.
template <typename S>
S narrow(float v) {
  using F = zs::Format<S>;
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    const double a = std::fabs(static_cast<double>(v));
    uint64_t key = F::kMaxKey;  // NaN
    if (std::isinf(v) && F::kHasInf) key = zs::largest_key<S>([](double m) { return !std::isnan(m); });
    if (std::isfinite(v)) key = zs::largest_key<S>([a](double m) { return m <= a; });
    const auto bits = static_cast<typename F::key_t>(key | (std::signbit(v) ? F::kSignBit : 0));
    S out;
    std::memcpy(&out, &bits, sizeof(S));
    return out;
  }
}

// The same scan with the histogram's count, as tally_chunk runs it for one
// span of a chunk (a contiguous 64K-element chunk is one span, so the
// counter is made once per span there too): where the build counts as it
// scans (AVX-512, NEON), in its loop; else by a pass of its own over the
// span after it (AVX2), and one element at a time on the scalar path.
template <typename S>
void scan_with_fields(VectorPath path, const S* x, const zs::Limits& lim) {
  zs::cpu::FieldCounter<S> counter(path);
  zs::Tally<S, int64_t> t;
  counter.scan(x, kElements, lim, 0.0, t);
  int64_t fields[zs::Binning<S>::kFields] = {};
  counter.write(fields);
  __asm__ volatile("" : : "r"(fields), "r"(&t) : "memory");
}

template <typename S>
void measure(const char* dtype, double tiny, const std::vector<VectorPath>& paths) {
  const zs::Limits lim = zs::limits_for<S>(tiny, 1e-7);
  for (const char* dist : {"randn", "zeros_50", "all_subnormal", "subnormal_0.1", "subnormal_3", "subnormal_30",
                           "nonfinite_0.01", "nonfinite_0.1", "nonfinite_1"}) {
    std::mt19937_64 rng(7);
    std::vector<S> x(kElements);
    for (auto& e : x) e = narrow<S>(value(rng, dist));
    for (VectorPath path : paths) {
      const double ns = best_ns_per_element(
          [&] {
            zs::Tally<S, int64_t> t;
            zs::cpu::scan_span_on(path, x.data(), kElements, lim, 0.0, t);
            __asm__ volatile("" : : "r"(&t) : "memory");
          },
          kElements);
      std::printf("%s %s %s %.4f\n", zs::cpu::vector_path_name(path), dtype, dist, ns);
      const double with_fields = best_ns_per_element([&] { scan_with_fields(path, x.data(), lim); }, kElements);
      std::printf("%s+histogram %s %s %.4f\n", zs::cpu::vector_path_name(path), dtype, dist, with_fields);
    }
  }
}

// A span's fixed cost: float32 randn spans of a few sizes, ns per call,
// the scan's setup and its end included (a small tensor of stats_many pays
// them once).
void measure_sizes(const std::vector<VectorPath>& paths) {
  const zs::Limits lim = zs::limits_for<float>(0x1p-126, 1e-7);
  std::mt19937_64 rng(7);
  std::vector<float> x(kElements);
  for (auto& v : x) v = value(rng, "randn");
  for (int64_t n : {int64_t(16), int64_t(256), int64_t(4096), kElements}) {
    // Batches of ~1 ms, so that a build's wider vector unit is awake (it
    // sleeps when idle, and the first wide instruction waits for it).
    const int64_t calls = std::max<int64_t>(40, 1000000 / (n + 100));
    for (VectorPath path : paths) {
      const double best = best_ns_per_element(
          [&] {
            zs::Tally<float, int64_t> t;
            zs::cpu::scan_span_on(path, x.data(), n, lim, 0.0, t);
            __asm__ volatile("" : : "r"(&t) : "memory");
          },
          1, calls);
      std::printf("size %s %lld %.1f\n", zs::cpu::vector_path_name(path), static_cast<long long>(n), best);
    }
  }
}

}  // namespace

int main() {
  std::vector<VectorPath> paths = zs::cpu::vector_paths_here();
  paths.insert(paths.begin(), VectorPath::kNone);  // the element-at-a-time reference too
  std::vector<float> floats(kElements);
  std::mt19937_64 rng(7);
  for (auto& v : floats) v = value(rng, "randn");
  const double sum_ns = best_ns_per_element(
      [&] {
        float lanes[16] = {};
        for (int64_t i = 0; i < kElements; i += 16) {
          for (int j = 0; j < 16; ++j) lanes[j] += floats[i + j];
        }
        __asm__ volatile("" : : "r"(lanes) : "memory");
      },
      kElements);
  std::printf("sum float32 randn %.4f\n", sum_ns);
  measure<float>("float32", 0x1p-126, paths);
  measure<zs::bf16_t>("bfloat16", 0x1p-126, paths);
  measure<zs::f16_t>("float16", 0x1p-14, paths);
  measure<zs::e4m3_t>("float8_e4m3fn", 0x1p-6, paths);
  measure_sizes(paths);
  return 0;
}
