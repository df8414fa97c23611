// A torch-free check of the CUDA scan kernels against a CPU reference.
//
// Build (see .ci/cuda_check.sh):
//   nvcc -std=c++20 tests/standalone_test.cu csrc/cuda/stats_cuda_*.cu -o standalone_test
// Run: standalone_test [--seed N] [--large | --small] [--emulate] [--skip-without-gpu]
//   --small: sizes up to 70001 and four value mixes only, for compute-sanitizer,
//   which runs each kernel 10-100x slower.
//
// For every storage type it builds tensors of many sizes, layouts and value
// mixes, scans them on the GPU through the same launch plan the torch
// launcher uses (plan_launches), and checks each result row against a CPU
// reference that shares no code with the kernels' classification: it walks
// the view's own sizes and strides, decodes every element to a double with
// host code written independently of dtypes.h's widening, and classifies
// and sums those doubles with plain real-number tests (x == 0, |x| < tiny,
// |x| <= tol, isnan, ...), the moments by a compensated two-pass sum. Counts
// and min/max |x| must match exactly, mean and m2 closely. It also checks
// that a row is bitwise the same whether its tensor is scanned alone, with
// all the others in one call, with a one-block grid, or a second time, that
// the device widening (Format<T>::value) of every float16/bfloat16/float8
// bit pattern is exact, and that the test's own tiny/eps agree with the
// dtype table (ZEROSCAN_DTYPES). Exits 1 on any mismatch. With no usable GPU
// it says so and exits 2, or 0 when given --skip-without-gpu.
//
// The histogram of stats_many_hist (the kernels with kHist): each tensor's
// fields are checked exactly against a reference histogram written apart
// from csrc/histogram.h (the field from frexp of the decoded double, or an
// integer's bit length counted bit by bit, over the view's own elements,
// repeats included), the fields past the tensor's own up to the call's
// width must stay zero, and the rows of a call with the histogram must be
// bitwise those of the call without it. On a GPU the histogram call is run
// with the full grid and with a one-block grid, and both must agree.
//
// --emulate needs no GPU: it runs the kernels' per-thread code (which is
// __host__ __device__) on the CPU, thread by thread and tile by tile, through
// the same launch plan, and checks it against the same reference. That
// covers the tiling, the tile-to-tensor lookup, the vector and strided walks,
// the per-element classification (Tally, classify.h), the per-thread shift,
// the key limits (limits_for), the widening, the one-byte types' value
// table (ByteSink, value_partial), and the histogram's per-element field
// (FieldBins or LaneBins, into a per-tile table as a block's shared memory
// would be), the counts the fast path takes from it (settle_by_fields) and
// its per-tile flush (row, width and repeat); it does
// not cover the block reduction, the atomics (shared or global) and fences,
// or real launches.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../csrc/cuda/stats_cuda.cuh"

namespace zeroscan {
namespace cuda {
namespace {

#define CHECK_CUDA(expr)                                                   \
  do {                                                                     \
    const cudaError_t err_ = (expr);                                       \
    if (err_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__,   \
                   #expr, cudaGetErrorString(err_));                       \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

// ---- Host decoding of every storage type (the reference's widening) -------

double decode_f16(uint16_t b) {
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  const int e = (b >> 10) & 31;
  const int m = b & 1023;
  if (e == 31) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

double decode_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double decode_e4m3(uint8_t b) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int e = (b >> 3) & 15;
  const int m = b & 7;
  if (e == 15 && m == 7) return NAN;  // no infinities in e4m3fn
  if (e == 0) return sign * std::ldexp(m, -9);
  return sign * std::ldexp(8 + m, e - 10);
}

double decode_e5m2(uint8_t b) { return decode_f16(static_cast<uint16_t>(b << 8)); }

// Every element as a double, exactly (int64 beyond 2^53 rounds, as on the
// device).
double host_value(float x) { return x; }
double host_value(double x) { return x; }
double host_value(f16_t v) { return decode_f16(v.bits); }
double host_value(bf16_t v) { return decode_bf16(v.bits); }
double host_value(e4m3_t v) { return decode_e4m3(v.bits); }
double host_value(e5m2_t v) { return decode_e5m2(v.bits); }
double host_value(bool_t v) { return v.bits ? 1.0 : 0.0; }
double host_value(uint8_t x) { return x; }
double host_value(int8_t x) { return x; }
double host_value(int16_t x) { return x; }
double host_value(int32_t x) { return x; }
double host_value(int64_t x) { return static_cast<double>(x); }

// ---- Value generation ------------------------------------------------------

enum class Mix {
  kNormal,          // dense: finite, nonzero, normal values only
  kSpecials,        // plus ~2% zeros, subnormals, near-zero values, NaN, +-inf
  kBits,            // uniformly random bit patterns (every class of value)
  kShifted,         // 1000 + 1e-3 * randn: the moments' cancellation test
  kHalfZeros,       // 50% exact zeros (either sign), the rest normal
  kMostlyZeros,     // 99% exact zeros
  kAllZeros,        // nothing but zeros
  kAllSubnormal,    // nothing but subnormal values (floating types)
  kSomeSubnormal,   // normal values, 0.1% subnormal (floating types)
  kSomeNonfinite,   // normal values, 0.01% NaN and +-inf (floating types)
  kOutliers,        // 1 + 1e-3 * randn with blocks of 64 far outliers, one
                    // at the start: shifts taken from unrepresentative values
  kNearMax,         // +-(0.5..1) * the largest value, in runs of one sign,
                    // among ordinary and tiny values (floating types)
  kConstantHuge,    // every value 0.75 * the largest, one sign
  kOneHuge,         // ordinary values and, first, one of +-0.9 * sqrt(largest):
                    // for float64 its square alone nearly fills the range, and
                    // the sums of squares about it (its thread's shift) overflow
  kMixedExponents,  // +-2^u, u uniform over [-24, 24] clipped to the normal
                    // range: every run of squares spans many binades
};
constexpr Mix kLastMix = Mix::kMixedExponents;

const char* mix_name(Mix m) {
  switch (m) {
    case Mix::kNormal: return "normal";
    case Mix::kSpecials: return "specials";
    case Mix::kBits: return "bits";
    case Mix::kShifted: return "shifted";
    case Mix::kHalfZeros: return "half_zeros";
    case Mix::kMostlyZeros: return "mostly_zeros";
    case Mix::kAllZeros: return "all_zeros";
    case Mix::kAllSubnormal: return "all_subnormal";
    case Mix::kSomeSubnormal: return "some_subnormal";
    case Mix::kSomeNonfinite: return "some_nonfinite";
    case Mix::kOutliers: return "outliers";
    case Mix::kNearMax: return "near_max";
    case Mix::kConstantHuge: return "constant_huge";
    case Mix::kOneHuge: return "one_huge";
    case Mix::kMixedExponents: return "mixed_exponents";
  }
  return "?";
}

struct Rng {
  std::mt19937_64 engine;
  double normal() { return std::normal_distribution<double>()(engine); }
  double uniform() { return std::uniform_real_distribution<double>()(engine); }
  uint64_t bits() { return engine(); }
  int64_t range(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine);
  }
};

template <typename T>
struct Traits;

// T holding the bytes of `u` (of the same size).
template <typename T, typename U>
T same_bits(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "same_bits needs equal sizes");
  T out;
  std::memcpy(&out, &u, sizeof(T));
  return out;
}

// Floating types: (name, tiny = 2^kMinExp, eps = 2^-kMantissa, conversion
// from double, and from the low bits of a uint64).
template <typename T, int kMinExp, int kMantissa>
struct FloatTraits {
  static constexpr int min_exp = kMinExp;
  static constexpr int mantissa = kMantissa;
  static double tiny() { return std::ldexp(1.0, kMinExp); }
  static double eps() { return std::ldexp(1.0, -kMantissa); }
  static T from_bits(uint64_t b) {
    return same_bits<T>(static_cast<UnsignedOf<sizeof(T)>>(b));
  }
};
template <>
struct Traits<float> : FloatTraits<float, -126, 23> {
  static constexpr const char* name = "float32";
  static float from(double v) { return static_cast<float>(v); }
};
template <>
struct Traits<double> : FloatTraits<double, -1022, 52> {
  static constexpr const char* name = "float64";
  static double from(double v) { return v; }
};
template <>
struct Traits<f16_t> : FloatTraits<f16_t, -14, 10> {
  static constexpr const char* name = "float16";
  static f16_t from(double v) {
    return same_bits<f16_t>(__float2half_rn(static_cast<float>(v)));
  }
};
template <>
struct Traits<bf16_t> : FloatTraits<bf16_t, -126, 7> {
  static constexpr const char* name = "bfloat16";
  static bf16_t from(double v) {
    return same_bits<bf16_t>(__float2bfloat16_rn(static_cast<float>(v)));
  }
};
template <>
struct Traits<e4m3_t> : FloatTraits<e4m3_t, -6, 3> {
  static constexpr const char* name = "float8_e4m3fn";
  static e4m3_t from(double v) {
    return e4m3_t{__nv_cvt_float_to_fp8(static_cast<float>(v), __NV_NOSAT, __NV_E4M3)};
  }
};
template <>
struct Traits<e5m2_t> : FloatTraits<e5m2_t, -14, 2> {
  static constexpr const char* name = "float8_e5m2";
  static e5m2_t from(double v) {
    return e5m2_t{__nv_cvt_float_to_fp8(static_cast<float>(v), __NV_NOSAT, __NV_E5M2)};
  }
};

// Integer types: (name, range); tiny and eps are 0.
template <typename I, int64_t Lo, int64_t Hi>
struct IntTraits {
  static double tiny() { return 0.0; }
  static double eps() { return 0.0; }
  static constexpr int64_t lo = Lo;
  static constexpr int64_t hi = Hi;
};
template <>
struct Traits<bool_t> : IntTraits<bool_t, 0, 1> {
  static constexpr const char* name = "bool";
  static bool_t from_int(int64_t v) { return bool_t{static_cast<uint8_t>(v != 0)}; }
};
template <>
struct Traits<uint8_t> : IntTraits<uint8_t, 0, 255> {
  static constexpr const char* name = "uint8";
  static uint8_t from_int(int64_t v) { return static_cast<uint8_t>(v); }
};
template <>
struct Traits<int8_t> : IntTraits<int8_t, -128, 127> {
  static constexpr const char* name = "int8";
  static int8_t from_int(int64_t v) { return static_cast<int8_t>(v); }
};
template <>
struct Traits<int16_t> : IntTraits<int16_t, -32768, 32767> {
  static constexpr const char* name = "int16";
  static int16_t from_int(int64_t v) { return static_cast<int16_t>(v); }
};
template <>
struct Traits<int32_t> : IntTraits<int32_t, INT32_MIN, INT32_MAX> {
  static constexpr const char* name = "int32";
  static int32_t from_int(int64_t v) { return static_cast<int32_t>(v); }
};
template <>
struct Traits<int64_t> : IntTraits<int64_t, INT64_MIN, INT64_MAX> {
  static constexpr const char* name = "int64";
  static int64_t from_int(int64_t v) { return v; }
};

template <typename T>
constexpr bool is_float_type() {
  return std::is_same_v<T, float> || std::is_same_v<T, double> ||
         std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t> ||
         std::is_same_v<T, e4m3_t> || std::is_same_v<T, e5m2_t>;
}

// ---- The reference histogram (written apart from csrc/histogram.h) --------

// Fields of one tensor of type T: for floats one per value of the exponent
// bits (2^(bits - 1 - mantissa bits)), for integers one per bit length
// 0..bits (bool: 0 and 1).
template <typename T>
int64_t reference_fields() {
  if constexpr (is_float_type<T>()) {
    return int64_t(1) << (8 * static_cast<int>(sizeof(T)) - 1 - Traits<T>::mantissa);
  } else if constexpr (std::is_same_v<T, bool_t>) {
    return 2;
  } else {
    return 8 * static_cast<int64_t>(sizeof(T)) + 1;
  }
}

// |x| of an integer type, as uint64 (|INT64_MIN| = 2^63 fits).
template <typename T>
uint64_t int_magnitude(T x) {
  if constexpr (std::is_same_v<T, bool_t>) {
    return x.bits != 0 ? 1 : 0;
  } else {
    const int64_t v = static_cast<int64_t>(x);
    return v < 0 ? uint64_t(0) - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
  }
}

// The field of one element, from its decoded value: 0 for zero and
// subnormal values (|x| < tiny), the last field for infinities and NaN, and
// otherwise the biased exponent of |x| (frexp's exponent - 1, plus the bias
// 1 - log2(tiny)); float8_e4m3fn's top binade, 256..448, comes out as its
// last field (15) that way, the field its NaN has too. Integers: the bit
// length of |x|, counted one bit at a time.
template <typename T>
int64_t reference_field(T x) {
  if constexpr (is_float_type<T>()) {
    const double v = host_value(x);
    if (std::isnan(v) || std::isinf(v)) return reference_fields<T>() - 1;
    const double a = std::fabs(v);
    if (a < Traits<T>::tiny()) return 0;
    int e = 0;
    std::frexp(a, &e);  // a = m * 2^e with 0.5 <= m < 1
    return (e - 1) + (1 - Traits<T>::min_exp);
  } else {
    uint64_t m = int_magnitude(x);
    int64_t bits = 0;
    while (m != 0) {
      ++bits;
      m >>= 1;
    }
    return bits;
  }
}

// The largest finite value of a floating type, from its patterns (or
// numeric_limits for the 4- and 8-byte ones).
template <typename T>
double largest() {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return std::numeric_limits<T>::max();
  } else {
    double top = 0.0;
    for (uint32_t b = 0; b < (1u << (8 * sizeof(T))); ++b) {
      const double v = host_value(Traits<T>::from_bits(b));
      if (std::isfinite(v) && v > top) top = v;
    }
    return top;
  }
}

// Whether make_values<T> can produce `mix`: the subnormal and non-finite
// mixes need a floating type, and 1000 + 1e-3 * randn a range beyond 1000
// (float8_e4m3fn stops at 448; bool has no room for a spread).
template <typename T>
bool mix_applies(Mix mix) {
  switch (mix) {
    case Mix::kAllSubnormal:
    case Mix::kSomeSubnormal:
    case Mix::kSomeNonfinite:
    case Mix::kOutliers:
    case Mix::kNearMax:
    case Mix::kConstantHuge:
    case Mix::kOneHuge:
    case Mix::kMixedExponents:
      return is_float_type<T>();
    case Mix::kBits:
      return is_float_type<T>() && sizeof(T) <= 4;
    case Mix::kShifted:
      return !std::is_same_v<T, e4m3_t> && !std::is_same_v<T, bool_t>;
    default:
      return true;
  }
}

template <typename T>
std::vector<T> make_values(int64_t n, Mix mix, Rng& rng) {
  using Tr = Traits<T>;
  std::vector<T> out(n);
  if constexpr (is_float_type<T>()) {
    // fp8 ranges are small: keep normal data well inside them.
    const double big = sizeof(T) == 1 ? 1.0 : 2.0;
    const double scale = std::pow(10.0, big * (2.0 * rng.uniform() - 1.0));
    const double loc = rng.uniform() < 0.5 ? 0.0 : scale * rng.normal();
    // A finite, nonzero, normal value once rounded to T.
    auto normal_value = [&]() {
      for (;;) {
        const T x = Tr::from(loc + scale * rng.normal());
        const double a = std::fabs(host_value(x));
        if (a >= Tr::tiny() && std::isfinite(a)) return x;
      }
    };
    // A subnormal value of T, either sign.
    auto subnormal_value = [&]() {
      for (;;) {
        const double v = Tr::tiny() * rng.uniform();
        const T x = Tr::from(rng.uniform() < 0.5 ? -v : v);
        const double a = std::fabs(host_value(x));
        if (a > 0.0 && a < Tr::tiny()) return x;
      }
    };
    auto zero = [&]() { return Tr::from(rng.uniform() < 0.5 ? 0.0 : -0.0); };
    const double top = largest<T>();
    // kOutliers: an offset each type resolves (float8 coarsely), and
    // outliers far off it but within range.
    const double outlier = sizeof(T) == 1 ? top / 2 : 1e4;
    const double spread = sizeof(T) == 1 ? 0.1 : 1e-3;
    bool in_outliers = false;
    double run_sign = 1.0;
    for (int64_t i = 0; i < n; ++i) {
      switch (mix) {
        case Mix::kOutliers:
          if (i % 64 == 0) in_outliers = i == 0 || rng.uniform() < 0.02;
          out[i] = Tr::from(in_outliers ? outlier * (1.0 + spread * rng.normal())
                                        : 1.0 + spread * rng.normal());
          continue;
        case Mix::kNearMax: {
          if (i % 1000 == 0) run_sign = rng.uniform() < 0.5 ? 1.0 : -1.0;
          const double pick = rng.uniform();
          out[i] = Tr::from(pick < 0.1   ? rng.normal()
                            : pick < 0.2 ? Tr::eps() * rng.normal()
                                         : run_sign * top * (0.5 + 0.5 * rng.uniform()));
          continue;
        }
        case Mix::kConstantHuge:
          out[i] = Tr::from(0.75 * top);
          continue;
        case Mix::kOneHuge:
          out[i] = i == 0 ? Tr::from((rng.uniform() < 0.5 ? -0.9 : 0.9) * std::sqrt(top))
                          : normal_value();
          continue;
        case Mix::kMixedExponents: {
          const double lo = std::max(-24.0, std::log2(Tr::tiny()));
          const double hi = std::min(24.0, std::log2(top) - 1.0);
          const double v = std::exp2(lo + (hi - lo) * rng.uniform());
          out[i] = Tr::from(rng.uniform() < 0.5 ? -v : v);
          continue;
        }
        case Mix::kBits:
          out[i] = Tr::from_bits(rng.bits());
          continue;
        case Mix::kShifted:
          out[i] = Tr::from(1000.0 + 1e-3 * rng.normal());
          continue;
        case Mix::kNormal:
          out[i] = normal_value();
          continue;
        case Mix::kHalfZeros:
          out[i] = rng.uniform() < 0.5 ? zero() : normal_value();
          continue;
        case Mix::kMostlyZeros:
          out[i] = rng.uniform() < 0.99 ? zero() : normal_value();
          continue;
        case Mix::kAllZeros:
          out[i] = zero();
          continue;
        case Mix::kAllSubnormal:
          out[i] = subnormal_value();
          continue;
        case Mix::kSomeSubnormal:
          out[i] = rng.uniform() < 0.001 ? subnormal_value() : normal_value();
          continue;
        case Mix::kSomeNonfinite: {
          if (rng.uniform() < 0.0001) {
            const int64_t pick = rng.range(0, 2);
            out[i] = Tr::from(pick == 0 ? NAN : pick == 1 ? INFINITY : -INFINITY);
          } else {
            out[i] = normal_value();
          }
          continue;
        }
        case Mix::kSpecials:
          break;
      }
      double v = loc + scale * rng.normal();
      if (rng.uniform() < 0.02) {
        switch (rng.range(0, 8)) {
          case 0: v = 0.0; break;
          case 1: v = -0.0; break;
          case 2: v = Tr::tiny() * rng.uniform(); break;   // subnormal or 0
          case 3: v = -Tr::tiny() * rng.uniform(); break;
          case 4: v = Tr::eps() * rng.uniform(); break;    // near zero
          case 5: v = NAN; break;
          case 6: v = INFINITY; break;
          case 7: v = -INFINITY; break;
          default: v = Tr::eps(); break;                   // the boundary
        }
      }
      out[i] = Tr::from(v);
    }
  } else {
    const int64_t lo = std::max<int64_t>(Tr::lo, -1000);
    const int64_t hi = std::min<int64_t>(Tr::hi, 1000);
    // A large mean and a tiny spread (+-3), as 1000 + 1e-3 * randn is for
    // floats: a mean far beyond double's resolution of the spread would test
    // the mean's rounding in the Partial record, not the scan.
    const int64_t base = std::min<int64_t>(Tr::hi - 3, 1000000);
    for (int64_t i = 0; i < n; ++i) {
      int64_t v = rng.range(lo, hi);
      switch (mix) {
        case Mix::kNormal:
          if (v == 0) v = hi;
          break;
        case Mix::kShifted:
          v = base + rng.range(-3, 3);
          break;
        case Mix::kHalfZeros:
          v = rng.uniform() < 0.5 ? 0 : v;
          break;
        case Mix::kMostlyZeros:
          v = rng.uniform() < 0.99 ? 0 : v;
          break;
        case Mix::kAllZeros:
          v = 0;
          break;
        default:
          if (rng.uniform() < 0.02) {
            const int64_t pick = rng.range(0, 2);
            v = pick == 0 ? 0 : pick == 1 ? Tr::lo : Tr::hi;
          }
          break;
      }
      out[i] = Tr::from_int(v);
    }
  }
  return out;
}

// ---- Test cases --------------------------------------------------------------

struct Case {
  std::string what;
  int type;                        // index into the type list
  int64_t elem_size;
  std::vector<uint8_t> host;       // the whole storage
  void* device = nullptr;          // a copy of it
  int64_t offset = 0;              // elements from the storage start
  std::vector<int64_t> sizes, strides;
  Layout layout;
  double tol = -1.0;               // < 0: the dtype's eps
  Mix mix = Mix::kNormal;
  Limits limits = {};              // limits_for the dtype and tol
  Partial want;
  double exact_mean = 0.0;  // of the finite values, from a compensated sum
  double mean_abs = 0.0;    // of the finite values
  bool is_f64 = false;
  bool fast = false;  // its dtype has the fast path (fast_tally.cuh)
  std::vector<int64_t> want_fields;  // the reference histogram [fields of T]
};

// The state the emulated kernels share, like the device buffers of a call.
struct EmulatedCall {
  int64_t tiles_fast = 0;   // tiles the fast path scanned
  int64_t tiles_again = 0;  // of which the Tally path scanned again
  std::vector<int64_t> fast_by_row, again_by_row;  // the same per result row
  std::vector<Partial> partials;
  std::vector<int32_t> counters;
  std::vector<int64_t> out;
  std::vector<int64_t> hist;  // [n, width], zeroed; empty: no histogram
};

// One storage type's functions, reached through the type index of a case.
struct TypeOps {
  const char* name;
  int64_t elem_size;
  bool floating;
  int64_t fields;  // reference_fields: the histogram's fields of one tensor
  std::function<bool(Mix)> applies;
  std::function<void(Case&, Mix, Rng&, int64_t)> fill;  // storage elements
  std::function<void(Case&)> reference;
  std::function<FastLimits(const Limits&)> fast_limits;
  std::function<void(const std::vector<ScanInput>&, const LaunchHeader&,
                     int64_t&, int)>
      launch;
  std::function<void(const std::vector<ScanInput>&, const LaunchHeader&,
                     int64_t&, EmulatedCall&)>
      emulate;
};

// Calls f(offset) for every element of the case's view, in its own
// sizes and strides (not the planned layout), repeats included.
template <typename F>
void for_each_element(const Case& c, F&& f) {
  const int nd = static_cast<int>(c.sizes.size());
  int64_t total = 1;
  for (int64_t s : c.sizes) total *= s;
  std::vector<int64_t> index(nd, 0);
  int64_t offset = 0;
  for (int64_t k = 0; k < total; ++k) {
    f(offset);
    for (int d = nd - 1; d >= 0; --d) {
      offset += c.strides[d];
      if (++index[d] < c.sizes[d]) break;
      offset -= c.sizes[d] * c.strides[d];
      index[d] = 0;
    }
  }
}

// The expected row, from the decoded doubles and real-number tests only.
template <typename T>
void reference_of(Case& c) {
  using Tr = Traits<T>;
  const double tiny = Tr::tiny();
  const double tol = c.tol < 0 ? Tr::eps() : c.tol;
  c.limits = limits_for<T>(tiny, tol);  // what the kernels get
  c.is_f64 = std::is_same_v<T, double>;
  c.fast = kHasFastPath<T>;
  const T* base = reinterpret_cast<const T*>(c.host.data()) + c.offset;
  Partial& w = c.want;
  w = Partial{};
  w.min_abs = w.min_abs_nonzero = INFINITY;
  w.max_abs = -INFINITY;
  // The sums are of the values scaled by 2^-k, k >= 0 the least for which
  // no sum of them overflows, and the squares of 2^-k2 times them, k2 the
  // least for which no sum of squared deviations does (the scalings are
  // exact: values small enough to lose bits weigh nothing beside the large
  // ones that call for them).
  double top = 0.0;
  for_each_element(c, [&](int64_t off) {
    const double a = std::fabs(host_value(base[off]));
    if (std::isfinite(a) && a > top) top = a;
  });
  const int exponent = top > 0.0 ? std::ilogb(top) : 0;
  const int k = std::max(0, exponent + 64 - 1020);
  const int k2 = std::max(0, exponent - 450);
  // Neumaier's compensated sum: the mean to within an ulp or so.
  double sum = 0.0, compensation = 0.0, sum_abs = 0.0;
  int64_t finite = 0;
  for_each_element(c, [&](int64_t off) {
    const double v = host_value(base[off]);
    const double a = std::fabs(v);
    w.numel += 1;
    if (std::isnan(v)) {
      w.nan += 1;
      return;
    }
    if (v == 0.0) w.zeros += 1;
    if (v != 0.0 && a < tiny) w.subnormal += 1;
    if (v != 0.0 && a <= tol) w.near_zero += 1;
    if (v < 0.0) w.negative += 1;
    if (v == INFINITY) w.posinf += 1;
    if (v == -INFINITY) w.neginf += 1;
    w.min_abs = std::min(w.min_abs, a);
    if (v != 0.0) w.min_abs_nonzero = std::min(w.min_abs_nonzero, a);
    w.max_abs = std::max(w.max_abs, a);
    if (std::isinf(v)) return;
    const double y = std::ldexp(v, -k);
    const double t = sum + y;
    compensation += std::fabs(sum) >= std::fabs(y) ? (sum - t) + y
                                                   : (y - t) + sum;
    sum = t;
    sum_abs += std::ldexp(a, -k);
    finite += 1;
  });
  c.exact_mean = finite > 0 ? std::ldexp((sum + compensation) / finite, k) : 0.0;
  c.mean_abs = finite > 0 ? std::ldexp(sum_abs / finite, k) : 0.0;
  // Second pass: squared deviations from the (nearly exact) mean, scaled
  // back by 2^k2 twice: inf when m2 lies beyond the float64 range.
  const double scaled_mean = std::ldexp(c.exact_mean, -k2);
  double m2 = 0.0;
  for_each_element(c, [&](int64_t off) {
    const double v = host_value(base[off]);
    const double d = std::ldexp(v, -k2) - scaled_mean;
    if (std::isfinite(v)) m2 += d * d;
  });
  w.mean = c.exact_mean;
  w.m2 = std::ldexp(std::ldexp(m2, k2), k2);

  const int64_t fields = reference_fields<T>();
  c.want_fields.assign(fields, 0);
  for_each_element(c, [&](int64_t off) {
    const int64_t f = reference_field(base[off]);
    if (f < 0 || f >= fields) {
      std::fprintf(stderr, "%s: reference field %lld out of range\n", c.what.c_str(),
                   static_cast<long long>(f));
      std::exit(1);
    }
    c.want_fields[f] += 1;
  });
}

template <typename T>
void launch_type(const std::vector<ScanInput>& inputs, const LaunchHeader& h,
                 int64_t& slot_cursor, int grid) {
  auto clamp = [&](int tiles) { return tiles < grid ? tiles : grid; };
  plan_launches(
      inputs.data(), static_cast<int64_t>(inputs.size()), sizeof(T), h,
      slot_cursor,
      [&](const ContigBatch& b) {
        launch_contig<T>(b, clamp(b.h.num_tiles), 0);
        CHECK_CUDA(cudaGetLastError());
      },
      [&](const StridedBatch& b) {
        launch_strided<T>(b, clamp(b.h.num_tiles), 0);
        CHECK_CUDA(cudaGetLastError());
      });
}

// One launch, emulated: every tile, every thread of its block in turn. The
// block's partials are combined in thread order (the device uses CUB's tree),
// and the last tile of a tensor is the one that completes its counter. With
// a histogram (b.h.hist, host memory here) the threads count into one table
// per block, as the kernel's shared memory, which flush_bins adds to the
// tensor's fields after each tile.
template <typename T, bool kStrided, typename Batch>
void emulate_launch(const Batch& b, EmulatedCall& call) {
  const Limits lim = b.h.limits;
  const bool hist = b.h.hist != nullptr;
  constexpr bool kFast = kHasFastPath<T>;
  using Bins = std::conditional_t<kFast, LaneBins<T>, FieldBins<T>>;  // as scan_tiles
  std::vector<uint32_t> bins(hist ? Bins::kWords : 0, 0u);
  for (int g = 0; g < b.h.num_tiles; ++g) {
    const TileSpan span = locate(b.h, b.t, g);
    const TensorTiles& t = b.t[span.tensor];
    Partial p = empty_partial();
    bool slow = true;
    bool walked = false;  // the fast path counted the histogram fields
    if constexpr (kByteTable<T>) {
      std::vector<uint32_t> table(kByteValues * kTableLanes, 0u);
      for (int tid = 0; tid < kThreads; ++tid) {
        ByteSink<T> sink{table.data(), static_cast<uint32_t>(tid & 31) * 4u};
        walk_share<T, kStrided>(b, span, tid, sink);
      }
      for (int v = 0; v < kByteValues; ++v) {
        combine(p, hist ? value_partial<T>(table.data(), v, lim, Bins::make(bins.data(), v))
                        : value_partial<T>(table.data(), v, lim, NoFields{}));
      }
      slow = false;
    } else if constexpr (kFast) {
      if (b.h.fast.on) {
        const TileCenter ctr = tile_center_serial<T, kStrided>(b, span);
        if (fast_center_ok<T>(ctr)) {
          TileSums sums;
          for (int tid = 0; tid < kThreads; ++tid) {
            combine_sums(sums, hist ? fast_thread_sums<T, kStrided>(b, span, tid, ctr, Bins::make(bins.data(), tid))
                                    : fast_thread_sums<T, kStrided>(b, span, tid, ctr, NoFields{}));
          }
          if (hist) {  // settle_from_table's sums, lane by lane
            const Bins table = Bins::make(bins.data(), 0);
            settle_by_fields<T>(sums, static_cast<float>(table.total(0)),
                                static_cast<float>(table.total(Binning<T>::kFields - 1)),
                                static_cast<float>(span.end - span.begin));
          }
          walked = true;
          slow = !fast_partial<T>(sums, ctr, span.end - span.begin, p);
        }
        if (slow) {
          p = empty_partial();
          ++call.tiles_again;
          ++call.again_by_row[t.row];
        }
        ++call.tiles_fast;
        ++call.fast_by_row[t.row];
      }
    }
    for (int tid = 0; slow && tid < kThreads; ++tid) {
      const Bins fields = Bins::make(bins.data(), tid);
      const Bins counted = walked ? fields.muted() : fields;
      combine(p, hist ? thread_partial<T, kStrided>(b, span, tid, lim, counted)
                      : thread_partial<T, kStrided>(b, span, tid, lim));
    }
    for (int tid = 0; hist && tid < kThreads; ++tid) {
      Bins::make(bins.data(), tid).flush(b.h, t, tid);
    }
    int64_t* row = call.out.data() + static_cast<int64_t>(t.row) * kNumFields;
    if (span.tiles == 1) {
      repeat(p, t.repeat);
      store(p, row);
      continue;
    }
    Partial* slots = call.partials.data() + b.h.slot_base + t.first_tile;
    slots[g - t.first_tile] = p;
    if (++call.counters[t.row] == span.tiles) {
      Partial q = empty_partial();
      for (int k = 0; k < span.tiles; ++k) combine(q, slots[k]);
      repeat(q, t.repeat);
      store(q, row);
    }
  }
}

template <typename T>
void emulate_type(const std::vector<ScanInput>& inputs, const LaunchHeader& h,
                  int64_t& slot_cursor, EmulatedCall& call) {
  plan_launches(
      inputs.data(), static_cast<int64_t>(inputs.size()), sizeof(T), h,
      slot_cursor,
      [&](const ContigBatch& b) { emulate_launch<T, false>(b, call); },
      [&](const StridedBatch& b) { emulate_launch<T, true>(b, call); });
}

template <typename T>
TypeOps ops_of() {
  TypeOps o;
  o.name = Traits<T>::name;
  o.elem_size = sizeof(T);
  o.floating = Format<T>::kFloating;
  o.fields = reference_fields<T>();
  o.applies = mix_applies<T>;
  o.fill = [](Case& c, Mix mix, Rng& rng, int64_t n) {
    const std::vector<T> v = make_values<T>(n, mix, rng);
    c.host.resize(n * sizeof(T));
    std::memcpy(c.host.data(), v.data(), n * sizeof(T));
  };
  o.reference = reference_of<T>;
  o.fast_limits = fast_limits_for<T>;
  o.launch = launch_type<T>;
  o.emulate = emulate_type<T>;
  return o;
}

// One per dtype of the table, in its order.
std::vector<TypeOps> all_types() {
#define ZEROSCAN_OPS(name, S, value_t, tiny, eps) ops_of<S>(),
  return {ZEROSCAN_DTYPES(ZEROSCAN_OPS)};
#undef ZEROSCAN_OPS
}

// The test's own tiny and eps (Traits) against the dtype table, the
// table's value type against Format<S>::value, and the test's own field
// count against the histogram's (csrc/histogram.h).
template <typename S, typename value_t>
int check_table_entry(const char* name, double tiny, double eps) {
  const bool ok =
      Traits<S>::tiny() == tiny && Traits<S>::eps() == eps &&
      std::is_same_v<decltype(Format<S>::value(S{})), value_t>;
  if (!ok) {
    std::printf("FAIL dtype table %s (%s): tiny %g eps %g, test has %g %g\n",
                name, Traits<S>::name, tiny, eps, Traits<S>::tiny(),
                Traits<S>::eps());
  }
  const bool fields_ok = Binning<S>::kFields == reference_fields<S>() &&
                         Binning<S>::kFields <= kMaxFields;
  if (!fields_ok) {
    std::printf("FAIL histogram fields %s (%s): Binning has %d, test has %lld\n",
                name, Traits<S>::name, Binning<S>::kFields,
                static_cast<long long>(reference_fields<S>()));
  }
  return (ok ? 0 : 1) + (fields_ok ? 0 : 1);
}

int check_table() {
  int bad = 0;
#define ZEROSCAN_CHECK(name, S, value_t, tiny, eps) \
  bad += check_table_entry<S, value_t>(#name, tiny, eps);
  ZEROSCAN_DTYPES(ZEROSCAN_CHECK)
#undef ZEROSCAN_CHECK
  return bad;
}

// A view (sizes, strides, offset) of a storage of `storage` elements.
struct View {
  std::string name;
  int64_t storage;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
};

// The layouts the launcher meets, for a tensor of about n elements.
std::vector<View> views_for(int64_t n, bool big) {
  std::vector<View> v;
  v.push_back({"contiguous", n, 0, {n}, {1}});
  v.push_back({"misaligned", n + 3, 1, {n}, {1}});
  if (big) {
    v.push_back({"sliced", 2 * n, 0, {n}, {2}});
    return v;
  }
  v.push_back({"sliced", 2 * n + 1, 1, {n}, {2}});
  if (n >= 5) {
    const int64_t rows = n / 5;
    v.push_back({"short_rows", rows * 5, 1 % (rows * 5), {rows, 3}, {5, 1}});
  }
  // Rows with gaps after them: a strided walk's groups of 32 positions a
  // lane cross rows (100) or stay in one for a while (1500).
  for (const int64_t row : {int64_t(100), int64_t(1500)}) {
    if (n >= 2 * row) {
      const int64_t rows = n / row;
      v.push_back({"rows_of_" + std::to_string(row), rows * (row + 7), 2, {rows, row}, {row + 7, 1}});
    }
  }
  if (n >= 8) {
    const int64_t m = n / 8;
    v.push_back({"expanded", m, 0, {8, m}, {0, 1}});
    v.push_back({"expanded_rows", m * 5, 0, {4, m, 3}, {0, 5, 1}});
  }
  if (n >= 24) {
    // [c, a, b] read from an a x b x (c + 1) storage: three dims that do not
    // merge, innermost not the smallest stride in logical order.
    const int64_t c = 3, a = 2, b = std::max<int64_t>(1, n / 6);
    v.push_back({"permuted", a * b * (c + 1), 0, {c, a, b},
                 {1, b * (c + 1), c + 1}});
  }
  if (n >= 8) {
    const int64_t m = n / 2;
    v.push_back({"overlapping", m, 0, {m - 3, 4}, {1, 1}});
  }
  if (n >= 2 * 3 * 2 * 3 * 2 * 2) {
    // Six dimensions, each sliced ::2 so none merge: the deepest walkable.
    const int64_t k = std::max<int64_t>(2, n / 72);
    std::vector<int64_t> sizes = {2, 3, 2, 3, 2, k};
    std::vector<int64_t> strides(6);
    int64_t s = 1;
    for (int d = 5; d >= 0; --d) {
      strides[d] = 2 * s;
      s *= 2 * sizes[d];
    }
    v.push_back({"six_dims", s, 0, sizes, strides});
  }
  return v;
}

// ---- Running one call -------------------------------------------------------

// The tiles of all `cases` together.
int64_t total_tiles_of(const std::vector<Case*>& cases) {
  int64_t total = 0;
  for (const Case* c : cases) total += tiles_of(c->layout, c->elem_size);
  return total;
}

// The launches of one call as stats_many groups them: cases of one type and
// tol, in row order within a group. Calls scan(first case of the group, its
// inputs); an input's first element is at data_of(case).
template <typename DataOf, typename Scan>
void for_each_launch(const std::vector<Case*>& cases, DataOf data_of, Scan scan) {
  const int64_t n = static_cast<int64_t>(cases.size());
  std::vector<bool> done(n, false);
  for (int64_t i = 0; i < n; ++i) {
    if (done[i]) continue;
    std::vector<ScanInput> inputs;
    for (int64_t j = i; j < n; ++j) {
      const Case& c = *cases[j];
      if (done[j] || c.type != cases[i]->type || c.tol != cases[i]->tol) continue;
      done[j] = true;
      inputs.push_back({data_of(c), &c.layout, static_cast<int32_t>(j)});
    }
    scan(*cases[i], inputs);
  }
}

// Exits unless plan_launches gave every tile of the call one partial slot.
void check_slots_numbered(int64_t slot_cursor, int64_t total_tiles) {
  if (slot_cursor != total_tiles) {
    std::fprintf(stderr, "plan_launches numbered %lld tiles, expected %lld\n",
                 static_cast<long long>(slot_cursor),
                 static_cast<long long>(total_tiles));
    std::exit(1);
  }
}

// What one call returns: rows [n, kNumFields], and with a histogram its
// fields [n, width] (width the most fields of the cases' types, as
// new_histogram sizes them).
struct CallResult {
  std::vector<int64_t> fast_by_row, again_by_row;  // --emulate: fast-path tiles, and those summed again
  std::vector<int64_t> rows;
  std::vector<int64_t> hist;  // empty without a histogram
  int64_t width = 0;
};

int64_t hist_width_of(const std::vector<TypeOps>& types, const std::vector<Case*>& cases) {
  int64_t width = 0;
  for (const Case* c : cases) width = std::max(width, types[c->type].fields);
  return width;
}

// Scans `cases` in one call (as stats_many does, or with `with_hist` as
// stats_many_hist does) and returns their rows (and histogram).
CallResult run_call(const std::vector<TypeOps>& types, const std::vector<Case*>& cases,
                    int grid, bool with_hist = false) {
  const int64_t n = static_cast<int64_t>(cases.size());
  const int64_t total_tiles = total_tiles_of(cases);
  CallResult result;
  int64_t* out = nullptr;
  Partial* partials = nullptr;
  int32_t* counters = nullptr;
  int64_t* hist = nullptr;
  CHECK_CUDA(cudaMalloc(&out, n * kNumFields * sizeof(int64_t)));
  CHECK_CUDA(cudaMemset(out, 0xff, n * kNumFields * sizeof(int64_t)));
  if (total_tiles > n) {
    CHECK_CUDA(cudaMalloc(&partials, total_tiles * sizeof(Partial)));
    CHECK_CUDA(cudaMalloc(&counters, n * sizeof(int32_t)));
    CHECK_CUDA(cudaMemsetAsync(counters, 0, n * sizeof(int32_t), 0));
  }
  if (with_hist) {
    result.width = hist_width_of(types, cases);
    CHECK_CUDA(cudaMalloc(&hist, std::max<size_t>(1, n * result.width * sizeof(int64_t))));
    CHECK_CUDA(cudaMemsetAsync(hist, 0, n * result.width * sizeof(int64_t), 0));
  }
  int64_t slot_cursor = 0;
  const auto on_device = [](const Case& c) -> const void* {
    return static_cast<const uint8_t*>(c.device) + c.offset * c.elem_size;
  };
  for_each_launch(cases, on_device, [&](const Case& first, const std::vector<ScanInput>& inputs) {
    LaunchHeader h;
    h.limits = first.limits;
    h.fast = types[first.type].fast_limits(first.limits);
    h.out = out;
    h.partials = partials;
    h.counters = counters;
    h.hist = hist;
    h.hist_width = result.width;
    types[first.type].launch(inputs, h, slot_cursor, grid);
  });
  check_slots_numbered(slot_cursor, total_tiles);
  CHECK_CUDA(cudaDeviceSynchronize());
  result.rows.resize(n * kNumFields);
  CHECK_CUDA(cudaMemcpy(result.rows.data(), out, result.rows.size() * sizeof(int64_t),
                        cudaMemcpyDeviceToHost));
  if (with_hist) {
    result.hist.resize(n * result.width);
    CHECK_CUDA(cudaMemcpy(result.hist.data(), hist, result.hist.size() * sizeof(int64_t),
                          cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(hist));
  }
  CHECK_CUDA(cudaFree(out));
  if (partials != nullptr) CHECK_CUDA(cudaFree(partials));
  if (counters != nullptr) CHECK_CUDA(cudaFree(counters));
  return result;
}

// run_call's twin for --emulate: host buffers, CPU threads of execution.
CallResult emulate_call(const std::vector<TypeOps>& types, const std::vector<Case*>& cases,
                        bool with_hist = false) {
  const int64_t n = static_cast<int64_t>(cases.size());
  const int64_t total_tiles = total_tiles_of(cases);
  const int64_t width = with_hist ? hist_width_of(types, cases) : 0;
  EmulatedCall call;
  call.out.assign(n * kNumFields, -1);
  call.partials.resize(total_tiles);
  call.counters.assign(n, 0);
  call.hist.assign(n * width, 0);
  call.fast_by_row.assign(n, 0);
  call.again_by_row.assign(n, 0);
  int64_t slot_cursor = 0;
  const auto on_host = [](const Case& c) -> const void* {
    return c.host.data() + c.offset * c.elem_size;
  };
  for_each_launch(cases, on_host, [&](const Case& first, const std::vector<ScanInput>& inputs) {
    LaunchHeader h;
    h.limits = first.limits;
    h.fast = types[first.type].fast_limits(first.limits);
    h.hist = with_hist ? call.hist.data() : nullptr;
    h.hist_width = width;
    types[first.type].emulate(inputs, h, slot_cursor, call);
  });
  check_slots_numbered(slot_cursor, total_tiles);
  std::printf("emulated call%s: %lld tiles on the fast path, %lld of them summed again by Tally\n",
              with_hist ? " with histograms" : "", static_cast<long long>(call.tiles_fast),
              static_cast<long long>(call.tiles_again));
  CallResult result;
  result.rows = std::move(call.out);
  result.hist = std::move(call.hist);
  result.width = width;
  result.fast_by_row = std::move(call.fast_by_row);
  result.again_by_row = std::move(call.again_by_row);
  return result;
}

// ---- Checks ------------------------------------------------------------------

int failures = 0;

// The largest errors of the fast path's moments seen so far: |m2 - want| /
// want, and |mean - want| as a fraction of the bound's floor (2e-7 mean |x|
// + 1e-6 std).
struct Worst {
  double m2 = 0.0, mean = 0.0;
  std::string m2_case, mean_case;
} worst_fast;

void fail(const Case& c, const char* field, double got, double want) {
  if (++failures <= 40) {
    std::printf("FAIL %s: %s got %.17g want %.17g\n", c.what.c_str(), field,
                got, want);
  }
}

bool same_double(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) ||
         std::memcmp(&a, &b, sizeof(a)) == 0;
}

void check_row(const Case& c, const int64_t* row) {
  const Partial got = load(row);
  const Partial& want = c.want;
  // Every count column of the row, a new one included (which the reference
  // above must then count too).
  int64_t wanted[kNumFields];
  store(want, wanted);
  for (int k = 0; k < kNumCountFields; ++k) {
    if (row[k] != wanted[k]) {
      const std::string field = "count column " + std::to_string(k);
      fail(c, field.c_str(), static_cast<double>(row[k]), static_cast<double>(wanted[k]));
    }
  }
  if (!same_double(got.min_abs, want.min_abs)) fail(c, "min_abs", got.min_abs, want.min_abs);
  if (!same_double(got.min_abs_nonzero, want.min_abs_nonzero))
    fail(c, "min_abs_nonzero", got.min_abs_nonzero, want.min_abs_nonzero);
  if (!same_double(got.max_abs, want.max_abs)) fail(c, "max_abs", got.max_abs, want.max_abs);
  for (int k = kM2 + 1; k < kNumFields; ++k) {
    if (row[k] != 0) fail(c, "padding", static_cast<double>(row[k]), 0.0);
  }
  // The mean against the compensated sum, by the test suite's own criterion
  // and the README's bound (tests/helpers.py `close`: rtol * |mean| + 1e-12 *
  // mean |x|, rtol 1e-10 for float64 and 1e-6 otherwise), which zero-centred
  // data makes demanding. (A floor of rtol * 1e-6 * mean |x|, 1e-16 for
  // float64, was below the rounding of an ordinary sum of float64 values and
  // failed one mostly-zero float64 case in a few thousand.)
  // Means of subnormal float64 data live on the subnormal grid, where every
  // combine of two partial means rounds by up to one grid step: a few steps
  // of slack.
  const double rtol = c.is_f64 ? 1e-10 : 1e-6;
  const double grid_slack = 256 * std::numeric_limits<double>::denorm_min();
  // The fast path (float32, bfloat16, float16; fast_tally.cuh) sums float32's
  // values with Kahan's compensation (within 2^-23 of the sum of |x|) and
  // the 16-bit types' deviations from the tile's shift in float32 runs
  // (within ~7 * 2^-24 of the sum of |x - shift|, under sqrt(2) times the
  // standard deviation where the tile is kept): the README's bound for them,
  // within rtol plus 2e-7 of the mean |x| plus 1e-6 of the standard deviation.
  const double sd = want.finite() > 0 && std::isfinite(want.m2)
                        ? std::sqrt(want.m2 / static_cast<double>(want.finite()))
                        : 0.0;
  const double floor = c.fast ? 2e-7 * c.mean_abs + 1e-6 * sd : 1e-12 * c.mean_abs;
  if (want.finite() > 0 &&
      std::fabs(got.mean - c.exact_mean) > rtol * std::fabs(c.exact_mean) + floor + grid_slack) {
    fail(c, "mean", got.mean, c.exact_mean);
  }
  // The Tally path widens each value exactly to double and sums it about the
  // thread's shift in double: float64's tolerance for every dtype. The fast
  // path (float32, bfloat16, float16) sums squares in float32 runs (see
  // fast_tally.cuh): the README's bound, std within 1e-6, m2 within 2e-6.
  // The reference sums millions of squared deviations in one sequential
  // double sum, whose own rounding reaches ~1e-11 with integer extremes.
  // m2 is inf when it lies beyond the float64 range, and only then.
  const double m2_rtol = c.fast ? 2e-6 : 1e-9;
  const bool m2_ok = std::isinf(want.m2) || std::isinf(got.m2)
                         ? got.m2 == want.m2
                         : std::fabs(got.m2 - want.m2) <= m2_rtol * want.m2 + 1e-300;
  if (!m2_ok) fail(c, "m2", got.m2, want.m2);
  if (c.fast && want.finite() > 0 && std::isfinite(want.m2) && want.m2 > 0) {
    const double e = std::fabs(got.m2 - want.m2) / want.m2;
    if (e > worst_fast.m2) worst_fast = {e, worst_fast.mean, c.what, worst_fast.mean_case};
  }
  if (c.fast && want.finite() > 1 && c.mean_abs + sd > 0) {
    const double e = std::fabs(got.mean - c.exact_mean) / (2e-7 * c.mean_abs + 1e-6 * sd);
    if (e > worst_fast.mean) worst_fast = {worst_fast.m2, e, worst_fast.m2_case, c.what};
  }
  // The mean of finite values is finite.
  if (want.finite() > 0 && !std::isfinite(got.mean)) fail(c, "mean", got.mean, c.exact_mean);
}

// Case c's histogram fields (`fields`: [width], its row of a histogram
// call) against the reference: its own fields exactly, the rest zero.
// Returns whether they matched.
bool check_fields(const Case& c, const int64_t* fields, int64_t width, const char* how) {
  const int64_t own = static_cast<int64_t>(c.want_fields.size());
  int bad = 0;
  for (int64_t f = 0; f < width; ++f) {
    const int64_t want = f < own ? c.want_fields[f] : 0;
    if (fields[f] != want && ++bad <= 3 && failures < 40) {
      std::printf("FAIL %s: %s histogram field %lld got %lld want %lld\n", c.what.c_str(),
                  how, static_cast<long long>(f), static_cast<long long>(fields[f]),
                  static_cast<long long>(want));
    }
  }
  failures += bad > 0 ? 1 : 0;  // one failure per case, however many fields
  return bad == 0;
}

// The histogram call's result against the reference, and its rows against
// those of the call without it (`plain`), which must be bitwise the same.
// Returns the cases that failed either.
int check_hist_call(const std::vector<Case>& cases, const CallResult& plain,
                    const CallResult& with_hist, const char* how) {
  int bad = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    bool ok = check_fields(cases[i], with_hist.hist.data() + i * with_hist.width,
                           with_hist.width, how);
    if (std::memcmp(plain.rows.data() + i * kNumFields,
                    with_hist.rows.data() + i * kNumFields, kNumFields * 8) != 0) {
      ok = false;
      if (++failures <= 40) {
        std::printf("FAIL %s: %s row differs from the row without the histogram\n",
                    cases[i].what.c_str(), how);
      }
    }
    bad += ok ? 0 : 1;
  }
  return bad;
}

// ---- The exhaustive widening check ----------------------------------------

template <typename T>
__global__ void widen_kernel(const T* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = Format<T>::value(in[i]);
}

// Every bit pattern of T (`patterns` of them), in order.
template <typename T, typename Bits>
std::vector<T> all_patterns(int patterns) {
  std::vector<T> host(patterns);
  for (int b = 0; b < patterns; ++b) host[b] = T{static_cast<Bits>(b)};
  return host;
}

// got[b], the widening of host[b] by the code under test, against the host
// decoding; `pass` ("" or "host ") names which widening it was.
template <typename T>
void compare_widening(const char* pass, const std::vector<T>& host,
                      const std::vector<float>& got) {
  const int patterns = static_cast<int>(host.size());
  int bad = 0;
  for (int b = 0; b < patterns; ++b) {
    const float want = static_cast<float>(host_value(host[b]));
    const bool ok = (std::isnan(want) && std::isnan(got[b])) ||
                    std::memcmp(&want, &got[b], 4) == 0;
    if (!ok && ++bad <= 5) {
      std::printf("FAIL %swiden %s bits 0x%x: got %.9g want %.9g\n", pass,
                  Traits<T>::name, b, got[b], want);
    }
  }
  failures += bad;
  std::printf("%swidening of all %d %s patterns: %s\n", pass, patterns,
              Traits<T>::name, bad ? "MISMATCH" : "exact");
}

// The device's widening of every pattern.
template <typename T, typename Bits>
void check_widening(int patterns) {
  const std::vector<T> host = all_patterns<T, Bits>(patterns);
  T* in = nullptr;
  float* out = nullptr;
  CHECK_CUDA(cudaMalloc(&in, patterns * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&out, patterns * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(in, host.data(), patterns * sizeof(T),
                        cudaMemcpyHostToDevice));
  widen_kernel<T><<<(patterns + 255) / 256, 256>>>(in, out, patterns);
  CHECK_CUDA(cudaGetLastError());
  std::vector<float> got(patterns);
  CHECK_CUDA(cudaMemcpy(got.data(), out, patterns * sizeof(float),
                        cudaMemcpyDeviceToHost));
  compare_widening("", host, got);
  CHECK_CUDA(cudaFree(in));
  CHECK_CUDA(cudaFree(out));
}

// The host pass of the same widening code (what --emulate runs).
template <typename T, typename Bits>
void check_host_widening(int patterns) {
  const std::vector<T> host = all_patterns<T, Bits>(patterns);
  std::vector<float> got(patterns);
  for (int b = 0; b < patterns; ++b) got[b] = Format<T>::value(host[b]);
  compare_widening("host ", host, got);
}

// ---- The fast path's classes against Tally's ---------------------------------

// The counts and key extremes of one element as the fast path finds them
// (a tally of that element alone) and as Tally does. A bfloat16 beyond 2^121
// is the fast path's to hand back (its square overflows), not to count.
// A 16-bit element sits in lane `lane` of its word.
template <typename T>
TileSums fast_sums_of(T x, int lane, const FastLimits& k) {
  const TileCenter ctr = make_center(0.0f, 0.0f, 0.0f);
  if constexpr (std::is_same_v<T, float>) {
    FastTally<float> f;
    f.add(x, k, ctr, 0);
    f.end_group();
    return f.finish(1);
  } else {
    FastTally16<T> f;
    f.lone(x.bits, lane, k, ctr);
    f.end_group();
    return f.finish(1);
  }
}

// Every pattern of a 16-bit type, or for float32 every exponent with its
// extreme and some random mantissas, against Tally, for several tols. Exits
// with a message on the first mismatch; returns the patterns checked.
template <typename T>
int64_t check_fast_classes(Rng& rng) {
  using F = Format<T>;
  const double tiny = Traits<T>::tiny(), eps = Traits<T>::eps();
  std::vector<double> tols = {eps, 0.0, tiny, tiny / 3, 1.0, 1e-3, 0.3};
  for (int k = 0; k < 8; ++k) tols.push_back(std::ldexp(1.0 + rng.uniform(), static_cast<int>(rng.range(-30, 20))));
  // About the top of each type's scaled view (fast_limits_for), which a tol
  // it takes must stay below.
  for (double edge : {0x1.8p103, 0x1.8p104, 0x1.8p40, 0x1.8p41, 0x1.8p42, 63.0, 64.0}) tols.push_back(edge);
  std::vector<uint32_t> patterns;
  if constexpr (sizeof(T) == 2) {
    for (uint32_t b = 0; b < (1u << 16); ++b) patterns.push_back(b);
  } else {
    for (uint32_t e = 0; e < 256; ++e) {
      for (uint32_t m : {0u, 1u, 2u, 0x400000u, 0x7ffffeu, 0x7fffffu}) patterns.push_back(e << 23 | m);
      for (int r = 0; r < 16; ++r) patterns.push_back(e << 23 | static_cast<uint32_t>(rng.bits() & 0x7fffff));
    }
    const size_t positive = patterns.size();
    for (size_t i = 0; i < positive; ++i) patterns.push_back(patterns[i] | 0x80000000u);
  }
  // The default tol (eps) and every bound must keep the fast path on: a bound
  // it cannot count exactly would send every launch of T to Tally.
  if (!fast_limits_for<T>(limits_for<T>(tiny, eps)).on) {
    std::printf("FAIL fast classes %s: the fast path is off at the default tol\n", Traits<T>::name);
    std::exit(1);
  }
  int64_t checked = 0;
  uint32_t flip = 0;  // the lane of pattern b is (b + flip) & 1: both lanes over the tols
  for (double tol : tols) {
    ++flip;
    const Limits lim = limits_for<T>(tiny, tol);
    const FastLimits k = fast_limits_for<T>(lim);
    if (!k.on) continue;  // such a tol takes the Tally path
    for (uint32_t b : patterns) {
      T x;
      std::memcpy(&x, &b, sizeof(T));
      const TileSums got = fast_sums_of(x, static_cast<int>((b + flip) & 1u), k);
      Tally<T, uint32_t> want;
      want.add(x, lim, 0.0);
      const Partial w = want.finish(0.0);
      const uint32_t key = static_cast<uint32_t>(F::key(x));
      const bool huge = std::is_same_v<T, bf16_t> && key >= 0x7c00u && key < 0x7f80u;
      if (huge) {
        // Summed about a shift of 0 at scale 1 (a sample below 2^57): its
        // square overflows, and fast_partial hands the tile to Tally.
        if (std::isfinite(got.s2)) {
          std::printf("FAIL fast classes %s %#x: a value beyond 2^121 not handed back\n", Traits<T>::name, b);
          std::exit(1);
        }
        continue;
      }
      const int64_t g[6] = {static_cast<int64_t>(got.zeros),
                            static_cast<int64_t>(got.at_most_sub) - static_cast<int64_t>(got.zeros),
                            1 - static_cast<int64_t>(got.non_nan),
                            static_cast<int64_t>(got.non_nan) - static_cast<int64_t>(got.finite) - static_cast<int64_t>(got.neginf),
                            static_cast<int64_t>(got.neginf), static_cast<int64_t>(got.negative)};
      const int64_t wv[6] = {w.zeros, w.subnormal, w.nan, w.posinf, w.neginf, w.negative};
      const char* names[6] = {"zeros", "subnormal", "nan", "posinf", "neginf", "negative"};
      for (int m = 0; m < kNumBounds; ++m) {  // every magnitude count (classify.h)
        if (static_cast<int64_t>(got.at_most[m]) != static_cast<int64_t>(want.at_most[m])) {
          std::printf("FAIL fast classes %s %#x tol %g: at most bound %d: %lld, Tally %lld\n", Traits<T>::name,
                      b, tol, m, static_cast<long long>(got.at_most[m]), static_cast<long long>(want.at_most[m]));
          std::exit(1);
        }
      }
      for (int f = 0; f < 6; ++f) {
        if (g[f] != wv[f]) {
          std::printf("FAIL fast classes %s %#x tol %g: %s %lld, Tally %lld\n", Traits<T>::name, b, tol, names[f],
                      static_cast<long long>(g[f]), static_cast<long long>(wv[f]));
          std::exit(1);
        }
      }
      const bool nonzero = w.numel - w.nan - w.zeros > 0;
      if (w.nan == 0 && got.hi != key) {
        std::printf("FAIL fast classes %s %#x: greatest key %#x\n", Traits<T>::name, b, got.hi);
        std::exit(1);
      }
      // 16-bit: a lone key of 0x7bff and above is settled later (fast_partial).
      const bool settled_later = sizeof(T) == 2 && key >= 0x7bffu;
      if (w.nan == 0 && nonzero && !settled_later && got.lo != key) {
        std::printf("FAIL fast classes %s %#x: least nonzero key %#x\n", Traits<T>::name, b, got.lo);
        std::exit(1);
      }
      ++checked;
    }
  }
  return checked;
}

// Per dtype and value mix, the fast path's tiles that Tally summed again
// (a second pass over their memory): the mixes that stand for data users
// have should need none.
void report_again(const std::vector<TypeOps>& types, const std::vector<Case>& cases,
                  const CallResult& call) {
  std::printf("fast-path tiles summed again by Tally, by dtype and mix (again / fast):\n");
  for (size_t t = 0; t < types.size(); ++t) {
    std::string line;
    for (int m = 0; m <= static_cast<int>(kLastMix); ++m) {
      int64_t fast = 0, again = 0;
      for (size_t i = 0; i < cases.size(); ++i) {
        if (cases[i].type != static_cast<int>(t) || static_cast<int>(cases[i].mix) != m) continue;
        fast += call.fast_by_row[i];
        again += call.again_by_row[i];
      }
      if (fast == 0) continue;
      line += " " + std::string(mix_name(static_cast<Mix>(m))) + " " + std::to_string(again) + "/" +
              std::to_string(fast);
    }
    if (!line.empty()) std::printf("  %s:%s\n", types[t].name, line.c_str());
  }
}

int run(uint64_t seed, bool large, bool small, bool emulate) {
  std::printf("seed %llu%s\n", static_cast<unsigned long long>(seed),
              emulate ? " (emulating the kernels on the CPU)" : "");
  Rng rng{std::mt19937_64(seed)};

  if (emulate) {
    check_host_widening<f16_t, uint16_t>(1 << 16);
    check_host_widening<bf16_t, uint16_t>(1 << 16);
    check_host_widening<e4m3_t, uint8_t>(1 << 8);
    check_host_widening<e5m2_t, uint8_t>(1 << 8);
  } else {
    check_widening<f16_t, uint16_t>(1 << 16);
    check_widening<bf16_t, uint16_t>(1 << 16);
    check_widening<e4m3_t, uint8_t>(1 << 8);
    check_widening<e5m2_t, uint8_t>(1 << 8);
  }

  failures += check_table();
  {
    const int64_t checked =
        check_fast_classes<float>(rng) + check_fast_classes<bf16_t>(rng) + check_fast_classes<f16_t>(rng);
    std::printf("the fast path's classes and key extremes of %lld patterns x tols: those of Tally\n",
                static_cast<long long>(checked));
  }

  const std::vector<TypeOps> types = all_types();
  std::vector<Case> cases;
  // Sizes that fill whole 16-byte vectors and whole unrolled groups of every
  // element size (16, 16384 = kUnroll * kThreads * 16 one-byte elements, and
  // 1 << 20, whole tiles), and sizes that leave ragged heads and tails (the
  // views below add misaligned starts, slices and strided layouts).
  const std::vector<int64_t> small_sizes = {1,     7,     16,    300,
                                            4099,  16384, 49157, 70001};
  const std::vector<Mix> all_mixes =
      small ? std::vector<Mix>{Mix::kSpecials, Mix::kHalfZeros,
                               Mix::kAllSubnormal, Mix::kSomeNonfinite}
            : std::vector<Mix>{
                  Mix::kNormal,      Mix::kSpecials,     Mix::kBits,
                  Mix::kHalfZeros,   Mix::kMostlyZeros,  Mix::kAllZeros,
                  Mix::kAllSubnormal, Mix::kSomeSubnormal, Mix::kSomeNonfinite,
                  Mix::kOutliers,    Mix::kNearMax,      Mix::kConstantHuge,
                  Mix::kOneHuge,     Mix::kMixedExponents};
  struct Big {
    int64_t n;
    std::vector<Mix> mixes;
  };
  const std::vector<Big> big_sizes = {
      {1000003, {Mix::kNormal, Mix::kSpecials, Mix::kSomeNonfinite, Mix::kOutliers,
                 Mix::kNearMax, Mix::kOneHuge, Mix::kMixedExponents}},
      {int64_t(1) << 20, {Mix::kHalfZeros, Mix::kSomeSubnormal}},
      {5000000, {Mix::kNormal, Mix::kMostlyZeros}}};
  for (int t = 0; t < static_cast<int>(types.size()); ++t) {
    const bool is_float = types[t].floating;
    auto add = [&](const View& v, Mix mix, double tol) {
      if (!types[t].applies(mix)) return;
      Case c;
      c.type = t;
      c.elem_size = types[t].elem_size;
      c.offset = v.offset;
      c.sizes = v.sizes;
      c.strides = v.strides;
      c.tol = tol;
      c.mix = mix;
      types[t].fill(c, mix, rng, v.storage);
      c.layout = plan_layout(c.sizes.data(), c.strides.data(),
                             static_cast<int>(c.sizes.size()));
      c.what = std::string(types[t].name) + " " + v.name + " n=" +
               std::to_string(c.layout.numel * c.layout.repeat) + " " +
               mix_name(mix) + (tol >= 0 ? " tol=" + std::to_string(tol) : "");
      cases.push_back(std::move(c));
    };
    for (int64_t n : small_sizes) {
      for (const View& v : views_for(n, false)) {
        for (Mix mix : all_mixes) add(v, mix, -1.0);
      }
    }
    for (const Big& b : big_sizes) {
      if (small) break;
      for (const View& v : views_for(b.n, true)) {
        for (Mix mix : b.mixes) add(v, mix, -1.0);
      }
    }
    add({"contiguous", 4099, 0, {4099}, {1}}, Mix::kSpecials, is_float ? 0.05 : 7.0);
    add({"contiguous", 300, 0, {300}, {1}}, Mix::kSpecials, 0.0);
    if (!small) add({"contiguous", 1000003, 0, {1000003}, {1}}, Mix::kShifted, -1.0);
    add({"sliced", 2 * 70001, 1, {70001}, {2}}, Mix::kShifted, -1.0);
    add({"scalar", 1, 0, {}, {}}, Mix::kNormal, -1.0);
    add({"empty", 0, 0, {0}, {1}}, Mix::kNormal, -1.0);
    add({"empty2d", 0, 0, {3, 0}, {0, 1}}, Mix::kNormal, -1.0);
  }
  if (large) {
    // More tiles than kMaxTiles at the minimum tile size: the tile grows.
    cases.push_back(Case());
    Case& c = cases.back();
    const int64_t n = kMaxTiles * (kMinTileBytes / 4) + 12345;
    c.type = 0;
    c.elem_size = 4;
    c.sizes = {n};
    c.strides = {1};
    types[0].fill(c, Mix::kSpecials, rng, n);
    c.layout = plan_layout(c.sizes.data(), c.strides.data(), 1);
    c.what = "float32 large n=" + std::to_string(n);
  }

  for (Case& c : cases) {
    if (!walkable(c.layout)) {
      std::printf("FAIL %s: layout not walkable\n", c.what.c_str());
      return 1;
    }
    types[c.type].reference(c);
  }
  std::printf("%zu cases over %zu types\n", cases.size(), types.size());
  std::vector<Case*> all;
  for (Case& c : cases) all.push_back(&c);

  if (emulate) {
    const CallResult plain = emulate_call(types, all);
    for (size_t i = 0; i < cases.size(); ++i) {
      check_row(cases[i], plain.rows.data() + i * kNumFields);
    }
    std::printf("emulated kernels against the CPU reference: %d mismatches\n",
                failures);
    std::printf("fast path, largest errors: m2 %.3g of m2 (%s), mean %.3g of its floor (%s)\n",
                worst_fast.m2, worst_fast.m2_case.c_str(), worst_fast.mean,
                worst_fast.mean_case.c_str());
    report_again(types, cases, plain);
    const CallResult with_hist = emulate_call(types, all, true);
    const int hist_bad = check_hist_call(cases, plain, with_hist, "emulated");
    std::printf("emulated histograms (width %lld) against the CPU reference, rows "
                "against those without: %d cases differ\n",
                static_cast<long long>(with_hist.width), hist_bad);
    std::printf("%s (emulated; nothing ran on a GPU): %d failures\n",
                failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
  }

  for (Case& c : cases) {
    CHECK_CUDA(cudaMalloc(&c.device, std::max<size_t>(1, c.host.size())));
    CHECK_CUDA(cudaMemcpy(c.device, c.host.data(), c.host.size(),
                          cudaMemcpyHostToDevice));
  }

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int grid = prop.multiProcessorCount * 32;

  // 1. All cases in one call, as stats_many does.
  const CallResult together = run_call(types, all, grid);
  for (size_t i = 0; i < cases.size(); ++i) {
    check_row(cases[i], together.rows.data() + i * kNumFields);
  }
  const int reference_failures = failures;
  std::printf("against the CPU reference: %d mismatches\n", reference_failures);
  std::printf("fast path, largest errors: m2 %.3g of m2 (%s), mean %.3g of its floor (%s)\n",
              worst_fast.m2, worst_fast.m2_case.c_str(), worst_fast.mean,
              worst_fast.mean_case.c_str());

  // 2. Bitwise identical alone, with a one-block grid, and when repeated.
  const CallResult one_block = run_call(types, all, 1);
  const CallResult again = run_call(types, all, grid);
  int unstable = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const CallResult alone = run_call(types, {&cases[i]}, grid);
    const int64_t* row = together.rows.data() + i * kNumFields;
    const bool same =
        std::memcmp(row, alone.rows.data(), kNumFields * 8) == 0 &&
        std::memcmp(row, one_block.rows.data() + i * kNumFields, kNumFields * 8) == 0 &&
        std::memcmp(row, again.rows.data() + i * kNumFields, kNumFields * 8) == 0;
    if (!same && ++unstable <= 10) {
      std::printf("FAIL %s: row differs between calls (alone / one block / "
                  "repeated)\n", cases[i].what.c_str());
    }
  }
  failures += unstable;
  std::printf("bitwise repeatability: %d rows differ\n", unstable);

  // 3. With the histogram, as stats_many_hist does: the fields exact, the
  // rows bitwise those without it, over the full grid (many blocks adding
  // to one tensor's fields) and a one-block grid (one block's table flushed
  // tile after tile, moving from tensor to tensor).
  const CallResult hist_grid = run_call(types, all, grid, true);
  const CallResult hist_one_block = run_call(types, all, 1, true);
  const int hist_bad = check_hist_call(cases, together, hist_grid, "full grid") +
                       check_hist_call(cases, together, hist_one_block, "one block");
  std::printf("histograms (width %lld) against the CPU reference, rows against those "
              "without: %d cases differ\n",
              static_cast<long long>(hist_grid.width), hist_bad);

  for (Case& c : cases) CHECK_CUDA(cudaFree(c.device));
  std::printf("%s: %d failures\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}

}  // namespace
}  // namespace cuda
}  // namespace zeroscan

int main(int argc, char** argv) {
  bool skip_without_gpu = false;
  bool large = false;
  bool small = false;
  bool emulate = false;
  uint64_t seed = std::random_device()();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--skip-without-gpu") {
      skip_without_gpu = true;
    } else if (arg == "--large") {
      large = true;
    } else if (arg == "--small") {
      small = true;
    } else if (arg == "--emulate") {
      emulate = true;
    } else if (arg == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--seed N] [--large | --small] [--emulate] "
                   "[--skip-without-gpu]\n",
                   argv[0]);
      return 2;
    }
  }
  if (large && small) {
    std::fprintf(stderr, "%s: --large and --small exclude each other\n", argv[0]);
    return 2;
  }
  if (emulate) return zeroscan::cuda::run(seed, large, small, true);
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("no usable CUDA device (%s): the kernels were NOT run\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return skip_without_gpu ? 0 : 2;
  }
  return zeroscan::cuda::run(seed, large, small, false);
}
