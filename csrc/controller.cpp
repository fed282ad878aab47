// Per-module controllers: what runs instead of a module's forward during a run.
//
// A controller shadows one module's ``forward`` (as an instance attribute, so the module's own
// __call__ machinery still runs). A call nobody waits on costs two set lookups and a counter bump,
// done here in C because the Python equivalent costs more than many small modules' own forward.
// A call some block waits on goes to the interleaver's ``visit`` (Python).
//
// The RunSlot is shared by all controllers of a model: it holds the run's interleaver, the set of
// module indices some block waits on (``hot``) and the per-module call counts of the current step.
// While a block's own code runs, ``bypass`` is set: a block that calls the model's modules itself
// (a logit lens through ``lm_head``) runs them plainly, unseen by the run.

#include "asyncpp_native.h"

#include <structmember.h>

namespace {

PyObject* str_visit = nullptr;
PyObject* str_visit_output = nullptr;

struct RunSlot {
  PyObject_HEAD
  PyObject* kernel;  // the interleaver of the run in progress, or None
  PyObject* hot;     // set of module indices some block waits on
  PyObject* counts;  // list: completed calls per module index in the current step
  int bypass;
};

int slot_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* s = reinterpret_cast<RunSlot*>(o);
  Py_VISIT(s->kernel);
  Py_VISIT(s->hot);
  Py_VISIT(s->counts);
  return 0;
}

int slot_clear(PyObject* o) {
  auto* s = reinterpret_cast<RunSlot*>(o);
  Py_CLEAR(s->kernel);
  Py_CLEAR(s->hot);
  Py_CLEAR(s->counts);
  return 0;
}

void slot_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  slot_clear(o);
  Py_TYPE(o)->tp_free(o);
}

PyObject* slot_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* s = reinterpret_cast<RunSlot*>(type->tp_alloc(type, 0));
  if (!s) return nullptr;
  Py_INCREF(Py_None);
  s->kernel = Py_None;
  s->hot = PySet_New(nullptr);
  s->counts = PyList_New(0);
  s->bypass = 0;
  if (!s->hot || !s->counts) {
    Py_DECREF(s);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(s);
}

// slot.activate(kernel, hot, counts): attach a run. slot.deactivate(): detach it.
PyObject* slot_activate(PyObject* o, PyObject* args) {
  auto* s = reinterpret_cast<RunSlot*>(o);
  PyObject *kernel, *hot, *counts;
  if (!PyArg_ParseTuple(args, "OO!O!", &kernel, &PySet_Type, &hot, &PyList_Type, &counts)) return nullptr;
  Py_INCREF(kernel);
  Py_INCREF(hot);
  Py_INCREF(counts);
  Py_SETREF(s->kernel, kernel);
  Py_SETREF(s->hot, hot);
  Py_SETREF(s->counts, counts);
  s->bypass = 0;
  Py_RETURN_NONE;
}

PyObject* slot_deactivate(PyObject* o, PyObject*) {
  auto* s = reinterpret_cast<RunSlot*>(o);
  Py_INCREF(Py_None);
  Py_SETREF(s->kernel, Py_None);
  s->bypass = 0;
  Py_RETURN_NONE;
}

PyMethodDef slot_methods[] = {
    {"activate", slot_activate, METH_VARARGS, "Attach a run: (interleaver, hot set, counts list)."},
    {"deactivate", slot_deactivate, METH_NOARGS, "Detach the run."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef slot_members[] = {
    {"kernel", T_OBJECT, offsetof(RunSlot, kernel), READONLY, "the interleaver of the run, or None"},
    {"bypass", T_BOOL, offsetof(RunSlot, bypass), 0, "set while a block's own code runs"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject RunSlotType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ------------------------------------------------------------------------------------------------

struct Controller {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  RunSlot* slot;
  PyObject* forward;   // the module's real forward
  PyObject* index;     // module index (int)
  Py_ssize_t idx;
  PyObject* replaced;  // the instance-level forward this controller shadows, or None
};

PyObject* visit_full(Controller* c, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject* tuple = PyTuple_New(nargs);
  if (!tuple) return nullptr;
  for (Py_ssize_t i = 0; i < nargs; i++) {
    Py_INCREF(args[i]);
    PyTuple_SET_ITEM(tuple, i, args[i]);
  }
  PyObject* kwargs = PyDict_New();
  if (!kwargs) {
    Py_DECREF(tuple);
    return nullptr;
  }
  if (kwnames) {
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nk; i++) {
      if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
        Py_DECREF(tuple);
        Py_DECREF(kwargs);
        return nullptr;
      }
    }
  }
  PyObject* kernel = c->slot->kernel;
  Py_INCREF(kernel);
  PyObject* out = PyObject_CallMethodObjArgs(kernel, str_visit, c->index, c->forward, tuple, kwargs, nullptr);
  Py_DECREF(kernel);
  Py_DECREF(tuple);
  Py_DECREF(kwargs);
  return out;
}

PyObject* controller_vectorcall(PyObject* o, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* c = reinterpret_cast<Controller*>(o);
  RunSlot* s = c->slot;
  if (s->kernel == Py_None || s->bypass) {
    return PyObject_Vectorcall(c->forward, args, nargsf, kwnames);
  }
  int hot = PySet_Contains(s->hot, c->index);
  if (hot < 0) return nullptr;
  if (hot) return visit_full(c, args, nargsf, kwnames);
  PyObject* out = PyObject_Vectorcall(c->forward, args, nargsf, kwnames);
  if (!out) return nullptr;
  if (s->kernel == Py_None) return out;  // the run ended while this call ran (an aborted run)
  hot = PySet_Contains(s->hot, c->index);
  if (hot < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  if (hot) {  // a block started waiting on this call's output while it ran
    PyObject* kernel = s->kernel;
    Py_INCREF(kernel);
    PyObject* r = PyObject_CallMethodObjArgs(kernel, str_visit_output, c->index, out, nullptr);
    Py_DECREF(kernel);
    Py_DECREF(out);
    return r;
  }
  PyObject* counts = s->counts;
  if (c->idx < PyList_GET_SIZE(counts)) {
    PyObject* old = PyList_GET_ITEM(counts, c->idx);
    PyObject* next = PyLong_FromSsize_t(PyLong_AsSsize_t(old) + 1);
    if (!next) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(counts, c->idx, next);
    Py_DECREF(old);
  }
  return out;
}

int controller_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* c = reinterpret_cast<Controller*>(o);
  Py_VISIT(c->slot);
  Py_VISIT(c->forward);
  Py_VISIT(c->index);
  Py_VISIT(c->replaced);
  return 0;
}

int controller_clear(PyObject* o) {
  auto* c = reinterpret_cast<Controller*>(o);
  Py_CLEAR(c->slot);
  Py_CLEAR(c->forward);
  Py_CLEAR(c->index);
  Py_CLEAR(c->replaced);
  return 0;
}

void controller_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  controller_clear(o);
  Py_TYPE(o)->tp_free(o);
}

// Controller(slot, index, forward, replaced)
PyObject* controller_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  PyObject *slot, *forward, *replaced;
  Py_ssize_t idx;
  if (!PyArg_ParseTuple(args, "O!nOO", &RunSlotType, &slot, &idx, &forward, &replaced)) return nullptr;
  auto* c = reinterpret_cast<Controller*>(type->tp_alloc(type, 0));
  if (!c) return nullptr;
  c->vectorcall = controller_vectorcall;
  Py_INCREF(slot);
  c->slot = reinterpret_cast<RunSlot*>(slot);
  Py_INCREF(forward);
  c->forward = forward;
  c->index = PyLong_FromSsize_t(idx);
  c->idx = idx;
  Py_INCREF(replaced);
  c->replaced = replaced;
  if (!c->index) {
    Py_DECREF(c);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(c);
}

PyMemberDef controller_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(Controller, forward), READONLY, "the module's real forward"},
    {"asyncpp_replaced", T_OBJECT, offsetof(Controller, replaced), READONLY,
     "the instance-level forward this controller shadows, or None"},
    {"index", T_PYSSIZET, offsetof(Controller, idx), READONLY, "the module's index"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject ControllerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// install(entries) / remove(entries): entries is a list of (module __dict__, controller, replaced).
PyObject* py_install(PyObject*, PyObject* entries) {
  static PyObject* key = PyUnicode_InternFromString("forward");
  if (!PyList_Check(entries)) return PyErr_Format(PyExc_TypeError, "install() takes a list");
  Py_ssize_t n = PyList_GET_SIZE(entries);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* e = PyList_GET_ITEM(entries, i);
    if (PyDict_SetItem(PyTuple_GET_ITEM(e, 0), key, PyTuple_GET_ITEM(e, 1)) < 0) return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* py_remove(PyObject*, PyObject* entries) {
  static PyObject* key = PyUnicode_InternFromString("forward");
  if (!PyList_Check(entries)) return PyErr_Format(PyExc_TypeError, "remove() takes a list");
  Py_ssize_t n = PyList_GET_SIZE(entries);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* e = PyList_GET_ITEM(entries, i);
    PyObject* d = PyTuple_GET_ITEM(e, 0);
    PyObject* own = PyTuple_GET_ITEM(e, 2);
    if (own == Py_None) {
      if (PyDict_DelItem(d, key) < 0) PyErr_Clear();
    } else if (PyDict_SetItem(d, key, own) < 0) {
      return nullptr;
    }
  }
  Py_RETURN_NONE;
}

PyMethodDef module_functions[] = {
    {"install", py_install, METH_O, "Shadow each module's forward with its controller."},
    {"remove", py_remove, METH_O, "Remove the controllers, restoring any forward they shadowed."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void asyncpp::register_controllers(pybind11::module_& m) {
  str_visit = PyUnicode_InternFromString("visit");
  str_visit_output = PyUnicode_InternFromString("visit_output");

  RunSlotType.tp_name = "asyncpp_native.RunSlot";
  RunSlotType.tp_basicsize = sizeof(RunSlot);
  RunSlotType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  RunSlotType.tp_doc = "The run a model's controllers serve (shared by all of them).";
  RunSlotType.tp_new = slot_new;
  RunSlotType.tp_dealloc = slot_dealloc;
  RunSlotType.tp_traverse = slot_traverse;
  RunSlotType.tp_clear = slot_clear;
  RunSlotType.tp_methods = slot_methods;
  RunSlotType.tp_members = slot_members;
  if (PyType_Ready(&RunSlotType) < 0) throw pybind11::error_already_set();

  ControllerType.tp_name = "asyncpp_native.Controller";
  ControllerType.tp_basicsize = sizeof(Controller);
  ControllerType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  ControllerType.tp_doc = "Runs in place of one module's forward during a run.";
  ControllerType.tp_new = controller_new;
  ControllerType.tp_dealloc = controller_dealloc;
  ControllerType.tp_traverse = controller_traverse;
  ControllerType.tp_clear = controller_clear;
  ControllerType.tp_call = PyVectorcall_Call;
  ControllerType.tp_vectorcall_offset = offsetof(Controller, vectorcall);
  ControllerType.tp_members = controller_members;
  if (PyType_Ready(&ControllerType) < 0) throw pybind11::error_already_set();

  Py_INCREF(&RunSlotType);
  m.add_object("RunSlot", reinterpret_cast<PyObject*>(&RunSlotType));
  Py_INCREF(&ControllerType);
  m.add_object("Controller", reinterpret_cast<PyObject*>(&ControllerType));
  for (PyMethodDef* d = module_functions; d->ml_name; d++) {
    PyObject* f = PyCFunction_New(d, nullptr);
    if (!f) throw pybind11::error_already_set();
    m.add_object(d->ml_name, f);
  }
}
