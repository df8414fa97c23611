// How one element is classified and accumulated.
//
// Every backend reads an element, widens it exactly to a compute type
// (`float` for 8/16/32-bit floats, `double` for float64 and integers), and
// classifies it on the bit pattern of |x|. For non-negative IEEE values the
// unsigned order of the bit patterns is the numeric order, so "is zero",
// "is subnormal", "is at most tol", "is NaN", "is inf", and min/max |x| are
// all exact integer compares that cannot be fooled by rounding, and NaN
// (any pattern above +inf) can never slip through a min or max the way it
// does with fminf/fmaxf.
#pragma once

#include <cstdint>

#include "stats_record.h"

namespace zeroscan {

template <typename acc_t>
struct FloatBits;

template <>
struct FloatBits<float> {
  using bits_t = uint32_t;
  static constexpr bits_t kAbsMask = 0x7fffffffu;
  static constexpr bits_t kSignMask = 0x80000000u;
  static constexpr bits_t kInf = 0x7f800000u;
};

template <>
struct FloatBits<double> {
  using bits_t = uint64_t;
  static constexpr bits_t kAbsMask = 0x7fffffffffffffffull;
  static constexpr bits_t kSignMask = 0x8000000000000000ull;
  static constexpr bits_t kInf = 0x7ff0000000000000ull;
};

template <typename acc_t>
ZS_HD typename FloatBits<acc_t>::bits_t to_bits(acc_t x) {
  typename FloatBits<acc_t>::bits_t b;
  memcpy(&b, &x, sizeof(b));
  return b;
}

template <typename acc_t>
ZS_HD acc_t from_bits(typename FloatBits<acc_t>::bits_t b) {
  acc_t x;
  memcpy(&x, &b, sizeof(x));
  return x;
}

// Thresholds on |x|, as bit patterns of the compute type.
template <typename acc_t>
struct Thresholds {
  using bits_t = typename FloatBits<acc_t>::bits_t;
  bits_t tiny;  // |x| < tiny (and != 0) is subnormal; 0 for integer inputs
  bits_t tol;   // |x| <= tol (and != 0) is near zero
};

// Scalar accumulation of one thread's elements. The CPU kernel uses it for
// block tails and blocks that contain zeros, subnormals or non-finite values;
// CUDA threads use it for every element.
template <typename acc_t>
struct ScalarAccumulator {
  using B = FloatBits<acc_t>;
  using bits_t = typename B::bits_t;
  static constexpr bits_t kNone = B::kAbsMask;  // above every non-NaN |x|

  int64_t numel = 0, zeros = 0, subnormal = 0, near_zero = 0;
  int64_t nan = 0, posinf = 0, neginf = 0, negative = 0;
  bits_t min_a = kNone, min_nonzero = kNone, max_a = 0;
  acc_t shift = 0;  // subtracted before summing; see set_moments
  double s1 = 0.0, s2 = 0.0;

  ZS_HD void push(acc_t x, const Thresholds<acc_t>& th) {
    const bits_t bits = to_bits(x);
    const bits_t a = bits & B::kAbsMask;
    const bool is_nan = a > B::kInf;
    const bool is_inf = a == B::kInf;
    const bool is_zero = a == 0;
    numel += 1;
    zeros += is_zero;
    subnormal += (!is_zero) & (a < th.tiny);
    near_zero += (!is_zero) & (a <= th.tol);
    nan += is_nan;
    posinf += is_inf & ((bits & B::kSignMask) == 0);
    neginf += is_inf & ((bits & B::kSignMask) != 0);
    negative += x < acc_t(0);
    if (!is_nan) {
      min_a = a < min_a ? a : min_a;
      max_a = a > max_a ? a : max_a;
      if (!is_zero) min_nonzero = a < min_nonzero ? a : min_nonzero;
    }
    if (a < B::kInf) {
      const double d = static_cast<double>(x) - static_cast<double>(shift);
      s1 += d;
      s2 += d * d;
    }
  }

  ZS_HD Partial finish() const {
    Partial p = empty_partial();
    p.numel = numel;
    p.zeros = zeros;
    p.subnormal = subnormal;
    p.near_zero = near_zero;
    p.nan = nan;
    p.posinf = posinf;
    p.neginf = neginf;
    p.negative = negative;
    if (numel - nan > 0) {
      p.min_abs = static_cast<double>(from_bits<acc_t>(min_a));
      p.max_abs = static_cast<double>(from_bits<acc_t>(max_a));
    }
    if (min_nonzero != kNone) {
      p.min_abs_nonzero = static_cast<double>(from_bits<acc_t>(min_nonzero));
    }
    set_moments(p, p.finite(), static_cast<double>(shift), s1, s2);
    return p;
  }
};

}  // namespace zeroscan
