// The CPU's histogram count (csrc/histogram.h): how many elements of each
// span lie in each field.
//
// The floats of up to 32 bits are counted by the scan itself as it reads
// each vector, where the build has 32 vector registers (vec_scan.h,
// kCountsFieldsInScan), into a window this file places before the span and
// completes after it. Elsewhere they, and the 1-byte integers, are counted
// in vectors right after the scan has read the span, while it is still in
// the core's caches (a chunk is at most 64K elements for tensors of up to
// 64M), so memory is read once. The others count one increment per element into small tables
// (ScalarFieldCounter). Consecutive elements often share a field (a binade
// holds half of all values of its neighbourhood), and an increment that
// waits on the previous one to the same counter stalls: the tables, taken
// in turn, let several increments run at once. That still costs ~2 cycles
// per element.
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
// 1-byte integers count in vectors the fields of a window of kWindowFields:
// every field of a dtype that has no more (float8_e4m3fn, the 1-byte
// integers), else the fields up to kHeadroom above the largest |x| seen
// before the span (values thin out geometrically below the bulk of most
// data: a binade holds twice the values of the one below it, for values
// spread evenly around 0). The floats' window is counted by the scan as it
// reads the span where its build does (before_scan places it: vec_scan.h,
// kCountsFieldsInScan), else by a pass of its own after the scan, as the
// integers' is, with the window's top at the largest finite field so far. The
// scan itself has counted the zero field (zeros and subnormals) and, but
// for float8_e4m3fn (whose top field also holds numbers), the top field
// (NaN and infinities), so the window need not cover them. The elements of
// any other field leave the window's count short of the span's length:
// windows beside it count them (from the largest field so far down to the
// window, and below it), then one element at a time. float64 and the wider
// integers count one element at a time.
template <typename S>
class FieldCounter {
 public:
  using B = Binning<S>;
  static constexpr int kTop = B::kFields - 1;

  // path: the vector build that counts (the process's own but in tests).
  explicit FieldCounter(VectorPath path = vector_path())
      : path_(path), scan_counts_(kScanCountsFields<S> && scan_counts_fields_on(path)) {}

  // Scans p ([n] contiguous) on the counter's path into `t`, the tally of
  // the spans before p (as tally_chunk keeps it), and counts p's fields:
  // into the window the scan counts as it reads where its build does, and
  // the rest after it, while p is in the core's caches.
  void scan(const S* p, int64_t n, const Limits& lim, double shift, Tally<S, int64_t>& t) {
    const int64_t at_most_sub = t.at_most_sub, non_finite = t.numel - t.finite;
    FieldWindow* window = before_scan(p, n, t.numel > 0 ? B::field(t.hi) : -1);
    scan_span_on(path_, p, n, lim, shift, t, window);
    add(p, n, t.at_most_sub - at_most_sub, t.numel - t.finite - non_finite, B::field(t.hi));
  }

  // How many elements the windowed count took one at a time: the spans'
  // scalar tails, and every element of a span whose fields the windows did
  // not cover (tests/span_check.cpp holds ordinary data to the tails
  // alone). 0 where the count is not windowed (ScalarFieldCounter).
  int64_t counted_singly() const { return singly_; }

  // fields: [B::kFields], added to.
  void write(int64_t* fields) {
    if constexpr (kWindowedFields<S>) {
      fold_window();
      for (int f = 0; f < B::kFields; ++f) fields[f] += counts_[f];
    }
    scalar_.write(fields);
  }

 private:
  // Before the scan of p ([n] contiguous) on the counter's path: the window
  // the scan counts the fields of its vector part into where its build
  // counts as it reads, and in which every vector build notes the field of
  // the largest finite |x| it read (FieldWindow::finite_top); null for the
  // dtypes no vector build scans into a window, and on the scalar path.
  // seen_field: the field of the largest non-NaN |x| of the spans before p,
  // or -1 for none.
  FieldWindow* before_scan(const S* p, int64_t n, int seen_field) {
    if (!kScanCountsFields<S> || path_ == VectorPath::kNone) return nullptr;
    if (scan_counts_) {
      place_window(p, n, largest_finite(seen_field), kHeadroom);
      before_ = window_total();
    }
    window_.scanned = 0;
    return &window_;
  }

  // After it: p as given to before_scan, and what the scan found in it: how
  // many of its elements are zero or subnormal, and NaN or infinite, and
  // the field of the largest non-NaN |x| so far (in p or before it).
  void add(const S* p, int64_t n, int64_t zero_field, int64_t top_field, int high_field) {
    if constexpr (kWindowedFields<S>) {
      if (path_ != VectorPath::kNone) return add_windowed(p, n, zero_field, top_field, high_field);
    }
    scalar_.add(p, n);
  }

  static constexpr int kW = kWindowFields;
  static constexpr int64_t kCalibrate = 256;  // elements whose largest field places a first window
  static constexpr int kHeadroom = 2;         // fields of the window above the largest seen
  static constexpr int kExtraWindows = 2;     // windows on each side of it, before one at a time
  // Whether the scan counted the top field: NaN and infinities (but for
  // float8_e4m3fn, whose top field also holds numbers).
  static constexpr bool kTopCounted = Format<S>::kFloating && !std::is_same_v<S, e4m3_t>;
  // Whether the window moves: else it covers every field from 0.
  static constexpr bool kMovable = kTopCounted && B::kFields > kW;
  // One past the last field a window may count: all but the scan's top field.
  static constexpr int kCountedEnd = kTopCounted ? kTop : B::kFields;

  void add_windowed(const S* p, int64_t n, int64_t zero_field, int64_t top_field, int high_field) {
    high_field = largest_finite(high_field);
    int64_t counted = 0;
    if (scan_counts_) {
      counted = window_.scanned;
    } else {
      // A pass of its own, while p is in the core's caches: the window's top
      // at the largest finite field so far, which the scan has just seen, so
      // with no headroom.
      place_window(p, n, high_field, 0);
      before_ = window_total();
      counted = count_window_on(path_, p, n, window_.lo, window_.counts);
    }
    count_each(p + counted, n - counted, zero_field, top_field);
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
    int64_t missing = expected - (window_total() - before_);
    const int lo = window_.lo;
    // Fields above the window, where the span held values past the largest
    // seen before it: windows from the largest finite field so far down to
    // the window. (Any vector the window counted has set finite_top, so an
    // infinity never leaves that field unknown here.)
    const int above = lo + kW;
    const int above_end = std::min(high_field + 1, kCountedEnd);
    int above_lo = std::max(above, above_end);  // fields above_lo .. above_end - 1 covered
    for (int extra = 0; missing != 0 && extra < kExtraWindows && above_lo > above; ++extra) {
      const int from = std::max(above, above_lo - kW);
      missing -= count_range(p, counted, from, above_lo);
      above_lo = from;
    }
    // Fields below it: most often values far below the bulk (a tensor
    // spanning more binades than the window).
    int below = lo;  // fields below .. lo + kW - 1 covered
    for (int extra = 0; missing != 0 && extra < kExtraWindows && below > 1; ++extra) {
      const int from = std::max(1, below - kW);
      missing -= count_range(p, counted, from, below);
      below = from;
    }
    if (missing != 0) count_outside(p, counted, below, above_lo, above_end);
    window_.scanned = 0;  // before_scan sets it again for the next span
  }

  // high_field (the field of the largest non-NaN |x| so far), or, where an
  // infinity makes it the top field, that of the largest finite |x| the
  // vector scans have read: without it, a tensor with one infinity would
  // count every span's fields above the window one element at a time.
  int largest_finite(int high_field) const {
    return high_field < kTop || window_.finite_top < 0 ? high_field : window_.finite_top;
  }

  bool zero_outside() const { return window_.lo > 0; }
  bool top_outside() const { return kTopCounted && window_.lo + kW <= kTop; }

  int64_t window_total() const {
    int64_t sum = 0;
    for (int j = 0; j < kW; ++j) sum += window_.counts[j];
    return sum;
  }

  // Counts the elements of p[0, n) (n: a whole number of vectors) whose
  // field is in [from, to), to - from <= kW, in vectors, into counts_;
  // returns how many there were.
  int64_t count_range(const S* p, int64_t n, int from, int to) {
    int64_t window[kW] = {};
    count_window_on(path_, p, n, from, window);
    int64_t sum = 0;
    for (int f = from; f < to; ++f) {
      counts_[f] += window[f - from];
      sum += window[f - from];
    }
    return sum;
  }

  // Counts every element of p[0, n) into counts_, and takes those of the
  // zero and top fields off the scan's counts of them.
  void count_each(const S* p, int64_t n, int64_t& zero_field, int64_t& top_field) {
    using F = Format<S>;
    singly_ += n;
    for (int64_t i = 0; i < n; ++i) {
      const int f = B::field(F::key(p[i]));
      ++counts_[f];
      zero_field -= f == 0;
      top_field -= f == kTop;
    }
  }

  // Counts the elements of p[0, n) that neither the windows (fields below
  // .. window_.lo + kW - 1 and above_lo .. above_end - 1) nor the scan's
  // counts of the zero and top fields took.
  void count_outside(const S* p, int64_t n, int below, int above_lo, int above_end) {
    using F = Format<S>;
    singly_ += n;
    for (int64_t i = 0; i < n; ++i) {
      const int f = B::field(F::key(p[i]));
      const bool inside = (f >= below && f < window_.lo + kW) || (f >= above_lo && f < above_end);
      const bool known = (f == 0 && zero_outside()) || (f == kTop && top_outside());
      if (!inside && !known) ++counts_[f];
    }
  }

  // Puts the window's top `headroom` fields above the largest field seen
  // (seen_field), or, where none was (or an infinity hides it), in p's
  // first kCalibrate elements; where an infinity hides it and a window was
  // placed, it stays. Within 1 .. kTop - 1, where the scan counts the zero
  // and top fields.
  void place_window(const S* p, int64_t n, int seen_field, int headroom) {
    if constexpr (kMovable) {
      int high = seen_field;
      if (high >= kTop && placed_) return;
      if (high < 1 || high >= kTop) {
        using F = Format<S>;
        high = 1;
        for (int64_t i = 0; i < std::min(n, kCalibrate); ++i) {
          const int f = B::field(F::key(p[i]));
          if (f < kTop) high = std::max(high, f);
        }
      }
      move_window(std::clamp(high + headroom - kW + 1, 1, kTop - kW));
      placed_ = true;
    }
  }

  void move_window(int lo) {
    if (lo == window_.lo) return;
    fold_window();
    window_.lo = lo;
  }

  void fold_window() {
    for (int j = 0; j < kW && window_.lo + j < B::kFields; ++j) counts_[window_.lo + j] += window_.counts[j];
    std::memset(window_.counts, 0, sizeof(window_.counts));
  }

  VectorPath path_;
  bool scan_counts_;  // the scan counts the window as it reads (before_scan)
  int64_t counts_[kWindowedFields<S> ? B::kFields : 1] = {};  // the window's until folded
  FieldWindow window_;  // the window's counts, fields lo .. lo + kW - 1
  int64_t before_ = 0;  // window_total() before the span
  bool placed_ = false;
  int64_t singly_ = 0;  // counted_singly
  ScalarFieldCounter<S> scalar_;
};

}  // namespace cpu
}  // namespace zeroscan
