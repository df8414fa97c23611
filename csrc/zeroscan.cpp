// The one place zeroscan's operators are declared. Each backend registers
// its kernels for these schemas in its own file (cpu/, cuda/), so a build
// without CUDA simply leaves cuda/ out.
#include <Python.h>
#include <torch/library.h>

namespace zeroscan {
extern PyMethodDef kPythonMethods[];  // tensor_meta.cpp
}

extern "C" {
// `import zeroscan._C` loads this shared library, which runs the
// registrations below; the module itself holds only tensor_metas,
// foreign_storage, stats_call and stats_many_call, helpers of stats_many and
// stats that are not operators (they read Python objects).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, zeroscan::kPythonMethods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(zeroscan, m) {
  // x: any shape -> int64 [16], one result row (see csrc/stats_record.h).
  m.def("stats(Tensor x, float? tol=None) -> Tensor");
  // xs: N tensors on one device -> int64 [N, 16].
  m.def("stats_many(Tensor[] xs, float? tol=None) -> Tensor");
  // xs: N tensors on one device -> (int64 [N, 16], int64 [N, B]):
  // stats_many's rows, and each tensor's log2-magnitude histogram fields
  // (see csrc/histogram.h), B the most fields of any of xs's dtypes.
  m.def("stats_many_hist(Tensor[] xs, float? tol=None) -> (Tensor, Tensor)");
  // xs: N CPU tensors viewing a memory-mapped file -> (int64 [N, 16], bool
  // [N], int64 [N, B]): stats_many's rows, whether a SIGBUS (the file
  // truncated meanwhile) hit while reading each tensor, whose row is then
  // zeros, and with `histogram` the fields of stats_many_hist (else B = 0).
  m.def("stats_many_mapped(Tensor[] xs, float? tol=None, bool histogram=False) -> (Tensor, Tensor, Tensor)");
  // rows: int64 [W, N, 16], W parts' rows of the same N tensors -> int64
  // [N, 16], each tensor's parts combined (`combine_in_tree`, stats_record.h).
  m.def("combine_rows(Tensor rows) -> Tensor");
  // xs: N tensors on one device; flags: int32 [F] on that device; slots: N
  // indices into flags. ORs into flags[slots[i]] 1 when xs[i] holds an
  // infinity and 2 when it holds a NaN (csrc/nonfinite.h); never reads the
  // flags back, so nothing waits for the device.
  m.def("mark_nonfinite(Tensor[] xs, Tensor(a!) flags, int[] slots) -> ()");
}

// The results are counts and encoded words, int64 and bool, which carry no
// gradient, so the Autograd keys pass these operators straight to the
// backend. Without this they reached torch's boxed autograd fallback, which
// would only warn about a result that requires grad (none can) and which
// turns every argument into an IValue and back on every call: 0.1 us of
// _C.stats_call's 1.3 us on 1K elements, and 4 of the 31 us of stats_many
// over 200 one-element tensors. (mark_nonfinite, which writes into an
// argument, keeps torch's default.)
TORCH_LIBRARY_IMPL(zeroscan, Autograd, m) {
  for (const char* op : {"stats", "stats_many", "stats_many_hist", "stats_many_mapped", "combine_rows"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}
