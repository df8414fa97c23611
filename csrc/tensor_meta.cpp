// zeroscan._C: the Python calls of stats and stats_many that are not
// operators. tensor_metas: the dtype and shape of every tensor of a list,
// and whether any may map a file, read in C++ so that stats_many's Python
// work does not grow per tensor; foreign_storage, whether one tensor may;
// stats_call and stats_many_call, the stats and stats_many operators called
// without torch.ops' argument parsing.
//
// stats_many's batch makes each Stats when first indexed; its dtype and shape
// must still be those of the tensor at the call, and the batch must not hold
// the tensors (a kept batch would keep a model's gradients alive). Reading
// them in Python costs ~150 ns a tensor (a torch.Size and a tuple each, and
// the garbage collections they set off); here it is a few ns a dimension,
// into one bytes object and one list of the dtype singletons. Whether a CPU
// tensor's storage is resizable (zeroscan/mapped_reads.py: one that is not
// may map a file, and is scanned under the SIGBUS guard) took another
// ~150 ns a tensor in Python.
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace zeroscan {
namespace {

bool is_foreign(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.has_storage() && !t.storage().resizable();
}

// tensor_metas(xs: list) -> (list[torch.dtype], bytes, bool) | None
//
// bytes: little-endian int64 words, n + 1 offsets into the dimensions that
// follow them (tensor i's sizes are dims[offsets[i]:offsets[i + 1]]).
// bool: whether any CPU tensor has a storage that cannot be resized (memory
// torch did not allocate, mapped_reads.maybe_mapped).
// None when an item is not a plain tensor with concrete sizes (a symbolic
// one, say): the caller then reads the metadata in Python.
PyObject* tensor_metas(PyObject* /*module*/, PyObject* xs) {
  if (!PyList_Check(xs)) {
    PyErr_Format(PyExc_TypeError, "tensor_metas: xs must be a list, got %s", Py_TYPE(xs)->tp_name);
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(xs);
  std::vector<int64_t> words(static_cast<size_t>(n) + 1);
  std::vector<at::ScalarType> dtypes(static_cast<size_t>(n));
  bool foreign = false;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyList_GET_ITEM(xs, i);
      if (!THPVariable_Check(item)) Py_RETURN_NONE;
      const at::Tensor& t = THPVariable_Unpack(item);
      if (!t.defined() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) Py_RETURN_NONE;
      words[static_cast<size_t>(i)] = static_cast<int64_t>(words.size()) - n - 1;
      for (const int64_t d : t.sizes()) words.push_back(d);
      dtypes[static_cast<size_t>(i)] = t.scalar_type();
      foreign = foreign || is_foreign(t);
    }
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  words[static_cast<size_t>(n)] = static_cast<int64_t>(words.size()) - n - 1;

  PyObject* types = PyList_New(n);
  if (types == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(dtypes[static_cast<size_t>(i)]));
    Py_INCREF(dtype);
    PyList_SET_ITEM(types, i, dtype);
  }
  PyObject* dims = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                             static_cast<Py_ssize_t>(words.size() * sizeof(int64_t)));
  if (dims == nullptr) {
    Py_DECREF(types);
    return nullptr;
  }
  PyObject* result = PyTuple_Pack(3, types, dims, foreign ? Py_True : Py_False);
  Py_DECREF(types);
  Py_DECREF(dims);
  return result;
}

// foreign_storage(x) -> bool: whether x is a CPU tensor whose storage cannot
// be resized (mapped_reads.maybe_mapped); False for anything else, a tensor
// with no storage of its own (a torch.func wrapper) among them.
PyObject* foreign_storage(PyObject* /*module*/, PyObject* x) {
  if (!THPVariable_Check(x)) Py_RETURN_FALSE;
  try {
    if (is_foreign(THPVariable_Unpack(x))) Py_RETURN_TRUE;
  } catch (const std::exception&) {
  }
  Py_RETURN_FALSE;
}

// The tensor of `item` when it is one the operators may be called with
// directly: exactly a torch.Tensor or Parameter (a subclass's
// __torch_function__ is for torch.ops to call), defined, on the CPU (GPU
// calls keep torch.ops, unmeasured here); else null.
const at::Tensor* plain_cpu_tensor(PyObject* item) {
  if (!THPVariable_CheckExact(item)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(item);
  return t.defined() && t.is_cpu() ? &t : nullptr;
}

// `tol` as the operators take it, or false when it is no float or None.
bool read_tol(PyObject* arg, std::optional<double>& tol) {
  if (arg == Py_None) return true;
  if (!PyFloat_Check(arg)) return false;
  tol = PyFloat_AS_DOUBLE(arg);
  return true;
}

// op.call(args...) with the GIL released, as torch's own bindings run
// kernels; an error still leaves it as a C++ exception for
// HANDLE_TH_ERRORS, with the GIL taken back.
template <typename Op, typename... Args>
auto call_without_gil(const Op& op, const Args&... args) {
  pybind11::gil_scoped_release no_gil;
  return op.call(args...);
}

// stats_call(x, tol: float | None) -> Tensor | None: the zeroscan::stats
// operator called for one plain CPU tensor, as zeroscan.stats calls it
// outside torch.compile and TorchFunctionModes. torch.ops.zeroscan.stats
// matches its Python arguments to the schema on every call, about 1 us of a
// 1K-element tensor's 2.5 us; here they are unpacked directly and the
// dispatcher is called with them typed, so it still picks the kernel
// (dispatch modes, vmap) as for torch.ops. None for any other x: the caller
// then takes torch.ops, which honours __torch_function__.
PyObject* stats_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  std::optional<double> tol;
  if (nargs != 2 || !read_tol(args[1], tol)) {
    PyErr_SetString(PyExc_TypeError, "stats_call: takes (x, tol: float | None)");
    return nullptr;
  }
  const at::Tensor* x = plain_cpu_tensor(args[0]);
  if (x == nullptr) Py_RETURN_NONE;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("zeroscan::stats", "")
                             .typed<at::Tensor(const at::Tensor&, std::optional<double>)>();
  return THPVariable_Wrap(call_without_gil(op, *x, tol));
  END_HANDLE_TH_ERRORS
}

// stats_many_call(xs: list, tol: float | None, histogram: bool)
//     -> Tensor | (Tensor, Tensor) | None
// The zeroscan::stats_many (or stats_many_hist) operator called for a list
// of plain CPU tensors, as stats_call calls zeroscan::stats: torch.ops
// matches the list to the schema tensor by tensor, 0.05 us a tensor whose
// metadata the caches hold and 0.2 us one whose they do not (200 one-element
// tensors: 41 -> 31 us, and 105 -> 60 us with 4 MB read between calls).
// None when an item is not a plain CPU tensor (plain_cpu_tensor).
PyObject* stats_many_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  std::optional<double> tol;
  if (nargs != 3 || !PyList_Check(args[0]) || !read_tol(args[1], tol) || !PyBool_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "stats_many_call: takes (xs: list, tol: float | None, histogram: bool)");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(args[0]);
  std::vector<at::Tensor> xs;
  xs.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* t = plain_cpu_tensor(PyList_GET_ITEM(args[0], i));
    if (t == nullptr) Py_RETURN_NONE;
    xs.push_back(*t);
  }
  if (args[2] == Py_False) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("zeroscan::stats_many", "")
                               .typed<at::Tensor(at::TensorList, std::optional<double>)>();
    return THPVariable_Wrap(call_without_gil(op, at::TensorList(xs), tol));
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("zeroscan::stats_many_hist", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList, std::optional<double>)>();
  auto [rows, fields] = call_without_gil(op, at::TensorList(xs), tol);
  PyObject* row_object = THPVariable_Wrap(std::move(rows));
  if (row_object == nullptr) return nullptr;
  PyObject* field_object = THPVariable_Wrap(std::move(fields));
  if (field_object == nullptr) {
    Py_DECREF(row_object);
    return nullptr;
  }
  PyObject* result = PyTuple_Pack(2, row_object, field_object);
  Py_DECREF(row_object);
  Py_DECREF(field_object);
  return result;
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef kPythonMethods[] = {
    {"tensor_metas", tensor_metas, METH_O,
     "tensor_metas(xs: list) -> (list[torch.dtype], bytes, bool) | None: every tensor's dtype, "
     "its sizes as int64 words (n + 1 offsets, then the dimensions), and whether any CPU tensor's "
     "storage cannot be resized."},
    {"foreign_storage", foreign_storage, METH_O,
     "foreign_storage(x) -> bool: whether x is a CPU tensor whose storage cannot be resized."},
    {"stats_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(stats_call)), METH_FASTCALL,
     "stats_call(x, tol: float | None) -> Tensor | None: torch.ops.zeroscan.stats(x, tol) for a plain "
     "CPU tensor, its arguments unpacked in C++; None for any other x."},
    {"stats_many_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(stats_many_call)),
     METH_FASTCALL,
     "stats_many_call(xs: list, tol: float | None, histogram: bool) -> Tensor | (Tensor, Tensor) | None: "
     "torch.ops.zeroscan.stats_many(_hist)(xs, tol) for plain CPU tensors, its arguments unpacked in "
     "C++; None for any other list."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace zeroscan
