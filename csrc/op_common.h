// What every backend's launcher shares: input checks with readable errors,
// the per-dtype thresholds, and the shape of the result.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <vector>

#include "classify.h"
#include "dtypes.h"
#include "histogram.h"
#include "layout.h"
#include "stats_record.h"

namespace zeroscan {

// Calls fn(DtypeTag<S>{}) with the storage type S of dtype `t` (dtypes.h).
template <typename S>
struct DtypeTag {
  using type = S;
};

template <typename Fn>
decltype(auto) visit_dtype(at::ScalarType t, Fn&& fn) {
  switch (t) {
#define ZEROSCAN_CASE(name, S, value_t, tiny, eps) \
  case at::ScalarType::name:                       \
    return fn(DtypeTag<S>{});
    ZEROSCAN_DTYPES(ZEROSCAN_CASE)
#undef ZEROSCAN_CASE
    default:
      TORCH_CHECK(false, "zeroscan: unsupported dtype ", t);
  }
}

inline bool is_supported_dtype(at::ScalarType t) {
  switch (t) {
#define ZEROSCAN_CASE(name, S, value_t, tiny, eps) case at::ScalarType::name:
    ZEROSCAN_DTYPES(ZEROSCAN_CASE)
#undef ZEROSCAN_CASE
    return true;
    default:
      return false;
  }
}

// The key limits (classify.h) of dtype `t` for `tol`, which defaults to the
// dtype's eps. The default ones are computed once per dtype.
template <typename S>
Limits limits_of(double tiny, double eps, c10::optional<double> tol) {
  static const Limits by_default = limits_for<S>(tiny, eps);
  if (!tol.has_value()) return by_default;
  Limits l = by_default;
  set_bounds<S>(l, *tol);  // all of them: a few binary searches, once per call
  return l;
}

inline Limits limits_of(at::ScalarType t, c10::optional<double> tol) {
  switch (t) {
#define ZEROSCAN_CASE(name, S, value_t, tiny, eps) \
  case at::ScalarType::name:                       \
    return limits_of<S>(tiny, eps, tol);
    ZEROSCAN_DTYPES(ZEROSCAN_CASE)
#undef ZEROSCAN_CASE
    default:
      TORCH_CHECK(false, "zeroscan: unsupported dtype ", t);
  }
}

inline void check_tol(const char* op, c10::optional<double> tol) {
  if (!tol.has_value()) return;
  TORCH_CHECK(!std::isnan(*tol) && *tol >= 0.0, op,
              ": tol must be a non-negative number, got ", *tol);
}

// Names an argument in messages: "x", or "xs[3]" for an element of a list.
struct ArgName {
  const char* name;
  int64_t index;  // -1: not a list element
};

inline std::ostream& operator<<(std::ostream& out, const ArgName& a) {
  out << a.name;
  if (a.index >= 0) out << "[" << a.index << "]";
  return out;
}

// The bytes of x's storage that its sizes, strides and offset reach: [first,
// end) from the start of the storage, or false when they overflow int64.
inline bool storage_reach(const at::Tensor& x, int64_t& first, int64_t& end) {
  int64_t low = x.storage_offset(), high = x.storage_offset();
  for (int64_t d = 0; d < x.dim(); ++d) {
    int64_t reach = 0;
    if (c10::mul_overflows(x.size(d) - 1, x.stride(d), &reach)) return false;
    if (c10::add_overflows(reach < 0 ? low : high, reach, reach < 0 ? &low : &high)) return false;
  }
  const int64_t size = static_cast<int64_t>(x.element_size());
  return !c10::mul_overflows(low, size, &first) &&
         !c10::add_overflows(high, int64_t{1}, &high) &&
         !c10::mul_overflows(high, size, &end);
}

// A tensor whose storage is smaller than its shape says would be read past
// the storage's end: FSDP frees an unsharded parameter's memory with
// untyped_storage().resize_(0) and leaves its shape as it was.
inline void check_storage(const char* op, ArgName what, const at::Tensor& x) {
  if (x.numel() == 0) return;
  TORCH_CHECK(x.has_storage(), op, ": ", what,
              " has no storage of its own to scan (a wrapper tensor)");
  const int64_t held = static_cast<int64_t>(x.storage().nbytes());
  int64_t first = 0, end = 0;
  const bool fits = storage_reach(x, first, end);
  TORCH_CHECK(fits && first >= 0 && end <= held, op, ": ", what,
              " has no data to scan: its storage holds ", held,
              " bytes but its shape ", x.sizes(), " and strides ", x.strides(),
              " reach ", fits ? std::to_string(end) : std::string("beyond int64"),
              " (a parameter whose memory was freed, as FSDP frees an unsharded "
              "parameter with untyped_storage().resize_(0))");
}

inline void check_input(const char* op, ArgName what, const at::Tensor& x) {
  TORCH_CHECK(x.defined(), op, ": ", what,
              " is an undefined tensor (a gradient that was never computed "
              "is None / undefined)");
  TORCH_CHECK(x.layout() == at::kStrided, op, ": ", what,
              " must be a dense (strided) tensor, got layout ", x.layout(),
              "; scan x.to_dense() or x.values()");
  TORCH_CHECK(is_supported_dtype(x.scalar_type()), op, ": ", what,
              x.is_complex() ? " is complex (" : " has unsupported dtype (",
              x.scalar_type(),
              x.is_complex()
                  ? "); scan x.abs() for magnitudes or torch.view_as_real(x) "
                    "for the real and imaginary parts"
                  : "); supported: float32, float64, float16, bfloat16, "
                    "float8_e4m3fn, float8_e5m2, bool, uint8, int8, int16, "
                    "int32 and int64");
  TORCH_CHECK(x.dim() <= kMaxDims, op, ": ", what, " has ", x.dim(),
              " dimensions; at most ", kMaxDims, " are supported");
  check_storage(op, what, x);
}

inline Layout layout_of(const at::Tensor& x) {
  return plan_layout(x.sizes().data(), x.strides().data(),
                     static_cast<int>(x.dim()));
}

// rows: int64 [W, N, kNumFields] with W >= 1, the input of combine_rows.
inline void check_rows(const char* op, const at::Tensor& rows) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 3 &&
                  rows.size(2) == kNumFields && rows.size(0) > 0,
              op, ": rows must be an int64 [W, N, ", int(kNumFields),
              "] tensor of result rows with W >= 1, got ", rows.scalar_type(),
              " of shape ", rows.sizes());
  check_storage(op, ArgName{"rows", -1}, rows);
}

// Histogram fields of one tensor of dtype `t` (histogram.h).
inline int64_t fields_of(at::ScalarType t) {
  return visit_dtype(t, [](auto tag) -> int64_t {
    return Binning<typename decltype(tag)::type>::kFields;
  });
}

// A CPU launcher's check that every tensor of xs is on `device` (a CUDA
// build of torch may hand it CUDA tensors beside CPU ones).
inline void check_same_device(const char* op, at::TensorList xs, c10::Device device) {
  for (size_t t = 0; t < xs.size(); ++t) {
    TORCH_CHECK(!xs[t].defined() || xs[t].device() == device, op,
                ": all tensors of one call must be on the same device; xs[0] is on ",
                device, " but xs[", t, "] is on ", xs[t].device());
  }
}

// The zeroed histogram buffer of xs: int64 [N, B] on `device`, B the most
// fields of any of their dtypes (0 for an empty list). Checks each input,
// so that an unsupported dtype is named as the scan would name it.
inline at::Tensor new_histogram(const char* op, at::TensorList xs, c10::Device device) {
  int64_t width = 0;
  for (size_t t = 0; t < xs.size(); ++t) {
    check_input(op, ArgName{"xs", static_cast<int64_t>(t)}, xs[t]);
    width = std::max(width, fields_of(xs[t].scalar_type()));
  }
  return at::zeros({static_cast<int64_t>(xs.size()), width},
                   at::TensorOptions().dtype(at::kLong).device(device));
}

// The result buffer: int64 [n, kNumFields] on `device`.
inline at::Tensor new_result(int64_t n, c10::Device device) {
  return at::empty({n, kNumFields},
                   at::TensorOptions().dtype(at::kLong).device(device));
}

}  // namespace zeroscan
