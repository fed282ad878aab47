// A block's rows of a batched value: the hot part of every read on a batching engine (vLLM), where
// each request's block sees only its own token rows. Python slicing costs about half a microsecond
// per tensor, and a decoder layer's output is two of them; here an inference tensor's rows are a
// view made without the dispatcher, and tuples are built directly.
#include "asyncpp_native.h"

namespace {

// Whether ``t.slice(0, ...)`` may be made as a bare view of its storage: an inference tensor (no
// autograd, no version counter to share) of a plain strided dense type, with no Python or
// functorch keys. Everything else goes through the dispatcher.
bool bare_view_ok(const at::Tensor& t) {
  if (!t.is_inference() || t.layout() != at::kStrided || t.is_quantized() || t.is_nested()) return false;
  const c10::DispatchKeySet keys = t.key_set();
  return !keys.has(c10::DispatchKey::Python) && !keys.has(c10::DispatchKey::PythonTLSSnapshot) &&
         !keys.has(c10::DispatchKey::Functionalize) && !keys.has(c10::DispatchKey::FuncTorchBatched) &&
         !keys.has(c10::DispatchKey::Conjugate) && !keys.has(c10::DispatchKey::Negative) &&
         t.has_storage();
}

// rows [start, stop) of ``t`` along dim 0: what ``t.slice(0, start, stop)`` returns (which clamps
// a range outside the tensor, and that case it makes itself).
at::Tensor rows_view(const at::Tensor& t, int64_t start, int64_t stop) {
  if (start < 0 || stop < start || stop > t.size(0) || !bare_view_ok(t)) return t.slice(0, start, stop);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(), t.dtype());
  c10::SmallVector<int64_t, 5> sizes(t.sizes().begin(), t.sizes().end());
  sizes[0] = stop - start;
  impl->set_sizes_and_strides(sizes, t.strides(), t.storage_offset() + start * t.stride(0));
  return at::Tensor(std::move(impl));
}

// The kernel's Python narrowing (batching.narrow), for the containers this file does not build
// itself (named tuples, dataclasses, dict subclasses): the two must agree on every value.
PyObject* fallback = nullptr;

PyObject* narrow(PyObject* o, int64_t start, int64_t stop, int64_t batch);

PyObject* narrow_dict(PyObject* o, int64_t start, int64_t stop, int64_t batch) {
  PyObject* out = PyDict_New();
  if (!out) return nullptr;
  PyObject *key, *item;
  Py_ssize_t pos = 0;
  while (PyDict_Next(o, &pos, &key, &item)) {
    PyObject* v = narrow(item, start, stop, batch);
    if (!v || PyDict_SetItem(out, key, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(v);
  }
  return out;
}

// ``value`` with its tensors of first dimension ``batch`` narrowed to rows [start, stop); tuples,
// lists and dicts element by element; other containers by the kernel's Python narrowing; plain
// scalars as they are. New reference, or nullptr with an error.
PyObject* narrow(PyObject* o, int64_t start, int64_t stop, int64_t batch) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.dim() > 0 && t.size(0) == batch) return THPVariable_Wrap(rows_view(t, start, stop));
    Py_INCREF(o);
    return o;
  }
  const bool is_tuple = PyTuple_CheckExact(o);
  if (!is_tuple && !PyList_CheckExact(o)) {
    if (o == Py_None || PyLong_Check(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o) || !fallback) {
      Py_INCREF(o);
      return o;
    }
    if (PyDict_CheckExact(o)) return narrow_dict(o, start, stop, batch);
    return PyObject_CallFunction(fallback, "OLLL", o, (long long)start, (long long)stop, (long long)batch);
  }
  const Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
  PyObject* out = is_tuple ? PyTuple_New(n) : PyList_New(n);
  if (!out) return nullptr;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* item = narrow(is_tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i), start, stop, batch);
    if (!item) {
      Py_DECREF(out);
      return nullptr;
    }
    if (is_tuple) {
      PyTuple_SET_ITEM(out, i, item);
    } else {
      PyList_SET_ITEM(out, i, item);
    }
  }
  return out;
}

pybind11::object narrow_value(const pybind11::object& value, int64_t start, int64_t stop, int64_t batch) {
  PyObject* out = narrow(value.ptr(), start, stop, batch);
  if (!out) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(out);
}

}  // namespace

PyObject* asyncpp::narrow_rows(PyObject* value, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t batch) {
  try {
    return narrow(value, start, stop, batch);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

void asyncpp::register_rows(pybind11::module_& m) {
  m.def("narrow_rows", &narrow_value, "value with its batch-sized tensors narrowed to rows [start, stop)");
  m.def(
      "set_narrow_fallback",
      [](const pybind11::object& fn) {
        Py_XDECREF(fallback);
        fallback = fn.is_none() ? nullptr : fn.inc_ref().ptr();
      },
      "``fn(value, start, stop, batch)`` narrows the containers narrow_rows does not build itself");
}
