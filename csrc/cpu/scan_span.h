// The CPU's scan of one contiguous span, free of torch headers: which vector
// build runs it, and the element-at-a-time reference it falls back to.
//
// The vector loop (vec_scan.h) is one source compiled once per target:
// span_avx512.cpp and span_avx2.cpp on x86-64, span_neon.cpp on AArch64.
// The best build the CPU can run is picked once per process, as torch picks
// its kernels; ZEROSCAN_CPU_CAPABILITY caps the choice, so that one machine
// tests every path (as ATEN_CPU_CAPABILITY does for torch):
//   scalar   every element through Tally::add (classify.h)
//   avx2     the AVX2 build (x86-64)
//   avx512   the AVX-512 build (x86-64)
//   native   or unset: the best the CPU has (NEON on AArch64)
// The histogram's count runs in the same build: the floats' as the scan
// reads each vector where the build has 32 vector registers (vec_scan.h),
// else, and the integers', in a pass right after the scan (vec_fields.h).
// Other values read as kInvalid, which the operators refuse before scanning.
// A cap above what the CPU has gives what the CPU has. The last elements of
// a span, fewer than a vector's lanes, go through Tally::add.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../classify.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define ZS_X86_KERNELS 1
#endif
#if defined(__aarch64__) && defined(__GNUC__)
#define ZS_NEON_KERNELS 1
#endif

namespace zeroscan {
namespace cpu {

enum class Capability { kScalar, kAvx2, kAvx512, kNative, kInvalid };

// `value`: ZEROSCAN_CPU_CAPABILITY, or null when unset.
inline Capability parse_capability(const char* value) {
  if (value == nullptr || *value == '\0' || std::strcmp(value, "native") == 0) return Capability::kNative;
  if (std::strcmp(value, "avx512") == 0) return Capability::kAvx512;
  if (std::strcmp(value, "avx2") == 0) return Capability::kAvx2;
  if (std::strcmp(value, "scalar") == 0) return Capability::kScalar;
  return Capability::kInvalid;
}

inline Capability capability_cap() {
  static const Capability cap = parse_capability(std::getenv("ZEROSCAN_CPU_CAPABILITY"));
  return cap;
}

inline bool capability_allows(Capability needed) {
  const Capability cap = capability_cap();
  return cap != Capability::kInvalid && static_cast<int>(cap) >= static_cast<int>(needed);
}

// The histogram fields (csrc/histogram.h) that one vector count covers, and
// the dtypes counted in vectors: the floats of up to 32 bits (their fields
// are their exponents) and the 1-byte integers (the bit lengths of |x|).
// The floats' may be counted by the scan itself, as it reads each vector
// (kScanCountsFields, scan_counts_fields_on); else, and for the integers,
// by a pass of their own after it (count_window_on).
constexpr int kWindowFields = 24;
template <typename S>
constexpr bool kWindowedFields = Format<S>::kFloating ? sizeof(S) <= 4 : sizeof(S) == 1;
template <typename S>
constexpr bool kScanCountsFields = kWindowedFields<S> && Format<S>::kFloating;

// The histogram window a vector scan counts into: how many elements of its
// vector part lie in each field lo .. lo + kWindowFields - 1 (count_fields.h
// places it and takes what falls outside), and how many elements it counted
// (0 where the build does not count as it scans: vec_scan.h,
// kCountsFieldsInScan). Every vector build also keeps in it the field of the
// largest finite |x| its scans have read (0 where they read none), which no
// infinity hides.
struct FieldWindow {
  int lo = 0;
  int64_t counts[kWindowFields] = {};
  int64_t scanned = 0;
  int finite_top = -1;  // -1 until a scan has read a vector
};

// The vector builds. Each adds the statistics of the first n / lanes * lanes
// elements of p ([n] contiguous) to `t` and returns that count; `shift` as
// for scan_span. For the dtypes of kScanCountsFields, the builds whose
// scan_counts_fields() is true also add the fields of those elements to
// `fields` (unless it is null), and their number to fields->scanned; every
// build raises fields->finite_top to the field of their largest finite |x|.
// Each also counts the fields of a window on its own (count_window_on,
// below; vec_fields.h).
#define ZS_DECLARE_TARGET(target)                                                          \
  namespace target {                                                                       \
  template <typename S>                                                                    \
  int64_t scan_vectors(const S* p, int64_t n, const Limits& lim, double shift,             \
                       Tally<S, int64_t>& t, FieldWindow* fields);                         \
  template <typename S>                                                                    \
  int64_t count_window(const S* p, int64_t n, int lo, int64_t* window);                    \
  bool scan_counts_fields();                                                               \
  }
#if defined(ZS_X86_KERNELS)
ZS_DECLARE_TARGET(avx2)
ZS_DECLARE_TARGET(avx512)
#endif
#if defined(ZS_NEON_KERNELS)
ZS_DECLARE_TARGET(neon)
#endif
#undef ZS_DECLARE_TARGET

enum class VectorPath { kNone, kAvx2, kAvx512, kNeon };

// The build this process runs: the best the CPU has, within the cap.
inline VectorPath pick_vector_path(Capability cap) {
  if (cap == Capability::kScalar || cap == Capability::kInvalid) return VectorPath::kNone;
#if defined(ZS_X86_KERNELS)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (avx512 && cap != Capability::kAvx2) return VectorPath::kAvx512;
  if (avx2) return VectorPath::kAvx2;
  return VectorPath::kNone;
#elif defined(ZS_NEON_KERNELS)
  return VectorPath::kNeon;  // every AArch64 CPU has NEON
#else
  return VectorPath::kNone;
#endif
}

inline VectorPath vector_path() {
  static const VectorPath path = pick_vector_path(capability_cap());
  return path;
}

// Every vector build this CPU runs, narrowest first (the span tests and
// benchmarks run each of them in one process).
inline std::vector<VectorPath> vector_paths_here() {
  std::vector<VectorPath> paths;
#if defined(ZS_X86_KERNELS)
  if (pick_vector_path(Capability::kAvx2) == VectorPath::kAvx2) paths.push_back(VectorPath::kAvx2);
  if (pick_vector_path(Capability::kAvx512) == VectorPath::kAvx512) paths.push_back(VectorPath::kAvx512);
#elif defined(ZS_NEON_KERNELS)
  paths.push_back(VectorPath::kNeon);
#endif
  return paths;
}

inline const char* vector_path_name(VectorPath path) {
  switch (path) {
    case VectorPath::kAvx2: return "avx2";
    case VectorPath::kAvx512: return "avx512";
    case VectorPath::kNeon: return "neon";
    default: return "scalar";
  }
}

// Whether `path`'s scan counts the histogram's fields as it reads (for the
// dtypes of kScanCountsFields, into the window scan_span_on is given).
inline bool scan_counts_fields_on(VectorPath path) {
  switch (path) {
#if defined(ZS_X86_KERNELS)
    case VectorPath::kAvx512: return avx512::scan_counts_fields();
    case VectorPath::kAvx2: return avx2::scan_counts_fields();
#endif
#if defined(ZS_NEON_KERNELS)
    case VectorPath::kNeon: return neon::scan_counts_fields();
#endif
    default: return false;
  }
}

// p: [n] contiguous. Adds its elements to `t` one at a time.
template <typename S>
void scan_span_scalar(const S* p, int64_t n, const Limits& lim, double shift,
                      Tally<S, int64_t>& t) {
  for (int64_t i = 0; i < n; ++i) t.add(p[i], lim, shift);
}

// p: [n] contiguous, scanned by `path`'s build. Adds its elements'
// statistics to `t`; `shift` is the value subtracted before the moments are
// summed (see set_moments): a whole number for integer dtypes and a float32
// value for floats of up to 32 bits (the float32 lanes subtract it exactly).
// The vector build may add the histogram fields of the elements it reads to
// `fields` (as scan_vectors says).
template <typename S>
void scan_span_on(VectorPath path, const S* p, int64_t n, const Limits& lim, double shift,
                  Tally<S, int64_t>& t, FieldWindow* fields = nullptr) {
  int64_t done = 0;
  switch (path) {
#if defined(ZS_X86_KERNELS)
    case VectorPath::kAvx512: done = avx512::scan_vectors(p, n, lim, shift, t, fields); break;
    case VectorPath::kAvx2: done = avx2::scan_vectors(p, n, lim, shift, t, fields); break;
#endif
#if defined(ZS_NEON_KERNELS)
    case VectorPath::kNeon: done = neon::scan_vectors(p, n, lim, shift, t, fields); break;
#endif
    default: break;
  }
  scan_span_scalar(p + done, n - done, lim, shift, t);
}

// p: [n] contiguous. Adds to window[j] (j < kWindowFields) the elements of
// a first part of p whose histogram field is lo + j, counted by `path`'s
// build, and returns how many elements that part holds (0: none counted).
template <typename S>
int64_t count_window_on(VectorPath path, const S* p, int64_t n, int lo, int64_t* window) {
  switch (path) {
#if defined(ZS_X86_KERNELS)
    case VectorPath::kAvx512: return avx512::count_window(p, n, lo, window);
    case VectorPath::kAvx2: return avx2::count_window(p, n, lo, window);
#endif
#if defined(ZS_NEON_KERNELS)
    case VectorPath::kNeon: return neon::count_window(p, n, lo, window);
#endif
    default: return 0;
  }
}

template <typename S>
void scan_span(const S* p, int64_t n, const Limits& lim, double shift, Tally<S, int64_t>& t,
               FieldWindow* fields = nullptr) {
  scan_span_on(vector_path(), p, n, lim, shift, t, fields);
}

}  // namespace cpu
}  // namespace zeroscan
