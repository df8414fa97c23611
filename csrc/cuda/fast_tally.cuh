// The per-thread scan of float32, bfloat16 and float16 at memory speed.
//
// classify.h defines what is counted: every class is a range of keys of
// |x|, and Tally counts it with one integer compare and one add per class
// and element. On Hopper the integer pipe issues a warp instruction every
// other clock, and float64 arithmetic and conversions cost more still, so a
// Tally::add costs about 60 issue slots per element where memory speed
// allows 32 for float32 and 16 for 2-byte types (benchmarks/sass_cost.py).
// FastTally counts the same key ranges on the float pipes instead:
//
//   [key <= L] = sat(|y| * a + b)        one FFMA.SAT (HFMA2.SAT: two elements)
//
// where y is x times a power of two, b / -a lies strictly between the
// magnitude of key L and that of key L + 1, and a is minus the inverse of
// their distance: the exact product and sum are >= 1 up to key L and <= 0
// from key L + 1 on, so the rounded, saturated result is exactly 1 or 0,
// and NaN saturates to 0 (NaN keys sit above every limit). The sums of these
// indicators are the counts (exact: float32 counts below 2^24, float16
// counts below 2^11, bounds the tiling keeps). The host derives a and b from
// the same Limits the Tally path uses (FastLimits), so both paths count the
// same classes, and standalone_test checks them against each other on every
// 16-bit pattern.
//
// The moments are taken about a shift and scale shared by the whole tile
// (TileCenter, from its first values): the squares of d = (x - shift) *
// scale are summed in float32 runs of at most 8, and the runs in a
// compensated float32 pair; float32's sum of x is compensated per element
// (Kahan), float16's and bfloat16's is a float32 sum of d in the same runs.
// A tile whose sums overflow, underflow or lie far from its own mean is
// summed again by the Tally path (fast_partial returns false). Everything
// here is __host__ __device__: standalone_test --emulate runs it on the CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include "../classify.h"
#include "../dtypes.h"
#include "../stats_record.h"

#if defined(__CUDACC__)
#define ZS_FHD __host__ __device__ __forceinline__
#else
#define ZS_FHD inline
#endif

namespace zeroscan {
namespace cuda {

constexpr float kFloatMax = 0x1.fffffep127f;

// ---- Per-launch constants (host) ------------------------------------------

// The constants of the fast path for one launch's dtype and tol. `on` is
// false where it cannot count a bound's class (classify.h) exactly (a bound
// at or beyond the top of its scaled view: 2^104 for float32, about 2^41
// for bfloat16, 64 for float16) or the dtype has no fast path: the launch
// then runs Tally.
struct FastLimits {
  bool on = false;
  // float32: [key <= bound_max[b]] = sat(|x * 2^24| * bound_a[b] + bound_b[b])
  float bound_a[kNumBounds] = {}, bound_b[kNumBounds] = {};
  uint32_t bound_ab[kNumBounds] = {};  // 16-bit: half a (low), half b (high) on the view * 2^10
};

// The float16 bits of v, which must be exactly representable (powers of two
// and small integers here). Host only.
inline uint16_t exact_half_bits(double v) {
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  double a = v < 0 ? -v : v;
  if (a == 0.0) return sign;
  int e = 0;
  const double m = std::frexp(a, &e);  // a = m * 2^e, 0.5 <= m < 1
  int biased = e - 1 + 15;             // exponent of 1.xxx * 2^(e-1)
  if (biased >= 31) return sign | 0x7c00;
  if (biased <= 0) {  // subnormal: a / 2^-24 must be an integer
    return sign | static_cast<uint16_t>(std::ldexp(a, 24));
  }
  const uint16_t mant = static_cast<uint16_t>(std::ldexp(m * 2.0 - 1.0, 10));
  return sign | static_cast<uint16_t>(biased << 10) | mant;
}

// The value of float16 bits h. Host only.
inline double half_value(uint16_t h) {
  const int e = (h >> 10) & 31;
  const int m = h & 1023;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31) return m ? NAN : s * INFINITY;
  if (e == 0) return s * std::ldexp(m, -24);
  return s * std::ldexp(1024 + m, e - 25);
}

// a, b with sat(v * a + b) = [v <= t] for the representable t < n that are
// neighbours (nothing representable lies between them); both finite. a is
// minus a power of two, so the product is exact.
inline void indicator_constants(double t, double n, double& a, double& b) {
  const double gap = n - t;
  int e = 0;
  std::frexp(gap, &e);
  const double inv = std::ldexp(1.0, 1 - e);  // 1 / gap, gap a power of two
  a = -inv;
  b = n * inv;
}

template <typename S>
FastLimits fast_limits_for(const Limits& lim);

template <>
inline FastLimits fast_limits_for<float>(const Limits& lim) {
  FastLimits f;
  // On t = x * 2^24, which holds every |x| below 2^104 exactly.
  const uint64_t top = 0x737fffffu;  // the largest key below 2^104
  for (int k = 0; k < kNumBounds; ++k) {
    const uint64_t key = lim.bound_max[k];
    if (key >= top) return FastLimits{};
    const double t = Format<float>::magnitude(static_cast<uint32_t>(key));
    const double n = Format<float>::magnitude(static_cast<uint32_t>(key + 1));
    double a = 0, b = 0;
    indicator_constants(std::ldexp(t, 24), std::ldexp(n, 24), a, b);
    f.bound_a[k] = static_cast<float>(a);
    f.bound_b[k] = static_cast<float>(b);
    if (static_cast<double>(f.bound_a[k]) != a || static_cast<double>(f.bound_b[k]) != b) return FastLimits{};
  }
  f.on = true;
  return f;
}

// The 16-bit types count on float16 views of their keys scaled by 2^10, in
// which every key below 0x5400 is exact and finite.
inline FastLimits fast_limits_16(const Limits& lim) {
  FastLimits f;
  for (int k = 0; k < kNumBounds; ++k) {
    const uint64_t key = lim.bound_max[k];
    if (key >= 0x5400 - 1) return FastLimits{};
    const double t = std::ldexp(half_value(static_cast<uint16_t>(key)), 10);
    const double n = std::ldexp(half_value(static_cast<uint16_t>(key + 1)), 10);
    double a = 0, b = 0;
    indicator_constants(t, n, a, b);
    if (half_value(exact_half_bits(a)) != a || half_value(exact_half_bits(b)) != b) return FastLimits{};
    f.bound_ab[k] = exact_half_bits(a) | (static_cast<uint32_t>(exact_half_bits(b)) << 16);
  }
  f.on = true;
  return f;
}

template <>
inline FastLimits fast_limits_for<bf16_t>(const Limits& lim) {
  return fast_limits_16(lim);
}
template <>
inline FastLimits fast_limits_for<f16_t>(const Limits& lim) {
  return fast_limits_16(lim);
}

// Other storage types have no fast path.
template <typename S>
FastLimits fast_limits_for(const Limits&) {
  return FastLimits{};
}

// The fast path's instructions (float16 pair min/max, warp REDUX) need
// sm_80: code compiled for an older GPU takes the Tally path.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kArchHasFastPath = false;
#else
constexpr bool kArchHasFastPath = true;
#endif

template <typename S>
constexpr bool kHasFastPath =
    kArchHasFastPath &&
    (std::is_same_v<S, float> || std::is_same_v<S, bf16_t> || std::is_same_v<S, f16_t>);

#if defined(__CUDACC__)

// ---- A tile's shift and scale -----------------------------------------------

// The moments of a tile are taken about `shift` (the mean of the finite
// values among its first kCenterSamples, or 0), their squares scaled by
// `scale`, the power of two that brings the largest of those to [1, 2)
// (kept in [2^-126, 2^126]; 1 without any).
constexpr int kCenterSamples = 32;

struct TileCenter {
  float shift = 0.0f;
  float scale = 1.0f;
  float nshift = 0.0f;  // -shift * scale, exact
  float largest = 0.0f;  // the sample's largest |x|
};

// bfloat16's views order its keys below 2^121 only. Such a value in a tile
// whose sample stays below 2^57 has a scaled deviation of 2^64 or more,
// whose square overflows the float32 runs: the tile goes to Tally (see
// fast_partial). A tile whose sample reaches 2^57 goes there at once.
constexpr float kBf16LargestSample = 0x1p57f;

// Whether a tile with this center takes the fast path.
template <typename T>
ZS_FHD bool fast_center_ok(const TileCenter& c) {
  return !std::is_same_v<T, bf16_t> || c.largest < kBf16LargestSample;
}

// From the sample's finite-value sum, count and largest |x|.
ZS_FHD TileCenter make_center(float sum, float count, float largest) {
  TileCenter c;
  if (count > 0.0f) {
#if defined(__CUDA_ARCH__)
    c.shift = __fdiv_rn(sum, count);
#else
    c.shift = sum / count;
#endif
  }
  if (largest > 0.0f) {
    const uint32_t bits = bit_cast_to<uint32_t>(largest);
    int e = static_cast<int>(bits >> 23) - 127;  // floor(log2 largest); subnormals: -127
    e = e < -126 ? -126 : e > 126 ? 126 : e;
    c.scale = bit_cast_to<float>(static_cast<uint32_t>(127 - e) << 23);
  }
  c.nshift = -(c.shift * c.scale);
  c.largest = largest;
  return c;
}

// ---- Portable float operations ------------------------------------------------

// The same operation on the device (one instruction, never contracted or
// reassociated) and in the host emulation (IEEE float: same result).
ZS_FHD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}
ZS_FHD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}
ZS_FHD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
// Saturated to [0, 1]; NaN becomes 0.
ZS_FHD float sat(float r) { return r > 0.0f ? (r < 1.0f ? r : 1.0f) : 0.0f; }
ZS_FHD float fma_sat(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
#else
  return sat(std::fma(a, b, c));
#endif
}
ZS_FHD float mul_sat(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("mul.rn.sat.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return sat(mul_rn(a, b));
#endif
}
ZS_FHD float add_sat(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("add.rn.sat.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return sat(add_rn(a, b));
#endif
}
// The smaller / larger; NaN loses to any number (FMNMX). The host spells it
// out: its fminf / fmaxf may compile to minss / maxss, which return the
// second operand when either is NaN.
ZS_FHD float min_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return a != a || b < a ? b : a;
#endif
}
ZS_FHD float max_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return a != a || b > a ? b : a;
#endif
}

// s - c holds a compensated sum (Kahan): adds y.
ZS_FHD void kahan_add(float& s, float& c, float y) {
  const float z = add_rn(y, -c);
  const float t = add_rn(s, z);
  c = add_rn(add_rn(t, -s), -z);
  s = t;
}

// ---- What a thread hands to the block ----------------------------------------

// A thread's (then a block's) counts, key extremes and moment sums for one
// tile, in the key space of its storage type. Combined by addition, min and
// max: the block reduction needs no division.
struct TileSums {
  // Counts as floats, exact: a tile holds at most kMaxTilePositions < 2^24 elements.
  float zeros = 0, at_most_sub = 0, at_most[kNumBounds] = {}, finite = 0, non_nan = 0,
        negative = 0, neginf = 0;
  uint32_t lo = ~0u;               // least nonzero non-NaN key
  uint32_t hi = 0;                 // greatest non-NaN key (when non_nan > 0)
  double s1 = 0.0, s2 = 0.0;       // sum of x (float32) or of d (16-bit); sum of d^2
};

ZS_FHD void combine_sums(TileSums& a, const TileSums& b) {
  a.zeros = add_rn(a.zeros, b.zeros);
  a.at_most_sub = add_rn(a.at_most_sub, b.at_most_sub);
#pragma unroll
  for (int k = 0; k < kNumBounds; ++k) a.at_most[k] = add_rn(a.at_most[k], b.at_most[k]);
  a.finite = add_rn(a.finite, b.finite);
  a.non_nan = add_rn(a.non_nan, b.non_nan);
  a.negative = add_rn(a.negative, b.negative);
  a.neginf = add_rn(a.neginf, b.neginf);
  a.lo = b.lo < a.lo ? b.lo : a.lo;
  a.hi = b.hi > a.hi ? b.hi : a.hi;
  a.s1 += b.s1;
  a.s2 += b.s2;
}

// ---- float32 --------------------------------------------------------------------

// Runs of squares longer than this lose more than ~7 float32 roundings.
constexpr int kRun = 8;

// kByFields: the kernel also counts every element's histogram field, whose
// field 0 (zeros and subnormals) and top field (infinities and NaN) hold the
// at_most_sub and non-finite counts: the tally leaves those two out, and
// settle_by_fields puts the block's in from the table.
template <typename T, bool kByFields = false>
struct FastTally;

template <bool kByFields>
struct FastTally<float, kByFields> {
  // Counts, exact in float32 (a thread sees fewer than 2^24 elements per tile).
  float zeros = 0.0f, at_most_sub = 0.0f, at_most[kNumBounds] = {}, finite = 0.0f, inf = 0.0f,
        neginf = 0.0f, negative = 0.0f;
  float lo = __builtin_huge_valf();  // least |x| over nonzero, zeros as kFloatMax
  float hi = 0.0f;                   // greatest |x| over non-NaN
  float s = 0.0f, c = 0.0f;          // s - c: the Kahan sum of the finite x
  float q = 0.0f, qc = 0.0f;         // Kahan sum of the runs of d^2
  float run[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the runs under way

  // One element; `r` picks the run its square goes to (a constant after unrolling).
  ZS_FHD void add(float x, const FastLimits& k, const TileCenter& ctr, int r) {
    const float ax = fabsf(x);
    const float t = mul_rn(x, 0x1p24f);  // |x| < 2^-149 * 2^24: the subnormal grid made normal
    const float is_zero = fma_sat(fabsf(t), -0x1p125f, 1.0f);
    zeros = add_rn(zeros, is_zero);
    if constexpr (!kByFields) {
      at_most_sub = add_rn(at_most_sub, fma_sat(fabsf(t), -0x1p125f, 0x1p23f));  // |x| < 2^-126
    }
#pragma unroll
    for (int b = 0; b < kNumBounds; ++b) {
      at_most[b] = add_rn(at_most[b], fma_sat(fabsf(t), k.bound_a[b], k.bound_b[b]));
    }
    negative = add_rn(negative, mul_sat(t, -0x1p125f));      // x < 0, -inf included
    inf = add_rn(inf, add_sat(ax, -kFloatMax));               // |x| = inf
    neginf = add_rn(neginf, fma_sat(x, -1.0f, -kFloatMax));   // x = -inf
    lo = min_f(lo, fma_rn(is_zero, kFloatMax, ax));          // NaN ignored
    hi = max_f(hi, ax);
    // A non-finite x enters the sums as the shift: d = 0, and fast_partial
    // takes its count times the shift off the sum of x.
    const bool is_finite = ax < __builtin_huge_valf();
    if constexpr (!kByFields) finite = is_finite ? add_rn(finite, 1.0f) : finite;
    const float y = is_finite ? x : ctr.shift;
    kahan_add(s, c, y);
    const float d = fma_rn(y, ctr.scale, ctr.nshift);
    run[r] = fma_rn(d, d, run[r]);
  }

  // After at most kRun elements into each run.
  ZS_FHD void end_group() {
    kahan_add(q, qc, add_rn(add_rn(run[0], run[1]), add_rn(run[2], run[3])));
    run[0] = run[1] = run[2] = run[3] = 0.0f;
  }

  ZS_FHD TileSums finish(uint32_t) const {
    TileSums t;
    t.zeros = zeros;
    t.at_most_sub = at_most_sub;
#pragma unroll
    for (int b = 0; b < kNumBounds; ++b) t.at_most[b] = at_most[b];
    t.finite = finite;
    t.non_nan = add_rn(finite, inf);  // kByFields: the infinities alone
    t.negative = negative;
    t.neginf = neginf;
    if constexpr (kByFields) {
      t.lo = bit_cast_to<uint32_t>(lo);  // settled for the block (settle_by_fields)
    } else if (finite > zeros) {
      t.lo = bit_cast_to<uint32_t>(lo);  // a finite nonzero |x| is at most lo's kFloatMax
    } else if (inf > 0.0f) {
      t.lo = 0x7f800000u;  // only infinities are nonzero
    }
    t.hi = bit_cast_to<uint32_t>(hi);  // 0 while no value but NaN came by
    t.s1 = static_cast<double>(s) - static_cast<double>(c);
    t.s2 = static_cast<double>(q) - static_cast<double>(qc);
    return t;
  }
};

// ---- Pairs of float16 lanes -------------------------------------------------------

// A 32-bit word holding two float16 lanes (low: element 2i, high: 2i + 1),
// operated on lane by lane: one HFMA2 / HADD2 / HMUL2 / VHMNMX for both.
// The host emulation computes each lane in float and rounds to float16
// once more; every use below is exact (scalings by powers of two, small
// integer counts, min/max) or saturates to exactly 0 or 1, which the second
// rounding cannot change.
ZS_FHD constexpr uint32_t pair(uint16_t v) { return v | (static_cast<uint32_t>(v) << 16); }

// CUDA's __half and __half2 are structs, which bit_cast_to does not take.
// __half goes through its raw struct. __half2 is copied from its word by
// __builtin_memcpy (never a fortified memcpy, see bit_cast_to), which ptxas
// reads as a move: built from __half2_raw it cost a shift and a byte permute
// a word in the float16 scan.
ZS_FHD __half half_of_bits(uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return __half(r);
}
ZS_FHD uint16_t bits_of_half(__half h) { return static_cast<__half_raw>(h).x; }
ZS_FHD __half2 half2_of_bits(uint32_t w) {
  __half2 h;
  __builtin_memcpy(&h, &w, sizeof(h));
  return h;
}

#if !defined(__CUDA_ARCH__)
inline float lane_value(uint32_t w, int lane) {
  return __half2float(half_of_bits(static_cast<uint16_t>(w >> (16 * lane))));
}
inline uint32_t from_lanes(float lo, float hi) {
  const uint16_t a = bits_of_half(__float2half_rn(lo));
  const uint16_t b = bits_of_half(__float2half_rn(hi));
  return a | (static_cast<uint32_t>(b) << 16);
}
#endif

ZS_FHD uint32_t h2_mul(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return from_lanes(lane_value(a, 0) * lane_value(b, 0), lane_value(a, 1) * lane_value(b, 1));
#endif
}
ZS_FHD uint32_t h2_add(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return from_lanes(lane_value(a, 0) + lane_value(b, 0), lane_value(a, 1) + lane_value(b, 1));
#endif
}
ZS_FHD uint32_t h2_add_sat(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("add.rn.sat.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return from_lanes(sat(lane_value(a, 0) + lane_value(b, 0)), sat(lane_value(a, 1) + lane_value(b, 1)));
#endif
}
ZS_FHD uint32_t h2_mul_sat(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("mul.rn.sat.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return from_lanes(sat(lane_value(a, 0) * lane_value(b, 0)), sat(lane_value(a, 1) * lane_value(b, 1)));
#endif
}
ZS_FHD uint32_t h2_fma_sat(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("fma.rn.sat.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return from_lanes(sat(std::fma(lane_value(a, 0), lane_value(b, 0), lane_value(c, 0))),
                    sat(std::fma(lane_value(a, 1), lane_value(b, 1), lane_value(c, 1))));
#endif
}
ZS_FHD uint32_t h2_fma(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return from_lanes(std::fma(lane_value(a, 0), lane_value(b, 0), lane_value(c, 0)),
                    std::fma(lane_value(a, 1), lane_value(b, 1), lane_value(c, 1)));
#endif
}
// |a| lane by lane (folds into the instruction that reads it).
ZS_FHD uint32_t h2_abs(uint32_t a) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("abs.f16x2 %0, %1;" : "=r"(r) : "r"(a));
  return r;
#else
  return a & 0x7fff7fffu;
#endif
}
#if !defined(__CUDA_ARCH__)
// max.f16x2 / min.f16x2 on the host: lane by lane, the lane `pick_b(a, b)`
// chooses; a NaN lane loses to any number, two NaNs give the canonical NaN.
template <typename PickB>
inline uint32_t h2_pick(uint32_t a, uint32_t b, PickB pick_b) {
  auto one = [&](uint16_t x, uint16_t y) -> uint16_t {
    const float fx = __half2float(half_of_bits(x)), fy = __half2float(half_of_bits(y));
    if (fx != fx) return fy != fy ? 0x7fff : y;
    if (fy != fy) return x;
    return pick_b(fx, fy) ? y : x;
  };
  return one(static_cast<uint16_t>(a), static_cast<uint16_t>(b)) |
         (static_cast<uint32_t>(one(static_cast<uint16_t>(a >> 16), static_cast<uint16_t>(b >> 16))) << 16);
}
#endif
// The larger lane by lane; a NaN lane loses to any number.
ZS_FHD uint32_t h2_max(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return h2_pick(a, b, [](float x, float y) { return y > x; });
#endif
}
// The smaller lane by lane; a NaN lane loses to any number.
ZS_FHD uint32_t h2_min(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return h2_pick(a, b, [](float x, float y) { return y < x; });
#endif
}
// A count pair's two lanes as one float (each lane an integer below 2^11).
ZS_FHD float h2_total(uint32_t a) {
#if defined(__CUDA_ARCH__)
  const __half2 h = half2_of_bits(a);
  return __low2float(h) + __high2float(h);
#else
  return lane_value(a, 0) + lane_value(a, 1);
#endif
}

// float16 constants (bits).
constexpr uint16_t kH1 = 0x3c00;       // 1
constexpr uint16_t kH1024 = 0x6400;    // 2^10
constexpr uint16_t kHNeg2p14 = 0xf400; // -2^14

// The 16-bit fast tally. Views, each of the word's two lanes read as float16:
//   R = w          raw bits: exact for float16; for bfloat16, its key as a
//                  float16 pattern: ordered like the keys below 0x7c00
//   T = R * 2^10   (subnormal float16 keys made normal, for the indicators)
//   S = (w ^ 0x7fff7fff) * 2^10  (bfloat16 only: keys turned round, its
//                  NaN and infinity keys 0x7f80.. made small and finite)
// float16 counts zeros, at_most_sub, at_most (the bounds) on |T|, negative on T
// (x * -2^24 saturated), finite (|R| * 0 + 1), non-NaN (|R| + 1) and -inf
// (-R - 65504) on R. bfloat16 counts zeros, at_most_sub, at_most and
// negative the same way, which is exact below key 0x7c00 (|x| < 2^121), and
// non-finite, NaN and -inf (S + 127 * 2^-14 = 0) on S. A finite bfloat16
// beyond 2^121, which no view orders, overflows the squares of its tile
// (kBf16LargestSample), which then goes to Tally.
// The extremes are float16 max / min of |R| (NaN lanes lose) and of |R|
// with zeros as 65504 (an ambiguous least key 0x7bff that fast_partial
// settles from the counts).
template <typename S, bool kByFields = false>
struct FastTally16 {
  static constexpr bool kBf16 = std::is_same_v<S, bf16_t>;
  // float16 count pairs (per lane below 2^11: the tiling bounds a thread's
  // tile share to 2^12 elements, 2^11 per lane).
  uint32_t zeros = 0, at_most_sub = 0, at_most[kNumBounds] = {}, negative = 0;
  uint32_t c4 = 0, c5 = 0, c6 = 0;  // float16: finite, non-NaN, -inf; bfloat16: non-finite, NaN, -inf
  uint32_t top = 0;                 // max of |R|
  uint32_t low = pair(0x7c00);      // min of |R|, zeros as 65504
  float runs1[4] = {0, 0, 0, 0}, runs2[4] = {0, 0, 0, 0};  // sums of d and d^2, per vector of a group
  float q1 = 0, q1c = 0, q2 = 0, q2c = 0;  // Kahan sums of the runs
  float pads = 0.0f;                        // NaN lanes added for lone elements
  uint32_t raw[2] = {0, 0}, nonzero[2] = {0, 0};  // the words awaiting extremes()

  // Word w (elements of run `run`); kept in raw[slot] for extremes().
  ZS_FHD void word(uint32_t w, const FastLimits& k, const TileCenter& ctr, int run, int slot) {
    const uint32_t t = h2_mul(w, pair(kH1024));
    const uint32_t at = h2_abs(t);
    const uint32_t is_zero = h2_fma_sat(at, pair(kHNeg2p14), pair(kH1));
    zeros = h2_add(zeros, is_zero);
    // key <= sub_max: bfloat16 0x7f (T = 127 * 2^-14), float16 0x3ff (1023 * 2^-14).
    if constexpr (!kByFields) {
      at_most_sub = h2_add(at_most_sub, h2_fma_sat(at, pair(kHNeg2p14), pair(kBf16 ? 0x5800 : 0x6400)));
    }
#pragma unroll
    for (int b = 0; b < kNumBounds; ++b) {
      at_most[b] = h2_add(at_most[b], h2_fma_sat(at, pair(static_cast<uint16_t>(k.bound_ab[b])),
                                                 pair(static_cast<uint16_t>(k.bound_ab[b] >> 16))));
    }
    negative = h2_add(negative, h2_mul_sat(t, pair(kHNeg2p14)));
    const uint32_t ar = h2_abs(w);
    uint32_t finite_view = w;  // |R| < inf: float16's finite values
    if constexpr (kBf16) {
      const uint32_t sv = h2_mul(w ^ 0x7fff7fffu, pair(kH1024));
      finite_view = sv;  // |S| > 127 * 2^-14 or NaN: bfloat16's finite values
      const uint32_t as = h2_abs(sv);
      if constexpr (!kByFields) {
        c4 = h2_add(c4, h2_fma_sat(as, pair(kHNeg2p14), pair(0x5800)));  // key >= 0x7f80: |S| <= 127 * 2^-14
      }
      c5 = h2_add(c5, h2_fma_sat(as, pair(kHNeg2p14), pair(0x57f0)));  // key >= 0x7f81: |S| <= 126 * 2^-14
      const uint32_t off = h2_abs(h2_add(sv, pair(0x1ff0)));            // S + 127 * 2^-14: 0 for -inf alone
      c6 = h2_add(c6, h2_fma_sat(off, pair(kHNeg2p14), pair(kH1)));
    } else {
      if constexpr (!kByFields) c4 = h2_add(c4, h2_fma_sat(ar, 0u, pair(kH1)));  // finite
      c5 = h2_add(c5, h2_add_sat(ar, pair(kH1)));                     // not NaN: sat(|R| + 1)
      c6 = h2_add(c6, h2_fma_sat(w, pair(0xbc00), pair(0xfbff)));     // -inf: sat(-x - 65504)
    }
    raw[slot] = ar;
    nonzero[slot] = h2_fma(is_zero, pair(0x7bff), ar);  // a zero lane becomes 65504
    moments(finite_view, lane_float(w, 0), lane_float(w, 1), ctr, run);
  }

  // The extremes of the two words since the last call: three-input float16
  // max and min, one instruction each for two words.
  ZS_FHD void extremes() {
    top = h2_max(top, h2_max(raw[0], raw[1]));
    low = h2_min(low, h2_min(nonzero[0], nonzero[1]));
  }

  // A word of two elements of the tile, without a partner word.
  ZS_FHD void one_word(uint32_t w, const FastLimits& k, const TileCenter& ctr) {
    word(w, k, ctr, 0, 0);
    raw[1] = raw[0];
    nonzero[1] = nonzero[0];
    extremes();
  }

  // A word with one element of the tile in lane `lane` (0 or 1) beside a
  // NaN pad. Callers alternate the lanes, so that neither lane of a count
  // pair counts more than half a thread's elements, rounded up.
  ZS_FHD void lone(uint16_t bits, int lane, const FastLimits& k, const TileCenter& ctr) {
    const uint32_t nan = kBf16 ? 0x7fc0u : 0x7e00u;
    one_word(lane == 0 ? bits | (nan << 16) : nan | (static_cast<uint32_t>(bits) << 16), k, ctr);
    pads = add_rn(pads, 1.0f);
  }

  ZS_FHD void end_group() {
    kahan_add(q1, q1c, add_rn(add_rn(runs1[0], runs1[1]), add_rn(runs1[2], runs1[3])));
    kahan_add(q2, q2c, add_rn(add_rn(runs2[0], runs2[1]), add_rn(runs2[2], runs2[3])));
#pragma unroll
    for (int r = 0; r < 4; ++r) runs1[r] = runs2[r] = 0.0f;
  }

  // `elements`: the tile's elements this thread added (pads not included).
  ZS_FHD TileSums finish(uint32_t elements) const {
    TileSums t;
    t.zeros = h2_total(zeros);
    t.at_most_sub = h2_total(at_most_sub);
#pragma unroll
    for (int b = 0; b < kNumBounds; ++b) t.at_most[b] = h2_total(at_most[b]);
    t.negative = h2_total(negative);
    t.neginf = h2_total(c6);
    float inf = 0.0f;  // bfloat16's (kByFields: settle_by_fields's)
    if constexpr (kBf16) {
      const float lanes = add_rn(static_cast<float>(elements), pads);
      const float nan = h2_total(c5);
      t.non_nan = add_rn(lanes, -nan);
      t.negative = add_rn(t.negative, t.neginf);  // T saw -inf as float16 NaN
      if constexpr (!kByFields) {
        const float nonfinite = h2_total(c4);
        t.finite = add_rn(lanes, -nonfinite);
        inf = add_rn(nonfinite, -nan);
      }
    } else {
      t.finite = h2_total(c4);  // kByFields: 0, settled for the block
      t.non_nan = h2_total(c5);
    }
    // float16's infinity is its largest |R|; bfloat16's is a NaN there.
    const uint32_t top_lo = top & 0xffffu, top_hi = top >> 16;
    t.hi = kBf16 && inf > 0.0f ? 0x7f80u : (top_lo > top_hi ? top_lo : top_hi);
    // Lanes below 0x7bff are exact least keys; 0x7bff and above (65504,
    // inf: no nonzero lane below 0x7bff) are settled by fast_partial.
    const uint32_t low_lo = low & 0xffffu, low_hi = low >> 16;
    const uint32_t least = low_lo < low_hi ? low_lo : low_hi;
    t.lo = least < 0x7bffu ? least : 0x7bffu;
    t.s1 = static_cast<double>(q1) - static_cast<double>(q1c);
    t.s2 = static_cast<double>(q2) - static_cast<double>(q2c);
    return t;
  }

 private:
  // Lane `lane` of w as a float32, exactly.
  ZS_FHD static float lane_float(uint32_t w, int lane) {
    if constexpr (kBf16) {
      return bit_cast_to<float>(lane == 0 ? w << 16 : w & 0xffff0000u);
    } else {
#if defined(__CUDA_ARCH__)
      const __half2 h = half2_of_bits(w);
      return lane == 0 ? __low2float(h) : __high2float(h);
#else
      return lane_value(w, lane);
#endif
    }
  }

  // The moments of the word's two elements, each summed only where it is
  // finite: |R| < inf for float16, |S| > 127 * 2^-14 (or NaN: a key below
  // 0x3ff) for bfloat16. Predicated on one HSETP2.
  ZS_FHD void moments(uint32_t view, float x0, float x1, const TileCenter& ctr, int run) {
    const float d0 = fma_rn(x0, ctr.scale, ctr.nshift);
    const float d1 = fma_rn(x1, ctr.scale, ctr.nshift);
#if defined(__CUDA_ARCH__)
    if constexpr (kBf16) {
      asm("{\n\t"
          ".reg .pred p, q;\n\t"
          ".reg .b32 a;\n\t"
          "abs.f16x2 a, %4;\n\t"
          "setp.gtu.f16x2 p|q, a, %5;\n\t"
          "@p add.rn.f32 %0, %0, %2;\n\t"
          "@p fma.rn.f32 %1, %2, %2, %1;\n\t"
          "@q add.rn.f32 %0, %0, %3;\n\t"
          "@q fma.rn.f32 %1, %3, %3, %1;\n\t"
          "}"
          : "+f"(runs1[run]), "+f"(runs2[run])
          : "f"(d0), "f"(d1), "r"(view), "r"(pair(0x1ff0)));
    } else {
      asm("{\n\t"
          ".reg .pred p, q;\n\t"
          ".reg .b32 a;\n\t"
          "abs.f16x2 a, %4;\n\t"
          "setp.lt.f16x2 p|q, a, %5;\n\t"
          "@p add.rn.f32 %0, %0, %2;\n\t"
          "@p fma.rn.f32 %1, %2, %2, %1;\n\t"
          "@q add.rn.f32 %0, %0, %3;\n\t"
          "@q fma.rn.f32 %1, %3, %3, %1;\n\t"
          "}"
          : "+f"(runs1[run]), "+f"(runs2[run])
          : "f"(d0), "f"(d1), "r"(view), "r"(pair(0x7c00)));
    }
#else
    bool p = false, q = false;
    for (int lane = 0; lane < 2; ++lane) {
      const float v = fabsf(lane_value(view, lane));
      const bool finite = kBf16 ? !(v <= 127 * 0x1p-14f) : v < __builtin_huge_valf();
      (lane == 0 ? p : q) = finite;
    }
    if (p) {
      runs1[run] = add_rn(runs1[run], d0);
      runs2[run] = fma_rn(d0, d0, runs2[run]);
    }
    if (q) {
      runs1[run] = add_rn(runs1[run], d1);
      runs2[run] = fma_rn(d1, d1, runs2[run]);
    }
#endif
  }
};

// A block's TileSums from FastTally<T, true>, completed from its histogram:
// `low_field` elements in field 0 (zeros and subnormals: at_most_sub, as
// tiny is the smallest normal) and `top_field` in the all-ones exponent
// field (infinities and NaN) of `positions`. All counts are exact floats.
template <typename T>
ZS_FHD void settle_by_fields(TileSums& s, float low_field, float top_field, float positions) {
  s.at_most_sub = low_field;
  s.finite = add_rn(positions, -top_field);
  if constexpr (std::is_same_v<T, float>) {
    const float inf = s.non_nan;  // the threads' non_nan held their infinities
    s.non_nan = add_rn(s.finite, inf);
    if (!(s.finite > s.zeros)) s.lo = inf > 0.0f ? 0x7f800000u : ~0u;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    if (s.non_nan > s.finite) s.hi = 0x7f80u;  // an infinity
  }
}

// ---- A tile's partial --------------------------------------------------------

// The Partial of a tile of `positions` elements of storage type T from its
// block's TileSums; false when its moments must be summed again (by Tally):
// sums that overflowed, squares of deviations that may have underflowed (a
// tile whose nonzero values all lie within 2^-50 of the sample's scale of the
// shift), or a shift so far from the tile's mean that the float32 rounding
// of the squares would weigh more than twice as much in the variance.
template <typename T>
ZS_FHD bool fast_partial(const TileSums& s, const TileCenter& ctr, int64_t positions, Partial& p) {
  using F = Format<T>;
  using key_t = typename F::key_t;
  p = empty_partial();
  const int64_t zeros = static_cast<int64_t>(s.zeros);
  const int64_t finite = static_cast<int64_t>(s.finite);
  const int64_t non_nan = static_cast<int64_t>(s.non_nan);
  p.numel = positions;
  p.zeros = zeros;
  p.subnormal = static_cast<int64_t>(s.at_most_sub) - zeros;
  p.nan = positions - non_nan;
  p.neginf = static_cast<int64_t>(s.neginf);
  p.posinf = non_nan - finite - p.neginf;
  p.negative = static_cast<int64_t>(s.negative);
  int64_t within[kNumBounds];
  for (int k = 0; k < kNumBounds; ++k) within[k] = static_cast<int64_t>(s.at_most[k]);
  set_magnitude_counts(p, within);
  uint32_t lo = s.lo;
  if constexpr (!std::is_same_v<T, float>) {
    // 0x7bff: no nonzero lane below it; any finite nonzero key is then 0x7bff
    // itself (float16's 65504; a bfloat16 above it, past 2^121, overflows the
    // squares and sends the tile to Tally below), else the least nonzero key
    // is an infinity's, if any.
    if (lo >= 0x7bffu) lo = finite > zeros ? 0x7bffu : (std::is_same_v<T, bf16_t> ? 0x7f80u : 0x7c00u);
  }
  if (non_nan > zeros) p.min_abs_nonzero = F::magnitude(static_cast<key_t>(lo));
  if (non_nan > 0) {
    p.min_abs = zeros > 0 ? 0.0 : p.min_abs_nonzero;
    p.max_abs = F::magnitude(static_cast<key_t>(s.hi));
  }
  if (finite == 0) return true;
  const double n = static_cast<double>(finite);
  // Every element the same finite nonzero value (|x| from one key, one
  // sign): no deviation to sum, whatever underflowed.
  if (zeros == 0 && non_nan == finite && lo == s.hi && (p.negative == 0 || p.negative == finite)) {
    p.mean = p.negative == 0 ? p.max_abs : -p.max_abs;
    p.m2 = 0.0;
    return true;
  }
  const double scale = ctr.scale, shift = ctr.shift;
  // The sum of the scaled deviations d.
  // float32 summed every element, the non-finite ones as the shift.
  const double sum_x = s.s1 - static_cast<double>(positions - finite) * shift;
  const double sum_d = std::is_same_v<T, float> ? (sum_x - n * shift) * scale : s.s1;
  if (!finite_double(sum_x) || !finite_double(s.s2) || !finite_double(sum_d)) return false;
  const double cross = sum_d * sum_d / n;
  if (cross > 0.5 * s.s2) return false;
  if (s.s2 < n * 0x1p-100 && finite > zeros) return false;
  const double inv = 1.0 / scale;  // a power of two: exact
  const double mean = std::is_same_v<T, float> ? sum_x / n : shift + sum_d * inv / n;
  const double m2 = (s.s2 - cross) * inv * inv;
  p.mean = within_range(mean);
  p.m2 = m2 > 0.0 ? m2 : 0.0;
  return true;
}

#endif  // defined(__CUDACC__)

}  // namespace cuda
}  // namespace zeroscan
