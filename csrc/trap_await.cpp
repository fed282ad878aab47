// ``await trap`` without a Python generator.
//
// A block suspends by awaiting a trap (a location, a step gate, a gather); ``Read.__await__`` as a
// Python generator costs a generator object and a frame per await. This iterator does the same in
// C: the first send yields the trap to the interleaver, the next returns the value sent back
// (through ``am_send``, so no StopIteration is raised). A ``throw()`` into the block raises at the
// block's own ``await`` line, since this iterator has no ``throw`` method of its own.
#include "asyncpp_native.h"

namespace {

struct TrapAwait {
  PyObject_HEAD
  PyObject* trap;
  int sent;  // 0: the trap not yet yielded; 1: yielded, waiting for the value; 2: done
};

PyTypeObject TrapAwaitType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PySendResult trap_send(PyObject* o, PyObject* arg, PyObject** result) {
  auto* a = reinterpret_cast<TrapAwait*>(o);
  if (a->sent == 0) {
    a->sent = 1;
    Py_INCREF(a->trap);
    *result = a->trap;
    return PYGEN_NEXT;
  }
  a->sent = 2;
  Py_INCREF(arg);
  *result = arg;
  return PYGEN_RETURN;
}

PyObject* trap_next(PyObject* o) {
  auto* a = reinterpret_cast<TrapAwait*>(o);
  if (a->sent == 0) {
    a->sent = 1;
    Py_INCREF(a->trap);
    return a->trap;
  }
  a->sent = 2;
  return nullptr;  // exhausted (a plain next() after the value: StopIteration(None))
}

// send(value): the same as am_send, for callers that use the method.
PyObject* trap_send_method(PyObject* o, PyObject* arg) {
  PyObject* result;
  if (trap_send(o, arg, &result) == PYGEN_NEXT) return result;
  _PyGen_SetStopIterationValue(result);
  Py_DECREF(result);
  return nullptr;
}

void trap_dealloc(PyObject* o) {
  Py_XDECREF(reinterpret_cast<TrapAwait*>(o)->trap);
  Py_TYPE(o)->tp_free(o);
}

PyAsyncMethods trap_async = {nullptr, nullptr, nullptr, trap_send};

PyMethodDef trap_methods[] = {{"send", trap_send_method, METH_O, "Resume with a value."},
                              {nullptr, nullptr, 0, nullptr}};

// The ``__await__`` installed on the trap classes.
PyObject* trap_await(PyObject* self, PyObject*) {
  auto* a = PyObject_New(TrapAwait, &TrapAwaitType);
  if (!a) return nullptr;
  Py_INCREF(self);
  a->trap = self;
  a->sent = 0;
  return reinterpret_cast<PyObject*>(a);
}

PyMethodDef await_def = {"__await__", trap_await, METH_NOARGS, "Yield this trap to the interleaver."};

// install_await(cls): make ``await obj`` of class ``cls`` use the native iterator.
PyObject* install_await(PyObject*, PyObject* cls) {
  if (!PyType_Check(cls)) return PyErr_Format(PyExc_TypeError, "install_await() takes a class");
  PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls), &await_def);
  if (!descr) return nullptr;
  int r = PyObject_SetAttrString(cls, "__await__", descr);
  Py_DECREF(descr);
  if (r < 0) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef functions[] = {{"install_await", install_await, METH_O, "Await instances of a trap class natively."},
                           {nullptr, nullptr, 0, nullptr}};

}  // namespace

void asyncpp::register_await(pybind11::module_& m) {
  TrapAwaitType.tp_name = "asyncpp_native.TrapAwait";
  TrapAwaitType.tp_basicsize = sizeof(TrapAwait);
  TrapAwaitType.tp_flags = Py_TPFLAGS_DEFAULT;
  TrapAwaitType.tp_doc = "The iterator of ``await trap``.";
  TrapAwaitType.tp_dealloc = trap_dealloc;
  TrapAwaitType.tp_as_async = &trap_async;
  TrapAwaitType.tp_iter = PyObject_SelfIter;
  TrapAwaitType.tp_iternext = trap_next;
  TrapAwaitType.tp_methods = trap_methods;
  if (PyType_Ready(&TrapAwaitType) < 0) throw pybind11::error_already_set();
  for (PyMethodDef* d = functions; d->ml_name; d++) {
    PyObject* f = PyCFunction_New(d, nullptr);
    if (!f) throw pybind11::error_already_set();
    m.add_object(d->ml_name, f);
  }
}
