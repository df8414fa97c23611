// The CPU's SIMD scan of one contiguous span, free of torch headers.
//
// The hot loop keeps L independent lanes per statistic so the compiler turns
// it into SIMD code. It assumes the common case -- no zeros, no subnormals,
// no NaN/Inf -- and checks that assumption once per block of L * kIters
// elements. A block that breaks it is rescanned (it is still in L1) by the
// exact scalar classifier, so rare values cost little and the answer never
// depends on the assumption.
#pragma once

#include <cstdint>
#include <cstring>

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

  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const Src* q = p + i;
    bits_t mn[L], mx[L], nz[L], ng[L];
    // The mean needs double sums (a float sum of zero-mean data loses it);
    // the second moment is positive and well conditioned around the shift,
    // so a kIters-term float sum per lane is accurate to ~1e-7 and is
    // widened once per block.
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
        f1[j] += static_cast<double>(d);
        f2[j] += d * d;
      }
    }
    bits_t lo = B::kAbsMask, hi = 0;
    for (int j = 0; j < L; ++j) {
      lo = mn[j] < lo ? mn[j] : lo;
      hi = mx[j] > hi ? mx[j] : hi;
    }
    if (lo < floor || hi >= B::kInf) {
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

ZS_SIMD_CLONES inline void scan_span(const float* p, int64_t n,
                                     const Thresholds<float>& th,
                                     Lanes<float>& lanes,
                                     ScalarAccumulator<float>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}
ZS_SIMD_CLONES inline void scan_span(const Bf16Bits* p, int64_t n,
                                     const Thresholds<float>& th,
                                     Lanes<float>& lanes,
                                     ScalarAccumulator<float>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}
ZS_SIMD_CLONES inline void scan_span(const double* p, int64_t n,
                                     const Thresholds<double>& th,
                                     Lanes<double>& lanes,
                                     ScalarAccumulator<double>& acc) {
  scan_span_impl(p, n, th, lanes, acc);
}

}  // namespace cpu
}  // namespace zeroscan
