// The CPU's histogram count (csrc/histogram.h): each element's field, one
// increment per element into small per-chunk tables.
//
// It runs over each span right after scan_span has read it, while the span
// is still in the core's caches (a chunk is at most 64K elements for tensors
// of up to 64M), so memory is read once. Consecutive elements often share a
// field (a binade holds half of all values of its neighbourhood), and an
// increment that waits on the previous one to the same counter stalls: the
// tables, taken in turn, let several increments run at once. That still
// costs ~2 cycles per element; float32 and bfloat16 on CPUs with AVX512-VBMI
// count most elements in vectors instead (WindowCounter, below).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../histogram.h"
#include "scan_span.h"

namespace zeroscan {
namespace cpu {

template <typename S>
class ScalarFieldCounter {
 public:
  using B = Binning<S>;

  ScalarFieldCounter() { std::memset(tables_, 0, sizeof(tables_)); }

  // p: [n] contiguous.
  void add(const S* p, int64_t n) {
    while (n > 0) {
      const int64_t take = std::min(n, kFlushEvery - pending_);
      add_some(p, take);
      p += take;
      n -= take;
      pending_ += take;
      if (pending_ == kFlushEvery) flush_into(spill_);
    }
  }

  // fields: [B::kFields], added to.
  void write(int64_t* fields) {
    flush_into(spill_);
    for (int f = 0; f < B::kFields; ++f) fields[f] += spill_[f];
  }

 private:
  static constexpr int kTables = 4;
  // A uint32 table counts at most this many increments between flushes.
  static constexpr int64_t kFlushEvery = int64_t(1) << 31;

  void add_some(const S* p, int64_t n) {
    using F = Format<S>;
    int64_t i = 0;
    for (; i + kTables <= n; i += kTables) {
#pragma GCC unroll 4
      for (int t = 0; t < kTables; ++t) ++tables_[t][B::field(F::key(p[i + t]))];
    }
    for (; i < n; ++i) ++tables_[0][B::field(F::key(p[i]))];
  }

  void flush_into(int64_t* out) {
    for (int f = 0; f < B::kFields; ++f) {
      for (int t = 0; t < kTables; ++t) out[f] += tables_[t][f];
    }
    std::memset(tables_, 0, sizeof(tables_));
    pending_ = 0;
  }

  uint32_t tables_[kTables][B::kFields];
  int64_t spill_[B::kFields] = {};
  int64_t pending_ = 0;
};

#if defined(ZS_X86_KERNELS)
#include <immintrin.h>

#define ZS_AVX512_VBMI \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,bmi,bmi2,popcnt,avx512vbmi")))

inline bool cpu_has_vbmi() {
  static const bool has =
      __builtin_cpu_supports("avx512vbmi") && capability_allows(Capability::kNative);
  return has;
}

// Byte permutes (index j picks byte idx[j] of two vectors, 0..127).
struct ByteIndex {
  alignas(64) uint8_t idx[64];
};

// Byte 3 of each float32 of two vectors, in the low 32 bytes.
constexpr ByteIndex make_float_field_bytes() {
  ByteIndex b{};
  for (int j = 0; j < 32; ++j) b.idx[j] = static_cast<uint8_t>(4 * j + 3);
  return b;
}

// Byte 1 of each bfloat16 of two vectors.
constexpr ByteIndex make_bf16_field_bytes() {
  ByteIndex b{};
  for (int j = 0; j < 64; ++j) b.idx[j] = static_cast<uint8_t>(2 * j + 1);
  return b;
}

inline constexpr ByteIndex kFloatFieldBytes = make_float_field_bytes();
inline constexpr ByteIndex kBf16FieldBytes = make_bf16_field_bytes();

// The 8-bit exponent fields of 64 float32 or bfloat16 values, one byte each:
// the byte of bits << 1 that holds the field (byte 3 of a float32, byte 1 of
// a bfloat16), gathered from 4 or 2 vectors by two-table byte permutes.
template <typename S>
ZS_AVX512_VBMI inline __m512i fields_of_64(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    const __m512i take = _mm512_load_si512(kFloatFieldBytes.idx);
    const __m512i v0 = _mm512_slli_epi32(_mm512_loadu_si512(p), 1);
    const __m512i v1 = _mm512_slli_epi32(_mm512_loadu_si512(p + 16), 1);
    const __m512i v2 = _mm512_slli_epi32(_mm512_loadu_si512(p + 32), 1);
    const __m512i v3 = _mm512_slli_epi32(_mm512_loadu_si512(p + 48), 1);
    const __m512i low = _mm512_permutex2var_epi8(v0, take, v1);
    const __m512i high = _mm512_permutex2var_epi8(v2, take, v3);
    return _mm512_inserti64x4(low, _mm512_castsi512_si256(high), 1);
  } else {
    const __m512i take = _mm512_load_si512(kBf16FieldBytes.idx);
    const __m512i v0 = _mm512_slli_epi16(_mm512_loadu_si512(p), 1);
    const __m512i v1 = _mm512_slli_epi16(_mm512_loadu_si512(p + 32), 1);
    return _mm512_permutex2var_epi8(v0, take, v1);
  }
}

// The fields of float32 or bfloat16 (256 of them), 64 elements at a time:
// each vector of fields is compared with a window of kWindow fields, and
// each compare's lanes counted in byte lanes (a masked subtraction; the lane
// counts are summed into 64-bit totals every 255 vectors). Field 0 (zeros
// and subnormals) and 255 (Inf and NaN) have compares of their own, so that
// zero-, subnormal- and NaN-filled data stay in the vector loop. The few
// lanes outside (values far below the bulk) are counted one at a time. The
// window sits where the first elements are, and moves to where most of the
// chunk's values are whenever more than 1/16 of a span fell outside it.
template <typename S>
class WindowCounter {
 public:
  static constexpr int kFields = 256;
  static constexpr int kWindow = 16;
  static constexpr int64_t kCalibrate = 256;  // elements counted one at a time first
  static constexpr int kBytesPerVector = 64;
  static constexpr int64_t kFold = 255;  // vectors a byte lane can count

  // p: [n] contiguous.
  ZS_AVX512_VBMI void add(const S* p, int64_t n) {
    int64_t i = 0;
    if (!placed_) {
      i = std::min(n, kCalibrate);
      add_scalar(p, i);
      place_window();
      placed_ = true;
    }
    int64_t outside = 0;
    while (i + kBytesPerVector <= n) {
      const int64_t vectors = std::min(kFold, (n - i) / kBytesPerVector);
      outside += add_vectors(p + i, vectors);
      i += vectors * kBytesPerVector;
    }
    add_scalar(p + i, n - i);
    if (outside * 16 > n) place_window();
  }

  // fields: [256], added to.
  void write(int64_t* fields) {
    fold_window();
    for (int f = 0; f < kFields; ++f) fields[f] += counts_[f];
  }

 private:
  // Counts `vectors` (at most kFold) vectors of 64 elements at p; returns
  // the lanes counted one at a time.
  ZS_AVX512_VBMI int64_t add_vectors(const S* p, int64_t vectors) {
    __m512i lanes[kWindow + 2];  // the window's fields, then 0 and 255
    for (auto& l : lanes) l = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(-1);
    const __m512i lo = _mm512_set1_epi8(static_cast<char>(lo_));
    int64_t outside = 0;
    for (int64_t v = 0; v < vectors; ++v) {
      const __m512i f = fields_of_64(p + v * kBytesPerVector);
      const __m512i offset = _mm512_sub_epi8(f, lo);
      const __mmask64 zero = _mm512_cmpeq_epi8_mask(f, _mm512_setzero_si512());
      const __mmask64 top = _mm512_cmpeq_epi8_mask(f, ones);
      lanes[kWindow] = _mm512_mask_sub_epi8(lanes[kWindow], zero, lanes[kWindow], ones);
      lanes[kWindow + 1] = _mm512_mask_sub_epi8(lanes[kWindow + 1], top, lanes[kWindow + 1], ones);
#pragma GCC unroll 16
      for (int j = 0; j < kWindow; ++j) {
        const __mmask64 m = _mm512_cmpeq_epi8_mask(offset, _mm512_set1_epi8(static_cast<char>(j)));
        lanes[j] = _mm512_mask_sub_epi8(lanes[j], m, lanes[j], ones);
      }
      const __mmask64 inside = _mm512_cmplt_epu8_mask(offset, _mm512_set1_epi8(kWindow));
      uint64_t rest = ~(inside | zero | top);
      if (__builtin_expect(rest != 0, 0)) outside += add_lanes(f, rest);
    }
    for (int j = 0; j < kWindow + 2; ++j) {
      const __m512i sums = _mm512_sad_epu8(lanes[j], _mm512_setzero_si512());
      const int64_t total = _mm512_reduce_add_epi64(sums);
      if (j < kWindow) {
        window_[j] += total;
      } else {
        counts_[j == kWindow ? 0 : 255] += total;
      }
    }
    return outside;
  }

  // Counts the lanes `rest` of the fields f one at a time; returns how many.
  ZS_AVX512_VBMI int64_t add_lanes(__m512i f, uint64_t rest) {
    alignas(64) uint8_t bytes[64];
    _mm512_store_si512(bytes, f);
    const int64_t count = __builtin_popcountll(rest);
    for (; rest != 0; rest &= rest - 1) ++counts_[bytes[__builtin_ctzll(rest)]];
    return count;
  }

  void add_scalar(const S* p, int64_t n) {
    using F = Format<S>;
    for (int64_t i = 0; i < n; ++i) ++counts_[Binning<S>::field(F::key(p[i]))];
  }

  // Folds the window's counts into counts_ and puts the window over the
  // kWindow consecutive fields in 1..254 that hold the most counts so far.
  void place_window() {
    fold_window();
    int64_t best = -1, sum = 0;
    for (int f = 1; f < 255; ++f) {
      sum += counts_[f];
      if (f - kWindow >= 1) sum -= counts_[f - kWindow];
      if (f >= kWindow && sum > best) {
        best = sum;
        lo_ = f - kWindow + 1;
      }
    }
  }

  void fold_window() {
    for (int j = 0; j < kWindow; ++j) {
      counts_[lo_ + j] += window_[j];
      window_[j] = 0;
    }
  }

  int64_t counts_[kFields] = {};  // every field; the window's until folded
  int64_t window_[kWindow] = {};  // fields lo_ .. lo_ + kWindow - 1
  int lo_ = 1;
  bool placed_ = false;
};

#endif  // ZS_X86_KERNELS

// The counter of each storage type: vectors for float32 and bfloat16 where
// the CPU has VBMI, one element at a time otherwise.
template <typename S>
class FieldCounter {
 public:
  FieldCounter() {
#if defined(ZS_X86_KERNELS)
    if constexpr (kVectorised) {
      use_window_ = cpu_has_vbmi();
    }
#endif
  }

  void add(const S* p, int64_t n) {
#if defined(ZS_X86_KERNELS)
    if constexpr (kVectorised) {
      if (use_window_) return window_.add(p, n);
    }
#endif
    scalar_.add(p, n);
  }

  // fields: [Binning<S>::kFields], added to.
  void write(int64_t* fields) {
#if defined(ZS_X86_KERNELS)
    if constexpr (kVectorised) {
      if (use_window_) return window_.write(fields);
    }
#endif
    scalar_.write(fields);
  }

 private:
  static constexpr bool kVectorised = std::is_same_v<S, float> || std::is_same_v<S, bf16_t>;
#if defined(ZS_X86_KERNELS)
  std::conditional_t<kVectorised, WindowCounter<S>, char> window_{};
#endif
  bool use_window_ = false;
  ScalarFieldCounter<S> scalar_;
};

}  // namespace cpu
}  // namespace zeroscan
