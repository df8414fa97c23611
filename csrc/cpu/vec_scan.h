// The CPU's vector scan of one contiguous span: one source for every vector
// instruction set, compiled once per target.
//
// Written against GCC/Clang vector extensions (`T __attribute__((vector_size
// (N)))`): plain C++ operators on whole vectors, which the compiler lowers
// for the target it builds. Each target's file (span_avx2.cpp,
// span_avx512.cpp, span_neon.cpp) defines the macros below and includes this
// header once, so the classifier exists once and a new statistic is written
// once. Why not the alternatives:
//   - at::vec::Vectorized has no unsigned lane compares or unsigned min/max
//     for 16/32-bit lanes, which every key test here is, and ties the span
//     code to torch's headers: the Arm build is cross-compiled and tested
//     under qemu without torch (tests/span_check.cpp).
//   - A portable SIMD library (Highway, xsimd) would be a new dependency for
//     what the compiler already does; its dispatch is what the three target
//     files and scan_span.h's table do here.
// Each target's functions live in a namespace of their own and carry their
// target attribute, so no copy compiled for a wider ISA can be linked into a
// narrower path. Intrinsics (and one asm store) appear only where the
// generic form compiles to more instructions on x86: two conversions
// (float16 to float32 by F16C, float32 to double, on AVX2 from a stored
// copy: halves_to_double), AVX2's psign (with_sign_of), and the test of
// whether any lane is nonzero (any_lane: vptest, vptestmq, umaxv). The rest
// differs between ISAs only where AVX-512's mask registers save an
// instruction: a lane count is a masked add, and the smallest nonzero key,
// the negative count and the largest finite key each one masked
// instruction (classify, scan_vector).
//
// Included with:
//   ZS_TARGET          the namespace of this build: avx2, avx512, neon
//   ZS_TARGET_BYTES    bytes per vector: 32, 64, 16
//   ZS_TARGET_ATTR     the attribute that enables the ISA for a function
//                      (empty where the compiler's baseline has it)
//   ZS_TARGET_MASKS    1 where compares produce mask registers (AVX-512)
//   ZS_TARGET_F16C     1 where float16 converts by F16C
//   ZS_TARGET_REGISTERS  vector registers: 16 (AVX2) or 32
//
// What one vector costs (see classify.h for the classes): each class is one
// compare and one lane count (the hot pass and the one for NaN and
// infinities take one of the nonzero count and the count above the
// subnormal bound from the other, kNonzeroIsAboveSub); min/max |x| are
// integer min/max on the keys; the moments are summed as the Moments
// section says, and no floating-point instruction sees a subnormal input:
// float32 and bfloat16 subnormals are taken through integers (their exact
// value is an integer times 2^-149).
// float64 subnormals are the exception (float64 squares of them underflow
// in double anyway): a run that holds one sums them in double as they are.
// The rare kinds of value (NaN, infinities, subnormals) are taken care of
// only in runs that hold them (see Float runs), so data without them pays
// nothing for them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../classify.h"
#include "../histogram.h"
#include "scan_span.h"

#if ZS_TARGET_F16C || ZS_TARGET_MASKS
#include <immintrin.h>
#endif
#if defined(ZS_NEON_KERNELS)
#include <arm_neon.h>
#endif

namespace zeroscan {
namespace cpu {
namespace ZS_TARGET {
namespace {

#define ZS_INLINE __attribute__((always_inline)) inline ZS_TARGET_ATTR

constexpr int kBytes = ZS_TARGET_BYTES;

template <typename T, int Bytes>
struct VecOf {
  typedef T type __attribute__((vector_size(Bytes)));
};
// A vector of kBytes bytes of T (Bytes: another width).
template <typename T, int Bytes = kBytes>
using Vec = typename VecOf<T, Bytes>::type;

// The bits of a vector as another vector type of the same size (a GCC
// vector cast reinterprets, it does not convert).
template <typename To, typename From>
ZS_INLINE To as(From v) {
  static_assert(sizeof(To) == sizeof(From), "as: sizes differ");
  return (To)v;
}

template <typename V>
ZS_INLINE V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// The low and high halves of a vector.
template <typename T>
ZS_INLINE Vec<T, kBytes / 2> low_half(Vec<T> v) {
  Vec<T, kBytes / 2> h;
  std::memcpy(&h, &v, sizeof(h));
  return h;
}
template <typename T>
ZS_INLINE Vec<T, kBytes / 2> high_half(Vec<T> v) {
  Vec<T, kBytes / 2> h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + sizeof(h), sizeof(h));
  return h;
}

template <typename V>
constexpr int lanes_of = static_cast<int>(sizeof(V) / sizeof(std::declval<V>()[0]));

// The sum of the lanes, in T.
template <typename T, typename V>
ZS_INLINE T lane_sum(V v) {
  T s = 0;
  for (int i = 0; i < lanes_of<V>; ++i) s += static_cast<T>(v[i]);
  return s;
}
template <typename V>
ZS_INLINE V vmin(V a, V b) { return a < b ? a : b; }
template <typename V>
ZS_INLINE V vmax(V a, V b) { return a > b ? a : b; }

// v, through a register the compiler cannot see into.
template <typename V>
ZS_INLINE V opaque(V v) {
#if defined(__x86_64__)
  __asm__("" : "+v"(v));
#else
  __asm__("" : "+w"(v));
#endif
  return v;
}

// Whether any lane of v is nonzero.
template <typename V>
ZS_INLINE bool any_lane(V v) {
#if ZS_TARGET_BYTES == 64
  return _mm512_test_epi64_mask((__m512i)v, (__m512i)v) != 0;
#elif defined(ZS_X86_KERNELS)
  return !_mm256_testz_si256((__m256i)v, (__m256i)v);
#else
  return vmaxvq_u32(vreinterpretq_u32_u8((uint8x16_t)v)) != 0;
#endif
}

// The largest, smallest or sum of the lanes, halving the vector each step
// (GCC does not vectorize lane_sum inside the loops over classify.h's
// bounds).
enum class Reduce { kMax, kMin, kSum };
template <Reduce kOp, typename T, int Bytes>
ZS_INLINE T reduce(Vec<T, Bytes> v) {
  if constexpr (Bytes == sizeof(T)) {
    return v[0];
  } else {
    // The halves are copied from an opaque copy of v: a vector whose
    // address is taken stays in memory in the loop that fills it, where each
    // store then waits on the data's loads (which a memcpy'd load may alias).
    const Vec<T, Bytes> w = opaque(v);
    Vec<T, Bytes / 2> lo, hi;
    std::memcpy(&lo, &w, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&w) + sizeof(lo), sizeof(hi));
    if constexpr (kOp == Reduce::kSum) {
      return reduce<kOp, T, Bytes / 2>(lo + hi);
    } else {
      return reduce<kOp, T, Bytes / 2>(kOp == Reduce::kMax ? (lo > hi ? lo : hi) : (lo < hi ? lo : hi));
    }
  }
}
template <typename T, int Bytes>
ZS_INLINE T reduce_max(Vec<T, Bytes> v) { return reduce<Reduce::kMax, T, Bytes>(v); }
template <typename T, int Bytes>
ZS_INLINE T reduce_min(Vec<T, Bytes> v) { return reduce<Reduce::kMin, T, Bytes>(v); }
template <typename T, int Bytes = kBytes>
ZS_INLINE T reduce_sum(Vec<T, Bytes> v) { return reduce<Reduce::kSum, T, Bytes>(v); }

// Adds 1 to the lanes of the counter `c` where `mask` (a compare's result,
// lanes 0 or -1) is set.
template <typename V, typename M>
ZS_INLINE V count(V c, M mask) {
#if ZS_TARGET_MASKS
  return mask ? c + 1 : c;  // one masked add
#else
  return c - as<V>(mask);
#endif
}

// The lane types of a storage type S: unsigned and signed, as wide as S.
template <typename S>
struct LaneTypes {
  using U = UnsignedOf<sizeof(S)>;
  using I = std::make_signed_t<U>;
  using VU = Vec<U>;
  using VI = Vec<I>;
  static constexpr int kLanes = kBytes / static_cast<int>(sizeof(S));
};

using VU32 = Vec<uint32_t>;
using VI32 = Vec<int32_t>;
using VF = Vec<float>;
using VD = Vec<double>;

// The low and high halves of float32 or int32 lanes, widened to double
// (one instruction each on x86, where the generic conversion takes three).
template <typename T>
ZS_INLINE VD low_to_double(Vec<T> v) {
#if ZS_TARGET_BYTES == 64
  if constexpr (std::is_same_v<T, float>) return (VD)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)v));
#elif ZS_TARGET_F16C
  if constexpr (std::is_same_v<T, float>) return (VD)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v));
#endif
  return __builtin_convertvector(low_half<T>(v), VD);
}
template <typename T>
ZS_INLINE VD high_to_double(Vec<T> v) {
#if ZS_TARGET_BYTES == 64
  if constexpr (std::is_same_v<T, float>) {
    return (VD)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1)));
  }
#elif ZS_TARGET_F16C
  if constexpr (std::is_same_v<T, float>) return (VD)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1));
#endif
  return __builtin_convertvector(high_half<T>(v), VD);
}

// The low half of float32 lanes plus the high half, in double. AVX2 widens
// each half from a stored copy: vcvtps2pd from memory is one uop on the
// ports that compute, where from a register it is two, and the high half
// would take a vextractf128 before it (3 of the 22 such uops a float32
// vector took; 6-14 % off AVX2's float32, bfloat16 and float16 loops,
// cached). Widening float16 to float32 so too measured slower (a second
// store and reload a vector).
// AVX-512's float32 loop measured 14 % slower so on dense data (3-4 %
// faster on the rest), and keeps the registers.
ZS_INLINE VD halves_to_double(VF v) {
#if ZS_TARGET_BYTES == 32 && ZS_TARGET_F16C
  alignas(32) float stored[8];
  __asm__("vmovaps {%1, %0|%0, %1}" : "=m"(stored) : "x"(v));  // a store the compiler cannot fold away
  return (VD)_mm256_cvtps_pd(_mm_load_ps(stored)) + (VD)_mm256_cvtps_pd(_mm_load_ps(stored + 4));
#else
  return low_to_double<float>(v) + high_to_double<float>(v);
#endif
}

// ---- Lane counters ---------------------------------------------------------

// Vectors between widenings of W-byte lane counters: a lane counts at most
// one element per vector and must not pass its maximum.
template <int W>
constexpr int64_t kFold = W == 1 ? 255 : 4096;

// W-byte lane counters widened into uint64 lanes, by pairwise sums.
template <int W>
ZS_INLINE Vec<uint64_t> widen_counts(Vec<UnsignedOf<W>> c) {
  if constexpr (W == 8) {
    return c;
  } else {
    using Wider = Vec<UnsignedOf<2 * W>>;
    const Wider w = as<Wider>(c);
    constexpr int kBits = 8 * W;
    const Wider low_mask = Wider{} + static_cast<UnsignedOf<2 * W>>((uint64_t(1) << kBits) - 1);
    return widen_counts<2 * W>((w & low_mask) + (w >> kBits));
  }
}

// The counts of classify.h's classes in one block, lane by lane.
template <typename S>
struct Counters {
  using VU = typename LaneTypes<S>::VU;
  VU nonzero{}, above_sub{}, above_bound[kNumBounds]{}, negative{};
  VU nan{}, non_finite{}, neginf{};  // floats: in the runs that count them
};

struct Totals {
  Vec<uint64_t> nonzero{}, above_sub{}, above_bound[kNumBounds]{}, negative{}, nan{}, non_finite{},
      neginf{};
};

template <typename S>
ZS_INLINE void fold(Totals& t, Counters<S>& c) {
  constexpr int W = sizeof(S);
  t.nonzero += widen_counts<W>(c.nonzero);
  t.above_sub += widen_counts<W>(c.above_sub);
  for (int b = 0; b < kNumBounds; ++b) t.above_bound[b] += widen_counts<W>(c.above_bound[b]);
  t.negative += widen_counts<W>(c.negative);
  t.nan += widen_counts<W>(c.nan);
  t.non_finite += widen_counts<W>(c.non_finite);
  t.neginf += widen_counts<W>(c.neginf);
  c = Counters<S>{};
}

// The limits of classify.h, broadcast to S's lanes (and as given, for the
// decisions made once per run). Float keys are below the sign bit, so their
// compares are signed (one instruction on every ISA).
template <typename S>
struct VectorLimits {
  using U = typename LaneTypes<S>::U;
  using I = typename LaneTypes<S>::I;
  using VU = typename LaneTypes<S>::VU;
  using VI = typename LaneTypes<S>::VI;
  Limits scalar;
  VI sub_max, bound_max[kNumBounds], finite_max, nonnan_max;
  // Floats: the raw pattern of -inf (or of the largest negative number
  // where there is no infinity), read as a signed integer. The raw patterns
  // of negative numbers (sign set, nonzero, not NaN) are those r with
  // r - 1 < it, -0 wrapping to the largest integer.
  VI neginf;
  VU bound_max_u[kNumBounds];  // integers: bound_max as unsigned

  explicit VectorLimits(const Limits& lim) : scalar(lim) {
    sub_max = VI{} + static_cast<I>(lim.sub_max);
    for (int b = 0; b < kNumBounds; ++b) {
      bound_max[b] = VI{} + static_cast<I>(lim.bound_max[b]);
      bound_max_u[b] = VU{} + static_cast<U>(lim.bound_max[b]);
    }
    finite_max = VI{} + static_cast<I>(lim.finite_max);
    nonnan_max = VI{} + static_cast<I>(lim.nonnan_max);
    uint64_t sign_bit = 0;
    if constexpr (Format<S>::kFloating) sign_bit = Format<S>::kSignBit;
    neginf = VI{} + static_cast<I>(static_cast<U>(sign_bit + lim.nonnan_max));
  }
};

// The loops read their constants through this. With 16 vector registers
// (AVX2) the accumulators and the constants do not all fit, and the
// compiler then keeps some accumulators in memory, where every vector's
// addition waits for the store of the one before; a pointer it cannot see
// through makes it read the constants from memory instead (a compare or an
// FMA takes one operand from memory at no cost).
template <typename T>
ZS_INLINE const T& constants(const T& c) {
  const T* p = &c;
#if ZS_TARGET_BYTES == 32
  __asm__("" : "+r"(p));
#endif
  return *p;
}

// ---- Classification --------------------------------------------------------

// The key of |x| of every lane (dtypes.h).
template <typename S>
ZS_INLINE typename LaneTypes<S>::VU key_of(typename LaneTypes<S>::VU raw) {
  using F = Format<S>;
  using L = LaneTypes<S>;
  using VU = typename L::VU;
  using VI = typename L::VI;
  if constexpr (F::kFloating) {
    return raw & static_cast<typename L::U>(F::kAbsMask);
  } else if constexpr (std::is_same_v<S, bool_t>) {
    const VI nonzero = raw != 0;
    return as<VU>(nonzero) & 1;
  } else if constexpr (F::kSigned) {
    const VI s = as<VI>(raw) >> (8 * sizeof(S) - 1);
    const VI magnitude = (as<VI>(raw) ^ s) - s;  // |INT_MIN| wraps to 2^(w-1): right unsigned
    return as<VU>(magnitude);
  } else {
    return raw;
  }
}

// How `lo` holds the smallest nonzero key of its lanes. Where compares give
// mask registers (AVX-512), a float's lanes take the key itself, by one
// masked min with the nonzero lanes' mask (float keys are below the sign
// bit, so the all-ones start is no key); elsewhere they take key - 1 by an
// unsigned min, a zero key wrapping to the largest. lowest_key reads either.
template <typename S>
constexpr bool kLoIsKey = ZS_TARGET_MASKS && Format<S>::kFloating;

// The smallest nonzero key in `lo` less one, or the largest uint64 when its
// lanes saw none.
template <typename S>
ZS_INLINE uint64_t lowest_key(typename LaneTypes<S>::VU lo) {
  using U = typename LaneTypes<S>::U;
  const U least = reduce_min<U, kBytes>(lo);
  if (least == static_cast<U>(~U(0))) return ~uint64_t(0);
  return kLoIsKey<S> ? least - 1 : least;
}

// Counts one vector's nonzero (where kNonzero), above-sub_max (where
// kAboveSub), above-bound (classify.h's magnitude counts) and negative
// lanes; keeps the smallest nonzero key in `lo` (kLoIsKey) and, where kTop,
// the max key in `top`. Returns the lanes above sub_max (floats).
template <typename S, bool kTop = true, bool kNonzero = true, bool kAboveSub = true>
ZS_INLINE typename LaneTypes<S>::VI classify(typename LaneTypes<S>::VU raw,
                                             typename LaneTypes<S>::VU key,
                                             const VectorLimits<S>& lim, Counters<S>& c,
                                             typename LaneTypes<S>::VU& lo,
                                             typename LaneTypes<S>::VU& top) {
  using F = Format<S>;
  using L = LaneTypes<S>;
  using VI = typename L::VI;
  using VU = typename L::VU;
  const VI nonzero = key != 0;
  if constexpr (kNonzero && ZS_TARGET_MASKS) {
    c.nonzero = count(c.nonzero, nonzero);  // one test and one masked add
  } else if constexpr (kNonzero) {
    c.nonzero += vmin(key, VU{} + 1);  // a compare would need a NOT
  }
  if constexpr (kLoIsKey<S>) {
    lo = nonzero ? vmin(lo, key) : lo;
  } else {
    lo = vmin(lo, key - 1);
  }
  VI above_sub{};
  if constexpr (F::kFloating) {
    const VI k = as<VI>(key);
    above_sub = k > lim.sub_max;
    if constexpr (kAboveSub) c.above_sub = count(c.above_sub, above_sub);
    for (int b = 0; b < kNumBounds; ++b) c.above_bound[b] = count(c.above_bound[b], k > lim.bound_max[b]);
    if constexpr (ZS_TARGET_MASKS) {
      c.negative = count(c.negative, nonzero & (as<VI>(raw) <= lim.neginf));  // one masked compare
    } else {
      const VU raw_less_one = raw - 1;
      c.negative = count(c.negative, lim.neginf > as<VI>(raw_less_one));
    }
    if constexpr (kTop) {
      const VI top_signed = vmax(as<VI>(top), k);
      top = as<VU>(top_signed);
    }
  } else {
    for (int b = 0; b < kNumBounds; ++b) c.above_bound[b] = count(c.above_bound[b], key > lim.bound_max_u[b]);
    if constexpr (F::kSigned) c.negative = count(c.negative, as<VI>(raw) < 0);
    top = vmax(top, key);
  }
  return above_sub;
}

// Counts one vector's NaN, non-finite and -inf lanes (floats); returns the
// non-finite lanes.
template <typename S>
ZS_INLINE typename LaneTypes<S>::VI count_non_finite(typename LaneTypes<S>::VU raw,
                                                     typename LaneTypes<S>::VU key,
                                                     const VectorLimits<S>& lim,
                                                     Counters<S>& c) {
  using VI = typename LaneTypes<S>::VI;
  const VI k = as<VI>(key);
  const VI non_finite = k > lim.finite_max;
  c.nan = count(c.nan, k > lim.nonnan_max);
  c.non_finite = count(c.non_finite, non_finite);
  if constexpr (Format<S>::kHasInf) c.neginf = count(c.neginf, as<VI>(raw) == lim.neginf);
  return non_finite;
}

// ---- Moments ---------------------------------------------------------------
//
// Floats of up to 32 bits are summed as float32 lanes ("groups" of kBytes
// / 4 values: a float32 vector is one group, a bfloat16 or float16 vector
// two, a float8 vector four, widened exactly). Per group:
//   the values         x, converted to double and summed there: exact but
//                      for double's own rounding (float32 sums of x lose
//                      the mean of zero-centred data)
//   the squares        of d = x * 2^k - shift * 2^k, in float32, 16 terms
//                      per lane before each fold into double: the squares
//                      are positive, so those sums stay within ~16 roundings
//                      (1e-6) of exact however long the tensor. 2^k keeps
//                      the run's largest |d| near 1 (RunScale).
// The span is summed about a shift that is a value of S. Lanes the floats
// must not see are replaced before any floating-point instruction, by
// integer operations:
//   NaN and infinities     by the shift (in passes that take care of them):
//                          d = 0 exactly, and the values gain one shift per
//                          such lane, taken off at the end
//   float32 and bfloat16   by zero: d = -shift. Passes that take care of
//   subnormals             them add the integer m of each (x = m * 2^-149,
//                          bfloat16's m widened as its bits are) and m^2, and
//                          the end adds 2^-149 sum(m) to the values and
//                          2^-298 sum(m^2) - 2 shift 2^-149 sum(m) to the
//                          squares: (x - shift)^2 = shift^2 - 2 shift x + x^2
// A run of nothing but zeros and subnormals (a "tiny" run: underflowed
// data) sums (m - shift * 2^149)^2 alone, which needs no such correction
// (whose cancellation would lose the variance of subnormal data around a
// subnormal mean), while the shift is small enough (|shift| <= 2^-89).
// float64 sums d and d^2 in double. Integers: 1-byte ones exactly in integer
// lanes, wider ones d and d^2 in double (the shift is a whole number).

template <typename S>
constexpr bool kFloat32Lanes = Format<S>::kFloating && sizeof(S) <= 4;
// The float32 and bfloat16 groups, whose subnormals are float32 subnormals.
template <typename S>
constexpr bool kSubnormalCare = std::is_same_v<S, float> || std::is_same_v<S, bf16_t>;
// The dtypes whose runs with subnormals need a pass of their own.
template <typename S>
constexpr bool kSubnormalPass = kSubnormalCare<S> || std::is_same_v<S, double>;
// float8_e4m3fn widens to x / 256 (kWidenScale).
template <typename S>
constexpr float kWidenScale = std::is_same_v<S, e4m3_t> ? 256.0f : 1.0f;
template <typename S>
constexpr int kGroups = kFloat32Lanes<S> ? 4 / static_cast<int>(sizeof(S)) : 1;

constexpr double kSubUnit = 0x1p-149;            // the value of m = 1

// float16 bits (in the low 16 of each lane) -> float32 bits, exactly, by
// integers: normal values rebias the exponent; subnormal ones are m * 2^-24
// (an exact int -> float conversion, then a scale whose result is normal).
ZS_INLINE VU32 f16_bits_to_f32(VU32 h) {
  const VU32 a = h & 0x7fffu;
  const VI32 a_signed = as<VI32>(a);
  const VI32 normal = a_signed > 0x3ff;
  const VI32 special = a_signed > 0x7bff;  // inf and NaN: exponent 0xff
  const VU32 rebiased = (a << 13) + (112u << 23) + (as<VU32>(special) & (112u << 23));
  const VF tiny = __builtin_convertvector(a_signed, VF) * 0x1p-24f;
  const VU32 small = as<VU32>(tiny);
  const VU32 pick = as<VU32>(normal);
  return (rebiased & pick) | (small & ~pick) | ((h & 0x8000u) << 16);
}

// A vector of 16-bit float16 patterns -> two groups of float32 bits.
ZS_INLINE void halves_to_groups(Vec<uint16_t> h, VU32& g0, VU32& g1) {
#if ZS_TARGET_F16C
  const auto lo = low_half<uint16_t>(h), hi = high_half<uint16_t>(h);
#if ZS_TARGET_BYTES == 64
  const __m512 a = _mm512_cvtph_ps(as<__m256i>(lo));
  const __m512 b = _mm512_cvtph_ps(as<__m256i>(hi));
#else
  const __m256 a = _mm256_cvtph_ps(as<__m128i>(lo));
  const __m256 b = _mm256_cvtph_ps(as<__m128i>(hi));
#endif
  g0 = as<VU32>(a);
  g1 = as<VU32>(b);
#else
  const VU32 w = as<VU32>(h);
  g0 = f16_bits_to_f32(w & 0xffffu);
  g1 = f16_bits_to_f32(w >> 16);
#endif
}

// The float32 bits of group g of one vector of S (kGroups<S> groups; the
// groups take the lanes in some order, which sums do not care about).
template <typename S>
ZS_INLINE void widen(typename LaneTypes<S>::VU raw, VU32 (&g)[kGroups<S>]) {
  if constexpr (std::is_same_v<S, float>) {
    g[0] = raw;
  } else if constexpr (std::is_same_v<S, bf16_t>) {
    // bfloat16 is the top half of a float32.
    const VU32 w = as<VU32>(raw);
    g[0] = w << 16;
    g[1] = w & 0xffff0000u;
  } else if constexpr (std::is_same_v<S, f16_t>) {
    halves_to_groups(raw, g[0], g[1]);
  } else {
    // float8 as float16 bits: e5m2 is the top byte of a float16; e4m3 moves
    // its 7 magnitude bits one place down into the float16's (x * 2^-8: the
    // biases differ by 8), the sign staying on top. NaN and Inf lanes come
    // out as some value; they are masked out or summed again.
    using V16 = Vec<uint16_t>;
    using VI16 = Vec<int16_t>;
    const V16 w = as<V16>(raw);
    V16 h[2] = {static_cast<V16>(w << 8), static_cast<V16>(w & 0xff00u)};
    if constexpr (std::is_same_v<S, e4m3_t>) {
      for (auto& v : h) {
        const VI16 shifted = as<VI16>(v) >> 1;
        v = as<V16>(shifted) & 0xbfffu;
      }
    }
    halves_to_groups(h[0], g[0], g[1]);
    halves_to_groups(h[1], g[2], g[3]);
  }
#if ZS_TARGET_F16C && ZS_TARGET_BYTES == 32
  // The groups of F16C's conversion, through a register: where their values
  // are then widened to double (float16, float8_e5m2), GCC otherwise
  // converts each group's low four values a second time, by a narrower
  // vcvtph2ps, for low_to_double (2 more uops a group, on the ports that
  // convert).
  if constexpr (std::is_same_v<S, f16_t> || std::is_same_v<S, e5m2_t>) {
    for (auto& v : g) v = opaque(v);
  }
#endif
}

// The power of two 2^k by which float32 and bfloat16 runs scale d before
// squaring it. Let M be the larger of a run's largest finite |x| and |shift|
// (every |d| is at most 2 M). k puts M * 2^k in [1, 2) for some run before;
// a run whose own M * 2^k leaves [2^-40, 2^40] is summed again with its own
// k. Inside that window no sum of squares overflows (16 terms of at most
// 2^84), and squares too small for float32 are below 2^-126 of the run's
// largest. The narrower floats' squares always fit: k stays 0.
template <typename S>
constexpr bool kScaledSquares = kSubnormalCare<S>;
constexpr int kWindow = 40;

struct RunScale {
  float scale;        // 2^k * kWidenScale
  float shift;        // shift * 2^k (the shift is a float32 value)
  double unscale;     // 2^-2k
  uint64_t low_key, high_key;  // the smallest keys at least 2^(-40-k), 2^(40-k)
  bool shift_in_window;        // |shift| * 2^k >= 2^-40
  bool shift_is_zero;
};

// The smallest key of S (float32 or bfloat16) whose magnitude is at least
// 2^e; above every finite key when 2^e overflows.
template <typename S>
uint64_t key_at_least(int e) {
  uint32_t bits = bit_cast_to<uint32_t>(std::ldexp(1.0f, e));  // 0 or inf at the ends
  if constexpr (std::is_same_v<S, bf16_t>) bits = (bits + 0xffffu) >> 16;
  return std::max<uint64_t>(bits, 1);
}

template <typename S>
RunScale make_scale(int k, double shift) {
  RunScale rs;
  rs.scale = std::ldexp(kWidenScale<S>, k);
  rs.shift = static_cast<float>(std::ldexp(shift, k));
  rs.unscale = std::ldexp(1.0, -2 * k);
  rs.low_key = kScaledSquares<S> ? key_at_least<S>(-kWindow - k) : 0;
  rs.high_key = kScaledSquares<S> ? key_at_least<S>(kWindow - k) : ~uint64_t(0);
  rs.shift_in_window = std::fabs(std::ldexp(shift, k)) >= std::ldexp(1.0, -kWindow);
  rs.shift_is_zero = shift == 0.0;
  return rs;
}

// k with m * 2^k in [1, 2), within what a float32 power of two holds.
inline int scale_exponent(double m);

// A span's first scale, from its shift alone; remembered for the last
// shift per thread, since a call over many small tensors (stats_many) starts
// thousands of spans with the same shift, and make_scale's ldexps are a
// tenth of a 4K-element span's time.
template <typename S>
RunScale first_scale(double shift) {
  static thread_local double last_shift = 0.0;
  static thread_local RunScale last = make_scale<S>(0, 0.0);
  if (shift != last_shift) {
    last = make_scale<S>(kScaledSquares<S> ? scale_exponent(std::fabs(shift)) : 0, shift);
    last_shift = shift;
  }
  return last;
}

// k with m * 2^k in [1, 2), within what a float32 power of two holds.
inline int scale_exponent(double m) { return m > 0.0 ? std::clamp(-std::ilogb(m), -126, 127) : 0; }

// Whether a run whose largest finite key is `top` fits the scale's window.
inline bool fits(const RunScale& rs, uint64_t top) {
  return top < rs.high_key &&
         (top >= rs.low_key || rs.shift_in_window || (rs.shift_is_zero && top == 0));
}

// How a pass sums a run's lanes: which of the rare kinds of value it takes
// care of. A pass is right for a run when it takes care of every kind the
// run holds; the cheapest is read first (see scan_float_vectors).
struct Pass {
  bool non_finite = false;  // count NaN and infinities and sum only finite lanes
  bool subnormal = false;   // float32/bfloat16: sum subnormals as integers;
                            // float64: sum them as they are
  bool tiny = false;        // float32/bfloat16: every lane zero or subnormal
  constexpr int index() const { return tiny ? 4 : (non_finite ? 1 : 0) + (subnormal ? 2 : 0); }
  constexpr bool covers(Pass need) const {
    if (tiny || need.tiny) return tiny == need.tiny || (!tiny && subnormal && !need.non_finite);
    return (non_finite || !need.non_finite) && (subnormal || !need.subnormal);
  }
  // The cheapest pass that covers both this one's kinds and `need`'s.
  constexpr Pass with(Pass need) const {
    if (covers(need)) return *this;
    if (tiny || need.tiny) return need.tiny && !non_finite ? Pass{false, false, true} : need;
    return Pass{non_finite || need.non_finite, subnormal || need.subnormal, false};
  }
};
constexpr Pass kHot{};
constexpr Pass kNonFinite{true, false, false};
constexpr Pass kSubnormal{false, true, false};
constexpr Pass kCareful{true, true, false};
constexpr Pass kTiny{false, false, true};

// One run's sums. The float32 lanes of squares are folded into double every
// segment (kSegment), so that each adds at most 16 terms.
struct RunSums {
  VF q{};            // float32 lanes: squares of d * 2^k, this segment
  VF xf{};           // float8_e4m3fn: values (/ kWidenScale), this segment (exact, kFloat32Values)
  VD qd[2]{};        // their folds (halves)
  VD x[1]{};         // float32 lanes: values (/ kWidenScale); float64: d
  VD q64{};          // float64: d^2
  VI32 sub_m{};      // subnormal lanes of subnormal passes: signed m
  VF sub_q{};        //   m^2, this segment
  VD sub_qd{};       //   its folds
  VI32 tiny_m{};     // lanes of tiny passes: signed m
  VF tiny_q{};       //   (m - s)^2, this segment
  VD tiny_qd{};      //   its folds
};

ZS_INLINE void end_segment(RunSums& r) {
  r.x[0] += low_to_double<float>(r.xf) + high_to_double<float>(r.xf);
  r.xf = VF{};
  r.qd[0] += low_to_double<float>(r.q);
  r.qd[1] += high_to_double<float>(r.q);
  r.q = VF{};
  r.sub_qd += low_to_double<float>(r.sub_q) + high_to_double<float>(r.sub_q);
  r.sub_q = VF{};
  r.tiny_qd += low_to_double<float>(r.tiny_q) + high_to_double<float>(r.tiny_q);
  r.tiny_q = VF{};
}

// The constants of one span's moments. The span is summed about `shift`, a
// value of S (scan_vectors rounds the caller's shift to one), so that a lane
// replaced by it (a NaN, say) adds exactly nothing to the squares.
template <typename S>
struct MomentConstants {
  RunScale rs;
  double shift;
  typename LaneTypes<S>::U shift_bits;  // shift as S's bits
  float sub_shift;                      // shift * 2^149 (tiny passes)
  bool small_shift;                     // |shift * 2^149| <= 2^60
  // The same, broadcast for the vector loop (set by broadcast()).
  VF scale_v, shift_v, sub_shift_v;
  VD shift64_v;
  typename LaneTypes<S>::VU shift_bits_v;

  ZS_TARGET_ATTR void broadcast() {
    scale_v = VF{} + rs.scale;
    shift_v = VF{} + rs.shift;
    sub_shift_v = VF{} + sub_shift;
    shift64_v = VD{} + shift;
    shift_bits_v = typename LaneTypes<S>::VU{} + shift_bits;
  }
};

// float8_e4m3fn values are whole multiples of 2^-9 below 2^9 (widened:
// of 2^-17 below 2): the 16 that a segment adds to one float32 lane sum to
// less than 2^22 such units, which float32 holds exactly, so they are summed
// there and folded into double once a segment, not converted one by one.
template <typename S>
constexpr bool kFloat32Values = std::is_same_v<S, e4m3_t>;

// Adds one float32 group (bits: float32 patterns) to `r`, scaled and
// shifted by `scale` and `shift` (RunScale).
template <typename S>
ZS_INLINE void add_group(VU32 bits, VF scale, VF shift, RunSums& r) {
  const VF x = as<VF>(bits);
  if constexpr (kFloat32Values<S>) {
    r.xf += x;
  } else {
    r.x[0] += halves_to_double(x);
  }
  const VF d = x * scale - shift;
  r.q += d * d;
}

// Adds one vector of float64 to `r`.
ZS_INLINE void add_doubles(Vec<uint64_t> bits, VD shift, RunSums& r) {
  const VD d = as<VD>(bits) - shift;
  r.x[0] += d;
  r.q64 += d * d;
}

// ---- Histogram fields ------------------------------------------------------
//
// A float's histogram field (csrc/histogram.h) is its exponent. The fields
// of a window of kWindowFields are counted in vectors, by the scan itself as
// it reads each vector (ScanFields, below) and by count_window (vec_fields.h)
// over data already read: each lane turns its field into a one-hot bit by a
// variable shift, 1 << 4 * (field - lo), so that adding the lanes counts 8
// fields per 32-bit lane in 4-bit counters, and kNibbleCounters such
// counters cover the window. Fields outside the window shift the bit out
// (the shift is 32 or more) and count nothing: count_fields.h knows the zero
// and non-finite fields from the scan's own counts, and takes the rare
// others by windows beside this one, then one at a time. The 4-bit counters
// are split into bytes before they can pass 15, the bytes into 16-bit lanes
// before they can pass 255, and those into the window's int64 totals before
// they can pass 65535 (WindowCounts).
//
// Cost per group of float32 lanes: 2 instructions for the field, 1 for the
// window's offset (the first counter's shift count), and for each counter
// the shift and the addition, and but for the first a subtraction: 11 for 3
// counters; no compare, no branch, nothing that depends on the values.

// 8 fields per 32-bit counter lane.
constexpr int kNibbleCounters = kWindowFields / 8;
static_assert(kWindowFields % 8 == 0, "the window is whole 32-bit counter lanes");

// 1 << a in every lane, 0 where a >= 32.
ZS_INLINE VU32 one_hot(VU32 a) {
#if ZS_TARGET_BYTES == 64
  return as<VU32>(_mm512_sllv_epi32(_mm512_set1_epi32(1), as<__m512i>(a)));
#elif defined(ZS_X86_KERNELS)
  return as<VU32>(_mm256_sllv_epi32(_mm256_set1_epi32(1), as<__m256i>(a)));
#else
  // NEON shifts by the low byte of each lane, signed (a negative count
  // shifts right); at 32 or more the bit is shifted out.
  const VU32 capped = vmin(a, VU32{} + 32u);
  return as<VU32>(vshlq_u32(vdupq_n_u32(1), vreinterpretq_s32_u32(as<uint32x4_t>(capped))));
#endif
}

// 4 * field of the elements of each float32-lane group of one vector of S
// (the groups as widen() takes them: which element lands in which lane does
// not matter to a count).
template <typename S>
ZS_INLINE void field_amounts(typename LaneTypes<S>::VU raw, VU32 (&a)[kGroups<S>]) {
  const VU32 w = as<VU32>(raw);
  if constexpr (std::is_same_v<S, float>) {  // exponent in bits 23..30
    a[0] = (w >> 21) & 0x3fcu;
  } else if constexpr (std::is_same_v<S, bf16_t>) {  // bits 7..14 of each half
    a[0] = (w >> 5) & 0x3fcu;
    a[1] = (w >> 21) & 0x3fcu;
  } else if constexpr (std::is_same_v<S, f16_t>) {  // bits 10..14 of each half
    a[0] = (w >> 8) & 0x7cu;
    a[1] = (w >> 24) & 0x7cu;
  } else if constexpr (std::is_same_v<S, e5m2_t>) {  // bits 2..6 of each byte
    for (int j = 0; j < 4; ++j) a[j] = (w >> (8 * j)) & 0x7cu;
  } else {  // float8_e4m3fn: bits 3..6 of each byte
    for (int j = 0; j < 4; ++j) a[j] = (w >> (8 * j + 1)) & 0x3cu;
  }
}

// Adds the fields of one vector of S (a float of up to 32 bits) to the 4-bit
// counters: base is 4 * the window's first field in every lane.
template <typename S>
ZS_INLINE void add_fields(typename LaneTypes<S>::VU raw, VU32 base, VU32 (&nibbles)[kNibbleCounters]) {
  VU32 a[kGroups<S>];
  field_amounts<S>(raw, a);
  for (int g = 0; g < kGroups<S>; ++g) {
    const VU32 offset = a[g] - base;  // lanes below the window wrap past 32
    for (int k = 0; k < kNibbleCounters; ++k) nibbles[k] += one_hot(offset - 32u * k);
  }
}

// A window's counts beyond the 4-bit counters of a few vectors: bytes, then
// 16-bit lanes, then int64 totals, each widened before it can overflow, and
// all in vectors but the last (a lane-by-lane widening of the bytes into
// int64 took ~3 instructions a vector counted).
//   bytes[0][k]: byte b of each lane counts field 8k + 2b
//   bytes[1][k]: byte b counts field 8k + 2b + 1
//   halves[j][k]: the 16-bit halves of bytes[j / 2][k]'s bytes 0 and 2
//                 (j even) or 1 and 3 (j odd)
// kAddsPerSplit: the most any 4-bit counter holds when split (<= 15).
template <int kAddsPerSplit>
struct WindowCounts {
  static_assert(kAddsPerSplit <= 15, "a 4-bit counter holds 15");
  static constexpr int kSplitsPerWiden = 255 / kAddsPerSplit;
  static constexpr int kWidensPerTotal = 65535 / 255;
  VU32 bytes[2][kNibbleCounters]{};
  VU32 halves[4][kNibbleCounters]{};
  int splits = 0, widens = 0;

  // Adds the 4-bit counters and clears them.
  ZS_INLINE void split(VU32 (&nibbles)[kNibbleCounters], int64_t* window) {
    for (int k = 0; k < kNibbleCounters; ++k) {
      bytes[0][k] += nibbles[k] & 0x0f0f0f0fu;
      bytes[1][k] += (nibbles[k] >> 4) & 0x0f0f0f0fu;
      nibbles[k] = VU32{};
    }
    if (++splits == kSplitsPerWiden) widen(window);
  }

  ZS_INLINE void widen(int64_t* window) {
    for (int k = 0; k < kNibbleCounters; ++k) {
      for (int j = 0; j < 2; ++j) {
        halves[2 * j][k] += bytes[j][k] & 0x00ff00ffu;
        halves[2 * j + 1][k] += (bytes[j][k] >> 8) & 0x00ff00ffu;
        bytes[j][k] = VU32{};
      }
    }
    splits = 0;
    if (++widens == kWidensPerTotal) total(window);
  }

  // Adds everything counted to window[kWindowFields] and clears it.
  ZS_INLINE void flush(int64_t* window) {
    widen(window);
    total(window);
  }

  ZS_INLINE void total(int64_t* window) {
    for (int k = 0; k < kNibbleCounters; ++k) {
      for (int j = 0; j < 4; ++j) {
        // halves[j]: fields 8k + 2 * (j % 2) + j / 2 (low) and 4 more (high)
        const int field = 8 * k + 2 * (j % 2) + j / 2;
        const VU32 h = halves[j][k];
        window[field] += sum_lanes<kBytes>(h & 0xffffu);
        window[field + 4] += sum_lanes<kBytes>(h >> 16);
        halves[j][k] = VU32{};
      }
    }
    widens = 0;
  }

  // The sum of v's lanes (less than 2^32), by halving the vector.
  template <int Bytes>
  static ZS_INLINE uint32_t sum_lanes(Vec<uint32_t, Bytes> v) {
    if constexpr (Bytes == 16) {
      return v[0] + v[1] + v[2] + v[3];
    } else {
      Vec<uint32_t, Bytes / 2> a, b;
      std::memcpy(&a, &v, sizeof(a));
      std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof(a), sizeof(b));
      return sum_lanes<Bytes / 2>(a + b);
    }
  }
};

// Whether this build's scan counts the floats' fields as it reads them
// (kScanCountsFields): where it has 32 vector registers. With 16 (AVX2) the
// counters do not fit beside the scan's, and the scan with the count in its
// loop took longer than the scan and a count after it, on data with NaN or
// subnormals (2.22-2.29x x.sum() against 2.12-2.14x, 64M float32 on a
// Sapphire Rapids, both builds timed in turn); elsewhere the count after
// the scan (count_window, vec_fields.h) takes its place.
constexpr bool kCountsFieldsInScan = ZS_TARGET_REGISTERS >= 32;

// The fields a scan counts as it reads a span's vectors (kScanCountsFields),
// split from the 4-bit counters every half segment (scan_run): kGroups<S> *
// kSegment<S> / 2 = 8 additions a lane.
struct ScanFields {
  static constexpr int kAddsPerHalfSegment = 8;
  FieldWindow* out = nullptr;
  VU32 base{};  // 4 * out->lo in every lane
  WindowCounts<kAddsPerHalfSegment> counts;
};

// ---- Float runs ------------------------------------------------------------

// What one pass over a run found: its keys' largest (all and finite) and
// smallest nonzero key - 1 (the largest value when there is none).
struct RunFacts {
  uint64_t top, top_finite, lo;
};

// Vectors per segment: each float32 lane of squares then adds at most 16
// terms (a vector has kGroups<S> groups). Vectors per run: the unit that is
// read again when it needs another pass, small enough to stay in L1.
template <typename S>
constexpr int64_t kSegment = kFloat32Lanes<S> ? 16 / kGroups<S> : 16;
template <typename S>
constexpr int64_t kRun = 4 * 16;

// Each vector of a first pass asks for two lines ahead of it: the one
// kFarBytes ahead into L2, from memory, and the one kNearBytes ahead into
// L1, from L2. The hardware prefetchers alone left the AVX2 scan of a
// float32 tensor beyond the caches at 2.0x a plain sum's time on one
// Sapphire Rapids core. Asking for the far line into L1 instead took
// 1.39-1.40x (AVX2) and 1.23-1.24x (AVX-512) of x.sum() on 64M float32
// elements with two threads (the worst of randn, 0.1 % subnormal and 1 %
// NaN, old and new builds timed in turn), where the two lines take
// 1.27-1.35x and 1.03-1.07x: one core's share of memory is bound by the
// misses it keeps in flight, and a prefetch into L1 holds one of its few L1
// miss buffers until the line arrives. The far line alone, into L2, left a
// span that L2 holds 11 % slower (its lines then wait on L2 in L1). A
// prefetch never faults, so reading ahead of a span's end is harmless.
// A scan that counts the histogram's fields in its loop takes longer per
// vector, and asks for the far line twice as far ahead: that took the
// float32 count from 1.38-1.58x to 1.33-1.49x x.sum(), over randn, 0.1 %
// subnormal and 1 % NaN (AVX-512, timed in turn).
constexpr int64_t kFarBytes = 8192;
constexpr int64_t kFarBytesCounting = 16384;
constexpr int64_t kNearBytes = 1024;

template <int64_t kFar = kFarBytes>
ZS_INLINE void prefetch_ahead(const void* p) {
  const char* q = static_cast<const char*>(p);
  __builtin_prefetch(q + kFar, 0, 2);        // into L2 (prefetcht1)
  __builtin_prefetch(q + kNearBytes, 0, 3);  // into L1 (prefetcht0)
}

// The passes that do not take care of subnormals (hot, and the one for NaN
// and infinities) sum a run only when it holds no nonzero subnormal (one
// with any is summed again by a pass that takes care of them), for the
// dtypes that have such passes; so they count either the nonzero lanes or
// those above sub_max: in a run they sum, the two are the same lanes, and
// scan_runs counts the other one by one in the runs that hold subnormals
// (count_uncounted).
template <typename S, int kPass>
constexpr bool kNonzeroIsAboveSub = (kPass == 0 || kPass == 1) && kSubnormalPass<S>;
// Which of the two they count. Where compares give mask registers, the
// nonzero lanes' mask is made anyway (for lo and the negative count) and
// counts with one masked add; elsewhere the compare with sub_max is made
// anyway (it picks the lanes summed) and counts with one subtraction, where
// the nonzero count takes two (a min and an add): 1 of AVX2's 19 uops a
// float32 vector (2-3 % off its float32 and bfloat16 loops, cached).
constexpr bool kHotCountsNonzero = ZS_TARGET_MASKS;
// With 16 registers (AVX2), the float32 passes that take care of
// subnormals (2 and 3) count no nonzero lanes in classify either: a nonzero
// lane is one above sub_max or a nonzero subnormal, and they count the
// second in the vectors that hold subnormals, beside the work those do
// anyway (scan_vector), and the first from the count above sub_max at the
// end of each run (scan_runs). That takes two uops and a counter off the 16
// registers in every vector without subnormals: cached float32 with 0.1 %,
// 3 % and 30 % subnormal took 0.383 -> 0.347, 0.396 -> 0.374 and 0.404 ->
// 0.392 ns an element (span_speed, builds in turn, best of 7). A bfloat16
// vector has twice the lanes, so at 30 % subnormal nearly every one holds
// some and the count only moves: it took 3.6 % longer. AVX-512 counts the
// nonzero lanes with one masked add of a mask it makes anyway, and took 2 %
// longer with 3 % and 30 %; NEON, with 32 registers, keeps its count too.
template <typename S, int kPass>
constexpr bool kSubnormalsCountNonzero =
    ZS_TARGET_REGISTERS < 32 && std::is_same_v<S, float> && (kPass == 2 || kPass == 3);

// The lanes of the vectors [0, vectors) at p that a hot pass did not count
// (kHotCountsNonzero): above sub_max, or nonzero. Counted lane by lane and
// returned, not added, so that no counter of the caller's loop has its
// address taken, which would keep it in memory there.
template <typename S>
__attribute__((noinline)) ZS_TARGET_ATTR typename LaneTypes<S>::VU count_uncounted(const S* p, int64_t vectors,
                                                                                   const VectorLimits<S>& lim) {
  using L = LaneTypes<S>;
  typename L::VU n{};
  for (int64_t v = 0; v < vectors; ++v) {
    const typename L::VI k = as<typename L::VI>(key_of<S>(load<typename L::VU>(p + v * L::kLanes)));
    n = count(n, kHotCountsNonzero ? k > lim.sub_max : k != 0);
  }
  return n;
}

// m (lanes >= 0), negated in the lanes where `sign` is negative: a
// float's magnitude as a signed integer. AVX2 has one instruction for it
// (psign, which also zeroes the lanes where `sign` is 0, whose m is 0
// here); AVX-512 a masked subtraction.
template <typename VI>
ZS_INLINE VI with_sign_of(VI m, VI sign) {
#if ZS_TARGET_BYTES == 32 && ZS_TARGET_F16C
  if constexpr (sizeof(m[0]) == 4) return (VI)_mm256_sign_epi32((__m256i)m, (__m256i)sign);
  if constexpr (sizeof(m[0]) == 2) return (VI)_mm256_sign_epi16((__m256i)m, (__m256i)sign);
#endif
#if ZS_TARGET_MASKS
  return sign < 0 ? -m : m;
#else
  const VI neg = sign >> (8 * sizeof(m[0]) - 1);
  return (m ^ neg) - neg;
#endif
}

// One vector q, summed into r: counted (kClassify) and summed as pass
// kPass (Pass::index), which counts NaN and infinities where kClassify or
// kCountNonFinite says. lo, top, top_finite: the run's smallest nonzero
// key (as kLoIsKey says: the key, or the key - 1), largest key and largest
// finite key (passes that take care of non-finite lanes), lane by lane.
// skip_clean: the subnormal passes skip the subnormal work of a vector that
// holds no subnormal (a test and a branch per vector), for runs where most
// vectors hold none (scan_runs; a run summed again skips always).
//
// Every pass but tiny sums the lanes as floats, with float32 and bfloat16
// subnormals zeroed (they add (0 - shift)^2 there, which the subnormal
// passes' sums of m correct) and, in passes that take care of them, NaN and
// infinities replaced by the shift (they add nothing there, and shift once
// per lane to the values, taken off at the end).
template <typename S, bool kClassify, bool kCountNonFinite, int kPass, int64_t kFar = kFarBytes>
ZS_INLINE void scan_vector(const S* q, const VectorLimits<S>& lim, const MomentConstants<S>& mc,
                           Counters<S>& c, RunSums& r, typename LaneTypes<S>::VU& lo,
                           typename LaneTypes<S>::VU& top, typename LaneTypes<S>::VU& top_finite,
                           bool skip_clean) {
  using L = LaneTypes<S>;
  using VU = typename L::VU;
  using VI = typename L::VI;
  constexpr Pass P = kPass == 4 ? kTiny : Pass{(kPass & 1) != 0, (kPass & 2) != 0, false};
  if constexpr (kClassify) prefetch_ahead<kFar>(q);
  const VU raw = load<VU>(q);
  const VU key = key_of<S>(raw);
  // Passes that take care of NaN and infinities keep the largest finite
  // key, and learn whether there were any from their counts; the others
  // keep the largest key.
  VI above_sub{};
  if constexpr (kClassify) {
    constexpr bool kOne = kNonzeroIsAboveSub<S, kPass>;  // counts one of nonzero and above_sub
    constexpr bool kNonzero = kOne ? kHotCountsNonzero : !kSubnormalsCountNonzero<S, kPass>;
    above_sub = classify<S, !P.non_finite, kNonzero, !kOne || !kHotCountsNonzero>(raw, key, lim, c, lo, top);
  } else {
    const VI k = as<VI>(key);
    if constexpr (!P.non_finite) {
      const VI t = vmax(as<VI>(top), k);
      top = as<VU>(t);
    }
    if constexpr (kSubnormalPass<S>) above_sub = k > lim.sub_max;
  }
  VI non_finite{};
  if constexpr (kCountNonFinite) {
    non_finite = count_non_finite<S>(raw, key, lim, c);
  } else if constexpr (P.non_finite) {
    non_finite = as<VI>(key) > lim.finite_max;
  }
  if constexpr (P.non_finite) {
    if constexpr (ZS_TARGET_MASKS) {
      const VI t = non_finite ? as<VI>(top_finite) : vmax(as<VI>(top_finite), as<VI>(key));  // a masked max
      top_finite = as<VU>(t);
    } else {
      const VU fk = key & ~as<VU>(non_finite);  // and-not and max: a blend costs more
      const VI t = vmax(as<VI>(top_finite), as<VI>(fk));
      top_finite = as<VU>(t);
    }
  }
  if constexpr (P.tiny) {
    // Zeros and subnormals alone: x = m * 2^-149, m signed, in the float32
    // groups (bfloat16's m widened as its bits are).
    const VI m = with_sign_of(as<VI>(key), as<VI>(raw));
    VU32 g[kGroups<S>];
    widen<S>(as<VU>(m), g);
    for (int i = 0; i < kGroups<S>; ++i) {
      r.tiny_m += as<VI32>(g[i]);
      const VF d = __builtin_convertvector(as<VI32>(g[i]), VF) - mc.sub_shift_v;
      r.tiny_q += d * d;
    }
    return;
  }
  VU kept = raw;
  if constexpr (kSubnormalCare<S> || (std::is_same_v<S, double> && !P.subnormal)) {
    kept = above_sub ? raw : VU{};  // float64 subnormal passes sum them as they are
  }
  if constexpr (P.non_finite) kept = non_finite ? mc.shift_bits_v : kept;
  if constexpr (std::is_same_v<S, double>) {
    add_doubles(kept, mc.shift64_v, r);
  } else {
    VU32 g[kGroups<S>];
    widen<S>(kept, g);
    for (int i = 0; i < kGroups<S>; ++i) add_group<S>(g[i], mc.scale_v, mc.shift_v, r);
  }
  if constexpr (P.subnormal && kSubnormalCare<S>) {
    // The zeroed subnormals' m, signed, for their values and the
    // correction of their squares (scan_vectors). Without mask registers
    // above_sub goes through a register: on AVX2 GCC otherwise knows its
    // lanes are 0 or -1 and makes the and-not a blend, 2 uops where the
    // and-not is 1.
    // A vector with no subnormal lane adds nothing here, and skips it
    // where skip_clean says (scan_runs).
    const VI sub_key = as<VI>(key) & ~(ZS_TARGET_MASKS ? above_sub : opaque(above_sub));
    if (skip_clean && !any_lane(sub_key)) return;
    if constexpr (kClassify && kSubnormalsCountNonzero<S, kPass>) c.nonzero += vmin(as<VU>(sub_key), VU{} + 1);
    const VI m = with_sign_of(sub_key, as<VI>(raw));
    VU32 g[kGroups<S>];
    widen<S>(as<VU>(m), g);
    for (int i = 0; i < kGroups<S>; ++i) {
      r.sub_m += as<VI32>(g[i]);
      const VF mf = __builtin_convertvector(as<VI32>(g[i]), VF);
      r.sub_q += mf * mf;
    }
  }
}

// The vectors [0, vectors) at p through scan_vector, segment by segment,
// and, where kFields, their histogram fields into `fields` as each is read
// (in the same loop, so that the count's instructions run while the scan
// waits on memory, rather than in a pass of their own after it). A segment
// adds 16 to a lane of the 4-bit counters, one more than they hold, so they
// are split every half segment: the segments stay those of a scan that does
// not count, and so do its sums, bit for bit.
template <typename S, bool kClassify, bool kCountNonFinite, int kPass, bool kFields = false>
ZS_INLINE void scan_run(const S* p, int64_t vectors, const VectorLimits<S>& lim,
                        const MomentConstants<S>& mc, Counters<S>& c, RunSums& r,
                        typename LaneTypes<S>::VU& lo, typename LaneTypes<S>::VU& top,
                        typename LaneTypes<S>::VU& top_finite, bool skip_clean,
                        ScanFields* fields = nullptr) {
  using VU = typename LaneTypes<S>::VU;
  constexpr int kLanes = LaneTypes<S>::kLanes;
  constexpr int64_t kHalf = kSegment<S> / 2;
  static_assert(!kFields || kGroups<S> * kHalf == ScanFields::kAddsPerHalfSegment, "half a segment's additions");
  for (int64_t begin = 0; begin < vectors; begin += kSegment<S>) {
    const int64_t end = std::min(vectors, begin + kSegment<S>);
    if constexpr (kFields) {
      for (int64_t half = begin; half < end; half += kHalf) {
        VU32 nibbles[kNibbleCounters]{};
        for (int64_t v = half; v < std::min(end, half + kHalf); ++v) {
          scan_vector<S, kClassify, kCountNonFinite, kPass, kFarBytesCounting>(
              p + v * kLanes, constants(lim), constants(mc), c, r, lo, top, top_finite, skip_clean);
          add_fields<S>(load<VU>(p + v * kLanes), fields->base, nibbles);
        }
        fields->counts.split(nibbles, fields->out->counts);
      }
    } else {
      for (int64_t v = begin; v < end; ++v) {
        scan_vector<S, kClassify, kCountNonFinite, kPass>(p + v * kLanes, constants(lim), constants(mc), c, r, lo,
                                                          top, top_finite, skip_clean);
      }
    }
    if constexpr (kFloat32Lanes<S>) end_segment(r);
  }
}

// A run's moments summed again as pass kPass, counting NaN and infinities
// into `c` where kCountNonFinite says (a first pass that did not); returns
// what the run holds.
template <typename S, bool kCountNonFinite, int kPass>
__attribute__((noinline)) ZS_TARGET_ATTR RunFacts resum_as(const S* p, int64_t vectors,
                                                           const VectorLimits<S>& limits,
                                                           const MomentConstants<S>& constants,
                                                           Counters<S>& counters, RunSums& out) {
  using U = typename LaneTypes<S>::U;
  using VU = typename LaneTypes<S>::VU;
  const VectorLimits<S> lim = limits;
  const MomentConstants<S> mc = constants;
  Counters<S> c = counters;
  RunSums r{};
  VU lo = VU{} - 1, top{}, top_finite{};
  scan_run<S, false, kCountNonFinite, kPass>(p, vectors, lim, mc, c, r, lo, top, top_finite, true);
  counters = c;
  out = r;
  RunFacts f;
  f.top = reduce_max<U, kBytes>(top);
  f.top_finite = kPass != 4 && (kPass & 1) ? reduce_max<U, kBytes>(top_finite) : f.top;
  f.lo = lowest_key<S>(lo);
  return f;
}

template <typename S>
ZS_TARGET_ATTR RunFacts resum(const S* p, int64_t vectors, const VectorLimits<S>& lim,
                              const MomentConstants<S>& mc, Counters<S>& c, bool count_non_finite,
                              Pass pass, RunSums& r) {
  switch (pass.index()) {
    case 0: return resum_as<S, false, 0>(p, vectors, lim, mc, c, r);
    case 1:
      return count_non_finite ? resum_as<S, true, 1>(p, vectors, lim, mc, c, r)
                              : resum_as<S, false, 1>(p, vectors, lim, mc, c, r);
    case 2: return resum_as<S, false, 2>(p, vectors, lim, mc, c, r);
    case 3:
      return count_non_finite ? resum_as<S, true, 3>(p, vectors, lim, mc, c, r)
                              : resum_as<S, false, 3>(p, vectors, lim, mc, c, r);
    default: return resum_as<S, false, 4>(p, vectors, lim, mc, c, r);
  }
}

// The sums of one span of floats.
struct FloatSums {
  VD s1[2]{}, s2[2]{};    // values (/ kWidenScale) or float64 d; squares, unscaled
  Vec<int64_t> sub_m{};   // subnormal passes: signed m
  VD sub_q{};             //   m^2
  Vec<int64_t> tiny_m{};  // tiny passes: signed m
  VD tiny_q{};            //   (m - s)^2
};

ZS_INLINE Vec<int64_t> widen_ints(VI32 v) {
  return __builtin_convertvector(low_half<int32_t>(v), Vec<int64_t>) +
         __builtin_convertvector(high_half<int32_t>(v), Vec<int64_t>);
}

template <typename S>
ZS_INLINE void add_run(FloatSums& s, const RunSums& r, double unscale) {
  if constexpr (std::is_same_v<S, double>) {
    s.s1[0] += r.x[0];
    s.s2[0] += r.q64;
  } else {
    s.s1[0] += r.x[0];
    s.s2[0] += r.qd[0] * unscale;
    s.s2[1] += r.qd[1] * unscale;
    if constexpr (kSubnormalCare<S>) {
      s.sub_m += widen_ints(r.sub_m);
      s.sub_q += r.sub_qd;
      s.tiny_m += widen_ints(r.tiny_m);
      s.tiny_q += r.tiny_qd;
    }
  }
}

// A span's float scan between calls of scan_runs.
template <typename S>
struct SpanState {
  using VU = typename LaneTypes<S>::VU;
  Counters<S> c;           // narrow lane counts since the last fold
  Totals totals;
  int64_t since_fold = 0;  // vectors counted into c
  FloatSums sums;
  VU lo = VU{} - 1;        // smallest nonzero key, lane by lane (kLoIsKey)
  uint64_t hi = 0;         // largest finite key
  ScanFields* fields = nullptr;  // the histogram's count, if the scan counts
  int64_t last_non_finite = -1;  // the last run that held NaN or infinities
  int64_t last_subnormal = -1;   // the last run that held a nonzero subnormal
};

// Widens the lane counters before they can overflow.
template <typename S>
ZS_INLINE void fold_when_full(Counters<S>& c, Totals& totals, int64_t& since_fold, int64_t len) {
  since_fold += len;
  if (since_fold + kRun<S> > kFold<sizeof(S)>) {
    fold(totals, c);
    since_fold = 0;
  }
}

// The pass a run needs: whether it holds NaN or infinities, its largest
// finite key (any key, where it holds none) and its smallest nonzero key - 1.
template <typename S>
Pass needed_pass(bool non_finite, uint64_t top, uint64_t lo, const VectorLimits<S>& lim, bool small_shift) {
  Pass need;
  need.non_finite = non_finite;
  need.subnormal = kSubnormalPass<S> && lo < lim.scalar.sub_max;
  if (kSubnormalCare<S> && need.subnormal && !non_finite && small_shift && top <= lim.scalar.sub_max) {
    return kTiny;  // zeros and subnormals alone
  }
  return need;
}

// Whether a run whose largest finite key is `top` needs a scale of its own
// (RunScale): subnormals are summed apart from it, so only normal keys count.
template <typename S>
bool outside_window(const RunScale& rs, uint64_t top, const VectorLimits<S>& lim) {
  if constexpr (!kScaledSquares<S>) {
    return false;
  } else {
    return !fits(rs, top > lim.scalar.sub_max ? top : 0);
  }
}

// Which pass reads the runs after one that needed more than its pass took
// care of (and was summed again): one that takes care of the kinds the run
// held where runs held them lately (within kGap runs), and of the kinds
// the pass took care of where runs held them within its lingering (kLinger
// runs); the hot pass where neither; after a tiny run the tiny pass (the
// runs of underflowed data come together). A careful run costs 1.3-1.45
// hot ones (AVX2 and AVX-512), and summing a run again one careful run, so
// it pays to stay careful where more than about a quarter of the runs need
// it: a NaN or a subnormal in every few runs, not in every tenth. Taking the
// careful pass after the first run that needed it (and leaving it after 4
// that did not) read a 64K-element span with a NaN or infinity every
// 10,000 values 3-13 % slower than this rule (float32, bfloat16, float16;
// AVX2 and AVX-512; span loops alone, cached): the careful pass lingered
// over the clean runs that followed each NaN.
// A span starts as if its run -1 held every kind, so that data with a rare
// kind in every run takes the careful pass from its first run, as before.
// kGap: the runs since the last one that held a kind within which it
// counts as lately; kLinger: the runs in a row that a careful pass reads,
// each needing less than it takes care of, before it gives way to the pass
// the last one needed (scan_runs).
constexpr int64_t kGap = 3;
constexpr int kLinger = 6;

// The pass for the runs after `run`, which pass P did not cover (it
// needed `needed`) or whose scale it did not have.
template <typename S>
Pass pass_after(Pass P, Pass needed, int64_t run, const SpanState<S>& st) {
  if (needed.tiny) return P.with(needed);
  const Pass kept{P.non_finite && (needed.non_finite || run - st.last_non_finite <= kLinger),
                  P.subnormal && (needed.subnormal || run - st.last_subnormal <= kLinger), false};
  const Pass lately{needed.non_finite && run - st.last_non_finite <= kGap,
                    needed.subnormal && run - st.last_subnormal <= kGap, false};
  return kept.with(lately);
}

// Notes the rare kinds run `run` held (after pass_after has read the
// runs before it).
template <typename S>
void note_kinds(Pass needed, int64_t run, SpanState<S>& st) {
  if (needed.non_finite) st.last_non_finite = run;
  if (needed.subnormal || needed.tiny) st.last_subnormal = run;
}

// Where scan_runs stopped.
struct Stop {
  int64_t run;  // the run it stopped at
  bool resum;   // that run is counted but not summed: it needs another pass or scale
  Pass next;    // the pass that run (resum), or the runs from it, need
  Pass then;    // resum: the pass for the runs after it
};

// Reads the runs [run, runs) of p's `vectors` vectors as pass kPass until
// one needs another pass or another scale, or they end. Each run is counted
// and summed in one pass, and its sums are added to the span's when the
// pass covered what it holds. Where kFields, its histogram fields are
// counted in the same pass (every run comes here once: a run summed again
// is not counted again).
template <typename S, int kPass, bool kFields>
__attribute__((noinline)) ZS_TARGET_ATTR Stop scan_runs(const S* p, int64_t vectors, int64_t run,
                                                        const VectorLimits<S>& limits,
                                                        const MomentConstants<S>& constants,
                                                        SpanState<S>& st) {
  using L = LaneTypes<S>;
  using U = typename L::U;
  using VU = typename L::VU;
  constexpr int kLanes = L::kLanes;
  constexpr Pass P = kPass == 4 ? kTiny : Pass{(kPass & 1) != 0, (kPass & 2) != 0, false};
  const VectorLimits<S> lim = limits;
  const MomentConstants<S> mc = constants;
  Counters<S> c = st.c;
  FloatSums sums = st.sums;
  VU span_lo = st.lo;
  uint64_t hi = st.hi;
  int64_t since_fold = st.since_fold;
  ScanFields* fields = st.fields;
  const int64_t runs = (vectors + kRun<S> - 1) / kRun<S>;
  Stop stop{runs, false, P, P};
  int unneeded = 0;  // runs in a row that needed less than P
  // Whether a subnormal pass skips the vectors without subnormals (see
  // scan_vector): while the run before held fewer subnormals than a quarter
  // of its vectors times its groups (a bfloat16 vector skips two groups'
  // work, a float32 one one), so that few of its vectors held any and the
  // branch is seldom mispredicted. Where nearly every vector holds one, the
  // test is paid for nothing: with the skip on every vector, cached float32
  // with 30 % subnormal took 0.284 -> 0.306 ns an element on AVX-512 and
  // 0.402 -> 0.433 on AVX2. With this rule, float32 and bfloat16 with 0.1 %
  // to 30 % subnormal took -15 % to +2 % of the time without the skip
  // (span_speed, best of 5 builds in turn). Each call starts with the skip,
  // as does a run summed again.
  bool skip_clean = true;
  for (; run < runs; ++run) {
    const int64_t begin = run * kRun<S>;
    const int64_t len = std::min(kRun<S>, vectors - begin);
    RunSums r{};
    VU lo = VU{} - 1, top{}, top_finite{};
    const VU non_finite_before = c.non_finite, nonzero_before = c.nonzero, above_sub_before = c.above_sub;
    scan_run<S, true, P.non_finite, kPass, kFields>(p + begin * kLanes, len, lim, mc, c, r, lo, top, top_finite,
                                                    skip_clean, fields);
    if constexpr (P.subnormal && kSubnormalCare<S>) {
      const VU above_sub = c.above_sub - above_sub_before;
      if constexpr (kSubnormalsCountNonzero<S, kPass>) c.nonzero += above_sub;
      const VU subnormal = (c.nonzero - nonzero_before) - above_sub;  // <= kRun a lane
      skip_clean = 4 * static_cast<int64_t>(reduce_sum<U, kBytes>(subnormal)) < kGroups<S> * len;
    }
    span_lo = vmin(span_lo, lo);
    const uint64_t run_lo = lowest_key<S>(lo);
    bool non_finite;
    uint64_t finite_top;
    if constexpr (P.non_finite) {
      finite_top = reduce_max<U, kBytes>(top_finite);
      const VU changed = as<VU>(c.non_finite != non_finite_before);
      non_finite = reduce_max<U, kBytes>(changed) != 0;
    } else {
      finite_top = reduce_max<U, kBytes>(top);  // NaN's keys too, where it holds any
      non_finite = finite_top > lim.scalar.finite_max;
    }
    if constexpr (kNonzeroIsAboveSub<S, kPass>) {
      // The count the pass did not make: the one it made, unless the run
      // holds subnormals.
      VU& uncounted = kHotCountsNonzero ? c.above_sub : c.nonzero;
      const VU counted = kHotCountsNonzero ? c.nonzero - nonzero_before : c.above_sub - above_sub_before;
      uncounted += run_lo < lim.scalar.sub_max ? count_uncounted<S>(p + begin * kLanes, len, lim) : counted;
    }
    fold_when_full(c, st.totals, since_fold, len);
    const Pass needed = needed_pass<S>(non_finite, finite_top, run_lo, lim, mc.small_shift);
    const bool resum = !P.covers(needed) || outside_window<S>(mc.rs, finite_top, lim);
    if (resum) stop = Stop{run, true, P.with(needed), pass_after<S>(P, needed, run, st)};
    note_kinds<S>(needed, run, st);
    if (resum) break;
    add_run<S>(sums, r, mc.rs.unscale);
    hi = std::max(hi, finite_top);
    // A pass that takes care of more than the runs need lingers for
    // kLinger runs, so that data with a rare kind in many runs (a subnormal
    // or a NaN every few hundred values) is not read twice in most of them.
    if (needed.index() == P.index()) {
      unneeded = 0;
    } else if (P.tiny || needed.tiny || ++unneeded >= kLinger) {
      stop = Stop{run + 1, false, needed, needed};
      break;
    }
  }
  st.c = c;
  st.sums = sums;
  st.lo = span_lo;
  st.hi = hi;
  st.since_fold = since_fold;
  return stop;
}

template <typename S, bool kFields>
ZS_TARGET_ATTR Stop scan_runs_by_pass(Pass pass, const S* p, int64_t vectors, int64_t run,
                                       const VectorLimits<S>& lim, const MomentConstants<S>& mc, SpanState<S>& st) {
  switch (pass.index()) {
    case 0: return scan_runs<S, 0, kFields>(p, vectors, run, lim, mc, st);
    case 1: return scan_runs<S, 1, kFields>(p, vectors, run, lim, mc, st);
    case 2: return scan_runs<S, 2, kFields>(p, vectors, run, lim, mc, st);
    case 3: return scan_runs<S, 3, kFields>(p, vectors, run, lim, mc, st);
    default: return scan_runs<S, 4, kFields>(p, vectors, run, lim, mc, st);
  }
}

template <typename S>
ZS_TARGET_ATTR Stop scan_runs_as(Pass pass, const S* p, int64_t vectors, int64_t run, const VectorLimits<S>& lim,
                                 const MomentConstants<S>& mc, SpanState<S>& st) {
  if constexpr (kScanCountsFields<S> && kCountsFieldsInScan) {
    if (st.fields != nullptr) return scan_runs_by_pass<S, true>(pass, p, vectors, run, lim, mc, st);
  }
  return scan_runs_by_pass<S, false>(pass, p, vectors, run, lim, mc, st);
}

// The vectors [0, vectors) of floats at p into `st`.
//
// Each run is read once, in the pass the runs before it needed (pass_after):
// hot (every lane finite and normal or zero: most runs of most data), or
// taking care of NaN and infinities, of subnormals, or of both, or tiny. A
// run that held more than its pass took care of is summed again as it
// needs, from the core's caches; so data with NaN, infinities or subnormals
// in every run (a NaN-poisoned or underflowed tensor) is read once, in the
// pass it needs, and data with a few pays a second pass over the runs that
// hold them.
template <typename S>
ZS_TARGET_ATTR void scan_float_vectors(const S* p, int64_t vectors, const VectorLimits<S>& lim,
                                       MomentConstants<S>& mc, SpanState<S>& st) {
  constexpr int kLanes = LaneTypes<S>::kLanes;
  const int64_t runs = (vectors + kRun<S> - 1) / kRun<S>;
  int64_t run = 0;
  Pass pass = kHot;
  while (run < runs) {
    const Stop stop = scan_runs_as<S>(pass, p, vectors, run, lim, mc, st);
    run = stop.run;
    if (!stop.resum) {
      pass = stop.next;
      continue;
    }
    // The run at `run` is counted; sum it as it needs, with its own scale
    // where it needs one.
    const S* at = p + run * kRun<S> * kLanes;
    const int64_t len = std::min(kRun<S>, vectors - run * kRun<S>);
    const Pass summed = stop.next;
    RunSums r;
    const RunFacts f = resum(at, len, lim, mc, st.c, summed.non_finite && !pass.non_finite, summed, r);
    const uint64_t top = summed.non_finite ? f.top_finite : f.top;
    if (outside_window<S>(mc.rs, top, lim)) {
      const uint64_t normal_top = top > lim.scalar.sub_max ? top : 0;
      using key_t = typename Format<S>::key_t;
      const double m = Format<S>::magnitude(static_cast<key_t>(normal_top));
      mc.rs = make_scale<S>(scale_exponent(std::max(m, std::fabs(mc.shift))), mc.shift);
      mc.broadcast();
      Counters<S> none;
      resum(at, len, lim, mc, none, false, summed, r);
    }
    add_run<S>(st.sums, r, mc.rs.unscale);
    st.hi = std::max(st.hi, top);
    pass = stop.then;
    ++run;
  }
  fold(st.totals, st.c);
}

// ---- Integers --------------------------------------------------------------

// 1-byte integers: values and squares summed exactly in integer lanes.
struct ByteSums {
  Vec<int32_t> values{};   // signed sums of 4 bytes' values
  Vec<uint32_t> squares{};
};

template <typename S>
ZS_INLINE void add_bytes(typename LaneTypes<S>::VU vals, ByteSums& s) {
  using V16 = Vec<uint16_t>;
  using VI16 = Vec<int16_t>;
  const V16 w = as<V16>(vals);
  VI16 lo, hi;
  if constexpr (Format<S>::kSigned) {
    const V16 up = w << 8;
    lo = as<VI16>(up) >> 8;
    hi = as<VI16>(w) >> 8;
  } else {
    const V16 l = w & 0xffu, h = w >> 8;
    lo = as<VI16>(l);
    hi = as<VI16>(h);
  }
  // Pairs of 16-bit lanes into 32-bit ones: the low lane sign-extended.
  const VI16 pair_sum = lo + hi;  // |.| <= 510
  const VI32 p = as<VI32>(pair_sum);
  s.values += ((p << 16) >> 16) + (p >> 16);
  const V16 sq_lo = as<V16>(lo) * as<V16>(lo);  // <= 65025
  const V16 sq_hi = as<V16>(hi) * as<V16>(hi);
  const VU32 a = as<VU32>(sq_lo), b = as<VU32>(sq_hi);
  s.squares += (a & 0xffffu) + (a >> 16) + (b & 0xffffu) + (b >> 16);
}

// Integers of 16 bits and more: d = x - shift and d^2 in double.
ZS_INLINE void add_shifted(VD x, double shift, VD& s1, VD& s2) {
  const VD d = x - shift;
  s1 += d;
  s2 += d * d;
}

template <typename S>
ZS_INLINE void add_wide_ints(typename LaneTypes<S>::VU raw, double shift, VD (&s1)[2], VD (&s2)[2]) {
  if constexpr (sizeof(S) == 8) {
    add_shifted(__builtin_convertvector(as<Vec<int64_t>>(raw), VD), shift, s1[0], s2[0]);
  } else {
    VI32 g[2];
    int groups = 1;
    if constexpr (sizeof(S) == 2) {
      const VI32 w = as<VI32>(raw);
      g[0] = (w << 16) >> 16;
      g[1] = w >> 16;
      groups = 2;
    } else {
      g[0] = as<VI32>(raw);
    }
    for (int i = 0; i < groups; ++i) {
      add_shifted(low_to_double<int32_t>(g[i]), shift, s1[0], s2[0]);
      add_shifted(high_to_double<int32_t>(g[i]), shift, s1[1], s2[1]);
    }
  }
}

// Vectors per block of 1-byte integers: a 32-bit lane of squares gains at
// most 4 * 255^2 per vector.
constexpr int64_t kByteBlock = 255;

// The value of S nearest v (finite v; S a float type) and its bits,
// remembered for the last v per thread: a strided tensor's many spans share
// their chunk's shift.
template <typename S>
struct NearestValue {
  double value;
  typename LaneTypes<S>::U bits;
};

template <typename S>
NearestValue<S> nearest_value(double v) {
  using F = Format<S>;
  using U = typename LaneTypes<S>::U;
  if constexpr (std::is_same_v<S, double>) {
    return {v, bit_cast_to<U>(v)};
  } else if constexpr (std::is_same_v<S, float>) {
    const float f = static_cast<float>(v);
    return {static_cast<double>(f), bit_cast_to<U>(f)};
  } else {
    static thread_local double last_in = 0.0;
    static thread_local NearestValue<S> last_out{0.0, 0};
    if (v == last_in) return last_out;
    const double a = std::fabs(v);
    uint64_t key = largest_key<S>([a](double m) { return m <= a; });
    const uint64_t finite_max = largest_key<S>([](double m) { return std::isfinite(m); });
    if (key < finite_max) {
      const double below = F::magnitude(static_cast<typename F::key_t>(key));
      const double above = F::magnitude(static_cast<typename F::key_t>(key + 1));
      if (above - a < a - below) ++key;
    }
    const double m = F::magnitude(static_cast<typename F::key_t>(key));
    last_in = v;
    last_out = {v < 0 ? -m : m, static_cast<U>(key | (v < 0 ? F::kSignBit : 0))};
    return last_out;
  }
}

template <typename S>
__attribute__((noinline)) ZS_TARGET_ATTR int64_t scan_vectors_here(const S* p, int64_t n, const Limits& limits,
                                                                   double shift, Tally<S, int64_t>& t,
                                                                   FieldWindow* fields) {
  using F = Format<S>;
  using L = LaneTypes<S>;
  using VU = typename L::VU;
  using key_t = typename F::key_t;
  constexpr int kLanes = L::kLanes;
  const int64_t vectors = n / kLanes;
  if (vectors == 0) return 0;
  const VectorLimits<S> lim(limits);
  Totals totals;
  uint64_t hi = 0, lo = ~uint64_t(0);

  const int64_t count = vectors * kLanes;
  double s1 = 0.0, s2 = 0.0;
  if constexpr (F::kFloating) {
    // The span is summed about the value of S nearest the caller's shift,
    // and its sums moved to the caller's shift at the end.
    const NearestValue<S> nearest = nearest_value<S>(shift);
    const double own = nearest.value;
    MomentConstants<S> mc;
    mc.shift = own;
    mc.shift_bits = nearest.bits;
    mc.rs = first_scale<S>(own);
    const double s_units = own / kSubUnit;
    mc.small_shift = std::fabs(s_units) <= 0x1p60;
    mc.sub_shift = mc.small_shift ? static_cast<float>(s_units) : 0.0f;
    mc.broadcast();
    SpanState<S> st;
    bool counted = false;
    if constexpr (kScanCountsFields<S> && kCountsFieldsInScan) {
      if (fields != nullptr) {
        ScanFields counting;
        counting.out = fields;
        counting.base = VU32{} + static_cast<uint32_t>(4 * fields->lo);
        st.fields = &counting;
        scan_float_vectors<S>(p, vectors, lim, mc, st);
        counting.counts.flush(fields->counts);
        fields->scanned += count;
        counted = true;
      }
    }
    if (!counted) scan_float_vectors<S>(p, vectors, lim, mc, st);
    totals = st.totals;
    const FloatSums& sums = st.sums;
    hi = st.hi;
    if (fields != nullptr) {
      fields->finite_top = std::max(fields->finite_top, Binning<S>::field(static_cast<key_t>(hi)));
    }
    lo = lowest_key<S>(st.lo);
    const int64_t nan = lane_sum<int64_t>(totals.nan);
    const int64_t finite = count - lane_sum<int64_t>(totals.non_finite);
    if constexpr (std::is_same_v<S, double>) {
      s1 = lane_sum<double>(sums.s1[0]);
      s2 = lane_sum<double>(sums.s2[0]);
    } else {
      // The values include the shift once per non-finite lane.
      double sum_x = static_cast<double>(kWidenScale<S>) * lane_sum<double>(sums.s1[0] + sums.s1[1]) -
                     static_cast<double>(count - finite) * own;
      s2 = lane_sum<double>(sums.s2[0] + sums.s2[1]);
      if constexpr (kSubnormalCare<S>) {
        // Subnormal passes summed their subnormals as zeros, each adding
        // own^2 where (x - own)^2 = own^2 - 2 own x + x^2 belongs; tiny
        // passes summed (x - own)^2 itself.
        const double sub_x = static_cast<double>(lane_sum<int64_t>(sums.sub_m)) * kSubUnit;
        const double tiny_x = static_cast<double>(lane_sum<int64_t>(sums.tiny_m)) * kSubUnit;
        sum_x += sub_x + tiny_x;
        s2 += lane_sum<double>(sums.sub_q) * (kSubUnit * kSubUnit) - 2.0 * own * sub_x +
              lane_sum<double>(sums.tiny_q) * (kSubUnit * kSubUnit);
      }
      s1 = sum_x - static_cast<double>(finite) * own;
    }
    if (own != shift) {  // about the caller's shift
      const double delta = own - shift, n_finite = static_cast<double>(finite);
      s2 += 2.0 * delta * s1 + n_finite * delta * delta;
      s1 += n_finite * delta;
    }
    t.finite += finite;
    t.non_nan += count - nan;
    t.neginf += lane_sum<int64_t>(totals.neginf);
    // hi: the largest finite key; an infinity, where there is one, is the
    // one non-NaN key above it.
    const bool infinite = count - nan > finite;
    t.hi = std::max<key_t>(t.hi, infinite ? static_cast<key_t>(limits.nonnan_max) : static_cast<key_t>(hi));
    t.at_most_sub += count - lane_sum<int64_t>(totals.above_sub);
  } else {
    Counters<S> c;
    VU vlo = VU{} - 1, vtop{};
    VD d1[2]{}, d2[2]{};
    int64_t byte_values = 0;
    uint64_t byte_squares = 0;
    constexpr int64_t kBlock = sizeof(S) == 1 ? kByteBlock : kFold<sizeof(S)>;
    for (int64_t begin = 0; begin < vectors; begin += kBlock) {
      const int64_t len = std::min(kBlock, vectors - begin);
      ByteSums b;
      for (int64_t v = 0; v < len; ++v) {
        prefetch_ahead(p + (begin + v) * kLanes);
        const VU raw = load<VU>(p + (begin + v) * kLanes);
        const VU key = key_of<S>(raw);
        classify<S>(raw, key, lim, c, vlo, vtop);
        if constexpr (sizeof(S) == 1) {
          add_bytes<S>(std::is_same_v<S, bool_t> ? key : raw, b);
        } else {
          add_wide_ints<S>(raw, shift, d1, d2);
        }
      }
      fold(totals, c);
      byte_values += lane_sum<int64_t>(b.values);
      byte_squares += lane_sum<uint64_t>(b.squares);
    }
    hi = reduce_max<typename L::U, kBytes>(vtop);
    lo = lowest_key<S>(vlo);
    const int64_t zeros = count - lane_sum<int64_t>(totals.nonzero);
    if constexpr (sizeof(S) == 1) {
      // The shift of an integer dtype is a whole number, so the shifted sums
      // are exact in int64: |x - shift| < 2^9 and a span holds far fewer
      // than 2^36 elements.
      const int64_t k = static_cast<int64_t>(shift);
      s1 = static_cast<double>(byte_values - count * k);
      s2 = static_cast<double>(static_cast<int64_t>(byte_squares) - 2 * k * byte_values + count * k * k);
    } else {
      s1 = lane_sum<double>(d1[0] + d1[1]);
      s2 = lane_sum<double>(d2[0] + d2[1]);
    }
    t.finite += count;
    t.non_nan += count;
    t.hi = std::max<key_t>(t.hi, static_cast<key_t>(hi));
    t.at_most_sub += zeros;  // integers have no subnormals
  }
  const int64_t zeros = count - lane_sum<int64_t>(totals.nonzero);
  t.numel += count;
  t.zeros += zeros;
  for (int b = 0; b < kNumBounds; ++b) t.at_most[b] += count - reduce_sum<uint64_t>(totals.above_bound[b]);
  t.negative += lane_sum<int64_t>(totals.negative);
  // lo: the smallest nonzero key - 1, or the largest value with none.
  if (static_cast<key_t>(lo) != static_cast<key_t>(~key_t(0))) {
    t.lo_nonzero = std::min<key_t>(t.lo_nonzero, static_cast<key_t>(lo + 1));
  }
  t.s1 += s1;
  t.s2 += s2;
  return count;
}

}  // namespace

// p: [n] contiguous. Adds the statistics of its first n / lanes * lanes
// elements to `t`, and their histogram fields to `fields` (kScanCountsFields,
// unless null; every build notes their largest finite field there), and
// returns how many that is (scan_span.h). Declared there
// without the target attribute, which would make it another function (GCC's
// function multiversioning), so it calls into the target's code.
template <typename S>
int64_t scan_vectors(const S* p, int64_t n, const Limits& limits, double shift, Tally<S, int64_t>& t,
                     FieldWindow* fields) {
  return scan_vectors_here<S>(p, n, limits, shift, t, fields);
}

bool scan_counts_fields() { return kCountsFieldsInScan; }

#define ZS_INSTANTIATE(name, S, value_t, tiny, eps)                                     \
  template int64_t scan_vectors<S>(const S*, int64_t, const Limits&, double, Tally<S, int64_t>&, FieldWindow*);
ZEROSCAN_DTYPES(ZS_INSTANTIATE)
#undef ZS_INSTANTIATE

}  // namespace ZS_TARGET
}  // namespace cpu
}  // namespace zeroscan
