// A block's rows of a batched value: the hot part of every read on a batching engine (vLLM), where
// each request's block sees only its own token rows. Python slicing costs about a microsecond per
// tensor; at::Tensor::slice here costs a fraction of that.
#include "asyncpp_native.h"

namespace {

// narrow_value(value, start, stop, batch): tensors whose first dimension is ``batch`` become the view
// value[start:stop]; tuples and lists are narrowed element by element; anything else is kept.
pybind11::object narrow_value(const pybind11::object& value, int64_t start, int64_t stop, int64_t batch) {
  PyObject* o = value.ptr();
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.dim() > 0 && t.size(0) == batch) {
      return pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(t.slice(0, start, stop)));
    }
    return value;
  }
  if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
    const bool is_tuple = PyTuple_CheckExact(o);
    const Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
    pybind11::list items(n);
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* item = is_tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i);
      items[i] = narrow_value(pybind11::reinterpret_borrow<pybind11::object>(item), start, stop, batch);
    }
    if (is_tuple) return pybind11::tuple(items);
    return items;
  }
  return value;
}

}  // namespace

PyObject* asyncpp::narrow_rows(PyObject* value, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t batch) {
  try {
    return narrow_value(pybind11::reinterpret_borrow<pybind11::object>(value), start, stop, batch).release().ptr();
  } catch (pybind11::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

void asyncpp::register_rows(pybind11::module_& m) {
  m.def("narrow_rows", &narrow_value, "value with its batch-sized tensors narrowed to rows [start, stop)");
}
