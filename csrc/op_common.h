// What every backend's launcher shares: input checks with readable errors,
// the per-dtype thresholds, and the shape of the result.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cfloat>
#include <cmath>
#include <ostream>
#include <vector>

#include "classify.h"
#include "layout.h"
#include "stats_record.h"

namespace zeroscan {

// The compute type a dtype is widened to, exactly: float for floating types
// of up to 32 bits, double for float64 and for integers (whose counts and
// |x| range must not round).
inline bool widens_to_float(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kHalf:
    case at::kBFloat16:
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2:
      return true;
    default:
      return false;
  }
}

inline bool is_supported_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2:
    case at::kBool:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// torch.finfo(t).tiny and torch.finfo(t).eps; 0 and 0 for integer types,
// which have no subnormals and no rounding unit.
inline double dtype_tiny(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FLT_MIN;
    case at::kDouble: return DBL_MIN;
    case at::kHalf: return std::ldexp(1.0, -14);
    case at::kBFloat16: return std::ldexp(1.0, -126);
    case at::kFloat8_e4m3fn: return std::ldexp(1.0, -6);
    case at::kFloat8_e5m2: return std::ldexp(1.0, -14);
    default: return 0.0;
  }
}

inline double dtype_eps(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return std::ldexp(1.0, -23);
    case at::kDouble: return std::ldexp(1.0, -52);
    case at::kHalf: return std::ldexp(1.0, -10);
    case at::kBFloat16: return std::ldexp(1.0, -7);
    case at::kFloat8_e4m3fn: return std::ldexp(1.0, -3);
    case at::kFloat8_e5m2: return std::ldexp(1.0, -2);
    default: return 0.0;
  }
}

// The largest acc_t value that is <= v (v >= 0), so that `|x| <= v` tested
// in acc_t is exactly `|x| <= v` tested in real numbers.
template <typename acc_t>
acc_t round_down(double v) {
  acc_t r = static_cast<acc_t>(v);
  if (static_cast<double>(r) > v) r = std::nextafter(r, acc_t(0));
  return r;
}

template <typename acc_t>
Thresholds<acc_t> thresholds_for(at::ScalarType t, c10::optional<double> tol) {
  Thresholds<acc_t> th;
  // tiny is a power of two, exact in every compute type.
  th.tiny = to_bits(static_cast<acc_t>(dtype_tiny(t)));
  th.tol = to_bits(round_down<acc_t>(tol.has_value() ? *tol : dtype_eps(t)));
  return th;
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
                    "float8_e4m3fn, float8_e5m2, bool and integer types");
  TORCH_CHECK(x.dim() <= kMaxDims, op, ": ", what, " has ", x.dim(),
              " dimensions; at most ", kMaxDims, " are supported");
}

inline Layout layout_of(const at::Tensor& x) {
  return plan_layout(x.sizes().data(), x.strides().data(),
                     static_cast<int>(x.dim()));
}

// The result buffer: int64 [n, kNumFields] on `device`.
inline at::Tensor new_result(int64_t n, c10::Device device) {
  return at::empty({n, kNumFields},
                   at::TensorOptions().dtype(at::kLong).device(device));
}

}  // namespace zeroscan
