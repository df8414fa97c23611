// zeroscan.mark_nonfinite on the CPU: ORs into flags[slots[i]] what kinds of
// non-finite value xs[i] holds (kHoldsInf, kHoldsNan: nonfinite.h).
//
// Each tensor is walked in place (layout.h) in fixed pieces, split across
// threads; once every kind its dtype can hold is found, the other pieces
// stop. The runs are tested by an AVX2 build of the same loop where the CPU
// has AVX2 (and ZEROSCAN_CPU_CAPABILITY is not "scalar"): the default
// x86-64 build has no 64-bit lane compares.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "../nonfinite_check.h"
#include "../nonfinite.h"
#include "../op_common.h"
#include "scan_span.h"

namespace zeroscan {
namespace cpu {
namespace {

constexpr int64_t kPiece = 1 << 14;  // elements tested between looks at `found`

template <typename S>
int32_t kinds_plain(const S* p, int64_t n, int64_t stride, uint64_t finite_max) {
  return nonfinite_kinds(p, n, stride, finite_max);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename S>
__attribute__((target("avx2"))) int32_t kinds_avx2(const S* p, int64_t n, int64_t stride, uint64_t finite_max) {
  return nonfinite_kinds(p, n, stride, finite_max);
}

// Every cap but "scalar" allows AVX2; "scalar" keeps the plain loop.
bool use_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && capability_allows(Capability::kAvx2);
  return yes;
}
#endif

template <typename S>
int32_t kinds_held(const at::Tensor& x) {
  constexpr int32_t kAll = all_kinds<S>();
  if constexpr (kAll == 0) {
    return 0;  // an integer tensor: nothing to read
  } else {
    const Layout l = layout_of(x);
    if (l.numel == 0) return 0;
    const uint64_t finite_max = limits_of(x.scalar_type(), c10::nullopt).finite_max;
    const S* base = static_cast<const S*>(x.const_data_ptr());
    auto test = &kinds_plain<S>;
#if defined(__x86_64__) && defined(__GNUC__)
    if (use_avx2()) test = &kinds_avx2<S>;
#endif
    std::atomic<int32_t> found{0};
    at::parallel_for(0, l.numel, 4 * kPiece, [&](int64_t begin, int64_t end) {
      for (int64_t at = begin; at < end && found.load(std::memory_order_relaxed) != kAll; at += kPiece) {
        int32_t here = 0;
        for_each_run(l, at, std::min(end, at + kPiece), [&](int64_t offset, int64_t length, int64_t stride) {
          here |= test(base + offset, length, stride, finite_max);
        });
        if (here != 0) found.fetch_or(here, std::memory_order_relaxed);
      }
    });
    return found.load();
  }
}

void mark_nonfinite_cpu(at::TensorList xs, const at::Tensor& flags, at::IntArrayRef slots) {
  TORCH_CHECK(capability_cap() != Capability::kInvalid,
              "zeroscan.mark_nonfinite: ZEROSCAN_CPU_CAPABILITY must be scalar, avx2, avx512 or native; got '",
              std::getenv("ZEROSCAN_CPU_CAPABILITY"), "'");
  check_mark_nonfinite(xs, flags, slots);
  int32_t* out = flags.mutable_data_ptr<int32_t>();
  for (size_t t = 0; t < xs.size(); ++t) {
    out[slots[t]] |= visit_dtype(xs[t].scalar_type(), [&](auto tag) {
      return kinds_held<typename decltype(tag)::type>(xs[t]);
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroscan, CPU, m) {
  m.impl("mark_nonfinite", &mark_nonfinite_cpu);
}

}  // namespace cpu
}  // namespace zeroscan
