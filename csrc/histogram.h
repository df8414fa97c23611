// The log2-magnitude histogram's bins: which field each element counts in.
//
// An element counts under the exponent field of |x| (its key shifted past
// the mantissa bits): field 0 holds zeros and subnormals, the fields after
// it one normal binade each, and the all-ones field infinities and NaN
// (float8_e4m3fn's also holds its top binade, 256..448). An integer counts
// under the bit length of |x|: field 0 for zero, k for 2^(k-1) <= |x| < 2^k.
// Every element is in exactly one field, so a tensor's fields sum to its
// numel, and the result row's zeros, subnormal, NaN and Inf counts split
// the shared fields (zeroscan/histogram.py, `Histogram.from_fields`).
//
// Torch-free, like dtypes.h: the CPU and CUDA kernels count with `field`,
// and the launchers size the output with `kFields`.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace zeroscan {

// The bit length of k: 0 for 0, else 1 + floor(log2 k).
ZS_HD int bit_length(uint64_t k) {
#if defined(__CUDA_ARCH__)
  return 64 - __clzll(static_cast<long long>(k));
#else
  return k == 0 ? 0 : 64 - __builtin_clzll(k);
#endif
}

template <typename S>
struct Binning {
  using F = Format<S>;
  using key_t = typename F::key_t;
  static constexpr int kBits = 8 * static_cast<int>(sizeof(S));
  // Fields of one tensor: 2^exponent bits for floats, bit lengths 0..bits
  // for integers (bool: 0 or 1).
  static constexpr int kFields =
      F::kFloating ? 1 << (kBits - 1 - F::kMantissaBits)
                   : (std::is_same_v<S, bool_t> ? 2 : kBits + 1);

  // key: Format<S>::key(x), the key of |x|.
  ZS_HD static int field(key_t key) {
    if constexpr (F::kFloating) {
      return static_cast<int>(key >> F::kMantissaBits);
    } else {
      return bit_length(static_cast<uint64_t>(key));
    }
  }
};

// The most fields any dtype has (float64's 2048).
constexpr int kMaxFields = Binning<double>::kFields;

}  // namespace zeroscan
