// How one element is classified and folded into the statistics.
//
// Every element is read as the unsigned key of |x| (dtypes.h). For
// non-negative values key order is numeric order and NaN keys sit above all
// others, so each class is a range of keys and every test is one unsigned
// compare against a per-dtype limit:
//
//   key == 0                      zero
//   key <= sub_max                zero or subnormal
//   key <= bound_max[b]           zero or within bound b (|x| <= tol: near zero)
//   key <= finite_max             finite
//   key <= nonnan_max             not NaN (infinite when above finite_max)
//
// Min/max |x| are integer min/max on keys, and the moments sum only the
// finite values (shifted, see set_moments). Nothing branches on the value,
// so zeros, subnormals, NaN and Inf cost what any other value costs. CUDA
// threads run `Tally::add` on every element; the CPU's vector loop
// (cpu/vec_scan.h) evaluates the same compares lane-parallel and adds its
// sums into a Tally, and CUDA's fast path (cuda/fast_tally.cuh) counts the
// same key ranges on the float pipes. Free of torch headers.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtypes.h"
#include "stats_record.h"

namespace zeroscan {

// ---- Magnitude counts --------------------------------------------------------
//
// A magnitude count is the number of nonzero |x| within a bound, or of
// finite |x| beyond it: one key compare per element and bound. Tally, the
// CPU's vector loop and CUDA's fast path each loop over this list, so a new
// count of this kind is its Field and Partial member (stats_record.h) and
// three lines here: its Bound, its test in `within_bound`, and its line in
// `set_magnitude_counts`.
enum Bound : int {
  kTolBound,  // near_zero: 0 < |x| <= tol
  kNumBounds,
};

// Whether |x| = v (a magnitude of the dtype) is within bound b, for the
// call's `tol`. The values within a bound must be all those below some
// magnitude: each bound is then one key. Host only.
inline bool within_bound(int b, double v, double tol) {
  switch (b) {
    case kTolBound:
      return v <= tol;
    default:
      return false;
  }
}

// The magnitude counts of `p`, whose other counts are set, from the number
// of elements whose key is at most each bound_max (the zeros among them):
// the nonzero |x| within a bound are at_most[b] - p.zeros, the finite |x|
// beyond a finite one p.finite() - at_most[b].
ZS_HD void set_magnitude_counts(Partial& p, const int64_t (&at_most)[kNumBounds]) {
  p.near_zero = at_most[kTolBound] - p.zeros;
}

// The key limits of one dtype and tol, widened to 64 bits so that one record
// serves every key width (and travels in the CUDA launch header, which each
// bound grows by 8 bytes here and 12 in cuda/fast_tally.cuh's FastLimits;
// stats_cuda.cuh asserts that the header fits a kernel's parameters). A
// bound's key may lie anywhere: tol is the caller's.
struct Limits {
  uint64_t sub_max;                // largest key below tiny; 0 when there is none
  uint64_t bound_max[kNumBounds];  // largest key within each bound; 0 when there is none
  uint64_t finite_max;             // largest finite key
  uint64_t nonnan_max;             // largest key that is not NaN
};

// The largest key whose magnitude satisfies `ok` (true for small keys, false
// from some key on), or 0 when even key 0 fails. Host only: the limits are
// computed once per call, by the launcher.
template <typename S, typename Ok>
uint64_t largest_key(Ok ok) {
  using F = Format<S>;
  uint64_t lo = 0, hi = F::kMaxKey;
  if (!ok(F::magnitude(0))) return 0;
  while (lo < hi) {  // ok(lo) holds; the answer is in [lo, hi]
    const uint64_t gap = hi - lo;  // hi - lo + 1 would overflow for uint64 keys
    const uint64_t mid = lo + gap / 2 + (gap & 1);
    if (ok(F::magnitude(static_cast<typename F::key_t>(mid)))) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// `tiny` and `tol` as real numbers: |x| < tiny is subnormal, and each
// bound is its test in within_bound. Exact: the key tests then decide
// exactly what the real-number tests would. set_bounds: the bounds alone,
// for a call's own tol.
template <typename S>
void set_bounds(Limits& l, double tol) {
  for (int b = 0; b < kNumBounds; ++b) {
    l.bound_max[b] = largest_key<S>([=](double v) { return within_bound(b, v, tol); });
  }
}

template <typename S>
Limits limits_for(double tiny, double tol) {
  Limits l;
  l.sub_max = largest_key<S>([tiny](double v) { return v < tiny; });
  set_bounds<S>(l, tol);
  l.finite_max = largest_key<S>([](double v) { return std::isfinite(v); });
  l.nonnan_max = largest_key<S>([](double v) { return !std::isnan(v); });
  return l;
}

// The running statistics of some elements of storage type S. `count_t` is
// int64_t on the CPU; a CUDA thread, which sees far fewer than 2^32
// elements, uses uint32_t.
template <typename S, typename count_t>
struct Tally {
  using F = Format<S>;
  using key_t = typename F::key_t;

  count_t numel = 0;
  count_t zeros = 0;
  count_t at_most_sub = 0;  // key <= sub_max
  count_t at_most[kNumBounds] = {};  // key <= bound_max[b]
  count_t finite = 0;
  count_t non_nan = 0;
  count_t negative = 0;     // sign set, nonzero, not NaN
  count_t neginf = 0;
  // min |x| is 0 when there is a zero and the min nonzero key otherwise, so
  // only the latter is kept (NaN keys, above all others, lose any min).
  key_t lo_nonzero = key_t(~key_t(0));  // min nonzero key
  key_t hi = 0;                         // max non-NaN key
  double s1 = 0.0, s2 = 0.0;            // sums of d and d^2, d = x * scale - shift

  // The moments are of x * scale (1, or kDownscale for float64 values
  // whose sums overflowed, stats_record.h).
  ZS_HD void add(S x, const Limits& lim, double shift, double scale = 1.0) {
    const key_t key = F::key(x);
    const bool sign = F::negative_sign(x);
    const bool nonzero = key != 0;
    const bool fin = key <= static_cast<key_t>(lim.finite_max);
    const bool num = key <= static_cast<key_t>(lim.nonnan_max);
    numel += 1;
    zeros += !nonzero;
    at_most_sub += key <= static_cast<key_t>(lim.sub_max);
    for (int b = 0; b < kNumBounds; ++b) at_most[b] += key <= static_cast<key_t>(lim.bound_max[b]);
    finite += fin;
    non_nan += num;
    negative += sign & nonzero & num;
    neginf += sign & num & !fin;
    lo_nonzero = nonzero & (key < lo_nonzero) ? key : lo_nonzero;
    hi = num & (key > hi) ? key : hi;
    // A non-finite value adds nothing: it is selected away, never summed.
    const double d = static_cast<double>(F::value(x)) * scale - shift;
    const double kept = fin ? d : 0.0;
    s1 += kept;
    s2 += kept * kept;
  }

  ZS_HD Partial finish(double shift) const {
    Partial p = empty_partial();
    p.numel = static_cast<int64_t>(numel);
    p.zeros = static_cast<int64_t>(zeros);
    p.subnormal = static_cast<int64_t>(at_most_sub - zeros);
    p.nan = static_cast<int64_t>(numel - non_nan);
    p.neginf = static_cast<int64_t>(neginf);
    p.posinf = static_cast<int64_t>(non_nan - finite - neginf);
    p.negative = static_cast<int64_t>(negative);
    int64_t within[kNumBounds];
    for (int b = 0; b < kNumBounds; ++b) within[b] = static_cast<int64_t>(at_most[b]);
    set_magnitude_counts(p, within);
    // A nonzero non-NaN key is below every NaN key, so the min over nonzero
    // keys is right whenever there is one.
    if (non_nan > zeros) p.min_abs_nonzero = F::magnitude(lo_nonzero);
    if (non_nan > 0) {
      p.min_abs = zeros > 0 ? 0.0 : p.min_abs_nonzero;
      p.max_abs = F::magnitude(hi);
    }
    set_moments(p, p.finite(), shift, s1, s2);
    return p;
  }
};

}  // namespace zeroscan
