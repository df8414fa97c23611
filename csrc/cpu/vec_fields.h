// The histogram's vector count (csrc/histogram.h): how many elements of a
// span lie in each field of a window of kWindowFields consecutive fields.
// Included by each target's file after vec_scan.h, whose vector types and
// target macros it uses, so it too is one source for every ISA.
//
// A float's field is its exponent (every float dtype of up to 32 bits;
// float64 and the wider integers are counted one at a time, count_fields.h).
// Each lane turns its field into a one-hot bit by a variable shift, 1 << 4 *
// (field - lo), so that adding the lanes counts 8 fields per 32-bit lane in
// 4-bit counters, and 3 such counters cover the window. Fields outside the
// window shift the bit out (the shift is 32 or more) and count nothing:
// count_fields.h knows the zero and non-finite fields from the scan's own
// counts, and takes the rare others by windows below, then one at a time.
// Every 15 / groups vectors the 4-bit counters are split into bytes, and
// every 17 such splits the bytes are added to the window's totals.
//
// Cost per group of float32 lanes: 2 instructions for the field, 1 for the
// window's offset, and 3 for each counter (a subtraction, the shift, the
// addition); no compare, no branch, nothing that depends on the values.
//
// A 1-byte integer's field is the bit length of |x| (0..8, bool 0..1):
// each vector counts in byte lanes the keys of at least 2^j for every j < 8
// (one compare and one count each), and the fields are the differences.
#pragma once

#include "../histogram.h"

#if defined(ZS_NEON_KERNELS)
#include <arm_neon.h>
#endif

namespace zeroscan {
namespace cpu {
namespace ZS_TARGET {
namespace {

// 8 fields per 32-bit counter lane.
constexpr int kNibbleCounters = kWindowFields / 8;
static_assert(kWindowFields % 8 == 0, "the window is whole 32-bit counter lanes");

// The 1-byte integers, whose fields are counted by bounds on the key.
// (float8_e4m3fn's 16 bounds took longer than its window on AVX2: their
// counters and bounds do not fit in 16 registers.)
template <typename S>
constexpr bool kBoundedFields = sizeof(S) == 1 && !Format<S>::kFloating;

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

// The window's byte counters, added to `window` lane by lane: byte b of
// lane i of even[k] counts field 8k + 2b, of odd[k] field 8k + 2b + 1.
ZS_INLINE void spill_bytes(VU32 (&even)[kNibbleCounters], VU32 (&odd)[kNibbleCounters], int64_t* window) {
  for (int k = 0; k < kNibbleCounters; ++k) {
    for (int i = 0; i < lanes_of<VU32>; ++i) {
      for (int b = 0; b < 4; ++b) {
        window[8 * k + 2 * b] += (even[k][i] >> (8 * b)) & 0xffu;
        window[8 * k + 2 * b + 1] += (odd[k][i] >> (8 * b)) & 0xffu;
      }
    }
    even[k] = VU32{};
    odd[k] = VU32{};
  }
}

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
  constexpr int G = kGroups<S>;
  // A 4-bit counter gains at most G a vector; a byte at most 15 a split.
  constexpr int64_t kNibbleVectors = 15 / G;
  constexpr int kSplitsPerSpill = 17;
  using VU = typename LaneTypes<S>::VU;
  const int64_t vectors = n / kLanes;
  const VU32 base = VU32{} + static_cast<uint32_t>(4 * lo);
  VU32 even[kNibbleCounters]{}, odd[kNibbleCounters]{};
  int splits = 0;
  for (int64_t v = 0; v < vectors;) {
    const int64_t len = std::min(kNibbleVectors, vectors - v);
    VU32 nibbles[kNibbleCounters]{};
    for (int64_t u = 0; u < len; ++u) {
      VU32 a[G];
      field_amounts<S>(load<VU>(p + (v + u) * kLanes), a);
      for (int g = 0; g < G; ++g) {
        const VU32 offset = a[g] - base;  // lanes below the window wrap past 32
        for (int k = 0; k < kNibbleCounters; ++k) nibbles[k] += one_hot(offset - 32u * k);
      }
    }
    v += len;
    for (int k = 0; k < kNibbleCounters; ++k) {
      even[k] += nibbles[k] & 0x0f0f0f0fu;
      odd[k] += (nibbles[k] >> 4) & 0x0f0f0f0fu;
    }
    if (++splits == kSplitsPerSpill) {
      spill_bytes(even, odd, window);
      splits = 0;
    }
  }
  spill_bytes(even, odd, window);
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
