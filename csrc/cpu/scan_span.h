// The CPU's SIMD scan of one contiguous span, free of torch headers.
//
// The hot loop keeps L independent lanes per statistic so the compiler turns
// it into SIMD code. It assumes the common case -- no zeros, no subnormals,
// no NaN/Inf, no |x| near overflow -- and checks that once per block of L * kIters
// elements. A block that breaks it is rescanned (it is still in L1) by the
// exact scalar classifier, so rare values cost little and the answer never
// depends on the assumption.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../classify.h"

#define ZS_INLINE __attribute__((always_inline)) inline

namespace zeroscan {
namespace cpu {

constexpr int kIters = 16;  // SIMD iterations per checked block

// bfloat16 as its raw bits: widening it is the kernel's job.
struct Bf16Bits {
  uint16_t x;
};

ZS_INLINE float widen(float x) { return x; }
ZS_INLINE double widen(double x) { return x; }
ZS_INLINE float widen(Bf16Bits b) {
  // bfloat16 is the top half of a float32: widening is a shift.
  const uint32_t u = static_cast<uint32_t>(b.x) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Fast blocks hold no |x| at or above this: shifted values then stay below
// 2^61 (float) or 2^501 (double), so the short float sums of their squares
// cannot overflow. A shift this large sends every block to the exact path.
template <typename acc_t>
ZS_INLINE typename FloatBits<acc_t>::bits_t fast_ceiling(acc_t shift) {
  using B = FloatBits<acc_t>;
  const typename B::bits_t ceiling =
      sizeof(acc_t) == 4 ? typename B::bits_t(0x5D800000u)             // 2^60
                         : typename B::bits_t(0x5EB0000000000000ull);  // 2^500
  return (to_bits(shift) & B::kAbsMask) < ceiling ? ceiling : 0;
}

// Chunk-level SIMD lanes of the fast path. Folded into a ScalarAccumulator
// (which shares the same shift) when the chunk is done.
template <typename acc_t>
struct Lanes {
  using B = FloatBits<acc_t>;
  using bits_t = typename B::bits_t;
  static constexpr int L = 16;  // one 512-bit vector of floats

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
  const bits_t ceiling = fast_ceiling(shift);
  const double dshift = static_cast<double>(shift);

  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const Src* q = p + i;
    bits_t mn[L], mx[L], nz[L], ng[L];
    // The mean needs every value in double: rounding x - shift in float, or
    // summing in float, costs ~1e-7 of the spread per value, which swamps
    // the mean of zero-centred data. The second moment is a sum of positive
    // terms, well conditioned around the shift, so a kIters-term float sum
    // per lane (widened once per block) keeps it within ~1e-7.
    double f1[L];
    acc_t f2[L];
    for (int j = 0; j < L; ++j) {
      mn[j] = B::kAbsMask;
      mx[j] = 0;
      nz[j] = ng[j] = 0;
      f1[j] = 0.0;
      f2[j] = acc_t(0);
    }
    // Vectorise across lanes (j), not across iterations.
#pragma GCC unroll 1
    for (int it = 0; it < kIters; ++it) {
      for (int j = 0; j < L; ++j) {
        const acc_t x = widen(q[it * L + j]);
        const bits_t a = to_bits(x) & B::kAbsMask;
        mn[j] = a < mn[j] ? a : mn[j];
        mx[j] = a > mx[j] ? a : mx[j];
        nz[j] += a <= th.tol;
        ng[j] += x < acc_t(0);
        const acc_t d = x - shift;
        f1[j] += static_cast<double>(x) - dshift;
        f2[j] += d * d;
      }
    }
    bits_t lo = B::kAbsMask, hi = 0;
    for (int j = 0; j < L; ++j) {
      lo = mn[j] < lo ? mn[j] : lo;
      hi = mx[j] > hi ? mx[j] : hi;
    }
    if (lo < floor || hi >= ceiling) {
      for (int64_t k = 0; k < kBlock; ++k) acc.push(widen(q[k]), th);
      continue;
    }
    for (int j = 0; j < L; ++j) {
      lanes.min_a[j] = mn[j] < lanes.min_a[j] ? mn[j] : lanes.min_a[j];
      lanes.max_a[j] = mx[j] > lanes.max_a[j] ? mx[j] : lanes.max_a[j];
      lanes.near_zero[j] += nz[j];
      lanes.negative[j] += ng[j];
      lanes.s1[j] += f1[j];
      lanes.s2[j] += static_cast<double>(f2[j]);
    }
    lanes.numel += kBlock;
  }
  for (; i < n; ++i) acc.push(widen(p[i]), th);
}

// The instruction-set clones live on these non-template entry points; the
// template above is inlined into each clone and compiled for its ISA.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZS_SIMD_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZS_SIMD_CLONES
#endif

ZS_SIMD_CLONES inline void scan_span_f32_generic(const float* p, int64_t n,
                                                 const Thresholds<float>& th,
                                                 Lanes<float>& lanes,
                                                 ScalarAccumulator<float>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}
ZS_SIMD_CLONES inline void scan_span_bf16_generic(const Bf16Bits* p, int64_t n,
                                                  const Thresholds<float>& th,
                                                  Lanes<float>& lanes,
                                                  ScalarAccumulator<float>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ZS_HAVE_AVX512_KERNELS 1
// Adds the 16 floats of v, widened to double, into the 8 lanes of sum.
__attribute__((target("avx512f,avx512dq"))) inline __m512d add_widened(__m512d sum, __m512 v) {
  sum = _mm512_add_pd(sum, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm512_add_pd(sum, _mm512_cvtps_pd(upper));
}

// bfloat16 with AVX-512BW. Everything but the moments is decided on the 16-bit
// patterns, 32 lanes at a time (min/max/compare on |x| bits need no
// widening); only the moments widen, which is a shift into the upper half of
// a float. The sum of values is kept in double so the mean of zero-centred data
// keeps its digits.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) inline void
scan_span_bf16_avx512(const Bf16Bits* p, int64_t n, const Thresholds<float>& th,
                      ScalarAccumulator<float>& acc) {
  constexpr int64_t kBlock = 32 * kIters;
  const uint32_t floor32 = th.tiny > 1 ? th.tiny : 1u;
  // |x| <= tol  <=>  bits16 <= tol32 >> 16 (the low half of |x| is zero);
  // |x| <  floor <=> bits16 <  ceil(floor32 / 2^16).
  const uint16_t tol16 = static_cast<uint16_t>(th.tol >> 16);
  const uint16_t floor16 = static_cast<uint16_t>((floor32 + 0xffffu) >> 16);
  const uint16_t ceiling16 = static_cast<uint16_t>(fast_ceiling(acc.shift) >> 16);
  const __m512i abs_mask = _mm512_set1_epi16(0x7fff);
  const __m512i tol_v = _mm512_set1_epi16(static_cast<short>(tol16));
  const __m512i one16 = _mm512_set1_epi16(1);
  const __m512i zero = _mm512_setzero_si512();
  const __m512 shift = _mm512_set1_ps(acc.shift);

  __m512i near_zero = _mm512_setzero_si512(), negative = _mm512_setzero_si512();
  __m512d s1 = _mm512_setzero_pd(), s2 = _mm512_setzero_pd();
  int64_t fast = 0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p + i);
    __m512i mn = _mm512_set1_epi16(-1), mx = zero, nz = zero, ng = zero;
    __m512 f2a = _mm512_setzero_ps(), f2b = _mm512_setzero_ps();
    __m512d f1a = _mm512_setzero_pd(), f1b = _mm512_setzero_pd();
    for (int it = 0; it < kIters; ++it) {
      const __m512i v = _mm512_loadu_si512(q + 32 * it);
      const __m512i a = _mm512_and_si512(v, abs_mask);
      mn = _mm512_min_epu16(mn, a);
      mx = _mm512_max_epu16(mx, a);
      nz = _mm512_mask_add_epi16(nz, _mm512_cmple_epu16_mask(a, tol_v), nz, one16);
      // No zero or NaN in a fast block, so x < 0 is the sign bit.
      ng = _mm512_add_epi16(ng, _mm512_srli_epi16(v, 15));
      // Interleaving with zeros puts each bfloat16 in the top half of a
      // float; the lane order changes, which sums do not mind.
      const __m512 lo = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)), shift);
      const __m512 hi = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)), shift);
      f2a = _mm512_fmadd_ps(lo, lo, f2a);
      f2b = _mm512_fmadd_ps(hi, hi, f2b);
      f1a = add_widened(f1a, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)));
      f1b = add_widened(f1b, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)));
    }
    // Smallest and largest |x| bits of the block (minpos finds a u16 minimum;
    // the maximum is the minimum of the complement).
    __m256i m256 = _mm256_min_epu16(_mm512_castsi512_si256(mn), _mm512_extracti64x4_epi64(mn, 1));
    __m128i m128 = _mm_min_epu16(_mm256_castsi256_si128(m256), _mm256_extracti128_si256(m256, 1));
    const uint16_t lo16 = static_cast<uint16_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(m128)));
    const __m512i not_mx = _mm512_xor_si512(mx, _mm512_set1_epi16(-1));
    m256 = _mm256_min_epu16(_mm512_castsi512_si256(not_mx), _mm512_extracti64x4_epi64(not_mx, 1));
    m128 = _mm_min_epu16(_mm256_castsi256_si128(m256), _mm256_extracti128_si256(m256, 1));
    const uint16_t hi16 = static_cast<uint16_t>(~_mm_cvtsi128_si32(_mm_minpos_epu16(m128)));
    if (lo16 < floor16 || hi16 >= ceiling16) {
      for (int64_t k = 0; k < kBlock; ++k) acc.push(widen(p[i + k]), th);
      continue;
    }
    const uint32_t lo32 = static_cast<uint32_t>(lo16) << 16;
    const uint32_t hi32 = static_cast<uint32_t>(hi16) << 16;
    acc.min_a = lo32 < acc.min_a ? lo32 : acc.min_a;
    acc.min_nonzero = lo32 < acc.min_nonzero ? lo32 : acc.min_nonzero;
    acc.max_a = hi32 > acc.max_a ? hi32 : acc.max_a;
    // u16 counters (at most kIters each) widened by pairwise adds to i32.
    near_zero = _mm512_add_epi32(near_zero, _mm512_madd_epi16(nz, one16));
    negative = _mm512_add_epi32(negative, _mm512_madd_epi16(ng, one16));
    s1 = _mm512_add_pd(s1, _mm512_add_pd(f1a, f1b));
    const __m512 f2 = _mm512_add_ps(f2a, f2b);
    s2 = _mm512_add_pd(s2, _mm512_cvtps_pd(_mm512_castps512_ps256(f2)));
    s2 = _mm512_add_pd(s2, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f2), 1))));
    fast += kBlock;
  }
  acc.numel += fast;
  acc.near_zero += _mm512_reduce_add_epi32(near_zero);
  acc.negative += _mm512_reduce_add_epi32(negative);
  // s1 summed the values themselves; the accumulator wants x - shift.
  acc.s1 += _mm512_reduce_add_pd(s1) - static_cast<double>(fast) * acc.shift;
  acc.s2 += _mm512_reduce_add_pd(s2);
  for (; i < n; ++i) acc.push(widen(p[i]), th);
}
#endif

#if defined(ZS_HAVE_AVX512_KERNELS)
// float32 with AVX-512: the same scheme as the generic loop, 32 values per
// step, with the counters as masked adds and the sum of values in double.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) inline void
scan_span_f32_avx512(const float* p, int64_t n, const Thresholds<float>& th,
                     ScalarAccumulator<float>& acc) {
  constexpr int64_t kBlock = 32 * kIters;
  const uint32_t floor32 = th.tiny > 1 ? th.tiny : 1u;
  const uint32_t ceiling = fast_ceiling(acc.shift);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i tol_v = _mm512_set1_epi32(static_cast<int>(th.tol));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 shift = _mm512_set1_ps(acc.shift);

  __m512i near_zero = _mm512_setzero_si512(), negative = _mm512_setzero_si512();
  __m512d s1 = _mm512_setzero_pd(), s2 = _mm512_setzero_pd();
  int64_t fast = 0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const float* q = p + i;
    __m512i mn = _mm512_set1_epi32(-1), mx = _mm512_setzero_si512();
    __m512i nz = _mm512_setzero_si512(), ng = _mm512_setzero_si512();
    __m512 f2a = _mm512_setzero_ps(), f2b = _mm512_setzero_ps();
    __m512d f1a = _mm512_setzero_pd(), f1b = _mm512_setzero_pd();
    for (int it = 0; it < kIters; ++it) {
      const __m512i va = _mm512_loadu_si512(q + 32 * it);
      const __m512i vb = _mm512_loadu_si512(q + 32 * it + 16);
      const __m512i aa = _mm512_and_si512(va, abs_mask);
      const __m512i ab = _mm512_and_si512(vb, abs_mask);
      mn = _mm512_min_epu32(mn, _mm512_min_epu32(aa, ab));
      mx = _mm512_max_epu32(mx, _mm512_max_epu32(aa, ab));
      nz = _mm512_mask_add_epi32(nz, _mm512_cmple_epu32_mask(aa, tol_v), nz, one);
      nz = _mm512_mask_add_epi32(nz, _mm512_cmple_epu32_mask(ab, tol_v), nz, one);
      // No zero or NaN in a fast block, so x < 0 is the sign bit.
      ng = _mm512_add_epi32(ng, _mm512_add_epi32(_mm512_srli_epi32(va, 31), _mm512_srli_epi32(vb, 31)));
      const __m512 da = _mm512_sub_ps(_mm512_castsi512_ps(va), shift);
      const __m512 db = _mm512_sub_ps(_mm512_castsi512_ps(vb), shift);
      f2a = _mm512_fmadd_ps(da, da, f2a);
      f2b = _mm512_fmadd_ps(db, db, f2b);
      f1a = add_widened(f1a, _mm512_castsi512_ps(va));
      f1b = add_widened(f1b, _mm512_castsi512_ps(vb));
    }
    const uint32_t lo = static_cast<uint32_t>(_mm512_reduce_min_epu32(mn));
    const uint32_t hi = static_cast<uint32_t>(_mm512_reduce_max_epu32(mx));
    if (lo < floor32 || hi >= ceiling) {
      for (int64_t k = 0; k < kBlock; ++k) acc.push(q[k], th);
      continue;
    }
    acc.min_a = lo < acc.min_a ? lo : acc.min_a;
    acc.min_nonzero = lo < acc.min_nonzero ? lo : acc.min_nonzero;
    acc.max_a = hi > acc.max_a ? hi : acc.max_a;
    near_zero = _mm512_add_epi32(near_zero, nz);
    negative = _mm512_add_epi32(negative, ng);
    s1 = _mm512_add_pd(s1, _mm512_add_pd(f1a, f1b));
    const __m512 f2 = _mm512_add_ps(f2a, f2b);
    s2 = _mm512_add_pd(s2, _mm512_cvtps_pd(_mm512_castps512_ps256(f2)));
    s2 = _mm512_add_pd(s2, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f2), 1))));
    fast += kBlock;
  }
  acc.numel += fast;
  // i32 lanes: a span handed to one call is at most one chunk, so each lane
  // counts at most chunk / 16 elements.
  acc.near_zero += static_cast<uint32_t>(_mm512_reduce_add_epi32(near_zero));
  acc.negative += static_cast<uint32_t>(_mm512_reduce_add_epi32(negative));
  // s1 summed the values themselves; the accumulator wants x - shift.
  acc.s1 += _mm512_reduce_add_pd(s1) - static_cast<double>(fast) * acc.shift;
  acc.s2 += _mm512_reduce_add_pd(s2);
  for (; i < n; ++i) acc.push(p[i], th);
}
#endif

// Picks the AVX-512 kernels when the running CPU has them.
inline bool cpu_has_avx512() {
#if defined(ZS_HAVE_AVX512_KERNELS)
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

inline void scan_span(const float* p, int64_t n, const Thresholds<float>& th,
                      Lanes<float>& lanes, ScalarAccumulator<float>& acc) {
#if defined(ZS_HAVE_AVX512_KERNELS)
  if (cpu_has_avx512()) return scan_span_f32_avx512(p, n, th, acc);
#endif
  scan_span_f32_generic(p, n, th, lanes, acc);
}

inline void scan_span(const Bf16Bits* p, int64_t n, const Thresholds<float>& th,
                      Lanes<float>& lanes, ScalarAccumulator<float>& acc) {
#if defined(ZS_HAVE_AVX512_KERNELS)
  if (cpu_has_avx512()) return scan_span_bf16_avx512(p, n, th, acc);
#endif
  scan_span_bf16_generic(p, n, th, lanes, acc);
}
ZS_SIMD_CLONES inline void scan_span(const double* p, int64_t n,
                                     const Thresholds<double>& th,
                                     Lanes<double>& lanes,
                                     ScalarAccumulator<double>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}

}  // namespace cpu
}  // namespace zeroscan
