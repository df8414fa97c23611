// The dtypes zeroscan scans, one line each, and how their bits are read.
//
// Torch-free: nvcc compiles it for the CUDA kernels and plain C++ for the CPU
// kernels. The table drives the dtype dispatch of both backends and the
// per-dtype thresholds (op_common.h); `Format<S>` says how one stored element
// becomes the unsigned key of |x| that every classification compares (see
// classify.h), whether it is negative, and its exact value.
#pragma once

#include <cstdint>
#include <type_traits>

#include "stats_record.h"

namespace zeroscan {

// Storage types that have no builtin C++ type: their raw bits.
struct f16_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};
struct e4m3_t {  // float8_e4m3fn
  uint8_t bits;
};
struct e5m2_t {  // float8_e5m2
  uint8_t bits;
};
struct bool_t {
  uint8_t bits;
};

// X(torch name, storage type, value type, tiny, eps)
//   torch name   the c10::ScalarType enumerator
//   storage      one element as it sits in memory
//   value type   the type it widens to exactly: float for floating types of
//                up to 32 bits, double for float64 and integers
//   tiny, eps    torch.finfo(dtype).tiny and .eps; 0 for integer types, which
//                have no subnormals and no rounding unit
// Adding a dtype is one line here (and a Format below if its storage is new).
#define ZEROSCAN_DTYPES(X)                                      \
  X(Float, float, float, 0x1p-126, 0x1p-23)                     \
  X(Double, double, double, 0x1p-1022, 0x1p-52)                 \
  X(Half, ::zeroscan::f16_t, float, 0x1p-14, 0x1p-10)           \
  X(BFloat16, ::zeroscan::bf16_t, float, 0x1p-126, 0x1p-7)      \
  X(Float8_e4m3fn, ::zeroscan::e4m3_t, float, 0x1p-6, 0x1p-3)   \
  X(Float8_e5m2, ::zeroscan::e5m2_t, float, 0x1p-14, 0x1p-2)    \
  X(Bool, ::zeroscan::bool_t, double, 0.0, 0.0)                 \
  X(Byte, uint8_t, double, 0.0, 0.0)                            \
  X(Char, int8_t, double, 0.0, 0.0)                             \
  X(Short, int16_t, double, 0.0, 0.0)                           \
  X(Int, int32_t, double, 0.0, 0.0)                             \
  X(Long, int64_t, double, 0.0, 0.0)

// The unsigned integer of `Bytes` bytes (1, 2, 4 or 8).
template <int Bytes>
using UnsignedOf = std::conditional_t<
    Bytes == 1, uint8_t,
    std::conditional_t<Bytes == 2, uint16_t, std::conditional_t<Bytes == 4, uint32_t, uint64_t>>>;

// A stored element's raw bits, and the element that holds given bits. The
// storage structs above are read and built through their member (bit_cast_to
// takes scalars only).
template <typename S>
ZS_HD UnsignedOf<sizeof(S)> storage_bits(S x) {
  if constexpr (std::is_scalar_v<S>) {
    return bit_cast_to<UnsignedOf<sizeof(S)>>(x);
  } else {
    return x.bits;
  }
}
template <typename S>
ZS_HD S storage_of_bits(UnsignedOf<sizeof(S)> bits) {
  if constexpr (std::is_scalar_v<S>) {
    return bit_cast_to<S>(bits);
  } else {
    return S{bits};
  }
}

// A float from a sign bit and the float32 pattern of |x| (which may be NaN).
ZS_HD float with_sign(uint32_t abs_bits, bool negative) {
  return bit_cast_to<float>(abs_bits | (negative ? 0x80000000u : 0u));
}

// float16 |x| bits (15) -> float32 |x| bits, exactly. Shifting |x| into a
// float's exponent and mantissa fields gives |x| * 2^-112 for normal and
// subnormal values alike (the exponent biases differ by 112), so one exact
// power-of-two scale finishes the job; infinity and NaN keep their meaning.
ZS_HD uint32_t f16_abs_to_f32_bits(uint32_t a) {
  const float scaled = bit_cast_to<float>(a << 13) * 0x1p112f;
  return a >= 0x7c00u ? 0x7f800000u | ((a & 0x3ffu) << 13)
                      : bit_cast_to<uint32_t>(scaled);
}

// How the elements of one storage type are read. Every type has:
//   key_t              unsigned, as wide as S
//   kFloating          has subnormals, and NaN/Inf where kHasNan/kHasInf say
//   kSigned            an integer type whose negative values have keys |x|
//   key(x)             |x| as an unsigned key: for non-negative values of
//                      every type, key order is numeric order, and NaN keys
//                      sit above every other key
//   negative_sign(x)   the sign bit (floats, including -0 and -NaN) or x < 0
//   value(x)           x widened exactly to float or double
//   magnitude(key)     the value of |x| for a key, in double
//   kMaxKey            no key of |x| is above it
//   kMantissaBits      the width of a float's mantissa field; 0 for integers
template <typename S>
struct Format;

template <typename S, typename Bits, int Mantissa, bool kInf>
struct FloatFormat {
  using key_t = Bits;
  static constexpr bool kFloating = true;
  static constexpr int kMantissaBits = Mantissa;
  static constexpr bool kSigned = false;
  static constexpr bool kHasInf = kInf;
  static constexpr bool kHasNan = true;
  static constexpr key_t kSignBit = key_t(key_t(1) << (8 * sizeof(S) - 1));
  static constexpr key_t kAbsMask = key_t(kSignBit - 1);
  static constexpr key_t kMaxKey = kAbsMask;  // keys of |x| never exceed it
  ZS_HD static key_t bits(S x) { return storage_bits(x); }
  ZS_HD static key_t key(S x) { return key_t(bits(x) & kAbsMask); }
  ZS_HD static bool negative_sign(S x) { return (bits(x) & kSignBit) != 0; }
};

template <>
struct Format<float> : FloatFormat<float, uint32_t, 23, true> {
  ZS_HD static float value(float x) { return x; }
  ZS_HD static double magnitude(key_t k) { return bit_cast_to<float>(k); }
};

template <>
struct Format<double>
    : FloatFormat<double, uint64_t, 52, true> {
  ZS_HD static double value(double x) { return x; }
  ZS_HD static double magnitude(key_t k) { return bit_cast_to<double>(k); }
};

template <>
struct Format<bf16_t> : FloatFormat<bf16_t, uint16_t, 7, true> {
  // bfloat16 is the top half of a float32.
  ZS_HD static float value(bf16_t x) {
    return bit_cast_to<float>(static_cast<uint32_t>(x.bits) << 16);
  }
  ZS_HD static double magnitude(key_t k) { return value(bf16_t{k}); }
};

template <>
struct Format<f16_t> : FloatFormat<f16_t, uint16_t, 10, true> {
  ZS_HD static float value(f16_t x) {
    return with_sign(f16_abs_to_f32_bits(x.bits & 0x7fffu), x.bits >> 15);
  }
  ZS_HD static double magnitude(key_t k) { return value(f16_t{k}); }
};

template <>
struct Format<e5m2_t> : FloatFormat<e5m2_t, uint8_t, 2, true> {
  // float8_e5m2 is the top byte of a float16, infinities and NaN included.
  ZS_HD static float value(e5m2_t x) {
    return Format<f16_t>::value(f16_t{static_cast<uint16_t>(x.bits << 8)});
  }
  ZS_HD static double magnitude(key_t k) { return value(e5m2_t{k}); }
};

template <>
struct Format<e4m3_t> : FloatFormat<e4m3_t, uint8_t, 3, false> {
  // |x|'s 7 bits shifted into a float's exponent and mantissa give
  // |x| * 2^-120 (the biases differ by 120); 0x7f is NaN, and there are no
  // infinities.
  ZS_HD static float value(e4m3_t x) {
    const uint32_t a = x.bits & 0x7fu;
    const float scaled = bit_cast_to<float>(a << 20) * 0x1p120f;
    return with_sign(a == 0x7fu ? 0x7fc00000u : bit_cast_to<uint32_t>(scaled),
                     x.bits >> 7);
  }
  ZS_HD static double magnitude(key_t k) { return value(e4m3_t{k}); }
};

template <typename S>
struct IntFormat {
  using key_t = UnsignedOf<sizeof(S)>;
  static constexpr bool kFloating = false;
  static constexpr int kMantissaBits = 0;
  static constexpr bool kSigned = S(-1) < S(0);
  static constexpr bool kHasInf = false;
  static constexpr bool kHasNan = false;
  static constexpr key_t kMaxKey = key_t(~key_t(0));
  // |x| as unsigned: |INT_MIN| = 2^(w-1) fits.
  ZS_HD static key_t key(S x) {
    const key_t u = static_cast<key_t>(x);
    return negative_sign(x) ? key_t(key_t(0) - u) : u;
  }
  ZS_HD static bool negative_sign(S x) {
    if constexpr (kSigned) {
      return x < S(0);
    } else {
      return false;
    }
  }
  ZS_HD static double value(S x) { return static_cast<double>(x); }
  ZS_HD static double magnitude(key_t k) { return static_cast<double>(k); }
};

template <>
struct Format<uint8_t> : IntFormat<uint8_t> {};
template <>
struct Format<int8_t> : IntFormat<int8_t> {};
template <>
struct Format<int16_t> : IntFormat<int16_t> {};
template <>
struct Format<int32_t> : IntFormat<int32_t> {};
template <>
struct Format<int64_t> : IntFormat<int64_t> {};

template <>
struct Format<bool_t> : IntFormat<uint8_t> {
  ZS_HD static key_t key(bool_t x) { return x.bits != 0 ? 1 : 0; }
  ZS_HD static bool negative_sign(bool_t) { return false; }
  ZS_HD static double value(bool_t x) { return x.bits != 0 ? 1.0 : 0.0; }
};

}  // namespace zeroscan
