// The CPU kernel of ``asyncpp::tap``, the operator a compiled vLLM engine calls at every tap
// (asyncpp/engines/vllm/taps.py defines it). A tap nobody waits on must cost one check: with the
// operator's kernel in Python, the dispatcher's trip into Python and back cost about 4 us per tap,
// some 14 taps a step on a small model. Here the check (is the tap's module index in the run's hot
// set?) and the count of a call nobody waited on are made in C++; only a tap a block waits on goes
// on to the Python kernel (``taps._tap``), with the same arguments.
//
// Even so, a call through torch's dispatcher from the compiled graph's Python code costs some
// 10 us in a running engine (parsing the arguments against the schema, the dispatch). So the
// operator's overload also gets a front door (``tap_front``, put in place of ``OpOverload._op``
// by taps.py): a plain call with plain CPU tensors is served here from the Python objects
// directly; anything else (fake or functional tensors while vLLM traces the model, an active
// dispatch or torch-function mode, keywords) goes on to torch's own entry.
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include "asyncpp_native.h"

namespace {

constexpr int64_t kOutput = 2;  // asyncpp.kernel.traps.OUTPUT: a tap on a module's output

// What the kernel reads, set by taps.bind() through tap_bind(); guarded by the GIL.
struct TapState {
  PyObject* hot_in = nullptr;   // set: module indices with waits on their input
  PyObject* hot_out = nullptr;  // set: module indices with waits on their output
  PyObject* counts = nullptr;   // list: calls per module index nobody waited on, this step
  PyObject* slow = nullptr;     // taps._tap: the whole kernel, for a tap someone waits on
  bool active = false;          // false: unbound, or standing aside (an auto engine's eager step)
};

// torch's own entry of the overload (its ``_op``), for the calls the front door passes on.
PyObject* torch_entry = nullptr;

TapState state;

void clear_state() {
  Py_CLEAR(state.hot_in);
  Py_CLEAR(state.hot_out);
  Py_CLEAR(state.counts);
  Py_CLEAR(state.slow);
  state.active = false;
}

PyObject* int_list(c10::IntArrayRef xs) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(xs.size()));
  if (!out) return nullptr;
  for (size_t i = 0; i < xs.size(); ++i) {
    PyObject* x = PyLong_FromLongLong(xs[i]);
    if (!x) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), x);
  }
  return out;
}

// The check of one tap call (``key`` is ``site`` as a Python int): 1 if a block waits on it, 0 if
// not (an output tap's call is then counted), -1 with a Python error set.
int check(PyObject* key, Py_ssize_t site, int64_t stage) {
  const int hot = PySet_Contains(stage == kOutput ? state.hot_out : state.hot_in, key);
  if (hot != 0) return hot;
  if (stage == kOutput && asyncpp::count_in(state.counts, site) < 0) return -1;
  return 0;
}

// The Python kernel, for a tap a block waits on. 0, or -1 with a Python error set.
int call_slow(at::TensorList values, int64_t site, c10::IntArrayRef layout, int64_t stage) {
  PyObject* tensors = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (!tensors) return -1;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* t = THPVariable_Wrap(values[i]);  // the tensor's own Python object where it has one
    if (!t) {
      Py_DECREF(tensors);
      return -1;
    }
    PyList_SET_ITEM(tensors, static_cast<Py_ssize_t>(i), t);
  }
  PyObject* lay = int_list(layout);
  PyObject* out = lay ? PyObject_CallFunction(state.slow, "OLOL", tensors, (long long)site, lay, (long long)stage)
                      : nullptr;
  Py_DECREF(tensors);
  Py_XDECREF(lay);
  if (!out) return -1;
  Py_DECREF(out);
  return 0;
}

void tap_cpu(at::TensorList values, int64_t site, c10::IntArrayRef layout, int64_t stage) {
  pybind11::gil_scoped_acquire gil;
  if (!state.active) return;
  PyObject* key = PyLong_FromLongLong(site);
  if (!key) throw pybind11::error_already_set();
  const int hot = check(key, site, stage);
  Py_DECREF(key);
  if (hot < 0) throw pybind11::error_already_set();
  if (!hot) return;
  if (call_slow(values, site, layout, stage) < 0) throw pybind11::error_already_set();
}

// Whether the front door may serve a call with these values itself: plain tensors (not
// subclasses such as fake or functional tensors), on the CPU, with no dispatch or torch-function
// mode active (vLLM's tracing of the model runs the operator that way, and must see it).
bool plain_call(PyObject* values) {
  if (!PyList_CheckExact(values) || PyList_GET_SIZE(values) == 0) return false;
  if (c10::impl::TorchDispatchModeTLS::any_modes_set() || at::impl::torch_function_mode_enabled()) return false;
  const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                    c10::DispatchKey::Functionalize});
  if (c10::impl::tls_local_dispatch_key_set().included_.has_any(traced)) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values); ++i) {
    PyObject* v = PyList_GET_ITEM(values, i);
    if (!THPVariable_CheckExact(v)) return false;
    const c10::DispatchKeySet ks = THPVariable_Unpack(v).key_set();
    if (!ks.has(c10::DispatchKey::CPU) || ks.has_any(traced)) return false;
  }
  return true;
}

// tap.default(values, site, layout, stage), as the compiled graph's code calls it.
PyObject* tap_front(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (kwnames == nullptr && nargs == 4 && PyLong_CheckExact(args[1]) && PyLong_CheckExact(args[3]) &&
      plain_call(args[0])) {
    if (!state.active) Py_RETURN_NONE;
    const long long stage = PyLong_AsLongLong(args[3]);
    const Py_ssize_t site = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return nullptr;
    const int hot = check(args[1], site, stage);
    if (hot < 0) return nullptr;
    if (!hot) Py_RETURN_NONE;
    return PyObject_Vectorcall(state.slow, args, static_cast<size_t>(nargs), nullptr);
  }
  if (torch_entry == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "asyncpp::tap: the front door is not in place (tap_front_door)");
    return nullptr;
  }
  return PyObject_Vectorcall(torch_entry, args, static_cast<size_t>(nargs), kwnames);
}

PyMethodDef tap_front_def = {
    "tap_front", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tap_front)),
    METH_FASTCALL | METH_KEYWORDS,
    "asyncpp::tap's overload entry while the front door is in place: serves plain calls with plain CPU "
    "tensors as the C++ kernel would, passes anything else on to torch's own entry."};

std::unique_ptr<torch::Library> registration;

}  // namespace

namespace asyncpp {

void register_tap(pybind11::module_& m) {
  m.def(
      "tap_register",
      [](bool on) {
        // after taps.py has defined the operator; the registration lasts until tap_register(False)
        if (!on) {
          registration.reset();
          return;
        }
        if (registration) return;
        registration = std::make_unique<torch::Library>(
            torch::Library::IMPL, "asyncpp", c10::DispatchKey::CPU, __FILE__, __LINE__);
        registration->impl("tap", TORCH_FN(tap_cpu));
      },
      pybind11::arg("on") = true,
      "Register the C++ CPU kernel of asyncpp::tap (True, once) or remove it (False: the operator's "
      "Python kernel, taps._tap, serves CPU tensors again).");
  m.def(
      "tap_bind",
      [](pybind11::object hot_in, pybind11::object hot_out, pybind11::object counts, pybind11::object slow) {
        if (!PySet_Check(hot_in.ptr()) || !PySet_Check(hot_out.ptr()) || !PyList_Check(counts.ptr())) {
          throw pybind11::type_error("tap_bind(): hot_in/hot_out must be sets, counts a list");
        }
        clear_state();
        state.hot_in = hot_in.inc_ref().ptr();
        state.hot_out = hot_out.inc_ref().ptr();
        state.counts = counts.inc_ref().ptr();
        state.slow = slow.inc_ref().ptr();
        state.active = true;
      },
      "Serve the taps of this process from these containers (the kernel's hot sets and counts); "
      "``slow(values, site, layout, stage)`` handles a tap a block waits on.");
  m.def(
      "tap_active", [](bool on) { state.active = on && state.slow != nullptr; },
      "Whether the taps serve (False: the operator returns at once).");
  m.def("tap_unbind", []() { clear_state(); }, "Forget the containers tap_bind() was given.");
  m.attr("tap_front") = pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(&tap_front_def, nullptr));
  m.def(
      "tap_front_door",
      [](pybind11::object entry) {
        Py_CLEAR(torch_entry);
        if (!entry.is_none()) torch_entry = entry.inc_ref().ptr();
      },
      "The overload's own entry (its ``_op``) that ``tap_front`` passes other calls on to, or None.");
}

}  // namespace asyncpp
