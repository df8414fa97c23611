// The histogram's vector count (csrc/histogram.h): how many elements of a
// span lie in each field of a window of kWindowFields consecutive fields.
// Included by each target's file after vec_scan.h, whose vector types and
// target macros it uses, so it too is one source for every ISA.
//
// An element's field is its exponent (every float dtype of up to 32 bits;
// float64 and the integers are counted one at a time, count_fields.h). Each
// lane turns its field into a one-hot bit by a variable shift, 1 << 4 *
// (field - lo), so that adding the lanes counts 8 fields per 32-bit lane in
// 4-bit counters, and 3 such counters cover the window. Fields outside the
// window shift the bit out (the shift is 32 or more) and count nothing:
// count_fields.h knows the zero and non-finite fields from the scan's own
// counts, and takes the rare others one at a time. Every 15 / groups vectors
// the 4-bit counters are split into bytes, and every 17 such splits the
// bytes are added to the window's totals.
//
// Cost per group of float32 lanes: 2 instructions for the field, 1 for the
// window's offset, and 3 for each counter (a subtraction, the shift, the
// addition); no compare, no branch, nothing that depends on the values.
#pragma once

#if defined(ZS_NEON_KERNELS)
#include <arm_neon.h>
#endif

namespace zeroscan {
namespace cpu {
namespace ZS_TARGET {
namespace {

// 8 fields per 32-bit counter lane.
constexpr int kNibbleCounters = kWindowFields / 8;

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

// p: [n] contiguous. Adds to window[j] the elements of the first n / lanes
// * lanes whose field is lo + j (j < kWindowFields), and returns how many
// elements that read; 0 for the dtypes counted one at a time
// (kWindowedFields, scan_span.h).
template <typename S>
int64_t count_window(const S* p, int64_t n, int lo, int64_t* window) {
  if constexpr (kWindowedFields<S>) {
    return count_window_here<S>(p, n, lo, window);
  } else {
    return 0;
  }
}

#define ZS_INSTANTIATE(name, S, value_t, tiny, eps) \
  template int64_t count_window<S>(const S*, int64_t, int, int64_t*);
ZEROSCAN_DTYPES(ZS_INSTANTIATE)
#undef ZS_INSTANTIATE

}  // namespace ZS_TARGET
}  // namespace cpu
}  // namespace zeroscan
