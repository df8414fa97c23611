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
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,fma")))
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

// Eight consecutive elements, widened exactly to double.
ZS_VEC __m512d widen8(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
ZS_VEC __m512d widen8(const double* p) { return _mm512_loadu_pd(p); }
ZS_VEC __m512d widen8(const f16_t* p) {
  return _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
ZS_VEC __m512d widen8(const bf16_t* p) {
  // bfloat16 is the top half of a float32.
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
}
ZS_VEC __m128i load8_u16(const uint8_t* p) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
ZS_VEC __m512d widen8(const e5m2_t* p) {
  // float8_e5m2 is the top byte of a float16.
  const __m128i h = _mm_slli_epi16(load8_u16(&p->bits), 8);
  return _mm512_cvtps_pd(_mm256_cvtph_ps(h));
}
ZS_VEC __m512d widen8(const e4m3_t* p) {
  // |x|'s 7 bits placed in a float16's exponent and mantissa give
  // |x| * 2^-8 (the biases differ by 8); the sign moves to bit 15. NaN lanes
  // come out finite, but they are never summed.
  const __m128i b = load8_u16(&p->bits);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
  return _mm512_cvtps_pd(_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f)));
}
ZS_VEC __m512d widen8(const bool_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_pd(_mm256_cvtepu8_epi32(_mm_min_epu8(b, _mm_set1_epi8(1))));
}
ZS_VEC __m512d widen8(const uint8_t* p) {
  return _mm512_cvtepi32_pd(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
ZS_VEC __m512d widen8(const int8_t* p) {
  return _mm512_cvtepi32_pd(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
ZS_VEC __m512d widen8(const int16_t* p) {
  return _mm512_cvtepi32_pd(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
ZS_VEC __m512d widen8(const int32_t* p) {
  return _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ZS_VEC __m512d widen8(const int64_t* p) { return _mm512_cvtepi64_pd(_mm512_loadu_si512(p)); }

// Vectors between widenings of the narrow lane counters of W-byte lanes: a
// lane counts at most one element per vector, and must not pass its maximum
// (255 for bytes, 65535 for 16-bit lanes).
template <int W>
constexpr int64_t kFold = W == 1 ? 255 : 4096;

// The vector registers of one span's scan. Counts are of lanes whose key is
// at most a limit (see classify.h), or nonzero, in narrow lane counters that
// scan_vectors widens into uint64 totals every kFold<W> vectors.
struct VectorTally {
  __m512i nonzero, sub, tol, finite, non_nan, negative, neginf;
  __m512i lo_nonzero, hi;
  __m512d s1a, s1b, s2a, s2b;  // two of each: half the add latency chain
  // 1-byte integers: exact integer moments instead (see kExactBytes).
  __m512i sum;     // uint64 lanes: sums of the values (int8: plus 128)
  __m512i sum_sq;  // int32 lanes: sums of squares, widened every kFold<1>
};

struct VectorTotals {
  __m512i nonzero, sub, tol, finite, non_nan, negative, neginf;  // uint64
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

// The limits of classify.h, broadcast to every lane.
struct VectorLimits {
  __m512i sub_max, tol_max, finite_max, nonnan_max;
  // Floats: x < 0 is raw in [sign + 1, sign + nonnan_max] (one subtraction
  // and one unsigned compare), and -inf, where there is one, is the single
  // pattern sign + nonnan_max.
  __m512i negative_lo, negative_span, neginf;
  __m512d shift;
};

// Adds `vectors` vectors of 64 bytes at p to the narrow counters of `v`
// (at most kFold<W> of them, so that no narrow lane overflows). Not inlined:
// a loop of its own keeps every accumulator in a register.
template <typename S>
__attribute__((noinline)) ZS_AVX512 void scan_block(const S* p, int64_t vectors,
                                                    const VectorLimits& lim,
                                                    VectorTally& tally) {
  using F = Format<S>;
  constexpr int W = sizeof(S);
  using V = Lanes<W>;
  using mask_t = typename V::mask_t;
  constexpr int kLanes = 64 / W;
  // Copied member by member into locals: `p` may alias anything (the
  // vector types may_alias), so accumulators reached through a reference
  // would be kept in memory.
  __m512i c_nonzero = tally.nonzero, c_sub = tally.sub, c_tol = tally.tol;
  __m512i c_finite = tally.finite, c_non_nan = tally.non_nan;
  __m512i c_negative = tally.negative, c_neginf = tally.neginf;
  __m512i lo_nonzero = tally.lo_nonzero, hi = tally.hi;
  __m512d s1a = tally.s1a, s1b = tally.s1b, s2a = tally.s2a, s2b = tally.s2b;
  __m512i sum = tally.sum, sum_sq = tally.sum_sq;
  for (int64_t k = 0; k < vectors; ++k) {
    const S* q = p + k * kLanes;
    const __m512i raw = _mm512_loadu_si512(q);
    __m512i key;
    if constexpr (F::kFloating) {
      key = _mm512_and_si512(raw, V::set1(F::kAbsMask));
    } else if constexpr (F::kSigned) {
      key = V::abs(raw);  // |INT_MIN| wraps to 2^(w-1): right as unsigned
    } else if constexpr (std::is_same_v<S, bool_t>) {
      key = V::min(raw, V::set1(1));
    } else {
      key = raw;
    }
    const mask_t nonzero = V::nonzero(key);
    c_nonzero = V::count(c_nonzero, nonzero);
    lo_nonzero = V::mask_min(lo_nonzero, nonzero, key);
    mask_t finite = static_cast<mask_t>(~mask_t(0));
    if constexpr (F::kHasNan) {
      const mask_t non_nan = V::le(key, lim.nonnan_max);
      c_non_nan = V::count(c_non_nan, non_nan);
      hi = V::mask_max(hi, non_nan, key);
      finite = non_nan;
    } else {
      hi = V::max(hi, key);
    }
    if constexpr (F::kHasInf) {
      finite = V::le(key, lim.finite_max);
      c_finite = V::count(c_finite, finite);
      c_neginf = V::count(c_neginf, V::eq(raw, lim.neginf));
    }
    if constexpr (F::kFloating) {
      c_sub = V::count(c_sub, V::le(key, lim.sub_max));
      c_negative = V::count(c_negative, V::le(V::sub(raw, lim.negative_lo), lim.negative_span));
    } else if constexpr (F::kSigned) {
      c_negative = V::count(c_negative, V::sign(raw));
    }
    c_tol = V::count(c_tol, V::le(key, lim.tol_max));
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
      continue;
    }
    // The moments: finite lanes only, 8 at a time in double; a masked-out
    // lane adds exactly nothing.
#pragma GCC unroll 8
    for (int g = 0; g < kLanes / 8; ++g) {
      const __m512d x = widen8(q + 8 * g);
      const __m512d d = F::kHasNan
                            ? _mm512_maskz_sub_pd(static_cast<__mmask8>(finite >> (8 * g)), x, lim.shift)
                            : _mm512_sub_pd(x, lim.shift);
      if (g % 2 == 0) {
        s1a = _mm512_add_pd(s1a, d);
        s2a = _mm512_fmadd_pd(d, d, s2a);
      } else {
        s1b = _mm512_add_pd(s1b, d);
        s2b = _mm512_fmadd_pd(d, d, s2b);
      }
    }
  }
  tally.nonzero = c_nonzero;
  tally.sub = c_sub;
  tally.tol = c_tol;
  tally.finite = c_finite;
  tally.non_nan = c_non_nan;
  tally.negative = c_negative;
  tally.neginf = c_neginf;
  tally.lo_nonzero = lo_nonzero;
  tally.hi = hi;
  tally.s1a = s1a;
  tally.s1b = s1b;
  tally.s2a = s2a;
  tally.s2b = s2b;
  tally.sum = sum;
  tally.sum_sq = sum_sq;
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
  constexpr bool kHasNan = F::kHasNan;
  constexpr bool kHasInf = F::kHasInf;

  VectorLimits vl;
  vl.sub_max = V::set1(lim.sub_max);
  vl.tol_max = V::set1(lim.tol_max);
  vl.finite_max = V::set1(lim.finite_max);
  vl.nonnan_max = V::set1(lim.nonnan_max);
  uint64_t sign_bit = 0;
  if constexpr (kFloating) sign_bit = F::kSignBit;
  vl.negative_lo = V::set1(sign_bit + 1);
  vl.negative_span = V::set1(lim.nonnan_max - 1);
  vl.neginf = V::set1(sign_bit + lim.nonnan_max);
  vl.shift = _mm512_set1_pd(shift);

  const __m512i zero = _mm512_setzero_si512();
  VectorTally v;
  v.nonzero = v.sub = v.tol = v.finite = v.non_nan = v.negative = v.neginf = zero;
  v.lo_nonzero = _mm512_set1_epi32(-1);
  v.hi = zero;
  v.s1a = v.s1b = v.s2a = v.s2b = _mm512_setzero_pd();
  v.sum = v.sum_sq = zero;
  VectorTotals total;
  total.nonzero = total.sub = total.tol = total.finite = zero;
  total.non_nan = total.negative = total.neginf = total.sum_sq = zero;

  const int64_t vectors = n / kLanes;
  for (int64_t begin = 0; begin < vectors; begin += kFold<W>) {
    scan_block(p + begin * kLanes, std::min(kFold<W>, vectors - begin), vl, v);
    fold<W>(total.nonzero, v.nonzero);
    fold<W>(total.sub, v.sub);
    fold<W>(total.tol, v.tol);
    fold<W>(total.finite, v.finite);
    fold<W>(total.non_nan, v.non_nan);
    fold<W>(total.negative, v.negative);
    fold<W>(total.neginf, v.neginf);
    if constexpr (kExactBytes<S>) fold<4>(total.sum_sq, v.sum_sq);
  }

  const int64_t count = vectors * kLanes;
  const int64_t nonzero = _mm512_reduce_add_epi64(total.nonzero);
  const int64_t zeros = count - nonzero;
  const int64_t non_nan = kHasNan ? _mm512_reduce_add_epi64(total.non_nan) : count;
  t.numel += count;
  t.zeros += zeros;
  // Integers have no subnormals: sub_max is 0, so "at most sub_max" is zero.
  t.at_most_sub += kFloating ? _mm512_reduce_add_epi64(total.sub) : zeros;
  t.at_most_tol += _mm512_reduce_add_epi64(total.tol);
  t.finite += kHasInf ? _mm512_reduce_add_epi64(total.finite) : non_nan;
  t.non_nan += non_nan;
  t.negative += _mm512_reduce_add_epi64(total.negative);
  t.neginf += _mm512_reduce_add_epi64(total.neginf);
  using key_t = typename F::key_t;
  const key_t lo_nonzero = static_cast<key_t>(reduce_key<W>(v.lo_nonzero, true));
  const key_t hi = static_cast<key_t>(reduce_key<W>(v.hi, false));
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
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return has;
}

#endif  // ZS_HAVE_AVX512_KERNELS

// p: [n] contiguous. Adds its elements' statistics to `t`; `shift` is the
// value subtracted before the moments are summed (see set_moments), and a
// whole number for integer dtypes.
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
