// Whether a tensor holds a NaN or an infinity: the one test of
// zeroscan.mark_nonfinite, shared by the CPU and CUDA backends.
//
// An element is non-finite when the key of |x| (dtypes.h) is above the
// dtype's largest finite key (Limits::finite_max, classify.h). For every
// floating dtype of the table the first key above it, `bad = finite_max + 1`,
// is a run of ones just below the sign bit (the exponent field of the IEEE
// formats; all seven bits of float8_e4m3fn, whose only non-finite value is
// NaN), and every key at or above it has all those ones set. So the test is
// `(bits & bad) == bad` on the stored bits, the sign ignored: an AND and an
// equality, which vectorize on any x86-64 where an unsigned compare of
// 32- or 64-bit lanes does not. The integer dtypes never hold one. Free of
// torch headers.
#pragma once

#include <cstdint>

#include "classify.h"
#include "dtypes.h"

namespace zeroscan {

// Whether any of the `n` elements at p[0], p[stride], ... is NaN or ±Inf.
// Folds the tests into an integer of the element's width, without branching,
// so that the contiguous loop vectorizes; a caller that wants to stop early
// calls it on pieces.
template <typename S>
ZS_HD bool any_nonfinite(const S* p, int64_t n, int64_t stride, uint64_t finite_max) {
  using F = Format<S>;
  if constexpr (!F::kFloating) {
    return false;
  } else {
    using key_t = typename F::key_t;
    const key_t bad = static_cast<key_t>(finite_max + 1);
    key_t found = 0;
    if (stride == 1) {
      for (int64_t i = 0; i < n; ++i) found |= key_t((F::bits(p[i]) & bad) == bad);
    } else {
      for (int64_t i = 0; i < n; ++i) found |= key_t((F::bits(p[i * stride]) & bad) == bad);
    }
    return found != 0;
  }
}

// What kinds of non-finite value the `n` elements at p[0], p[stride], ...
// hold: kHoldsInf | kHoldsNan bits (0: all finite). Tests each element twice, so
// a caller runs it where any_nonfinite found one.
constexpr int32_t kHoldsInf = 1;
constexpr int32_t kHoldsNan = 2;

template <typename S>
ZS_HD int32_t nonfinite_kinds(const S* p, int64_t n, int64_t stride, uint64_t finite_max, uint64_t nonnan_max) {
  using F = Format<S>;
  int32_t kinds = 0;
  if constexpr (F::kFloating) {
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t key = F::key(p[i * stride]);
      kinds |= key > nonnan_max ? kHoldsNan : key > finite_max ? kHoldsInf : 0;
    }
  }
  return kinds;
}

}  // namespace zeroscan
