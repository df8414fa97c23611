// A torch-free check of the CUDA scan kernels against a CPU reference.
//
// Build (see .ci/cuda_check.sh):
//   nvcc -std=c++20 -DZEROSCAN_STANDALONE_TEST -Icsrc \
//        csrc/cuda/standalone_test.cu csrc/cuda/stats_cuda_*.cu -o standalone_test
// Run: standalone_test [--seed N] [--large] [--emulate] [--skip-without-gpu]
//
// For every storage type it builds tensors of many sizes, layouts and value
// mixes, scans them on the GPU through the same launch plan the torch
// launcher uses (plan_launches), and checks each result row against a CPU
// reference: one ScalarAccumulator (csrc/classify.h) over the elements,
// widened by host code written independently of the device widening. Counts
// and min/max |x| must match exactly, mean and m2 closely. It also checks
// that a row is bitwise the same whether its tensor is scanned alone, with
// all the others in one call, with a one-block grid, or a second time, and
// that the device widening of every float16/bfloat16/float8 bit pattern is
// exact. Exits 1 on any mismatch. With no usable GPU it says so and exits 2,
// or 0 when given --skip-without-gpu.
//
// --emulate needs no GPU: it runs the kernels' per-thread code (which is
// __host__ __device__) on the CPU, thread by thread and tile by tile, through
// the same launch plan, and checks it against the same reference. That
// covers the tiling, the tile-to-tensor lookup, the vector and strided walks,
// the fast path and the widening; it does not cover the block reduction, the
// atomics and fences of the last-block combine, or real launches.
//
// The whole file is inside ZEROSCAN_STANDALONE_TEST so that a build which
// globs csrc/cuda/*.cu into the extension compiles it to nothing.
#if defined(ZEROSCAN_STANDALONE_TEST)

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
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "stats_cuda.cuh"

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

float host_value(float x) { return x; }
double host_value(double x) { return x; }
float host_value(f16_t v) { return static_cast<float>(decode_f16(v.bits)); }
float host_value(bf16_t v) { return static_cast<float>(decode_bf16(v.bits)); }
float host_value(e4m3_t v) { return static_cast<float>(decode_e4m3(v.bits)); }
float host_value(e5m2_t v) { return static_cast<float>(decode_e5m2(v.bits)); }
double host_value(bool_t v) { return v.bits ? 1.0 : 0.0; }
double host_value(uint8_t x) { return x; }
double host_value(int8_t x) { return x; }
double host_value(int16_t x) { return x; }
double host_value(int32_t x) { return x; }
double host_value(int64_t x) { return static_cast<double>(x); }

// ---- Value generation ------------------------------------------------------

enum class Mix {
  kNormal,    // finite, nonzero, normal values only: the kernels' fast path
  kSpecials,  // plus ~2% zeros, subnormals, near-zero values, NaN and +-inf
  kBits,      // uniformly random bit patterns (every class of value)
  kShifted,   // 1000 + 1e-3 * randn: the moments' cancellation test
};

const char* mix_name(Mix m) {
  switch (m) {
    case Mix::kNormal: return "normal";
    case Mix::kSpecials: return "specials";
    case Mix::kBits: return "bits";
    case Mix::kShifted: return "shifted";
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

// Floating types: (name, tiny, eps, conversion from double).
template <>
struct Traits<float> {
  static constexpr const char* name = "float32";
  static double tiny() { return FLT_MIN; }
  static double eps() { return std::ldexp(1.0, -23); }
  static float from(double v) { return static_cast<float>(v); }
  static float from_bits(uint64_t b) {
    const uint32_t u = static_cast<uint32_t>(b);
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
template <>
struct Traits<double> {
  static constexpr const char* name = "float64";
  static double tiny() { return DBL_MIN; }
  static double eps() { return std::ldexp(1.0, -52); }
  static double from(double v) { return v; }
  static double from_bits(uint64_t b) {
    double f;
    std::memcpy(&f, &b, 8);
    return f;
  }
};
template <>
struct Traits<f16_t> {
  static constexpr const char* name = "float16";
  static double tiny() { return std::ldexp(1.0, -14); }
  static double eps() { return std::ldexp(1.0, -10); }
  static f16_t from(double v) {
    const __half h = __float2half_rn(static_cast<float>(v));
    f16_t out;
    std::memcpy(&out.bits, &h, 2);
    return out;
  }
  static f16_t from_bits(uint64_t b) { return f16_t{static_cast<uint16_t>(b)}; }
};
template <>
struct Traits<bf16_t> {
  static constexpr const char* name = "bfloat16";
  static double tiny() { return std::ldexp(1.0, -126); }
  static double eps() { return std::ldexp(1.0, -7); }
  static bf16_t from(double v) {
    const __nv_bfloat16 h = __float2bfloat16_rn(static_cast<float>(v));
    bf16_t out;
    std::memcpy(&out.bits, &h, 2);
    return out;
  }
  static bf16_t from_bits(uint64_t b) { return bf16_t{static_cast<uint16_t>(b)}; }
};
template <>
struct Traits<e4m3_t> {
  static constexpr const char* name = "float8_e4m3fn";
  static double tiny() { return std::ldexp(1.0, -6); }
  static double eps() { return std::ldexp(1.0, -3); }
  static e4m3_t from(double v) {
    return e4m3_t{__nv_cvt_float_to_fp8(static_cast<float>(v), __NV_NOSAT,
                                        __NV_E4M3)};
  }
  static e4m3_t from_bits(uint64_t b) { return e4m3_t{static_cast<uint8_t>(b)}; }
};
template <>
struct Traits<e5m2_t> {
  static constexpr const char* name = "float8_e5m2";
  static double tiny() { return std::ldexp(1.0, -14); }
  static double eps() { return std::ldexp(1.0, -2); }
  static e5m2_t from(double v) {
    return e5m2_t{__nv_cvt_float_to_fp8(static_cast<float>(v), __NV_NOSAT,
                                        __NV_E5M2)};
  }
  static e5m2_t from_bits(uint64_t b) { return e5m2_t{static_cast<uint8_t>(b)}; }
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

template <typename T>
std::vector<T> make_values(int64_t n, Mix mix, Rng& rng) {
  using Tr = Traits<T>;
  std::vector<T> out(n);
  if constexpr (is_float_type<T>()) {
    // fp8 ranges are small: keep normal data well inside them.
    const double big = sizeof(T) == 1 ? 1.0 : 2.0;
    const double scale = std::pow(10.0, big * (2.0 * rng.uniform() - 1.0));
    const double loc = rng.uniform() < 0.5 ? 0.0 : scale * rng.normal();
    for (int64_t i = 0; i < n; ++i) {
      if (mix == Mix::kBits && sizeof(T) <= 2) {
        out[i] = Tr::from_bits(rng.bits());
        continue;
      }
      if (mix == Mix::kShifted) {
        out[i] = Tr::from(1000.0 + 1e-3 * rng.normal());
        continue;
      }
      double v = loc + scale * rng.normal();
      if (mix == Mix::kNormal) {
        // Finite, nonzero and normal once rounded to T: redraw until so.
        for (;;) {
          const double a = std::fabs(static_cast<double>(host_value(Tr::from(v))));
          if (a >= Tr::tiny() && a > 0.0 && std::isfinite(a)) break;
          v = loc + scale * rng.normal();
        }
      } else if (rng.uniform() < 0.02) {
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
    for (int64_t i = 0; i < n; ++i) {
      int64_t v = rng.range(lo, hi);
      if (mix != Mix::kNormal && rng.uniform() < 0.02) {
        const int64_t pick = rng.range(0, 2);
        v = pick == 0 ? 0 : pick == 1 ? Tr::lo : Tr::hi;
      }
      if (mix == Mix::kNormal && v == 0) v = hi;
      out[i] = Tr::from_int(v);
    }
  }
  return out;
}

// The largest acc_t <= v, as op_common.h's thresholds_for does it.
template <typename acc_t>
Thresholds<acc_t> host_thresholds(double tiny, double tol) {
  acc_t r = static_cast<acc_t>(tol);
  if (static_cast<double>(r) > tol) r = std::nextafter(r, acc_t(0));
  Thresholds<acc_t> th;
  th.tiny = to_bits(static_cast<acc_t>(tiny));
  th.tol = to_bits(r);
  return th;
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
  uint64_t tiny_bits = 0, tol_bits = 0;
  Partial want;
  bool double_acc = false;
  bool is_f64 = false;
  double exact_mean = 0.0;  // of the finite values, from a compensated sum
  double mean_abs = 0.0;    // of the finite values
};

// The state the emulated kernels share, like the device buffers of a call.
struct EmulatedCall {
  std::vector<Partial> partials;
  std::vector<int32_t> counters;
  std::vector<int64_t> out;
};

// One storage type's functions, reached through the type index of a case.
struct TypeOps {
  const char* name;
  int64_t elem_size;
  std::function<void(Case&, Mix, Rng&, int64_t)> fill;  // storage elements
  std::function<void(Case&)> reference;
  std::function<void(const std::vector<ScanInput>&, const LaunchHeader&,
                     int64_t&, int)>
      launch;
  std::function<void(const std::vector<ScanInput>&, const LaunchHeader&,
                     int64_t&, EmulatedCall&)>
      emulate;
};

template <typename T>
void reference_of(Case& c) {
  using acc_t = acc_of<T>;
  using Tr = Traits<T>;
  const double tol = c.tol < 0 ? Tr::eps() : c.tol;
  const Thresholds<acc_t> th = host_thresholds<acc_t>(Tr::tiny(), tol);
  c.tiny_bits = th.tiny;
  c.tol_bits = th.tol;
  c.double_acc = sizeof(acc_t) == 8;
  c.is_f64 = std::is_same_v<T, double>;
  const T* base = reinterpret_cast<const T*>(c.host.data()) + c.offset;
  ScalarAccumulator<acc_t> acc;
  bool have_shift = false;
  // Neumaier's compensated sum: the mean to within an ulp or so.
  double sum = 0.0, compensation = 0.0, sum_abs = 0.0;
  int64_t finite = 0;
  for_each_run(c.layout, 0, c.layout.numel,
               [&](int64_t off, int64_t len, int64_t stride) {
                 for (int64_t k = 0; k < len; ++k) {
                   const acc_t x = host_value(base[off + k * stride]);
                   const auto a = to_bits(x) & FloatBits<acc_t>::kAbsMask;
                   if (a < FloatBits<acc_t>::kInf) {
                     if (!have_shift) {
                       acc.shift = x;
                       have_shift = true;
                     }
                     const double v = static_cast<double>(x);
                     const double t = sum + v;
                     compensation += std::fabs(sum) >= std::fabs(v)
                                         ? (sum - t) + v
                                         : (v - t) + sum;
                     sum = t;
                     sum_abs += std::fabs(v);
                     finite += 1;
                   }
                   acc.push(x, th);
                 }
               });
  c.want = acc.finish();
  repeat(c.want, c.layout.repeat);
  c.exact_mean = finite > 0 ? (sum + compensation) / finite : 0.0;
  c.mean_abs = finite > 0 ? sum_abs / finite : 0.0;
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
// and the last tile of a tensor is the one that completes its counter.
template <typename T, bool kStrided, typename Batch>
void emulate_launch(const Batch& b, EmulatedCall& call) {
  using acc_t = acc_of<T>;
  using bits_t = typename FloatBits<acc_t>::bits_t;
  Thresholds<acc_t> th;
  th.tiny = static_cast<bits_t>(b.h.tiny);
  th.tol = static_cast<bits_t>(b.h.tol);
  for (int g = 0; g < b.h.num_tiles; ++g) {
    const TileSpan span = locate(b.h, b.t, g);
    const TensorTiles& t = b.t[span.tensor];
    const T* data = static_cast<const T*>(t.data);
    Partial p = empty_partial();
    for (int tid = 0; tid < kThreads; ++tid) {
      ScalarAccumulator<acc_t> acc;
      bool have_shift = false;
      if constexpr (kStrided) {
        scan_strided<T>(data, b.shape[span.tensor], span.begin, span.end, tid,
                        acc, th, have_shift);
      } else {
        scan_contiguous<T>(data, span.begin, span.end, tid, acc, th,
                           have_shift);
      }
      combine(p, acc.finish());
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
  o.fill = [](Case& c, Mix mix, Rng& rng, int64_t n) {
    const std::vector<T> v = make_values<T>(n, mix, rng);
    c.host.resize(n * sizeof(T));
    std::memcpy(c.host.data(), v.data(), n * sizeof(T));
  };
  o.reference = reference_of<T>;
  o.launch = launch_type<T>;
  o.emulate = emulate_type<T>;
  return o;
}

std::vector<TypeOps> all_types() {
  return {ops_of<float>(),   ops_of<double>(),  ops_of<f16_t>(),
          ops_of<bf16_t>(),  ops_of<e4m3_t>(),  ops_of<e5m2_t>(),
          ops_of<bool_t>(),  ops_of<uint8_t>(), ops_of<int8_t>(),
          ops_of<int16_t>(), ops_of<int32_t>(), ops_of<int64_t>()};
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

// Scans `cases` in one call (as stats_many does) and returns their rows.
std::vector<int64_t> run_call(const std::vector<TypeOps>& types,
                              const std::vector<Case*>& cases, int grid) {
  const int64_t n = static_cast<int64_t>(cases.size());
  int64_t total_tiles = 0;
  for (const Case* c : cases) total_tiles += tiles_of(c->layout, c->elem_size);
  int64_t* out = nullptr;
  Partial* partials = nullptr;
  int32_t* counters = nullptr;
  CHECK_CUDA(cudaMalloc(&out, n * kNumFields * sizeof(int64_t)));
  CHECK_CUDA(cudaMemset(out, 0xff, n * kNumFields * sizeof(int64_t)));
  if (total_tiles > n) {
    CHECK_CUDA(cudaMalloc(&partials, total_tiles * sizeof(Partial)));
    CHECK_CUDA(cudaMalloc(&counters, n * sizeof(int32_t)));
    CHECK_CUDA(cudaMemsetAsync(counters, 0, n * sizeof(int32_t), 0));
  }
  int64_t slot_cursor = 0;
  // Grouped by (type, thresholds), in row order within a group.
  std::vector<bool> done(n, false);
  for (int64_t i = 0; i < n; ++i) {
    if (done[i]) continue;
    LaunchHeader h;
    h.tiny = cases[i]->tiny_bits;
    h.tol = cases[i]->tol_bits;
    h.out = out;
    h.partials = partials;
    h.counters = counters;
    std::vector<ScanInput> inputs;
    for (int64_t j = i; j < n; ++j) {
      const Case& c = *cases[j];
      if (done[j] || c.type != cases[i]->type || c.tol_bits != h.tol) continue;
      done[j] = true;
      const void* data =
          static_cast<const uint8_t*>(c.device) + c.offset * c.elem_size;
      inputs.push_back({data, &c.layout, static_cast<int32_t>(j)});
    }
    types[cases[i]->type].launch(inputs, h, slot_cursor, grid);
  }
  if (slot_cursor != total_tiles) {
    std::fprintf(stderr, "plan_launches numbered %lld tiles, expected %lld\n",
                 static_cast<long long>(slot_cursor),
                 static_cast<long long>(total_tiles));
    std::exit(1);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<int64_t> rows(n * kNumFields);
  CHECK_CUDA(cudaMemcpy(rows.data(), out, rows.size() * sizeof(int64_t),
                        cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(out));
  if (partials != nullptr) CHECK_CUDA(cudaFree(partials));
  if (counters != nullptr) CHECK_CUDA(cudaFree(counters));
  return rows;
}

// run_call's twin for --emulate: host buffers, CPU threads of execution.
std::vector<int64_t> emulate_call(const std::vector<TypeOps>& types,
                                  const std::vector<Case*>& cases) {
  const int64_t n = static_cast<int64_t>(cases.size());
  int64_t total_tiles = 0;
  for (const Case* c : cases) total_tiles += tiles_of(c->layout, c->elem_size);
  EmulatedCall call;
  call.out.assign(n * kNumFields, -1);
  call.partials.resize(total_tiles);
  call.counters.assign(n, 0);
  int64_t slot_cursor = 0;
  std::vector<bool> done(n, false);
  for (int64_t i = 0; i < n; ++i) {
    if (done[i]) continue;
    LaunchHeader h;
    h.tiny = cases[i]->tiny_bits;
    h.tol = cases[i]->tol_bits;
    std::vector<ScanInput> inputs;
    for (int64_t j = i; j < n; ++j) {
      const Case& c = *cases[j];
      if (done[j] || c.type != cases[i]->type || c.tol_bits != h.tol) continue;
      done[j] = true;
      const void* data = c.host.data() + c.offset * c.elem_size;
      inputs.push_back({data, &c.layout, static_cast<int32_t>(j)});
    }
    types[cases[i]->type].emulate(inputs, h, slot_cursor, call);
  }
  if (slot_cursor != total_tiles) {
    std::fprintf(stderr, "plan_launches numbered %lld tiles, expected %lld\n",
                 static_cast<long long>(slot_cursor),
                 static_cast<long long>(total_tiles));
    std::exit(1);
  }
  return call.out;
}

// ---- Checks ------------------------------------------------------------------

int failures = 0;

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
  const int64_t g[8] = {got.numel, got.zeros, got.subnormal, got.near_zero,
                        got.nan, got.posinf, got.neginf, got.negative};
  const int64_t w[8] = {want.numel, want.zeros, want.subnormal, want.near_zero,
                        want.nan, want.posinf, want.neginf, want.negative};
  const char* names[8] = {"numel", "zeros", "subnormal", "near_zero",
                          "nan", "posinf", "neginf", "negative"};
  for (int k = 0; k < 8; ++k) {
    if (g[k] != w[k]) fail(c, names[k], static_cast<double>(g[k]),
                           static_cast<double>(w[k]));
  }
  if (!same_double(got.min_abs, want.min_abs)) fail(c, "min_abs", got.min_abs, want.min_abs);
  if (!same_double(got.min_abs_nonzero, want.min_abs_nonzero))
    fail(c, "min_abs_nonzero", got.min_abs_nonzero, want.min_abs_nonzero);
  if (!same_double(got.max_abs, want.max_abs)) fail(c, "max_abs", got.max_abs, want.max_abs);
  for (int k = kM2 + 1; k < kNumFields; ++k) {
    if (row[k] != 0) fail(c, "padding", static_cast<double>(row[k]), 0.0);
  }
  // The mean against the compensated sum, by the test suite's own criterion
  // (tests/helpers.py: rtol * |mean| + rtol * 1e-6 * mean |x|, rtol 1e-10 for
  // float64 and 1e-6 otherwise), which zero-centred data makes demanding.
  const double rtol = c.is_f64 ? 1e-10 : 1e-6;
  if (want.finite() > 0 &&
      std::fabs(got.mean - c.exact_mean) >
          rtol * std::fabs(c.exact_mean) + rtol * 1e-6 * c.mean_abs) {
    fail(c, "mean", got.mean, c.exact_mean);
  }
  // Float compute types sum each 16-byte vector's few squares in float
  // (~1e-7); the reference sums millions of terms in one sequential double
  // sum, whose own rounding reaches ~1e-11 with integer extremes.
  const double m2_rtol = c.double_acc ? 1e-9 : 2e-6;
  if (std::fabs(got.m2 - want.m2) > m2_rtol * want.m2 + 1e-300) {
    fail(c, "m2", got.m2, want.m2);
  }
}

// ---- The exhaustive widening check ----------------------------------------

template <typename T>
__global__ void widen_kernel(const T* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = widen(in[i]);
}

template <typename T, typename Bits>
void check_widening(int patterns) {
  std::vector<T> host(patterns);
  for (int b = 0; b < patterns; ++b) host[b] = T{static_cast<Bits>(b)};
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
  int bad = 0;
  for (int b = 0; b < patterns; ++b) {
    const float want = host_value(host[b]);
    const bool ok = (std::isnan(want) && std::isnan(got[b])) ||
                    std::memcmp(&want, &got[b], 4) == 0;
    if (!ok && ++bad <= 5) {
      std::printf("FAIL widen %s bits 0x%x: got %.9g want %.9g\n",
                  Traits<T>::name, b, got[b], want);
    }
  }
  failures += bad;
  std::printf("widening of all %d %s patterns: %s\n", patterns,
              Traits<T>::name, bad ? "MISMATCH" : "exact");
  CHECK_CUDA(cudaFree(in));
  CHECK_CUDA(cudaFree(out));
}

// The host pass of the same widening code (what --emulate runs).
template <typename T, typename Bits>
void check_host_widening(int patterns) {
  int bad = 0;
  for (int b = 0; b < patterns; ++b) {
    const T x{static_cast<Bits>(b)};
    const float want = host_value(x);
    const float got = widen(x);
    const bool ok = (std::isnan(want) && std::isnan(got)) ||
                    std::memcmp(&want, &got, 4) == 0;
    if (!ok && ++bad <= 5) {
      std::printf("FAIL host widen %s bits 0x%x: got %.9g want %.9g\n",
                  Traits<T>::name, b, got, want);
    }
  }
  failures += bad;
  std::printf("host widening of all %d %s patterns: %s\n", patterns,
              Traits<T>::name, bad ? "MISMATCH" : "exact");
}

int run(uint64_t seed, bool large, bool emulate) {
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

  const std::vector<TypeOps> types = all_types();
  std::vector<Case> cases;
  const std::vector<int64_t> small_sizes = {1, 7, 300, 4099, 70001};
  const std::vector<int64_t> big_sizes = {1000003, 5000000};
  for (int t = 0; t < static_cast<int>(types.size()); ++t) {
    const bool is_float = t < 6;
    const bool narrow = types[t].elem_size <= 2 && is_float;
    std::vector<Mix> mixes = {Mix::kNormal, Mix::kSpecials};
    if (narrow) mixes.push_back(Mix::kBits);
    auto add = [&](const View& v, Mix mix, double tol) {
      Case c;
      c.type = t;
      c.elem_size = types[t].elem_size;
      c.offset = v.offset;
      c.sizes = v.sizes;
      c.strides = v.strides;
      c.tol = tol;
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
        for (Mix mix : mixes) add(v, mix, -1.0);
      }
    }
    for (int64_t n : big_sizes) {
      for (const View& v : views_for(n, true)) {
        for (Mix mix : {Mix::kNormal, Mix::kSpecials}) add(v, mix, -1.0);
      }
    }
    add({"contiguous", 4099, 0, {4099}, {1}}, Mix::kSpecials, is_float ? 0.05 : 7.0);
    add({"contiguous", 300, 0, {300}, {1}}, Mix::kSpecials, 0.0);
    if (is_float && types[t].elem_size >= 2) {  // 1000 is beyond float8_e4m3fn
      add({"contiguous", 1000003, 0, {1000003}, {1}}, Mix::kShifted, -1.0);
    }
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
    const std::vector<int64_t> rows = emulate_call(types, all);
    for (size_t i = 0; i < cases.size(); ++i) {
      check_row(cases[i], rows.data() + i * kNumFields);
    }
    std::printf("emulated kernels against the CPU reference: %d mismatches\n",
                failures);
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
  const std::vector<int64_t> together = run_call(types, all, grid);
  for (size_t i = 0; i < cases.size(); ++i) {
    check_row(cases[i], together.data() + i * kNumFields);
  }
  const int reference_failures = failures;
  std::printf("against the CPU reference: %d mismatches\n", reference_failures);

  // 2. Bitwise identical alone, with a one-block grid, and when repeated.
  const std::vector<int64_t> one_block = run_call(types, all, 1);
  const std::vector<int64_t> again = run_call(types, all, grid);
  int unstable = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::vector<int64_t> alone = run_call(types, {&cases[i]}, grid);
    const int64_t* row = together.data() + i * kNumFields;
    const bool same =
        std::memcmp(row, alone.data(), kNumFields * 8) == 0 &&
        std::memcmp(row, one_block.data() + i * kNumFields, kNumFields * 8) == 0 &&
        std::memcmp(row, again.data() + i * kNumFields, kNumFields * 8) == 0;
    if (!same && ++unstable <= 10) {
      std::printf("FAIL %s: row differs between calls (alone / one block / "
                  "repeated)\n", cases[i].what.c_str());
    }
  }
  failures += unstable;
  std::printf("bitwise repeatability: %d rows differ\n", unstable);

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
  bool emulate = false;
  uint64_t seed = std::random_device()();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--skip-without-gpu") {
      skip_without_gpu = true;
    } else if (arg == "--large") {
      large = true;
    } else if (arg == "--emulate") {
      emulate = true;
    } else if (arg == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--seed N] [--large] [--emulate] "
                   "[--skip-without-gpu]\n",
                   argv[0]);
      return 2;
    }
  }
  if (emulate) return zeroscan::cuda::run(seed, large, true);
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("no usable CUDA device (%s): the kernels were NOT run\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return skip_without_gpu ? 0 : 2;
  }
  return zeroscan::cuda::run(seed, large, false);
}

#endif  // defined(ZEROSCAN_STANDALONE_TEST)
