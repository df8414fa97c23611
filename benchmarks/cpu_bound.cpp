// The CPU scan's per-vector work, taken apart: bench_cpu_bound.py times each
// part alone on cached data, to show which share of the time each costs and
// how far below x.sum() the scan can go at all.
//
// Every part runs the very inline functions of csrc/cpu/scan_span.h that the
// scan's vector loop runs (scan_block, scan_block_e4m3), in a loop of its
// own over one contiguous tensor, on the calling thread:
//   classify  load, |x| key, the counts of classify.h and min/max |x|: what
//             every vector pays however the moments are summed
//   moments   load and the moments only (floats: add_moments; float8_e4m3fn
//             on VBMI/VNNI CPUs: the four integer planes)
//   both      the two together: the clean-run loop without its run structure
// A part's lane counters wrap (nothing folds them): its results are wrong on
// purpose and only kept alive, never read.
#include <torch/extension.h>

#include <chrono>
#include <limits>

#include "../csrc/op_common.h"
#include "../csrc/cpu/scan_span.h"

namespace zeroscan {
namespace cpu {
namespace {

#if defined(ZS_HAVE_AVX512_KERNELS)

enum class Part { kClassify, kMoments, kBoth };

// One pass of `part` over p[0, vectors * 64 bytes) of a float dtype S.
template <typename S, Part P>
__attribute__((noinline)) ZS_AVX512 int64_t float_pass(const S* p, int64_t vectors,
                                                       const VectorLimits& vl, double shift) {
  using V = Lanes<sizeof(S)>;
  constexpr int64_t kLanes = 64 / static_cast<int64_t>(sizeof(S));
  const __m512i zero = _mm512_setzero_si512();
  LaneCounts c{zero, zero, zero, zero, _mm512_set1_epi32(-1), zero};
  const RunScale rs = make_scale<S>(scale_exponent(std::fabs(shift)), shift);
  RunSums even = empty_run(), odd = empty_run();
  in_pairs(vectors, [&](int64_t k, int parity) __attribute__((always_inline)) ZS_AVX512 {
    prefetch_ahead(p + k * kLanes);
    const __m512i raw = _mm512_loadu_si512(p + k * kLanes);
    if constexpr (P != Part::kMoments) {
      const __m512i key = key_of<S>(raw);
      count_common<S>(raw, key, vl, c);
      c.hi = V::max(c.hi, key);
    }
    if constexpr (P != Part::kClassify) {
      add_moments<S, false>(raw, 0, rs, shift, parity == 0 ? even : odd);
    }
  });
  const RunSums r = add_runs(even, odd);
  // Every field is used, so that the compiler drops no part of the work.
  const __m512 f = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(r.v1, r.v2), _mm512_add_ps(r.u1, r.u2)),
                                 _mm512_add_ps(r.q1, r.q2));
  const __m512d d = _mm512_add_pd(_mm512_add_pd(_mm512_add_pd(r.w1, r.w2), _mm512_add_pd(r.w3, r.w4)), r.r1);
  __m512i all = _mm512_add_epi64(_mm512_add_epi64(c.nonzero, c.sub), _mm512_add_epi64(c.tol, c.negative));
  all = _mm512_add_epi64(all, _mm512_add_epi64(c.lo_nonzero, c.hi));
  return _mm512_reduce_add_epi64(all) + static_cast<int64_t>(_mm512_reduce_add_ps(f)) +
         static_cast<int64_t>(_mm512_reduce_add_pd(d));
}

// The same for float8_e4m3fn by integer planes (scan_block_e4m3's loop).
template <Part P>
__attribute__((noinline)) ZS_AVX512_PLANES int64_t e4m3_pass(const e4m3_t* p, int64_t vectors,
                                                             const VectorLimits& vl) {
  using S = e4m3_t;
  using V = Lanes<1>;
  const __m512i zero = _mm512_setzero_si512();
  LaneCounts c{zero, zero, zero, zero, _mm512_set1_epi32(-1), zero};
  NonFiniteCounts nf{zero, zero, zero};
  __m512i low[4], high[4], values[4], squares[4];
  for (int h = 0; h < 4; ++h) {
    low[h] = _mm512_load_si512(kE4m3Planes.b[h]);
    high[h] = _mm512_load_si512(kE4m3Planes.b[h] + 64);
    values[h] = squares[h] = zero;
  }
  for (int64_t k = 0; k < vectors; ++k) {
    prefetch_ahead(p + k * 64);
    const __m512i raw = _mm512_loadu_si512(p + k * 64);
    __mmask64 negative;
    if constexpr (P != Part::kMoments) {
      const __m512i key = key_of<S>(raw);
      negative = count_common<S>(raw, key, vl, c);
      const __mmask64 finite = count_non_finite<S>(raw, key, vl, nf);
      c.hi = V::mask_max(c.hi, finite, key);
    } else {
      negative = V::sign(raw);
    }
    if constexpr (P != Part::kClassify) add_planes(raw, negative, low, high, values, squares);
  }
  __m512i all = _mm512_add_epi64(_mm512_add_epi64(c.nonzero, c.sub), _mm512_add_epi64(c.tol, c.negative));
  all = _mm512_add_epi64(all, _mm512_add_epi64(c.lo_nonzero, c.hi));
  all = _mm512_add_epi64(all, nf.non_nan);
  for (int h = 0; h < 4; ++h) all = _mm512_add_epi64(all, _mm512_add_epi64(values[h], squares[h]));
  return _mm512_reduce_add_epi64(all);
}

template <typename S>
int64_t run_part(const at::Tensor& x, Part part, double shift) {
  const int64_t vectors = x.numel() * x.element_size() / 64;
  const S* p = reinterpret_cast<const S*>(x.const_data_ptr());
  const Limits lim = limits_of(x.scalar_type(), c10::nullopt);
  const VectorLimits vl = vector_limits<S>(lim);
  if constexpr (std::is_same_v<S, e4m3_t>) {
    (void)shift;  // the planes need none
    TORCH_CHECK(cpu_has_e4m3_planes(), "cpu_bound: float8_e4m3fn parts need AVX512-VBMI and VNNI");
    switch (part) {
      case Part::kClassify: return e4m3_pass<Part::kClassify>(p, vectors, vl);
      case Part::kMoments: return e4m3_pass<Part::kMoments>(p, vectors, vl);
      default: return e4m3_pass<Part::kBoth>(p, vectors, vl);
    }
  } else {
    switch (part) {
      case Part::kClassify: return float_pass<S, Part::kClassify>(p, vectors, vl, shift);
      case Part::kMoments: return float_pass<S, Part::kMoments>(p, vectors, vl, shift);
      default: return float_pass<S, Part::kBoth>(p, vectors, vl, shift);
    }
  }
}

#endif  // ZS_HAVE_AVX512_KERNELS

// x: contiguous CPU tensor of float32, bfloat16, float16 or float8_e4m3fn
// whose size is a whole number of 64-byte vectors. Returns the best time of
// one pass of `part` ("classify", "moments" or "both") over `repeats` runs,
// in seconds.
double time_part(const at::Tensor& x, const std::string& part, int64_t repeats) {
#if defined(ZS_HAVE_AVX512_KERNELS)
  TORCH_CHECK(cpu_has_avx512(), "cpu_bound: the scan's AVX-512 loop is off here (the CPU lacks AVX-512, "
              "or ZEROSCAN_CPU_CAPABILITY=scalar)");
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "cpu_bound: x must be a contiguous CPU tensor");
  TORCH_CHECK(x.numel() * x.element_size() % 64 == 0, "cpu_bound: x must fill whole 64-byte vectors, got ",
              x.numel(), " elements");
  TORCH_CHECK(repeats > 0, "cpu_bound: repeats must be positive, got ", repeats);
  Part p;
  if (part == "classify") {
    p = Part::kClassify;
  } else if (part == "moments") {
    p = Part::kMoments;
  } else {
    TORCH_CHECK(part == "both", "cpu_bound: part must be classify, moments or both; got '", part, "'");
    p = Part::kBoth;
  }
  // The shift and scale stay run-time values, as in the scan, so that the
  // compiler folds nothing the scan computes.
  volatile double opaque_shift = 0.0;
  auto once = [&]() -> int64_t {
    const double shift = opaque_shift;
    switch (x.scalar_type()) {
      case at::kFloat: return run_part<float>(x, p, shift);
      case at::kBFloat16: return run_part<bf16_t>(x, p, shift);
      case at::kHalf: return run_part<f16_t>(x, p, shift);
      case at::kFloat8_e4m3fn: return run_part<e4m3_t>(x, p, shift);
      default:
        TORCH_CHECK(false, "cpu_bound: x must be float32, bfloat16, float16 or float8_e4m3fn; got ",
                    x.scalar_type());
    }
  };
  volatile int64_t sink = once();  // warm the caches and the code
  double best = std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    sink = sink + once();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count());
  }
  return best;
#else
  TORCH_CHECK(false, "cpu_bound: built without the AVX-512 kernels (not x86-64 with GCC or Clang)");
#endif
}

}  // namespace
}  // namespace cpu
}  // namespace zeroscan

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("time_part", &zeroscan::cpu::time_part, "best time of one pass of a part of the scan's vector loop");
}
