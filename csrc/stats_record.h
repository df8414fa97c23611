// The partial-statistics record and how two partials combine.
//
// This header is the single definition of zeroscan's statistics. The CPU
// kernel, the CUDA kernels and the distributed merge all accumulate into a
// `Partial` and reduce with `combine`, so every backend agrees by
// construction. It includes no torch header: nvcc compiles it for device code
// and plain C++ compiles it for the host.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define ZS_HD __host__ __device__ __forceinline__
#else
#define ZS_HD inline
#endif

namespace zeroscan {

// The bits of scalar x as a scalar To of the same size. __builtin_bit_cast
// rather than memcpy: where the host compiler fortifies memcpy (Ubuntu's g++
// defines _FORTIFY_SOURCE when it optimizes), nvcc compiles a device-side
// memcpy differently, and the float16 scan spilled registers with the define
// and not without. Scalars only: nvcc's device compiler fails on a struct (an
// internal compiler error), so dtypes.h reads the storage structs through
// their member (storage_bits) and fast_tally.cuh has its own casts for CUDA's
// __half2.
template <typename To, typename From>
ZS_HD To bit_cast_to(From x) {
  static_assert(std::is_scalar_v<To> && std::is_scalar_v<From>, "bit_cast_to: scalars only");
  static_assert(sizeof(To) == sizeof(From), "bit_cast_to: sizes differ");
  return __builtin_bit_cast(To, x);
}

// Columns of one result row: an int64 [kNumFields] record per scanned tensor.
// Counts are stored as int64 so they stay exact; the float64 fields are stored
// bit-for-bit in the int64 slots (the Python side reads them with
// `.view(torch.float64)`), which keeps one call's result in one buffer.
enum Field : int {
  kNumel = 0,
  kZeros = 1,          // x == 0 (either sign)
  kSubnormal = 2,      // 0 < |x| < finfo.tiny
  kNearZero = 3,       // 0 < |x| <= tol
  kNan = 4,
  kPosInf = 5,
  kNegInf = 6,
  kNegative = 7,       // x < 0 (so -0 and NaN do not count)
  kMinAbs = 8,         // over non-NaN values; +inf when there are none
  kMinAbsNonzero = 9,  // over non-NaN, nonzero values; +inf when none
  kMaxAbs = 10,        // over non-NaN values; -inf when there are none
  kMean = 11,          // over finite values
  kM2 = 12,            // sum of squared deviations from kMean, finite values
  kNumCountFields = 8,
  kNumFields = 16,     // padded so a row is 128 bytes
};

struct Partial {
  int64_t numel;
  int64_t zeros;
  int64_t subnormal;
  int64_t near_zero;
  int64_t nan;
  int64_t posinf;
  int64_t neginf;
  int64_t negative;
  double min_abs;
  double min_abs_nonzero;
  double max_abs;
  double mean;
  double m2;

  ZS_HD int64_t finite() const { return numel - nan - posinf - neginf; }
};

ZS_HD Partial empty_partial() {
  Partial p;
  p.numel = p.zeros = p.subnormal = p.near_zero = 0;
  p.nan = p.posinf = p.neginf = p.negative = 0;
  p.min_abs = __builtin_huge_val();
  p.min_abs_nonzero = __builtin_huge_val();
  p.max_abs = -__builtin_huge_val();
  p.mean = 0.0;
  p.m2 = 0.0;
  return p;
}

// The largest finite double, and whether v is finite (NaN and infinities
// are not), by its bits: the same test on the host and the device.
constexpr double kMaxDouble = 0x1.fffffffffffffp1023;
ZS_HD bool finite_double(double v) {
  const uint64_t bits = bit_cast_to<uint64_t>(v);
  return (bits & 0x7fffffffffffffffull) < 0x7ff0000000000000ull;
}

// float64 values far beyond 1e150, summed about a shift, can overflow the
// sums: (x - shift)^2 above ~1.8e308, or x - shift itself when the values
// lie near both ends of the range. Inputs that are not finite never enter
// the sums, so an overflow always shows as a sum that is not finite; the
// scans then sum the same values again as y = x * kDownscale, exactly (but
// for values below 2^-482, whose lost bits weigh nothing beside the values
// near 1e150 that overflowed), and no sum of fewer than 2^53 such values or
// their squares can overflow: |y| < 2^484. upscale_moments scales the
// result back.
constexpr double kDownscale = 0x1p-540;
constexpr double kUpscale = 0x1p540;

// A mean, held within the float64 range: the mean of finite values is
// finite, but rounding can carry one within an ulp of the largest double
// past it. NaN passes.
ZS_HD double within_range(double mean) {
  return mean > kMaxDouble ? kMaxDouble : mean < -kMaxDouble ? -kMaxDouble : mean;
}

// Builds the moment part of a partial from sums of shifted values.
// Shifting by a value close to the mean (`shift`) is what keeps the variance
// of `1000 + 1e-3 * randn` accurate: the raw second moment would cancel
// catastrophically. `s1 = sum(x - shift)`, `s2 = sum((x - shift)^2)`.
ZS_HD void set_moments(Partial& p, int64_t n_finite, double shift, double s1,
                       double s2) {
  if (n_finite == 0) {
    p.mean = 0.0;
    p.m2 = 0.0;
    return;
  }
  const double n = static_cast<double>(n_finite);
  const double d = s1 / n;
  p.mean = within_range(shift + d);
  const double m2 = s2 - s1 * d;
  p.m2 = m2 > 0.0 ? m2 : 0.0;
}

// The moments of a partial whose sums were of its values times kDownscale,
// made those of the values themselves. m2 overflows to inf when it exceeds
// the float64 range, and only then.
ZS_HD void upscale_moments(Partial& p) {
  p.mean = within_range(p.mean * kUpscale);
  p.m2 = p.m2 * kUpscale * kUpscale;
}

ZS_HD double min_d(double a, double b) { return b < a ? b : a; }
ZS_HD double max_d(double a, double b) { return b > a ? b : a; }

// Merges `b` into `a`. Moments use the parallel-variance (Chan et al.)
// update, which is exact in exact arithmetic and stable in floating point;
// stds are never averaged. The result depends on the order of combination
// only through rounding, so callers combine in a fixed order.
ZS_HD void combine(Partial& a, const Partial& b) {
  const int64_t na = a.finite();
  const int64_t nb = b.finite();
  a.numel += b.numel;
  a.zeros += b.zeros;
  a.subnormal += b.subnormal;
  a.near_zero += b.near_zero;
  a.nan += b.nan;
  a.posinf += b.posinf;
  a.neginf += b.neginf;
  a.negative += b.negative;
  a.min_abs = min_d(a.min_abs, b.min_abs);
  a.min_abs_nonzero = min_d(a.min_abs_nonzero, b.min_abs_nonzero);
  a.max_abs = max_d(a.max_abs, b.max_abs);
  if (nb == 0) return;
  if (na == 0) {
    a.mean = b.mean;
    a.m2 = b.m2;
    return;
  }
  const double n = static_cast<double>(na + nb);
  const double delta = b.mean - a.mean;
  const double wb = static_cast<double>(nb) / n;
  // A delta that overflows (means near both ends of the float64 range)
  // takes the weighted mean of the two, of opposite signs, which cannot
  // overflow; otherwise a.mean + delta * wb lies between the two means and
  // is exactly a.mean when they are equal. na * wb >= 1/2: delta is
  // multiplied by it before it is squared, so the m2 term overflows only
  // when it exceeds the float64 range, as it does when delta overflows.
  a.mean = finite_double(delta) ? a.mean + delta * wb : a.mean * (1.0 - wb) + b.mean * wb;
  a.m2 += b.m2 + delta * (static_cast<double>(na) * wb) * delta;
}

// Combines partials 0..n-1 in the one fixed pairwise tree that every backend
// and the distributed merge use: (0+1), (2+3), ... then those pairs, and so
// on, a partial without a partner passing up unchanged; for n = 7,
// ((0+1)+(2+3))+((4+5)+6). So the result depends on the partials alone, never
// on who combines them. It is left in part 0. `parts` gives get(i) -> Partial
// and set(i, Partial): an array of Partials (PartialArray) or of result rows
// (RowArray).
template <typename Parts>
ZS_HD void combine_in_tree(Parts& parts, int64_t n) {
  for (int64_t width = 1; width < n; width *= 2) {
    for (int64_t i = 0; i + width < n; i += 2 * width) {
      Partial a = parts.get(i);
      combine(a, parts.get(i + width));
      parts.set(i, a);
    }
  }
}

struct PartialArray {
  Partial* parts;
  ZS_HD Partial get(int64_t i) const { return parts[i]; }
  ZS_HD void set(int64_t i, const Partial& p) { parts[i] = p; }
};

// The statistics of a tensor whose every element appears `k` times, as an
// expanded (stride-0) view does. Reading the memory once and scaling is both
// faster and exactly what reading it k times would give.
ZS_HD void repeat(Partial& p, int64_t k) {
  p.numel *= k;
  p.zeros *= k;
  p.subnormal *= k;
  p.near_zero *= k;
  p.nan *= k;
  p.posinf *= k;
  p.neginf *= k;
  p.negative *= k;
  p.m2 *= static_cast<double>(k);
}

ZS_HD void store_double(int64_t* slot, double v) {
  *slot = bit_cast_to<int64_t>(v);
}

ZS_HD double load_double(const int64_t* slot) {
  return bit_cast_to<double>(*slot);
}

// row: [kNumFields]
ZS_HD void store(const Partial& p, int64_t* row) {
  row[kNumel] = p.numel;
  row[kZeros] = p.zeros;
  row[kSubnormal] = p.subnormal;
  row[kNearZero] = p.near_zero;
  row[kNan] = p.nan;
  row[kPosInf] = p.posinf;
  row[kNegInf] = p.neginf;
  row[kNegative] = p.negative;
  store_double(row + kMinAbs, p.min_abs);
  store_double(row + kMinAbsNonzero, p.min_abs_nonzero);
  store_double(row + kMaxAbs, p.max_abs);
  store_double(row + kMean, p.mean);
  store_double(row + kM2, p.m2);
  for (int i = kM2 + 1; i < kNumFields; ++i) row[i] = 0;
}

// row: [kNumFields]
ZS_HD Partial load(const int64_t* row) {
  Partial p;
  p.numel = row[kNumel];
  p.zeros = row[kZeros];
  p.subnormal = row[kSubnormal];
  p.near_zero = row[kNearZero];
  p.nan = row[kNan];
  p.posinf = row[kPosInf];
  p.neginf = row[kNegInf];
  p.negative = row[kNegative];
  p.min_abs = load_double(row + kMinAbs);
  p.min_abs_nonzero = load_double(row + kMinAbsNonzero);
  p.max_abs = load_double(row + kMaxAbs);
  p.mean = load_double(row + kMean);
  p.m2 = load_double(row + kM2);
  return p;
}

// Result rows of kNumFields words, `stride` words apart (the same tensor's
// row from each rank of an int64 [W, N, kNumFields] gather: stride N * 16).
struct RowArray {
  int64_t* rows;
  int64_t stride;
  ZS_HD Partial get(int64_t i) const { return load(rows + i * stride); }
  ZS_HD void set(int64_t i, const Partial& p) { store(p, rows + i * stride); }
};

}  // namespace zeroscan
