// The CPU's scan of one contiguous span, free of torch headers.
//
// Every element goes through the exact classification of classify.h, with no
// branch on its value. On x86-64 CPUs with AVX-512 the span is read 64 bytes
// at a time and the classification runs on all lanes at once: each key test
// is one mask compare, each count a masked subtraction into narrow lane
// counters (widened every kFold<W> vectors), min/max |x| are integer min/max on
// the keys, and the moments add the finite lanes, widened to double, 8 at a
// time. So a span of zeros, subnormals or NaN costs what a span of ordinary
// values costs. The last few elements of a span, and every element on CPUs
// without AVX-512, go through Tally::add one at a time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ZS_HAVE_AVX512_KERNELS 1
#endif

#include "../classify.h"

namespace zeroscan {
namespace cpu {

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

// AVX-512 operations on the 64 / W unsigned lanes of W bytes in one vector.
template <int W>
struct Lanes;

template <>
struct Lanes<1> {
  using mask_t = __mmask64;
  static ZS_VEC __m512i set1(uint64_t v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static ZS_VEC mask_t le(__m512i a, __m512i b) { return _mm512_cmple_epu8_mask(a, b); }
  static ZS_VEC mask_t nonzero(__m512i a) { return _mm512_test_epi8_mask(a, a); }
  static ZS_VEC mask_t eq(__m512i a, __m512i b) { return _mm512_cmpeq_epi8_mask(a, b); }
  static ZS_VEC mask_t sign(__m512i a) { return _mm512_movepi8_mask(a); }
  // Lanes of `k` where a <= b as signed integers.
  static ZS_VEC mask_t le_signed(mask_t k, __m512i a, __m512i b) {
    return _mm512_mask_cmple_epi8_mask(k, a, b);
  }
  static ZS_VEC __m512i count(__m512i c, mask_t m) {
    return _mm512_mask_sub_epi8(c, m, c, _mm512_set1_epi8(-1));
  }
  static ZS_VEC __m512i sub(__m512i a, __m512i b) { return _mm512_sub_epi8(a, b); }
  static ZS_VEC __m512i abs(__m512i a) { return _mm512_abs_epi8(a); }
  static ZS_VEC __m512i min(__m512i a, __m512i b) { return _mm512_min_epu8(a, b); }
  static ZS_VEC __m512i max(__m512i a, __m512i b) { return _mm512_max_epu8(a, b); }
  static ZS_VEC __m512i mask_min(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_min_epu8(a, m, a, b);
  }
  static ZS_VEC __m512i mask_max(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_max_epu8(a, m, a, b);
  }
  // The lane counters summed into 8 uint64 lanes.
  static ZS_VEC __m512i widen_counts(__m512i c) {
    return _mm512_sad_epu8(c, _mm512_setzero_si512());
  }
};

template <>
struct Lanes<2> {
  using mask_t = __mmask32;
  static ZS_VEC __m512i set1(uint64_t v) { return _mm512_set1_epi16(static_cast<short>(v)); }
  static ZS_VEC mask_t le(__m512i a, __m512i b) { return _mm512_cmple_epu16_mask(a, b); }
  static ZS_VEC mask_t nonzero(__m512i a) { return _mm512_test_epi16_mask(a, a); }
  static ZS_VEC mask_t eq(__m512i a, __m512i b) { return _mm512_cmpeq_epi16_mask(a, b); }
  static ZS_VEC mask_t sign(__m512i a) { return _mm512_movepi16_mask(a); }
  // Lanes of `k` where a <= b as signed integers.
  static ZS_VEC mask_t le_signed(mask_t k, __m512i a, __m512i b) {
    return _mm512_mask_cmple_epi16_mask(k, a, b);
  }
  static ZS_VEC __m512i count(__m512i c, mask_t m) {
    return _mm512_mask_sub_epi16(c, m, c, _mm512_set1_epi16(-1));
  }
  static ZS_VEC __m512i sub(__m512i a, __m512i b) { return _mm512_sub_epi16(a, b); }
  static ZS_VEC __m512i abs(__m512i a) { return _mm512_abs_epi16(a); }
  static ZS_VEC __m512i min(__m512i a, __m512i b) { return _mm512_min_epu16(a, b); }
  static ZS_VEC __m512i max(__m512i a, __m512i b) { return _mm512_max_epu16(a, b); }
  static ZS_VEC __m512i mask_min(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_min_epu16(a, m, a, b);
  }
  static ZS_VEC __m512i mask_max(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_max_epu16(a, m, a, b);
  }
  static ZS_VEC __m512i widen_counts(__m512i c) {
    const __m512i pairs = _mm512_madd_epi16(c, _mm512_set1_epi16(1));  // u32
    return _mm512_add_epi64(_mm512_srli_epi64(pairs, 32),
                            _mm512_and_si512(pairs, _mm512_set1_epi64(0xffffffff)));
  }
};

template <>
struct Lanes<4> {
  using mask_t = __mmask16;
  static ZS_VEC __m512i set1(uint64_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
  static ZS_VEC mask_t le(__m512i a, __m512i b) { return _mm512_cmple_epu32_mask(a, b); }
  static ZS_VEC mask_t nonzero(__m512i a) { return _mm512_test_epi32_mask(a, a); }
  static ZS_VEC mask_t eq(__m512i a, __m512i b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static ZS_VEC mask_t sign(__m512i a) { return _mm512_movepi32_mask(a); }
  // Lanes of `k` where a <= b as signed integers.
  static ZS_VEC mask_t le_signed(mask_t k, __m512i a, __m512i b) {
    return _mm512_mask_cmple_epi32_mask(k, a, b);
  }
  static ZS_VEC __m512i count(__m512i c, mask_t m) {
    return _mm512_mask_sub_epi32(c, m, c, _mm512_set1_epi32(-1));
  }
  static ZS_VEC __m512i sub(__m512i a, __m512i b) { return _mm512_sub_epi32(a, b); }
  static ZS_VEC __m512i abs(__m512i a) { return _mm512_abs_epi32(a); }
  static ZS_VEC __m512i min(__m512i a, __m512i b) { return _mm512_min_epu32(a, b); }
  static ZS_VEC __m512i max(__m512i a, __m512i b) { return _mm512_max_epu32(a, b); }
  static ZS_VEC __m512i mask_min(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_min_epu32(a, m, a, b);
  }
  static ZS_VEC __m512i mask_max(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_max_epu32(a, m, a, b);
  }
  static ZS_VEC __m512i widen_counts(__m512i c) {
    return _mm512_add_epi64(_mm512_srli_epi64(c, 32),
                            _mm512_and_si512(c, _mm512_set1_epi64(0xffffffff)));
  }
};

template <>
struct Lanes<8> {
  using mask_t = __mmask8;
  static ZS_VEC __m512i set1(uint64_t v) { return _mm512_set1_epi64(static_cast<long long>(v)); }
  static ZS_VEC mask_t le(__m512i a, __m512i b) { return _mm512_cmple_epu64_mask(a, b); }
  static ZS_VEC mask_t nonzero(__m512i a) { return _mm512_test_epi64_mask(a, a); }
  static ZS_VEC mask_t eq(__m512i a, __m512i b) { return _mm512_cmpeq_epi64_mask(a, b); }
  static ZS_VEC mask_t sign(__m512i a) { return _mm512_movepi64_mask(a); }
  // Lanes of `k` where a <= b as signed integers.
  static ZS_VEC mask_t le_signed(mask_t k, __m512i a, __m512i b) {
    return _mm512_mask_cmple_epi64_mask(k, a, b);
  }
  static ZS_VEC __m512i count(__m512i c, mask_t m) {
    return _mm512_mask_sub_epi64(c, m, c, _mm512_set1_epi64(-1));
  }
  static ZS_VEC __m512i sub(__m512i a, __m512i b) { return _mm512_sub_epi64(a, b); }
  static ZS_VEC __m512i abs(__m512i a) { return _mm512_abs_epi64(a); }
  static ZS_VEC __m512i min(__m512i a, __m512i b) { return _mm512_min_epu64(a, b); }
  static ZS_VEC __m512i max(__m512i a, __m512i b) { return _mm512_max_epu64(a, b); }
  static ZS_VEC __m512i mask_min(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_min_epu64(a, m, a, b);
  }
  static ZS_VEC __m512i mask_max(__m512i a, mask_t m, __m512i b) {
    return _mm512_mask_max_epu64(a, m, a, b);
  }
  static ZS_VEC __m512i widen_counts(__m512i c) { return c; }
};

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
// (key = key_of(raw)), and min nonzero |x|.
template <typename S>
ZS_VEC void count_common(__m512i raw, __m512i key, const VectorLimits& lim, LaneCounts& c) {
  using F = Format<S>;
  using V = Lanes<sizeof(S)>;
  const auto nonzero = V::nonzero(key);
  c.nonzero = V::count(c.nonzero, nonzero);
  c.lo_nonzero = V::mask_min(c.lo_nonzero, nonzero, key);
  if constexpr (F::kFloating) {
    c.sub = V::count(c.sub, V::le(key, lim.sub_max));
    c.negative = V::count(c.negative, V::le_signed(nonzero, raw, lim.neginf));
  } else if constexpr (F::kSigned) {
    c.negative = V::count(c.negative, V::sign(raw));
  }
  c.tol = V::count(c.tol, V::le(key, lim.tol_max));
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
// d = x - shift of the finite values, summed in double: x widens exactly to
// double, so d is exact but for the one rounding of a double subtraction,
// and the mean of zero-centred data keeps double accuracy. float8_e4m3fn
// alone sums in float32 (kFloat32Sums), where its sums are exact.

// Eight consecutive integers, widened exactly to double.
ZS_VEC __m512d widen8(const int16_t* p) {
  return _mm512_cvtepi32_pd(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
ZS_VEC __m512d widen8(const int32_t* p) {
  return _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ZS_VEC __m512d widen8(const int64_t* p) { return _mm512_cvtepi64_pd(_mm512_loadu_si512(p)); }

// Floats of up to 32 bits: the g-th 16 values of the vector `raw` as
// float32, times kWidenScale<S> (exact). The lanes come in some order (sums
// do not care), which masks follow through lanes_of.
template <typename S>
constexpr double kWidenScale = std::is_same_v<S, e5m2_t> ? 0x1p112
                               : std::is_same_v<S, e4m3_t> ? 0x1p120
                                                           : 1.0;

ZS_VEC __m512 widen16(float, __m512i raw, int) { return _mm512_castsi512_ps(raw); }
ZS_VEC __m512 widen16(bf16_t, __m512i raw, int g) {
  // bfloat16 is the top half of a float32: interleaving zeros below the
  // values widens them (elements 0-3, 8-11, ... for g = 0; the rest for 1).
  const __m512i z = _mm512_setzero_si512();
  return _mm512_castsi512_ps(g == 0 ? _mm512_unpacklo_epi16(z, raw) : _mm512_unpackhi_epi16(z, raw));
}
ZS_VEC __m512 widen16(f16_t, __m512i raw, int g) {
  return _mm512_cvtph_ps(g == 0 ? _mm512_castsi512_si256(raw) : _mm512_extracti64x4_epi64(raw, 1));
}
// float8: the byte, sign-extended and shifted so that its exponent and
// mantissa land in the low bits of a float32's, with the exponent's top bits
// cleared, is x * 2^-112 (e5m2) or x * 2^-120 (e4m3), subnormals included.
// NaN and Inf lanes come out finite; they are masked out or summed again.
ZS_VEC __m512i sign_extended16(__m512i raw, int g) {
  return _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, g));
}
ZS_VEC __m512 widen16(e5m2_t, __m512i raw, int g) {
  const __m512i b = _mm512_slli_epi32(sign_extended16(raw, g), 21);
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0x8fe00000u))));
}
ZS_VEC __m512 widen16(e4m3_t, __m512i raw, int g) {
  const __m512i b = _mm512_slli_epi32(sign_extended16(raw, g), 20);
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0x87f00000u))));
}

// The bits of a vector mask that belong to widen16's lanes of group g.
template <typename S>
ZS_VEC __mmask16 lanes_of(typename Lanes<sizeof(S)>::mask_t m, int g) {
  if constexpr (std::is_same_v<S, bf16_t>) {
    // Group g holds elements 8 j + 4 g + 0..3 of every 128-bit lane j.
    const uint64_t pick = g == 0 ? 0x0f0f0f0fu : 0xf0f0f0f0u;
    return static_cast<__mmask16>(_pext_u64(static_cast<uint64_t>(m), pick));
  } else {
    return static_cast<__mmask16>(static_cast<uint64_t>(m) >> (16 * g));
  }
}

ZS_VEC __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// float8_e4m3fn values are multiples of 2^-9 below 2^9 in magnitude, and
// its shift is a multiple of 2^-9 too (stats_cpu.cpp picks it so): every d
// is then a whole number of 2^-9 below 2^10, and a float32 lane that adds
// 16 of them (kRun<1> vectors, two chains) stays below 2^24 units, so the
// sum of d is exact in float32 and the squares round only as float32
// products do. Summing 64 values per vector in float32 instead of double
// halves the work.
template <typename S>
constexpr bool kFloat32Sums = std::is_same_v<S, e4m3_t>;

// Sums of d and d^2 of one run of vectors: two chains of each, for latency.
template <typename S>
struct RunSums {
  using acc_t = std::conditional_t<kFloat32Sums<S>, __m512, __m512d>;
  acc_t s1a, s2a, s1b, s2b;
};

template <typename S>
ZS_VEC RunSums<S> empty_run() {
  if constexpr (kFloat32Sums<S>) {
    const __m512 z = _mm512_setzero_ps();
    return RunSums<S>{z, z, z, z};
  } else {
    const __m512d z = _mm512_setzero_pd();
    return RunSums<S>{z, z, z, z};
  }
}

template <typename acc_t>
ZS_VEC void add_to(acc_t d, acc_t& s1, acc_t& s2) {
  if constexpr (std::is_same_v<acc_t, __m512>) {
    s1 = _mm512_add_ps(s1, d);
    s2 = _mm512_fmadd_ps(d, d, s2);
  } else {
    s1 = _mm512_add_pd(s1, d);
    s2 = _mm512_fmadd_pd(d, d, s2);
  }
}

// The moments of one vector of floats. kMasked: of the lanes of `finite`
// only, a masked-out lane adding exactly nothing; otherwise of every lane.
template <typename S, bool kMasked>
ZS_VEC void add_moments(__m512i raw, typename Lanes<sizeof(S)>::mask_t finite,
                        double shift, RunSums<S>& r) {
  if constexpr (std::is_same_v<S, double>) {
    const __m512d x = _mm512_castsi512_pd(raw);
    const __m512d s = _mm512_set1_pd(shift);
    add_to(kMasked ? _mm512_maskz_sub_pd(static_cast<__mmask8>(finite), x, s) : _mm512_sub_pd(x, s),
           r.s1a, r.s2a);
  } else if constexpr (kFloat32Sums<S>) {
    const __m512 scale = _mm512_set1_ps(static_cast<float>(kWidenScale<S>));
    const __m512 s = _mm512_set1_ps(static_cast<float>(shift));
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512 x = widen16(S{}, raw, g);
      const __m512 d = kMasked ? _mm512_maskz_fmsub_ps(lanes_of<S>(finite, g), x, scale, s)
                               : _mm512_fmsub_ps(x, scale, s);
      add_to(d, g % 2 == 0 ? r.s1a : r.s1b, g % 2 == 0 ? r.s2a : r.s2b);
    }
  } else {
    const __m512d scale = _mm512_set1_pd(kWidenScale<S>);
    const __m512d s = _mm512_set1_pd(shift);
    constexpr int kGroups = 64 / static_cast<int>(sizeof(S)) / 16;
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) {
      const __m512 x = widen16(S{}, raw, g);
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      const __m512d hi = _mm512_cvtps_pd(high_half(x));
      const __mmask16 m = kMasked ? lanes_of<S>(finite, g) : 0;
      add_to(kMasked ? _mm512_maskz_fmsub_pd(static_cast<__mmask8>(m), lo, scale, s)
                     : _mm512_fmsub_pd(lo, scale, s),
             r.s1a, r.s2a);
      add_to(kMasked ? _mm512_maskz_fmsub_pd(static_cast<__mmask8>(m >> 8), hi, scale, s)
                     : _mm512_fmsub_pd(hi, scale, s),
             r.s1b, r.s2b);
    }
  }
}

// ---- Runs: NaN and infinities out of the vector loop -----------------------
//
// Floats are scanned in runs of kRun<W> vectors. The loop counts every class
// but NaN and infinities, sums every lane into the run's own sums, and keeps
// the run's largest key. A run whose largest key is finite (most runs of
// most data) is then folded as it is: its lanes were all finite. Only a run
// that holds NaN or an infinity is read again by recount_run, which counts
// them and sums the finite lanes alone. That leaves three compares and
// three counts per vector out of the loop; data with NaN or Inf in every
// run pays about what counting them in the loop would cost.
template <int W>
constexpr int64_t kRun = W == 1 ? 8 : 16;

// A run of `vectors` vectors at p that holds NaN or an infinity: counts its
// NaN and infinite lanes into `c`, returns the sums of its finite lanes and
// sets `run_max` to its largest finite key. Out of line: most runs never
// come here.
template <typename S>
__attribute__((noinline, cold)) ZS_AVX512 RunSums<S> recount_run(const S* p, int64_t vectors,
                                                                 const VectorLimits& lim,
                                                                 double shift, NonFiniteCounts& c,
                                                                 __m512i& run_max) {
  using V = Lanes<sizeof(S)>;
  constexpr int kLanes = 64 / static_cast<int>(sizeof(S));
  RunSums<S> r = empty_run<S>();
  run_max = _mm512_setzero_si512();
  for (int64_t k = 0; k < vectors; ++k) {
    const __m512i raw = _mm512_loadu_si512(p + k * kLanes);
    const __m512i key = key_of<S>(raw);
    const auto finite = count_non_finite<S>(raw, key, lim, c);
    run_max = V::mask_max(run_max, finite, key);
    add_moments<S, true>(raw, finite, shift, r);
  }
  return r;
}

// ---- The vector loop -------------------------------------------------------

// The vector registers of one span's scan.
struct VectorTally {
  LaneCounts counts;
  NonFiniteCounts non_finite;  // floats: of the runs recount_run saw
  int64_t clean_vectors;       // floats: vectors of the other runs
  __m512d s1a, s1b, s2a, s2b;  // double sums of d and d^2
  // 1-byte integers: exact integer moments instead (see kExactBytes).
  __m512i sum;     // uint64 lanes: sums of the values (int8: plus 128)
  __m512i sum_sq;  // int32 lanes: sums of squares, widened every kFold<1>
};

struct VectorTotals {
  __m512i nonzero, sub, tol, negative, non_nan, finite, neginf;  // uint64
  __m512i sum_sq;                                                 // uint64
};

// int8, uint8 and bool: their moments are summed exactly in integers (a sum
// of absolute differences for the values, pairwise multiply-adds of the
// values widened to 16 bits for the squares), which costs a handful of
// instructions per 64 elements instead of eight double conversions.
template <typename S>
constexpr bool kExactBytes = sizeof(S) == 1 && !Format<S>::kFloating;

template <int W>
ZS_VEC void fold(__m512i& total, __m512i& narrow) {
  total = _mm512_add_epi64(total, Lanes<W>::widen_counts(narrow));
  narrow = _mm512_setzero_si512();
}

// Adds `vectors` vectors of 64 bytes at p to `tally` (at most kFold<W> of
// them, so that no narrow lane counter overflows). Not inlined: a loop of
// its own keeps every accumulator in a register.
template <typename S>
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
    int64_t clean = 0;
    for (int64_t begin = 0; begin < vectors; begin += kRun<W>) {
      const int64_t len = std::min(kRun<W>, vectors - begin);
      const S* run = p + begin * kLanes;
      RunSums<S> r = empty_run<S>();
      __m512i run_max = _mm512_setzero_si512();
      for (int64_t k = 0; k < len; ++k) {
        const __m512i raw = _mm512_loadu_si512(run + k * kLanes);
        const __m512i key = key_of<S>(raw);
        count_common<S>(raw, key, lim, c);
        run_max = V::max(run_max, key);
        add_moments<S, false>(raw, 0, shift, r);
      }
      // A key above finite_max: the run holds NaN or an infinity.
      if (__builtin_expect(V::le(run_max, lim.finite_max) != static_cast<mask_t>(~mask_t(0)), 0)) {
        r = recount_run(run, len, lim, shift, tally.non_finite, run_max);
      } else {
        clean += len;
      }
      c.hi = V::max(c.hi, run_max);
      if constexpr (kFloat32Sums<S>) {
        // Exact in float32 (see kFloat32Sums), and exactly widened.
        const __m512 r1 = _mm512_add_ps(r.s1a, r.s1b), r2 = _mm512_add_ps(r.s2a, r.s2b);
        s1a = _mm512_add_pd(s1a, _mm512_cvtps_pd(_mm512_castps512_ps256(r1)));
        s1b = _mm512_add_pd(s1b, _mm512_cvtps_pd(high_half(r1)));
        s2a = _mm512_add_pd(s2a, _mm512_cvtps_pd(_mm512_castps512_ps256(r2)));
        s2b = _mm512_add_pd(s2b, _mm512_cvtps_pd(high_half(r2)));
      } else {
        s1a = _mm512_add_pd(s1a, r.s1a);
        s1b = _mm512_add_pd(s1b, r.s1b);
        s2a = _mm512_add_pd(s2a, r.s2a);
        s2b = _mm512_add_pd(s2b, r.s2b);
      }
    }
    tally.clean_vectors += clean;
  } else {
    NonFiniteCounts nf = tally.non_finite;
    __m512i sum = tally.sum, sum_sq = tally.sum_sq;
    for (int64_t k = 0; k < vectors; ++k) {
      const S* q = p + k * kLanes;
      const __m512i raw = _mm512_loadu_si512(q);
      const __m512i key = key_of<S>(raw);
      count_common<S>(raw, key, lim, c);
      c.hi = V::max(c.hi, key);
      if constexpr (kExactBytes<S>) {
        // Per vector an int32 lane of sum_sq gains at most 2 * 2 * 255^2, so
        // kFold<1> = 255 vectors stay below 2^31.
        const __m512i values = std::is_same_v<S, bool_t> ? key : raw;
        const __m512i biased =  // int8 + 128 is an unsigned byte
            F::kSigned ? _mm512_xor_si512(values, _mm512_set1_epi8(static_cast<char>(0x80))) : values;
        sum = _mm512_add_epi64(sum, _mm512_sad_epu8(biased, _mm512_setzero_si512()));
        const __m256i low = _mm512_castsi512_si256(values);
        const __m256i high = _mm512_extracti64x4_epi64(values, 1);
        const __m512i w0 = F::kSigned ? _mm512_cvtepi8_epi16(low) : _mm512_cvtepu8_epi16(low);
        const __m512i w1 = F::kSigned ? _mm512_cvtepi8_epi16(high) : _mm512_cvtepu8_epi16(high);
        sum_sq = _mm512_add_epi32(sum_sq, _mm512_add_epi32(_mm512_madd_epi16(w0, w0), _mm512_madd_epi16(w1, w1)));
      } else {
        // Integers of 16 bits and more, 8 at a time in double.
        const __m512d s = _mm512_set1_pd(shift);
#pragma GCC unroll 4
        for (int g = 0; g < kLanes / 8; ++g) {
          const __m512d d = _mm512_sub_pd(widen8(q + 8 * g), s);
          if (g % 2 == 0) {
            s1a = _mm512_add_pd(s1a, d);
            s2a = _mm512_fmadd_pd(d, d, s2a);
          } else {
            s1b = _mm512_add_pd(s1b, d);
            s2b = _mm512_fmadd_pd(d, d, s2b);
          }
        }
      }
    }
    tally.non_finite = nf;
    tally.sum = sum;
    tally.sum_sq = sum_sq;
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
  using V = Lanes<W>;
  constexpr int kLanes = 64 / W;
  constexpr bool kFloating = F::kFloating;

  VectorLimits vl;
  vl.sub_max = V::set1(lim.sub_max);
  vl.tol_max = V::set1(lim.tol_max);
  vl.finite_max = V::set1(lim.finite_max);
  vl.nonnan_max = V::set1(lim.nonnan_max);
  uint64_t sign_bit = 0;
  if constexpr (kFloating) sign_bit = F::kSignBit;
  vl.neginf = V::set1(sign_bit + lim.nonnan_max);

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
  VectorTotals total;
  total.nonzero = total.sub = total.tol = total.negative = zero;
  total.non_nan = total.finite = total.neginf = total.sum_sq = zero;

  const int64_t vectors = n / kLanes;
  for (int64_t begin = 0; begin < vectors; begin += kFold<W>) {
    scan_block(p + begin * kLanes, std::min(kFold<W>, vectors - begin), vl, shift, v);
    fold<W>(total.nonzero, c.nonzero);
    fold<W>(total.sub, c.sub);
    fold<W>(total.tol, c.tol);
    fold<W>(total.negative, c.negative);
    fold<W>(total.non_nan, nf.non_nan);
    fold<W>(total.finite, nf.finite);
    fold<W>(total.neginf, nf.neginf);
    if constexpr (kExactBytes<S>) fold<4>(total.sum_sq, v.sum_sq);
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
    const int64_t sum_sq = _mm512_reduce_add_epi64(total.sum_sq);
    t.s1 += static_cast<double>(sum - count * k);
    t.s2 += static_cast<double>(sum_sq - 2 * k * sum + count * k * k);
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
      __builtin_cpu_supports("bmi2");
  return has;
}

#endif  // ZS_HAVE_AVX512_KERNELS

// p: [n] contiguous. Adds its elements' statistics to `t`; `shift` is the
// value subtracted before the moments are summed (see set_moments): a whole
// number for integer dtypes and a multiple of 2^-9 for float8_e4m3fn (see
// kFloat32Sums).
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
