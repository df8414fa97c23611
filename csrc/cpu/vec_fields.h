// The histogram's count over data already read (csrc/histogram.h): how many
// elements of a span lie in each field of a window of kWindowFields
// consecutive fields. Included by each target's file after vec_scan.h, whose
// vector types, target macros and field counters (its Histogram fields
// section) it uses, so it too is one source for every ISA.
//
// Where the build has 32 vector registers the scan counts the floats'
// fields itself as it reads them (ScanFields, vec_scan.h), and count_window
// counts the fields outside the scan's window over a span the scan has read;
// elsewhere count_window is the floats' count, a pass right after the scan
// (count_fields.h).
// float64 and the wider integers are counted one at a time (count_fields.h).
//
// A 1-byte integer's field is the bit length of |x| (0..8, bool 0..1):
// each vector counts in byte lanes the keys of at least 2^j for every j < 8
// (one compare and one count each), and the fields are the differences.
#pragma once

#include "../histogram.h"

namespace zeroscan {
namespace cpu {
namespace ZS_TARGET {
namespace {

// The 1-byte integers, whose fields are counted by bounds on the key.
// (float8_e4m3fn's 16 bounds took longer than its window on AVX2: their
// counters and bounds do not fit in 16 registers.)
template <typename S>
constexpr bool kBoundedFields = sizeof(S) == 1 && !Format<S>::kFloating;

// The bit lengths of 1-byte integers: field j >= 1 holds the keys from
// 2^(j-1). Every field (Binning<S>::kFields) is added to fields[].
template <typename S>
__attribute__((noinline)) ZS_TARGET_ATTR int64_t count_bounded_fields(const S* p, int64_t n, int64_t* fields) {
  using V8 = Vec<uint8_t>;
  using VI8 = Vec<int8_t>;
  constexpr int kLanes = kBytes;
  constexpr int kBounds = Binning<S>::kFields - 1;
  const int64_t vectors = n / kLanes;
  Vec<uint64_t> at_least[kBounds]{};  // keys of field j + 1 or above
  // The bounds, biased, read through an opaque pointer: with constants it
  // can see, the compiler turns each compare into three instructions.
  struct Bounds {
    VI8 v[kBounds];
  } bounds_here;
  for (int j = 0; j < kBounds; ++j) bounds_here.v[j] = VI8{} + static_cast<int8_t>(((1 << j) - 1) ^ 0x80);
  const Bounds* bounds = &bounds_here;
  __asm__("" : "+r"(bounds));
  for (int64_t v = 0; v < vectors;) {
    const int64_t len = std::min(kFold<1>, vectors - v);
    V8 counts[kBounds]{};
    for (int64_t u = 0; u < len; ++u) {
      const V8 key = as<V8>(key_of<S>(load<typename LaneTypes<S>::VU>(p + (v + u) * kLanes)));
      // Unsigned order as signed order: one signed compare per bound.
      const VI8 biased = as<VI8>(key ^ 0x80);
#pragma GCC unroll 8
      for (int j = 0; j < kBounds; ++j) {
        counts[j] = count(counts[j], biased > bounds->v[j]);
      }
    }
    v += len;
    for (int j = 0; j < kBounds; ++j) at_least[j] += widen_counts<1>(counts[j]);
  }
  const int64_t counted = vectors * kLanes;
  int64_t above = counted;  // keys of field j or above: every key for j = 0
  for (int j = 0; j < kBounds; ++j) {
    const int64_t next = lane_sum<int64_t>(at_least[j]);
    fields[j] += above - next;
    above = next;
  }
  fields[kBounds] += above;
  return counted;
}

template <typename S>
__attribute__((noinline)) ZS_TARGET_ATTR int64_t count_window_here(const S* p, int64_t n, int lo,
                                                                   int64_t* window) {
  constexpr int kLanes = LaneTypes<S>::kLanes;
  // A 4-bit counter gains at most kGroups<S> a vector.
  constexpr int64_t kNibbleVectors = 15 / kGroups<S>;
  using VU = typename LaneTypes<S>::VU;
  const int64_t vectors = n / kLanes;
  const VU32 base = VU32{} + static_cast<uint32_t>(4 * lo);
  WindowCounts<15> counts;
  for (int64_t v = 0; v < vectors;) {
    const int64_t len = std::min(kNibbleVectors, vectors - v);
    VU32 nibbles[kNibbleCounters]{};
    for (int64_t u = 0; u < len; ++u) add_fields<S>(load<VU>(p + (v + u) * kLanes), base, nibbles);
    v += len;
    counts.split(nibbles, window);
  }
  counts.flush(window);
  return vectors * kLanes;
}

}  // namespace

// p: [n] contiguous; 0 <= lo < Binning<S>::kFields. Adds to window[j] the
// elements of the first n / lanes * lanes whose field is lo + j (j <
// kWindowFields), and returns how many elements that read; 0 for the dtypes
// counted one at a time (kWindowedFields, scan_span.h).
template <typename S>
int64_t count_window(const S* p, int64_t n, int lo, int64_t* window) {
  if constexpr (!kWindowedFields<S>) {
    return 0;
  } else if constexpr (!kBoundedFields<S>) {
    return count_window_here<S>(p, n, lo, window);
  } else {
    int64_t fields[Binning<S>::kFields] = {};
    const int64_t counted = count_bounded_fields<S>(p, n, fields);
    for (int j = 0; j < kWindowFields && lo + j < Binning<S>::kFields; ++j) window[j] += fields[lo + j];
    return counted;
  }
}

#define ZS_INSTANTIATE(name, S, value_t, tiny, eps) \
  template int64_t count_window<S>(const S*, int64_t, int, int64_t*);
ZEROSCAN_DTYPES(ZS_INSTANTIATE)
#undef ZS_INSTANTIATE

}  // namespace ZS_TARGET
}  // namespace cpu
}  // namespace zeroscan
