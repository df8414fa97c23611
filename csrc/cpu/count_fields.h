// The CPU's histogram count (csrc/histogram.h): how many elements of each
// span lie in each field.
//
// It runs over each span right after scan_span has read it, while the span
// is still in the core's caches (a chunk is at most 64K elements for tensors
// of up to 64M), so memory is read once. The floats of up to 32 bits and the
// 1-byte integers count in vectors (FieldCounter, below); the others one
// increment per element into small tables (ScalarFieldCounter). Consecutive elements often share
// a field (a binade holds half of all values of its neighbourhood), and an
// increment that waits on the previous one to the same counter stalls: the
// tables, taken in turn, let several increments run at once. That still
// costs ~2 cycles per element.
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

// The counter of each storage type. The floats of up to 32 bits and the
// 1-byte integers count in vectors (count_window_on, vec_fields.h) the
// fields of a window of kWindowFields: every field of a dtype that has no
// more (float8_e4m3fn, the 1-byte integers), else the fields up to that of
// the largest |x| the scan has seen (values thin out geometrically below
// the bulk of most data: a binade holds twice the values of the one below
// it, for values spread evenly around 0). The scan itself has counted the
// zero field (zeros and subnormals) and, but for float8_e4m3fn (whose top
// field also holds numbers), the top field (NaN and infinities), so the
// window need not cover them. The elements of any other field leave the
// window's count short of the span's length: windows below the first count
// them, then one element at a time. float64 and the wider integers count
// one element at a time.
template <typename S>
class FieldCounter {
 public:
  using B = Binning<S>;
  static constexpr int kTop = B::kFields - 1;

  // path: the vector build that counts (the process's own but in tests).
  explicit FieldCounter(VectorPath path = vector_path()) : path_(path) {}

  // p: [n] contiguous, and what the scan found in it (floats): how many of
  // its elements are zero or subnormal, and NaN or infinite, and the field
  // of the largest non-NaN |x| it has seen so far (in p or before it).
  void add(const S* p, int64_t n, int64_t zero_field, int64_t top_field, int high_field) {
    if constexpr (kWindowedFields<S>) {
      if (path_ != VectorPath::kNone) return add_windowed(p, n, zero_field, top_field, high_field);
    }
    scalar_.add(p, n);
  }

  // fields: [B::kFields], added to.
  void write(int64_t* fields) {
    if constexpr (kWindowedFields<S>) {
      fold_window();
      for (int f = 0; f < B::kFields; ++f) fields[f] += counts_[f];
    }
    scalar_.write(fields);
  }

 private:
  static constexpr int kW = kWindowFields;
  static constexpr int64_t kCalibrate = 256;  // elements counted one at a time first
  static constexpr int kHeadroom = 2;         // fields of the window above the largest seen
  static constexpr int kExtraWindows = 2;     // windows below the first, before one at a time
  // Whether the scan counted the top field: NaN and infinities (but for
  // float8_e4m3fn, whose top field also holds numbers).
  static constexpr bool kTopCounted = Format<S>::kFloating && !std::is_same_v<S, e4m3_t>;
  // Whether the window moves: else it covers every field from 0.
  static constexpr bool kMovable = kTopCounted && B::kFields > kW;

  void add_windowed(const S* p, int64_t n, int64_t zero_field, int64_t top_field, int high_field) {
    int64_t done = 0;
    if (kMovable && high_field < kTop) {
      // The window's top at the largest field the scan has seen: then only
      // values far below the bulk can fall outside it. (An infinity hides
      // the largest finite field: the window then stays where it was.)
      move_window(std::clamp(high_field - kW + 1, 1, kTop - kW));
      placed_ = true;
    } else if (!placed_) {
      done = std::min(n, kCalibrate);
      count_each(p, done, zero_field, top_field);
      place_window();
      placed_ = true;
    }
    const int64_t before = window_total();
    const int64_t counted = count_window_on(path_, p + done, n - done, lo_, window_);
    count_each(p + done + counted, n - done - counted, zero_field, top_field);
    // zero_field and top_field now count the vector part's elements alone.
    int64_t expected = counted;
    if (zero_outside()) {
      counts_[0] += zero_field;
      expected -= zero_field;
    }
    if (top_outside()) {
      counts_[kTop] += top_field;
      expected -= top_field;
    }
    int64_t missing = expected - (window_total() - before);
    // The elements the window missed: most often values far below the
    // bulk (a tensor spanning more binades than the window), so the windows
    // below it count them in vectors, then what is left one at a time.
    int covered = lo_;  // fields covered: covered .. lo_ + kW - 1
    for (int extra = 0; missing != 0 && extra < kExtraWindows && covered > 1; ++extra) {
      const int below = std::max(1, covered - kW);
      int64_t window[kW] = {};
      count_window_on(path_, p + done, counted, below, window);
      for (int f = below; f < covered; ++f) {
        counts_[f] += window[f - below];
        missing -= window[f - below];
      }
      covered = below;
    }
    if (missing != 0) {
      count_outside(p + done, counted, covered);
      place_window();
    }
  }

  bool zero_outside() const { return lo_ > 0; }
  bool top_outside() const { return kTopCounted && lo_ + kW <= kTop; }

  int64_t window_total() const {
    int64_t sum = 0;
    for (int j = 0; j < kW; ++j) sum += window_[j];
    return sum;
  }

  // Counts every element of p[0, n) into counts_, and takes those of the
  // zero and top fields off the scan's counts of them.
  void count_each(const S* p, int64_t n, int64_t& zero_field, int64_t& top_field) {
    using F = Format<S>;
    for (int64_t i = 0; i < n; ++i) {
      const int f = B::field(F::key(p[i]));
      ++counts_[f];
      zero_field -= f == 0;
      top_field -= f == kTop;
    }
  }

  // Counts the elements of p[0, n) that neither the windows (fields
  // covered .. lo_ + kW - 1) nor the scan's counts of the zero and top
  // fields took.
  void count_outside(const S* p, int64_t n, int covered) {
    using F = Format<S>;
    for (int64_t i = 0; i < n; ++i) {
      const int f = B::field(F::key(p[i]));
      const bool inside = f >= covered && f < lo_ + kW;
      const bool known = (f == 0 && zero_outside()) || (f == kTop && top_outside());
      if (!inside && !known) ++counts_[f];
    }
  }

  // Folds the window into counts_ and puts it below the largest field
  // counted so far, with kHeadroom fields above it, where the scan could
  // not say its largest field (a span with an infinity): values can reach
  // above what a first sample saw. Within 1 .. kTop - 1 where the scan
  // counts the zero and top fields, else from field 0 (a dtype of at most kW
  // fields).
  void place_window() {
    fold_window();
    if (!kMovable) {
      lo_ = 0;
      return;
    }
    int high = 1;
    for (int f = 1; f < kTop; ++f) {
      if (counts_[f] != 0) high = f;
    }
    lo_ = std::clamp(high + kHeadroom - kW + 1, 1, kTop - kW);
  }

  void move_window(int lo) {
    if (lo == lo_) return;
    fold_window();
    lo_ = lo;
  }

  void fold_window() {
    for (int j = 0; j < kW && lo_ + j < B::kFields; ++j) counts_[lo_ + j] += window_[j];
    std::memset(window_, 0, sizeof(window_));
  }

  VectorPath path_;
  int64_t counts_[kWindowedFields<S> ? B::kFields : 1] = {};  // the window's until folded
  int64_t window_[kW] = {};  // fields lo_ .. lo_ + kW - 1
  int lo_ = 0;
  bool placed_ = false;
  ScalarFieldCounter<S> scalar_;
};

}  // namespace cpu
}  // namespace zeroscan
