// Whether a tensor holds a NaN or an infinity: the one test of
// zeroscan.mark_nonfinite, shared by the CPU and CUDA backends.
//
// An element is non-finite when the key of |x| (dtypes.h) is above the
// dtype's largest finite key (Limits::finite_max, classify.h). For every
// floating dtype of the table the first key above it, `bad = finite_max + 1`,
// is a run of ones just below the sign bit (the exponent field of the IEEE
// formats; all seven bits of float8_e4m3fn, whose only non-finite value is
// NaN), and every key at or above it has all those ones set. So on the stored
// bits, the sign ignored:
//
//   non-finite   (bits & bad) == bad
//   infinite     (bits & kAbsMask) == bad, in a dtype that has infinities
//   NaN          non-finite and not infinite
//
// ANDs and equalities, which vectorize on any x86-64 where an unsigned
// compare of 32- or 64-bit lanes does not. The integer dtypes never hold a
// non-finite value. Free of torch headers.
#pragma once

#include <cstdint>

#include "classify.h"
#include "dtypes.h"

namespace zeroscan {

constexpr int32_t kHoldsInf = 1;
constexpr int32_t kHoldsNan = 2;

// Every kind a dtype can hold: a caller that has found them all can stop.
template <typename S>
constexpr int32_t all_kinds() {
  return Format<S>::kHasInf ? (kHoldsInf | kHoldsNan) : Format<S>::kHasNan ? kHoldsNan : 0;
}

// The kinds of non-finite value (kHoldsInf | kHoldsNan; 0: all finite) among
// the `n` elements at p[0], p[stride], ... Folds the tests into integers of
// the element's width, without branching, so that the contiguous loop
// vectorizes; a caller that wants to stop early calls it on pieces.
template <typename S>
ZS_HD int32_t nonfinite_kinds(const S* p, int64_t n, int64_t stride, uint64_t finite_max) {
  using F = Format<S>;
  if constexpr (!F::kFloating) {
    return 0;
  } else {
    using key_t = typename F::key_t;
    const key_t bad = static_cast<key_t>(finite_max + 1);
    key_t infinite = 0, nan = 0;
    auto test = [&](key_t bits) {
      const key_t is_inf = F::kHasInf ? key_t((bits & F::kAbsMask) == bad) : key_t(0);
      infinite |= is_inf;
      nan |= key_t(((bits & bad) == bad) & !is_inf);
    };
    if (stride == 1) {
      for (int64_t i = 0; i < n; ++i) test(F::bits(p[i]));
    } else {
      for (int64_t i = 0; i < n; ++i) test(F::bits(p[i * stride]));
    }
    return (infinite != 0 ? kHoldsInf : 0) | (nan != 0 ? kHoldsNan : 0);
  }
}

}  // namespace zeroscan
