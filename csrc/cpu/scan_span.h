// The CPU's scan of one contiguous span, free of torch headers.
//
// Every element goes through the exact classification of classify.h, with no
// branch on its value. On x86-64 CPUs with AVX-512 the span is read 64 bytes
// at a time and the classification runs on all lanes at once: each key test
// is one mask compare, each count a masked subtraction into narrow lane
// counters (widened every kFold<W> vectors), min/max |x| are integer min/max on
// the keys, and the moments are summed as the Moments section says. So a span
// of zeros or subnormals costs what a span of ordinary values costs; NaN and
// infinities are counted per run of vectors (see Runs), which costs a second
// pass over the runs that hold any. The last few elements of a span, and
// every element on CPUs without AVX-512, go through Tally::add one at a time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ZS_HAVE_AVX512_KERNELS 1
#endif

#include "../classify.h"

namespace zeroscan {
namespace cpu {

// ZEROSCAN_CPU_CAPABILITY caps what the scan may use, so that one machine
// tests the paths of CPUs with less (as ATEN_CPU_CAPABILITY does for torch):
// "scalar" (no AVX-512), "avx512" (AVX-512 without VNNI or VBMI), "native" or
// unset (all the CPU has). Other values read as kInvalid, which the operator
// refuses before scanning.
enum class Capability { kScalar, kAvx512, kNative, kInvalid };

inline Capability capability_cap() {
  static const Capability cap = [] {
    const char* v = std::getenv("ZEROSCAN_CPU_CAPABILITY");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "native") == 0) return Capability::kNative;
    if (std::strcmp(v, "avx512") == 0) return Capability::kAvx512;
    if (std::strcmp(v, "scalar") == 0) return Capability::kScalar;
    return Capability::kInvalid;
  }();
  return cap;
}

inline bool capability_allows(Capability needed) {
  const Capability cap = capability_cap();
  return cap != Capability::kInvalid && static_cast<int>(cap) >= static_cast<int>(needed);
}

// p: [n] contiguous. Adds its elements to `t` one at a time.
template <typename S>
void scan_span_scalar(const S* p, int64_t n, const Limits& lim, double shift,
                      Tally<S, int64_t>& t) {
  for (int64_t i = 0; i < n; ++i) t.add(p[i], lim, shift);
}

#if defined(ZS_HAVE_AVX512_KERNELS)

#define ZS_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,fma,bmi2")))
#define ZS_VEC __attribute__((always_inline)) inline ZS_AVX512

// The narrow lane counters of W-byte lanes summed into 8 uint64 lanes.
template <int W>
ZS_VEC __m512i widen_lane_counts(__m512i c) {
  if constexpr (W == 1) {
    return _mm512_sad_epu8(c, _mm512_setzero_si512());
  } else if constexpr (W == 8) {
    return c;
  } else {
    if constexpr (W == 2) c = _mm512_madd_epi16(c, _mm512_set1_epi16(1));  // u32 pairs
    return _mm512_add_epi64(_mm512_srli_epi64(c, 32),
                            _mm512_and_si512(c, _mm512_set1_epi64(0xffffffff)));
  }
}

// AVX-512 operations on the 64 / W unsigned lanes of W bytes in one vector.
// Each is one intrinsic whose name differs between widths only in its
// lane-size suffix (B bits), so ZS_LANES spells them once.
template <int W>
struct Lanes;

#define ZS_LANES(W, B, MASK)                                                  \
  template <>                                                                 \
  struct Lanes<W> {                                                           \
    using mask_t = MASK;                                                      \
    using lane_t = uint##B##_t;                                               \
    static ZS_VEC __m512i set1(uint64_t v) {                                  \
      return _mm512_set1_epi##B(static_cast<std::make_signed_t<lane_t>>(v));  \
    }                                                                         \
    static ZS_VEC mask_t le(__m512i a, __m512i b) { return _mm512_cmple_epu##B##_mask(a, b); } \
    static ZS_VEC mask_t nonzero(__m512i a) { return _mm512_test_epi##B##_mask(a, a); }        \
    static ZS_VEC mask_t eq(__m512i a, __m512i b) { return _mm512_cmpeq_epi##B##_mask(a, b); } \
    static ZS_VEC mask_t sign(__m512i a) { return _mm512_movepi##B##_mask(a); }                \
    /* Lanes of `k` where a <= b as signed integers. */                       \
    static ZS_VEC mask_t le_signed(mask_t k, __m512i a, __m512i b) {          \
      return _mm512_mask_cmple_epi##B##_mask(k, a, b);                        \
    }                                                                         \
    /* Adds 1 to the lanes of `m` (lane counters). */                         \
    static ZS_VEC __m512i count(__m512i c, mask_t m) {                        \
      return _mm512_mask_sub_epi##B(c, m, c, _mm512_set1_epi##B(-1));         \
    }                                                                         \
    static ZS_VEC __m512i sub(__m512i a, __m512i b) { return _mm512_sub_epi##B(a, b); }        \
    static ZS_VEC __m512i abs(__m512i a) { return _mm512_abs_epi##B(a); }                      \
    static ZS_VEC __m512i min(__m512i a, __m512i b) { return _mm512_min_epu##B(a, b); }        \
    static ZS_VEC __m512i max(__m512i a, __m512i b) { return _mm512_max_epu##B(a, b); }        \
    static ZS_VEC __m512i mask_min(__m512i a, mask_t m, __m512i b) {          \
      return _mm512_mask_min_epu##B(a, m, a, b);                              \
    }                                                                         \
    static ZS_VEC __m512i mask_max(__m512i a, mask_t m, __m512i b) {          \
      return _mm512_mask_max_epu##B(a, m, a, b);                              \
    }                                                                         \
    static ZS_VEC __m512i widen_counts(__m512i c) { return widen_lane_counts<W>(c); } \
  };

ZS_LANES(1, 8, __mmask64)
ZS_LANES(2, 16, __mmask32)
ZS_LANES(4, 32, __mmask16)
ZS_LANES(8, 64, __mmask8)
#undef ZS_LANES

// Horizontal min / max of the key lanes: narrow lanes are widened, half a
// vector at a time, until they are 32 bits wide.
ZS_VEC __m512i u8_halves_to_u16(__m512i a, bool take_min) {
  const __m512i lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(a));
  const __m512i hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(a, 1));
  return take_min ? _mm512_min_epu16(lo, hi) : _mm512_max_epu16(lo, hi);
}
ZS_VEC __m512i u16_halves_to_u32(__m512i a, bool take_min) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(a));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(a, 1));
  return take_min ? _mm512_min_epu32(lo, hi) : _mm512_max_epu32(lo, hi);
}

template <int W>
ZS_VEC uint64_t reduce_key(__m512i a, bool take_min) {
  if constexpr (W == 8) {
    return take_min ? _mm512_reduce_min_epu64(a) : _mm512_reduce_max_epu64(a);
  } else {
    if constexpr (W == 1) a = u8_halves_to_u16(a, take_min);
    if constexpr (W <= 2) a = u16_halves_to_u32(a, take_min);
    return static_cast<uint32_t>(take_min ? _mm512_reduce_min_epu32(a)
                                          : _mm512_reduce_max_epu32(a));
  }
}


// Vectors between widenings of the narrow lane counters of W-byte lanes: a
// lane counts at most one element per vector, and must not pass its maximum
// (255 for bytes, 65535 for 16-bit lanes).
template <int W>
constexpr int64_t kFold = W == 1 ? 255 : 4096;

// ---- Classification ------------------------------------------------------

// Narrow lane counters of classify.h's classes, and min/max of keys.
struct LaneCounts {
  __m512i nonzero, sub, tol, negative;
  __m512i lo_nonzero;  // min nonzero key
  __m512i hi;          // floats: max finite key; integers: max key
};
// The classes that tell NaN and infinities apart from finite values.
struct NonFiniteCounts {
  __m512i non_nan, finite, neginf;
};

// The limits of classify.h, broadcast to every lane.
struct VectorLimits {
  __m512i sub_max, tol_max, finite_max, nonnan_max;
  // Floats: the raw pattern of -inf (or, without infinities, of the
  // largest negative number). Read as signed integers, the raw patterns of
  // x < 0 are exactly those of nonzero keys at most it: -0 is the smallest
  // raw pattern and has key 0, and -NaN patterns lie above it.
  __m512i neginf;
};

// `lim` broadcast to the lanes of S.
template <typename S>
ZS_AVX512 VectorLimits vector_limits(const Limits& lim) {
  using F = Format<S>;
  using V = Lanes<sizeof(S)>;
  VectorLimits vl;
  vl.sub_max = V::set1(lim.sub_max);
  vl.tol_max = V::set1(lim.tol_max);
  vl.finite_max = V::set1(lim.finite_max);
  vl.nonnan_max = V::set1(lim.nonnan_max);
  uint64_t sign_bit = 0;
  if constexpr (F::kFloating) sign_bit = F::kSignBit;
  vl.neginf = V::set1(sign_bit + lim.nonnan_max);
  return vl;
}

template <typename S>
ZS_VEC __m512i key_of(__m512i raw) {
  using F = Format<S>;
  using V = Lanes<sizeof(S)>;
  if constexpr (F::kFloating) {
    return _mm512_and_si512(raw, V::set1(F::kAbsMask));
  } else if constexpr (F::kSigned) {
    return V::abs(raw);  // |INT_MIN| wraps to 2^(w-1): right as unsigned
  } else if constexpr (std::is_same_v<S, bool_t>) {
    return V::min(raw, V::set1(1));
  } else {
    return raw;
  }
}

// Counts the zero, subnormal, near-zero and negative lanes of one vector
// (key = key_of(raw)), and min nonzero |x|; returns the negative lanes
// (floats: nonzero, not NaN, sign set).
template <typename S>
ZS_VEC typename Lanes<sizeof(S)>::mask_t count_common(__m512i raw, __m512i key,
                                                      const VectorLimits& lim, LaneCounts& c) {
  using F = Format<S>;
  using V = Lanes<sizeof(S)>;
  const auto nonzero = V::nonzero(key);
  c.nonzero = V::count(c.nonzero, nonzero);
  c.lo_nonzero = V::mask_min(c.lo_nonzero, nonzero, key);
  typename V::mask_t negative = 0;
  if constexpr (F::kFloating) {
    c.sub = V::count(c.sub, V::le(key, lim.sub_max));
    negative = V::le_signed(nonzero, raw, lim.neginf);
  } else if constexpr (F::kSigned) {
    negative = V::sign(raw);
  }
  if constexpr (F::kFloating || F::kSigned) c.negative = V::count(c.negative, negative);
  c.tol = V::count(c.tol, V::le(key, lim.tol_max));
  return negative;
}

// Counts the NaN and infinite lanes of one vector and returns its finite
// lanes (every lane, for integers).
template <typename S>
ZS_VEC typename Lanes<sizeof(S)>::mask_t count_non_finite(__m512i raw, __m512i key,
                                                          const VectorLimits& lim,
                                                          NonFiniteCounts& c) {
  using F = Format<S>;
  using V = Lanes<sizeof(S)>;
  using mask_t = typename V::mask_t;
  mask_t finite = static_cast<mask_t>(~mask_t(0));
  if constexpr (F::kHasNan) {
    finite = V::le(key, lim.nonnan_max);
    c.non_nan = V::count(c.non_nan, finite);
  }
  if constexpr (F::kHasInf) {
    finite = V::le(key, lim.finite_max);
    c.finite = V::count(c.finite, finite);
    c.neginf = V::count(c.neginf, V::eq(raw, lim.neginf));
  }
  return finite;
}

// ---- Moments ---------------------------------------------------------------
//
// What is summed, per dtype:
//   float64              d = x - shift and d^2, in double.
//   other floats         x in double (exact but for the double sums' own
//                        rounding: float32 sums of x lose the mean of
//                        zero-centred data as soon as small values mix with
//                        large ones), and d^2 in float32 runs; float16 and
//                        the float8 types sum x in float32 runs too, exactly
//                        (below).
//   integers             d and d^2 in double, or exactly (kExactBytes).
// A run is kRun<W> vectors, whose float32 sums are folded into double at
// its end, so a float32 lane adds at most 16 terms: the squares are
// positive, and their float32 sums stay within ~16 roundings (1e-6) of
// exact however long the tensor. sum(d) is then sum(x) - n * shift, in
// double. float32 and bfloat16 reach 2^-149 and 2^128, beyond what float32
// squares hold, so their runs square d * 2^k (RunScale).

// Eight consecutive integers, widened exactly to double.
ZS_VEC __m512d widen8(const int16_t* p) {
  return _mm512_cvtepi32_pd(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
ZS_VEC __m512d widen8(const int32_t* p) {
  return _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ZS_VEC __m512d widen8(const int64_t* p) { return _mm512_cvtepi64_pd(_mm512_loadu_si512(p)); }

template <typename S>
constexpr bool kFloat32Squares = Format<S>::kFloating && sizeof(S) <= 4;
// float8_e4m3fn values are whole multiples of 2^-9 below 2^9: the 32 that a
// run sums into one lane sum to less than 2^23 such units, which float32
// holds exactly (CPUs with VBMI and VNNI sum them in integers instead).
template <typename S>
constexpr bool kFloat32Values = std::is_same_v<S, e4m3_t>;
// float16 values (and float8_e5m2's, a subset) are whole multiples of 2^-24
// below 2^16. Each is split exactly into hi, x rounded to a multiple of 2^-4
// by adding and subtracting kSplitPoint (1.5 * 2^19, whose float32 ulp is
// 2^-4), and lo = x - hi, |lo| <= 2^-5. Sums of at most 16 his (below 2^20,
// in steps of 2^-4) and of at most 32 los (below 1, in steps of 2^-24) fit
// float32's 24 bits, so both are exact: four float32 additions instead of
// two conversions to double, which cost more.
template <typename S>
constexpr bool kSplitValues = std::is_same_v<S, f16_t> || std::is_same_v<S, e5m2_t>;
constexpr float kSplitPoint = 0x1.8p19f;
template <typename S>
constexpr bool kScaledSquares = std::is_same_v<S, float> || std::is_same_v<S, bf16_t>;

// widen16 gives the values divided by this power of two.
template <typename S>
constexpr float kWidenScale = std::is_same_v<S, e4m3_t> ? 256.0f : 1.0f;

// Floats of up to 32 bits: the g-th 16 values of the vector `raw` as
// float32, exactly (divided by kWidenScale<S>). The lanes come in some
// order (sums do not care), which masks follow through lanes_of. Every
// conversion is exact and ignores MXCSR's denormals-are-zero.
ZS_VEC __m512 widen16(float, __m512i raw, int) { return _mm512_castsi512_ps(raw); }
ZS_VEC __m512 widen16(bf16_t, __m512i raw, int g) {
  // bfloat16 is the top half of a float32: interleaving zeros below the
  // values widens them (elements 0-3, 8-11, ... for g = 0; the rest for 1).
  const __m512i z = _mm512_setzero_si512();
  return _mm512_castsi512_ps(g == 0 ? _mm512_unpacklo_epi16(z, raw) : _mm512_unpackhi_epi16(z, raw));
}
ZS_VEC __m512 half_to_float(__m512i h, int half) {
  return _mm512_cvtph_ps(half == 0 ? _mm512_castsi512_si256(h) : _mm512_extracti64x4_epi64(h, 1));
}
ZS_VEC __m512 widen16(f16_t, __m512i raw, int g) { return half_to_float(raw, g); }
// float8 as float16 bits: e5m2 is the top byte of a float16, so a zero byte
// interleaved below each value widens it (group g: bytes 16 j + 8 (g & 1)
// + 0..7 of each 128-bit lane j in half g / 2). e4m3 moves its 7 magnitude
// bits one place down into the float16's (x * 2^-8: the biases differ by 8),
// the sign staying on top. NaN and Inf lanes come out finite; they are
// masked out or summed again.
ZS_VEC __m512i bytes_as_high(__m512i raw, int g) {
  const __m512i z = _mm512_setzero_si512();
  return (g & 1) == 0 ? _mm512_unpacklo_epi8(z, raw) : _mm512_unpackhi_epi8(z, raw);
}
ZS_VEC __m512 widen16(e5m2_t, __m512i raw, int g) { return half_to_float(bytes_as_high(raw, g), g >> 1); }
ZS_VEC __m512 widen16(e4m3_t, __m512i raw, int g) {
  const __m512i h = _mm512_and_si512(_mm512_srai_epi16(bytes_as_high(raw, g), 1),
                                     _mm512_set1_epi16(static_cast<short>(0xbfff)));
  return half_to_float(h, g >> 1);
}

// The bits of a vector mask that belong to widen16's lanes of group g.
template <typename S>
ZS_VEC __mmask16 lanes_of(typename Lanes<sizeof(S)>::mask_t m, int g) {
  const uint64_t bits = static_cast<uint64_t>(m);
  if constexpr (std::is_same_v<S, bf16_t>) {
    return static_cast<__mmask16>(_pext_u64(bits, g == 0 ? 0x0f0f0f0full : 0xf0f0f0f0ull));
  } else if constexpr (sizeof(S) == 1) {
    const uint64_t pick = ((g & 1) == 0 ? 0x00ff00ffull : 0xff00ff00ull) << (32 * (g >> 1));
    return static_cast<__mmask16>(_pext_u64(bits, pick));
  } else {
    return static_cast<__mmask16>(bits >> (16 * g));
  }
}

ZS_VEC __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// The power of two 2^k by which float32 and bfloat16 runs scale d before
// squaring it. Let M be the larger of a run's largest finite |x| and |shift|
// (every |d| is at most 2 M). k puts M * 2^k in [1, 2) for some run before;
// a run whose own M * 2^k leaves [2^-40, 2^40] squares again with its own
// k (rescale_run). Inside that window no sum of squares overflows (16 terms
// of at most 2^84), and squares too small for float32 are below 2^-126 of
// the run's largest. Data whose magnitude jumps by 2^40 from one run to the
// next pays a second pass over that run; no distribution zeroscan measures
// does. The narrower floats' squares always fit: k stays 0.
struct RunScale {
  __m512 scale;              // 2^k * kWidenScale
  __m512 shift;              // shift * 2^k (the shift is a float32 value)
  __m512d unscale;           // 2^-2k
  __m512i low_key, high_key; // the smallest keys at least 2^(-40-k), 2^(40-k)
  bool shift_in_window;      // |shift| * 2^k >= 2^-40
  bool shift_is_zero;
};

constexpr int kWindow = 40;

// The smallest key of S (float32 or bfloat16) whose magnitude is at least
// 2^e; above every finite key when 2^e overflows.
template <typename S>
uint64_t key_at_least(int e) {
  uint32_t bits = bit_cast_to<uint32_t>(std::ldexp(1.0f, e));  // 0 or inf at the ends
  if constexpr (std::is_same_v<S, bf16_t>) bits = (bits + 0xffffu) >> 16;
  return std::max<uint64_t>(bits, 1);
}

template <typename S>
ZS_AVX512 RunScale make_scale(int k, double shift) {
  using V = Lanes<sizeof(S)>;
  RunScale rs;
  rs.scale = _mm512_set1_ps(std::ldexp(kWidenScale<S>, k));
  rs.shift = _mm512_set1_ps(static_cast<float>(std::ldexp(shift, k)));
  rs.unscale = _mm512_set1_pd(std::ldexp(1.0, -2 * k));
  rs.low_key = V::set1(kScaledSquares<S> ? key_at_least<S>(-kWindow - k) : 0);
  rs.high_key = V::set1(kScaledSquares<S> ? key_at_least<S>(kWindow - k) : 0);
  rs.shift_in_window = std::fabs(std::ldexp(shift, k)) >= std::ldexp(1.0, -kWindow);
  rs.shift_is_zero = shift == 0.0;
  return rs;
}

// k with m * 2^k in [1, 2), within what a float32 power of two holds.
inline int scale_exponent(double m) {
  return m > 0.0 ? std::clamp(-std::ilogb(m), -126, 127) : 0;
}

// One run's sums. Each dtype uses the fields its section comment names;
// the others stay zero and cost nothing. A vector's groups go to different
// chains (the g-th to v1/q1 or v2/q2, its values' halves to w1, w2 or w3,
// w4), and the vector loop keeps two RunSums, for even and odd vectors, so
// that no chain of additions waits on its own last addition every vector.
struct RunSums {
  __m512 v1, v2;           // float32 sums of x (float8_e4m3fn) or of hi (kSplitValues)
  __m512 u1, u2;           // float32 sums of lo: kSplitValues
  __m512d w1, w2, w3, w4;  // double sums of x (other floats) or of d (float64)
  __m512 q1, q2;           // float32 sums of (d * 2^k)^2: floats of up to 32 bits
  __m512d r1;              // double sums of d^2: float64
};

ZS_VEC RunSums empty_run() {
  const __m512 z = _mm512_setzero_ps();
  const __m512d zd = _mm512_setzero_pd();
  return RunSums{z, z, z, z, zd, zd, zd, zd, z, z, zd};
}

ZS_VEC RunSums add_runs(const RunSums& a, const RunSums& b) {
  return RunSums{_mm512_add_ps(a.v1, b.v1), _mm512_add_ps(a.v2, b.v2),
                 _mm512_add_ps(a.u1, b.u1), _mm512_add_ps(a.u2, b.u2),
                 _mm512_add_pd(a.w1, b.w1), _mm512_add_pd(a.w2, b.w2),
                 _mm512_add_pd(a.w3, b.w3), _mm512_add_pd(a.w4, b.w4),
                 _mm512_add_ps(a.q1, b.q1), _mm512_add_ps(a.q2, b.q2),
                 _mm512_add_pd(a.r1, b.r1)};
}

// Adds one vector of floats to `r`. kMasked: the lanes of `finite` only,
// a masked-out lane adding exactly nothing; otherwise every lane.
// kValues: the sums of x too (a rescaled run sums its squares again only).
template <typename S, bool kMasked, bool kValues = true>
ZS_VEC void add_moments(__m512i raw, typename Lanes<sizeof(S)>::mask_t finite,
                        const RunScale& rs, double shift, RunSums& r) {
  if constexpr (std::is_same_v<S, double>) {
    const __m512d x = _mm512_castsi512_pd(raw);
    const __m512d s = _mm512_set1_pd(shift);
    const __m512d d = kMasked ? _mm512_maskz_sub_pd(static_cast<__mmask8>(finite), x, s)
                              : _mm512_sub_pd(x, s);
    r.w1 = _mm512_add_pd(r.w1, d);
    r.r1 = _mm512_fmadd_pd(d, d, r.r1);
  } else {
    constexpr int kGroups = 64 / static_cast<int>(sizeof(S)) / 16;
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) {
      const __m512 x = widen16(S{}, raw, g);
      // bfloat16 and float8_e5m2 widen NaN and Inf to float32 NaN and Inf,
      // which one classification finds faster than lanes_of gathers bits.
      constexpr bool kClassify = std::is_same_v<S, bf16_t> || std::is_same_v<S, e5m2_t>;
      const __mmask16 m = !kMasked ? 0
                          : kClassify ? static_cast<__mmask16>(~_mm512_fpclass_ps_mask(x, 0x99))
                                      : lanes_of<S>(finite, g);
      const __m512 d = kMasked ? _mm512_maskz_fmsub_ps(m, x, rs.scale, rs.shift)
                               : _mm512_fmsub_ps(x, rs.scale, rs.shift);
      auto& q = g % 2 == 0 ? r.q1 : r.q2;
      q = _mm512_fmadd_ps(d, d, q);
      if constexpr (!kValues) continue;
      const __m512 v = kMasked ? _mm512_maskz_mov_ps(m, x) : x;
      if constexpr (kFloat32Values<S>) {
        auto& acc = g % 2 == 0 ? r.v1 : r.v2;
        acc = _mm512_add_ps(acc, v);
      } else if constexpr (kSplitValues<S>) {
        const __m512 point = _mm512_set1_ps(kSplitPoint);
        const __m512 hi = _mm512_sub_ps(_mm512_add_ps(v, point), point);
        auto& his = g % 2 == 0 ? r.v1 : r.v2;
        auto& los = g % 2 == 0 ? r.u1 : r.u2;
        his = _mm512_add_ps(his, hi);
        los = _mm512_add_ps(los, _mm512_sub_ps(v, hi));
      } else {
        auto& low = g % 2 == 0 ? r.w1 : r.w3;
        auto& high = g % 2 == 0 ? r.w2 : r.w4;
        low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        high = _mm512_add_pd(high, _mm512_cvtps_pd(high_half(v)));
      }
    }
  }
}

// Calls scan_vector(k, parity) for k in [0, n), parity 0 for even k and 1
// for odd: the two sets of accumulator chains of RunSums.
template <typename ScanVector>
ZS_VEC void in_pairs(int64_t n, ScanVector&& scan_vector) {
  int64_t k = 0;
  for (; k + 2 <= n; k += 2) {
    scan_vector(k, 0);
    scan_vector(k + 1, 1);
  }
  if (k < n) scan_vector(k, 0);
}

// ---- Runs: NaN and infinities out of the vector loop -----------------------
//
// Floats are scanned in runs of kRun<W> vectors. The loop counts every class
// but NaN and infinities, sums every lane into the run's own sums, and keeps
// the run's largest key. A run whose largest key is finite (most runs of
// most data) is then folded as it is: its lanes were all finite. Only a run
// that holds NaN or an infinity is read again, in one pass that counts them
// and sums its finite lanes alone, and the runs after it count them in the
// loop until one holds none (scan_block). That keeps three compares and
// three counts per vector out of the loop for data without NaN or Inf; data
// with some in every run (a NaN-poisoned tensor) pays 1.5-1.7x. float8_e4m3fn
// on CPUs with VBMI and VNNI counts its NaN in the loop instead (its integer
// planes never add NaN, so that is all it needs).
template <int W>
constexpr int64_t kRun = W == 1 ? 8 : 16;

// A run of `vectors` vectors at p that holds NaN or an infinity, read once
// more: counts its NaN and infinite lanes into `c`, returns the sums of its
// finite lanes and sets `top` to its largest finite keys. One pass, with two
// chains as in the vector loop: data with a NaN every few thousand values
// (nonfinite_0.01) sends one run in twenty to forty here.
template <typename S>
__attribute__((noinline)) ZS_AVX512 RunSums redo_non_finite_run(
    const S* p, int64_t vectors, const VectorLimits& lim, const RunScale& rs, double shift,
    NonFiniteCounts& c, __m512i& top) {
  using V = Lanes<sizeof(S)>;
  constexpr int kLanes = 64 / static_cast<int>(sizeof(S));
  NonFiniteCounts counts = c;  // in registers while the loop runs
  __m512i finite_max = _mm512_setzero_si512();
  RunSums even = empty_run(), odd = empty_run();
  in_pairs(vectors, [&](int64_t k, int parity) __attribute__((always_inline)) ZS_AVX512 {
    const __m512i raw = _mm512_loadu_si512(p + k * kLanes);
    const __m512i key = key_of<S>(raw);
    const auto finite = count_non_finite<S>(raw, key, lim, counts);
    finite_max = V::mask_max(finite_max, finite, key);
    add_moments<S, true>(raw, finite, rs, shift, parity == 0 ? even : odd);
  });
  c = counts;
  top = finite_max;
  return add_runs(even, odd);
}

// The squares of the finite lanes of a run of `vectors` vectors at p.
template <typename S>
__attribute__((noinline, cold)) ZS_AVX512 RunSums sum_finite_squares(
    const S* p, int64_t vectors, const VectorLimits& lim, const RunScale& rs, double shift) {
  using V = Lanes<sizeof(S)>;
  constexpr int kLanes = 64 / static_cast<int>(sizeof(S));
  RunSums r = empty_run();
  for (int64_t k = 0; k < vectors; ++k) {
    const __m512i raw = _mm512_loadu_si512(p + k * kLanes);
    add_moments<S, true, false>(raw, V::le(key_of<S>(raw), lim.finite_max), rs, shift, r);
  }
  return r;
}

// A run outside its scale's window (run_max: its largest finite key): sets
// `rs` to the run's own scale and returns the run's squares summed again.
template <typename S>
ZS_AVX512 RunSums rescale_run(const S* p, int64_t vectors, const VectorLimits& lim,
                              __m512i run_max, double shift, RunScale& rs) {
  const auto top = static_cast<typename Format<S>::key_t>(reduce_key<sizeof(S)>(run_max, false));
  rs = make_scale<S>(scale_exponent(std::max(Format<S>::magnitude(top), std::fabs(shift))), shift);
  return sum_finite_squares(p, vectors, lim, rs, shift);
}

// ---- The vector loop -------------------------------------------------------

// Each vector asks for the one kPrefetchBytes ahead. The hardware prefetchers
// alone left the scan of tensors beyond the caches 15-25 % slower than its
// own speed on cached data (measured on Zen 5 at 64M elements, 4-16 KB ahead
// alike); a prefetch never faults, so reading ahead of a span's end is
// harmless.
constexpr int64_t kPrefetchBytes = 8192;

ZS_VEC void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

// a += the low 8 lanes of v, b += the high 8, in double.
ZS_VEC void add_to_double(__m512d& a, __m512d& b, __m512 v) {
  a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  b = _mm512_add_pd(b, _mm512_cvtps_pd(high_half(v)));
}

// The vector registers of one span's scan.
struct VectorTally {
  LaneCounts counts;
  NonFiniteCounts non_finite;  // floats: of the runs read again
  int64_t clean_vectors;       // floats: vectors of the other runs
  // Double sums. Floats of up to 32 bits: of x and of d^2; float64 and
  // integers of 16 bits and more: of d and d^2.
  __m512d s1a, s1b, s2a, s2b;
  RunScale scale;  // floats (used by those of up to 32 bits)
  // 1-byte integers: exact integer moments instead (see kExactBytes).
  __m512i sum;     // uint64 lanes: sums of the values (int8: plus 128)
  __m512i sum_sq;  // int32 lanes: sums of squares, widened every kFold<1>
};

struct VectorTotals {
  __m512i nonzero, sub, tol, negative, non_nan, finite, neginf;  // uint64
  __m512i sum_sq;                                                 // uint64
};

// int8, uint8 and bool: their moments are summed exactly in integers, which
// costs a handful of instructions per 64 elements instead of eight double
// conversions. The values: a sum of absolute differences of the bytes (int8
// biased to unsigned, u = x + 128). The squares, in int32 lanes: with
// AVX512-VNNI one multiply-add of unsigned by signed bytes, of u * x = x^2 +
// 128 x for int8 and of x * (x - 128) = x^2 - 128 x for uint8 and bool,
// corrected by the sum of the values at the end; without it, pairwise
// multiply-adds of the values widened to 16 bits.
template <typename S>
constexpr bool kExactBytes = sizeof(S) == 1 && !Format<S>::kFloating;

template <int W>
ZS_VEC void fold(__m512i& total, __m512i& narrow) {
  total = _mm512_add_epi64(total, Lanes<W>::widen_counts(narrow));
  narrow = _mm512_setzero_si512();
}

// Signed int32 lanes added into int64 lanes.
ZS_VEC void fold_signed(__m512i& total, __m512i& narrow) {
  const __m512i low = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(narrow));
  const __m512i high = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(narrow, 1));
  total = _mm512_add_epi64(total, _mm512_add_epi64(low, high));
  narrow = _mm512_setzero_si512();
}

// The window test of RunScale.
template <typename S>
ZS_VEC bool fits(const RunScale& rs, __m512i run_max) {
  using V = Lanes<sizeof(S)>;
  return V::le(rs.high_key, run_max) == 0 &&
         (V::le(rs.low_key, run_max) != 0 || rs.shift_in_window ||
          (rs.shift_is_zero && V::nonzero(run_max) == 0));
}

// acc + the sums of 4 products of unsigned bytes of u by signed bytes of s,
// per int32 lane (AVX512-VNNI's vpdpbusd). Written out, so that the loop
// needs no VNNI target of its own: only CPUs that report VNNI run it.
ZS_VEC __m512i dot_bytes(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
  return acc;
}

inline bool cpu_has_vnni() {
  static const bool has =
      __builtin_cpu_supports("avx512vnni") && capability_allows(Capability::kNative);
  return has;
}

// ---- float8_e4m3fn moments in integers -------------------------------------
//
// |x| * 2^9 is a whole number y = a * 2^E for every float8_e4m3fn value x,
// with a < 16 and E <= 14 (x = (8 + m) * 2^(e - 8) for an exponent field
// e >= 1, m * 2^-9 for e = 0). Written as y = b * 16^h, h = E / 4 and
// b = a * 2^(E mod 4) <= 120, both sums are four byte dot products (AVX512-
// VNNI): sum(sign * y) = sum_h 16^h sum(sign * b_h) and sum(y^2) = sum_h
// 256^h sum(b_h^2), where plane h holds b for the codes of that h and 0
// elsewhere (NaN's code too), looked up by x's 7 magnitude bits (AVX512-
// VBMI's two-table byte permute). The sums are then exact and need no shift;
// CPUs without VBMI or VNNI sum in float32 runs instead (Moments).
struct E4m3Planes {
  alignas(64) uint8_t b[4][128];
};

constexpr E4m3Planes make_e4m3_planes() {
  E4m3Planes t{};
  for (int code = 0; code < 0x7f; ++code) {  // 0x7f, NaN, stays 0 everywhere
    const int e = code >> 3, m = code & 7;
    const int a = e == 0 ? m : 8 + m;
    const int E = e == 0 ? 0 : e - 1;
    t.b[E / 4][code] = static_cast<uint8_t>(a << (E % 4));
  }
  return t;
}

inline constexpr E4m3Planes kE4m3Planes = make_e4m3_planes();

inline bool cpu_has_e4m3_planes() {
  static const bool has = __builtin_cpu_supports("avx512vbmi") &&
                          __builtin_cpu_supports("avx512vnni") &&
                          capability_allows(Capability::kNative);
  return has;
}

// The int32 lanes of the planes' sums (widened every kFold<1> vectors: a
// lane gains at most 4 * 120 and 4 * 120^2 per vector).
struct PlaneSums {
  __m512i values[4];   // sum(sign * b_h)
  __m512i squares[4];  // sum(b_h^2)
};

// Adds `vectors` vectors of float8_e4m3fn at p (at most kFold<1>) to the
// counts of `tally` and to `planes`; the vector loop of scan_block, with the
// moments of this section.
#define ZS_AVX512_PLANES \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,fma,bmi2,avx512vbmi,avx512vnni")))

// Adds one vector of float8_e4m3fn codes to the planes: sign * b_h to
// values[h] and b_h^2 to squares[h]; low/high: the halves of kE4m3Planes.b.
// The dot products go through dot_bytes, not GCC's intrinsic, which it
// scheduled worse here (the scan 3-5 % slower, measured on Zen 5).
__attribute__((always_inline)) ZS_AVX512_PLANES inline void add_planes(
    __m512i raw, __mmask64 negative, const __m512i low[4], const __m512i high[4],
    __m512i values[4], __m512i squares[4]) {
  const __m512i sign = _mm512_mask_blend_epi8(negative, _mm512_set1_epi8(1), _mm512_set1_epi8(-1));
#pragma GCC unroll 4
  for (int h = 0; h < 4; ++h) {
    // vpermi2b reads the low 7 bits of each index byte: |x|'s code.
    const __m512i b = _mm512_permutex2var_epi8(low[h], raw, high[h]);
    values[h] = dot_bytes(values[h], b, sign);
    squares[h] = dot_bytes(squares[h], b, b);
  }
}

__attribute__((noinline)) ZS_AVX512_PLANES inline void scan_block_e4m3(
    const e4m3_t* p, int64_t vectors, const VectorLimits& lim, VectorTally& tally,
    PlaneSums& planes) {
  using S = e4m3_t;
  using V = Lanes<1>;
  LaneCounts c = tally.counts;
  __m512i low[4], high[4], values[4], squares[4];
  for (int h = 0; h < 4; ++h) {
    low[h] = _mm512_load_si512(kE4m3Planes.b[h]);
    high[h] = _mm512_load_si512(kE4m3Planes.b[h] + 64);
    values[h] = planes.values[h];
    squares[h] = planes.squares[h];
  }
  NonFiniteCounts nf = tally.non_finite;
  // NaN is counted here, in the loop: two instructions a vector, fewer than
  // a run structure around the loop costs this short a loop (see Runs).
  for (int64_t k = 0; k < vectors; ++k) {
    prefetch_ahead(p + k * 64);
    const __m512i raw = _mm512_loadu_si512(p + k * 64);
    const __m512i key = key_of<S>(raw);
    const __mmask64 negative = count_common<S>(raw, key, lim, c);
    const __mmask64 finite = count_non_finite<S>(raw, key, lim, nf);
    c.hi = V::mask_max(c.hi, finite, key);
    add_planes(raw, negative, low, high, values, squares);
  }
  tally.non_finite = nf;
  for (int h = 0; h < 4; ++h) {
    planes.values[h] = values[h];
    planes.squares[h] = squares[h];
  }
  tally.counts = c;
}

// Adds `vectors` vectors of 64 bytes at p to `tally` (at most kFold<W> of
// them, so that no narrow lane counter overflows); kVnni: the squares of
// kExactBytes by dot_bytes. Not inlined: a loop of its own keeps every
// accumulator in a register.
template <typename S, bool kVnni = false>
__attribute__((noinline)) ZS_AVX512 void scan_block(const S* p, int64_t vectors,
                                                    const VectorLimits& lim, double shift,
                                                    VectorTally& tally) {
  using F = Format<S>;
  constexpr int W = sizeof(S);
  using V = Lanes<W>;
  using mask_t = typename V::mask_t;
  constexpr int kLanes = 64 / W;
  // Copied into locals: `p` may alias anything (the vector types may_alias),
  // so accumulators reached through a reference would be kept in memory.
  LaneCounts c = tally.counts;
  __m512d s1a = tally.s1a, s1b = tally.s1b, s2a = tally.s2a, s2b = tally.s2b;

  if constexpr (F::kFloating) {
    RunScale rs = tally.scale;
    int64_t clean = 0;
    bool masked = false;  // the run before held NaN or an infinity
    for (int64_t begin = 0; begin < vectors; begin += kRun<W>) {
      const int64_t len = std::min(kRun<W>, vectors - begin);
      const S* run = p + begin * kLanes;
      RunSums even = empty_run(), odd = empty_run();
      __m512i run_max = _mm512_setzero_si512();  // of finite keys
      // A key above finite_max: NaN or an infinity.
      auto all_finite = [&](__m512i top) __attribute__((always_inline)) ZS_AVX512 {
        return V::le(top, lim.finite_max) == static_cast<mask_t>(~mask_t(0));
      };
      RunSums r;
      if (__builtin_expect(!masked, 1)) {
        in_pairs(len, [&](int64_t k, int parity) __attribute__((always_inline)) ZS_AVX512 {
          prefetch_ahead(run + k * kLanes);
          const __m512i raw = _mm512_loadu_si512(run + k * kLanes);
          const __m512i key = key_of<S>(raw);
          count_common<S>(raw, key, lim, c);
          run_max = V::max(run_max, key);
          add_moments<S, false>(raw, 0, rs, shift, parity == 0 ? even : odd);
        });
        r = add_runs(even, odd);
        if (__builtin_expect(all_finite(run_max), 1)) {
          clean += len;
        } else {
          r = redo_non_finite_run(run, len, lim, rs, shift, tally.non_finite, run_max);
          masked = true;
        }
      } else {
        // Runs after one with NaN or Inf count them in the loop and sum
        // only finite lanes, until a run holds none: data where every run
        // holds some (a NaN-poisoned tensor) is then read once, not three
        // times, and pays 1.5-1.7x a clean run instead of 2.1-2.7x.
        NonFiniteCounts nf = tally.non_finite;
        __m512i top = _mm512_setzero_si512();  // of all keys
        in_pairs(len, [&](int64_t k, int parity) __attribute__((always_inline)) ZS_AVX512 {
          prefetch_ahead(run + k * kLanes);
          const __m512i raw = _mm512_loadu_si512(run + k * kLanes);
          const __m512i key = key_of<S>(raw);
          count_common<S>(raw, key, lim, c);
          const auto finite = count_non_finite<S>(raw, key, lim, nf);
          run_max = V::mask_max(run_max, finite, key);
          top = V::max(top, key);
          add_moments<S, true>(raw, finite, rs, shift, parity == 0 ? even : odd);
        });
        r = add_runs(even, odd);
        tally.non_finite = nf;
        masked = !all_finite(top);
      }
      if constexpr (kScaledSquares<S>) {
        if (__builtin_expect(!fits<S>(rs, run_max), 0)) {
          const RunSums again = rescale_run(run, len, lim, run_max, shift, rs);
          r.q1 = again.q1;
          r.q2 = again.q2;
        }
      }
      c.hi = V::max(c.hi, run_max);
      if constexpr (kFloat32Values<S>) {
        add_to_double(s1a, s1b, _mm512_add_ps(r.v1, r.v2));
      } else if constexpr (kSplitValues<S>) {
        // A run gave each lane of v1 and v2 at most 16 his, of u1 and u2
        // at most 16 los (16 vectors of float16, 8 of float8 with two groups
        // a chain): v1 + v2 could round, u1 + u2 not (kSplitValues).
        add_to_double(s1a, s1b, r.v1);
        add_to_double(s1a, s1b, r.v2);
        add_to_double(s1a, s1b, _mm512_add_ps(r.u1, r.u2));
      } else {
        s1a = _mm512_add_pd(s1a, _mm512_add_pd(r.w1, r.w3));
        s1b = _mm512_add_pd(s1b, _mm512_add_pd(r.w2, r.w4));
      }
      if constexpr (kFloat32Squares<S>) {
        const __m512 q = _mm512_add_ps(r.q1, r.q2);
        s2a = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(q)), rs.unscale, s2a);
        s2b = _mm512_fmadd_pd(_mm512_cvtps_pd(high_half(q)), rs.unscale, s2b);
      } else {
        s2a = _mm512_add_pd(s2a, r.r1);
      }
    }
    tally.scale = rs;
    tally.clean_vectors += clean;
  } else {
    // Two sets of chains, for even and odd vectors (see RunSums).
    __m512i sum = tally.sum, sum_sq[2] = {tally.sum_sq, _mm512_setzero_si512()};
    __m512d s1[2][2] = {{s1a, s1b}, {_mm512_setzero_pd(), _mm512_setzero_pd()}};
    __m512d s2[2][2] = {{s2a, s2b}, {_mm512_setzero_pd(), _mm512_setzero_pd()}};
    in_pairs(vectors, [&](int64_t k, int parity) __attribute__((always_inline)) ZS_AVX512 {
      const S* q = p + k * kLanes;
      prefetch_ahead(q);
      const __m512i raw = _mm512_loadu_si512(q);
      const __m512i key = key_of<S>(raw);
      count_common<S>(raw, key, lim, c);
      c.hi = V::max(c.hi, key);
      if constexpr (kExactBytes<S>) {
        // Per vector an int32 lane of sum_sq gains at most 2 * 2 * 255^2
        // (4 * 255 * 128 with VNNI), so kFold<1> = 255 vectors stay below 2^31.
        const __m512i values = std::is_same_v<S, bool_t> ? key : raw;
        const __m512i biased =  // int8 + 128 is an unsigned byte
            F::kSigned ? _mm512_xor_si512(values, _mm512_set1_epi8(static_cast<char>(0x80))) : values;
        sum = _mm512_add_epi64(sum, _mm512_sad_epu8(biased, _mm512_setzero_si512()));
        __m512i& sq = sum_sq[parity];
        if constexpr (kVnni) {
          sq = F::kSigned ? dot_bytes(sq, biased, values)
                          : dot_bytes(sq, values,
                                      _mm512_xor_si512(values, _mm512_set1_epi8(static_cast<char>(0x80))));
        } else {
          const __m256i low = _mm512_castsi512_si256(values);
          const __m256i high = _mm512_extracti64x4_epi64(values, 1);
          const __m512i w0 = F::kSigned ? _mm512_cvtepi8_epi16(low) : _mm512_cvtepu8_epi16(low);
          const __m512i w1 = F::kSigned ? _mm512_cvtepi8_epi16(high) : _mm512_cvtepu8_epi16(high);
          sq = _mm512_add_epi32(sq, _mm512_add_epi32(_mm512_madd_epi16(w0, w0), _mm512_madd_epi16(w1, w1)));
        }
      } else {
        // Integers of 16 bits and more, 8 at a time in double.
        const __m512d s = _mm512_set1_pd(shift);
#pragma GCC unroll 4
        for (int g = 0; g < kLanes / 8; ++g) {
          const __m512d d = _mm512_sub_pd(widen8(q + 8 * g), s);
          s1[parity][g % 2] = _mm512_add_pd(s1[parity][g % 2], d);
          s2[parity][g % 2] = _mm512_fmadd_pd(d, d, s2[parity][g % 2]);
        }
      }
    });
    // Both int32 chains together gained no more than one would have.
    tally.sum = sum;
    tally.sum_sq = _mm512_add_epi32(sum_sq[0], sum_sq[1]);
    s1a = _mm512_add_pd(s1[0][0], s1[1][0]);
    s1b = _mm512_add_pd(s1[0][1], s1[1][1]);
    s2a = _mm512_add_pd(s2[0][0], s2[1][0]);
    s2b = _mm512_add_pd(s2[0][1], s2[1][1]);
  }
  tally.counts = c;
  tally.s1a = s1a;
  tally.s1b = s1b;
  tally.s2a = s2a;
  tally.s2b = s2b;
}

// p: [n] contiguous, n a multiple of the vector's lanes. Adds the span's
// statistics to `t` (see the file comment).
template <typename S>
ZS_AVX512 void scan_vectors(const S* p, int64_t n, const Limits& lim,
                            double shift, Tally<S, int64_t>& t) {
  using F = Format<S>;
  constexpr int W = sizeof(S);
  constexpr int kLanes = 64 / W;
  constexpr bool kFloating = F::kFloating;

  const VectorLimits vl = vector_limits<S>(lim);

  const __m512i zero = _mm512_setzero_si512();
  VectorTally v;
  LaneCounts& c = v.counts;
  NonFiniteCounts& nf = v.non_finite;
  c.nonzero = c.sub = c.tol = c.negative = zero;
  c.lo_nonzero = _mm512_set1_epi32(-1);
  c.hi = zero;
  nf.non_nan = nf.finite = nf.neginf = zero;
  v.clean_vectors = 0;
  v.s1a = v.s1b = v.s2a = v.s2b = _mm512_setzero_pd();
  v.sum = v.sum_sq = zero;
  if constexpr (kFloating) {  // float64 carries it unused: scan_block copies it
    v.scale = make_scale<S>(kScaledSquares<S> ? scale_exponent(std::fabs(shift)) : 0, shift);
  }
  VectorTotals total;
  total.nonzero = total.sub = total.tol = total.negative = zero;
  total.non_nan = total.finite = total.neginf = total.sum_sq = zero;

  const int64_t vectors = n / kLanes;
  const bool vnni = kExactBytes<S> && cpu_has_vnni();
  constexpr bool kE4m3 = std::is_same_v<S, e4m3_t>;
  const bool by_planes = kE4m3 && cpu_has_e4m3_planes();
  PlaneSums planes, plane_totals;
  for (int h = 0; h < 4; ++h) {
    planes.values[h] = planes.squares[h] = zero;
    plane_totals.values[h] = plane_totals.squares[h] = zero;
  }
  for (int64_t begin = 0; begin < vectors; begin += kFold<W>) {
    const int64_t block = std::min(kFold<W>, vectors - begin);
    if constexpr (kExactBytes<S>) {
      if (vnni) {
        scan_block<S, true>(p + begin * kLanes, block, vl, shift, v);
      } else {
        scan_block(p + begin * kLanes, block, vl, shift, v);
      }
    } else if constexpr (kE4m3) {
      if (by_planes) {
        scan_block_e4m3(p + begin * kLanes, block, vl, v, planes);
        for (int h = 0; h < 4; ++h) {
          fold_signed(plane_totals.values[h], planes.values[h]);
          fold_signed(plane_totals.squares[h], planes.squares[h]);
        }
      } else {
        scan_block(p + begin * kLanes, block, vl, shift, v);
      }
    } else {
      scan_block(p + begin * kLanes, block, vl, shift, v);
    }
    fold<W>(total.nonzero, c.nonzero);
    fold<W>(total.sub, c.sub);
    fold<W>(total.tol, c.tol);
    fold<W>(total.negative, c.negative);
    fold<W>(total.non_nan, nf.non_nan);
    fold<W>(total.finite, nf.finite);
    fold<W>(total.neginf, nf.neginf);
    if constexpr (kExactBytes<S>) {
      if (vnni) {
        fold_signed(total.sum_sq, v.sum_sq);
      } else {
        fold<4>(total.sum_sq, v.sum_sq);
      }
    }
  }

  const int64_t count = vectors * kLanes;
  const int64_t nonzero = _mm512_reduce_add_epi64(total.nonzero);
  const int64_t zeros = count - nonzero;
  // Floats counted NaN and infinities only in the runs that held any.
  const int64_t unseen = v.clean_vectors * kLanes;
  const int64_t non_nan = F::kHasNan ? unseen + _mm512_reduce_add_epi64(total.non_nan) : count;
  const int64_t finite = F::kHasInf ? unseen + _mm512_reduce_add_epi64(total.finite) : non_nan;
  t.numel += count;
  t.zeros += zeros;
  // Integers have no subnormals: sub_max is 0, so "at most sub_max" is zero.
  t.at_most_sub += kFloating ? _mm512_reduce_add_epi64(total.sub) : zeros;
  t.at_most_tol += _mm512_reduce_add_epi64(total.tol);
  t.finite += finite;
  t.non_nan += non_nan;
  t.negative += _mm512_reduce_add_epi64(total.negative);
  t.neginf += _mm512_reduce_add_epi64(total.neginf);
  using key_t = typename F::key_t;
  const key_t lo_nonzero = static_cast<key_t>(reduce_key<W>(c.lo_nonzero, true));
  // Floats kept the max finite key; an infinity, where there is one, is the
  // one non-NaN key above it.
  const key_t hi = non_nan > finite ? static_cast<key_t>(lim.nonnan_max)
                                    : static_cast<key_t>(reduce_key<W>(c.hi, false));
  t.lo_nonzero = std::min(t.lo_nonzero, lo_nonzero);
  t.hi = std::max(t.hi, hi);
  if constexpr (kExactBytes<S>) {
    // The shift of an integer dtype is a whole number (scan_span's contract),
    // so the shifted sums are exact in int64: |x - shift| < 2^9 and a span
    // holds far fewer than 2^36 elements.
    const int64_t k = static_cast<int64_t>(shift);
    const int64_t sum = _mm512_reduce_add_epi64(v.sum) - (F::kSigned ? 128 * count : 0);
    const int64_t correction = vnni ? (F::kSigned ? -128 : 128) * sum : 0;  // see kExactBytes
    const int64_t sum_sq = _mm512_reduce_add_epi64(total.sum_sq) + correction;
    t.s1 += static_cast<double>(sum - count * k);
    t.s2 += static_cast<double>(sum_sq - 2 * k * sum + count * k * k);
  } else if (by_planes) {
    // In units of 2^-9 and 2^-18, exact: |y| < 2^18 and a span holds far
    // fewer than 2^40 elements. The shift is a whole number of 2^-9 units
    // but for `delta` (as_shift makes it one).
    int64_t sum_y = 0;
    __int128 sum_y2 = 0;
    for (int h = 3; h >= 0; --h) {
      sum_y = 16 * sum_y + _mm512_reduce_add_epi64(plane_totals.values[h]);
      sum_y2 = 256 * sum_y2 + _mm512_reduce_add_epi64(plane_totals.squares[h]);
    }
    const int64_t k = std::llrint(shift * 512.0);
    const double delta = shift - std::ldexp(static_cast<double>(k), -9);
    const double s1 = std::ldexp(static_cast<double>(sum_y - finite * k), -9);
    const __int128 s2_units = sum_y2 - 2 * static_cast<__int128>(k) * sum_y +
                              static_cast<__int128>(finite) * k * k;
    const double s2 = std::ldexp(static_cast<double>(s2_units), -18);
    t.s1 += s1 - static_cast<double>(finite) * delta;
    t.s2 += s2 - 2.0 * delta * s1 + static_cast<double>(finite) * delta * delta;
  } else if constexpr (kFloat32Squares<S>) {
    const double sum_x = kWidenScale<S> * _mm512_reduce_add_pd(_mm512_add_pd(v.s1a, v.s1b));
    t.s1 += sum_x - static_cast<double>(finite) * shift;
    t.s2 += _mm512_reduce_add_pd(_mm512_add_pd(v.s2a, v.s2b));
  } else {
    t.s1 += _mm512_reduce_add_pd(_mm512_add_pd(v.s1a, v.s1b));
    t.s2 += _mm512_reduce_add_pd(_mm512_add_pd(v.s2a, v.s2b));
  }
}

// Whether the running CPU has every instruction set the vector loop uses.
inline bool cpu_has_avx512() {
  static const bool has =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("bmi2") && capability_allows(Capability::kAvx512);
  return has;
}

#endif  // ZS_HAVE_AVX512_KERNELS

// Whether scan_span sums the moments of S exactly in integers whatever the
// shift (float8_e4m3fn on CPUs with VBMI and VNNI), so that a chunk's shift
// far from its mean costs no accuracy.
template <typename S>
bool exact_float_moments() {
#if defined(ZS_HAVE_AVX512_KERNELS)
  return std::is_same_v<S, e4m3_t> && cpu_has_avx512() && cpu_has_e4m3_planes();
#else
  return false;
#endif
}

// p: [n] contiguous. Adds its elements' statistics to `t`; `shift` is the
// value subtracted before the moments are summed (see set_moments): a whole
// number for integer dtypes and a float32 value for floats of up to 32 bits
// (the float32 runs subtract it exactly).
template <typename S>
void scan_span(const S* p, int64_t n, const Limits& lim, double shift,
               Tally<S, int64_t>& t) {
  int64_t done = 0;
#if defined(ZS_HAVE_AVX512_KERNELS)
  if (cpu_has_avx512()) {
    constexpr int64_t kLanes = 64 / static_cast<int64_t>(sizeof(S));
    done = n / kLanes * kLanes;
    if (done > 0) scan_vectors(p, done, lim, shift, t);
  }
#endif
  scan_span_scalar(p + done, n - done, lim, shift, t);
}

}  // namespace cpu
}  // namespace zeroscan
