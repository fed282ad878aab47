// asyncpp's native extension: the pieces of the hot path that Python cannot make cheap enough.
#pragma once

#include <torch/extension.h>

namespace asyncpp {

// Torch thread-local-state swap at every switch between a block and the forward (tls_swap.cpp).
void register_tls(pybind11::module_& m);

// Install / save a block's torch state on the calling thread (tls_swap.cpp); -1 with a Python
// error set on failure. ``state`` is a BlockState object.
int tls_enter(PyObject* state);
int tls_leave(PyObject* state);

// The calling thread's autocast fields in torch, to read and write in place (autocast_tls.cpp); all null
// where they cannot be located, and then torch's getters are the way to read them.
struct AutocastFields {
  bool* cache = nullptr;
  at::ScalarType* dtype = nullptr;  // per device type
  int* nesting = nullptr;
};
AutocastFields autocast_fields_here();

// Per-module controllers that shadow each module's forward during a run (controller.cpp).
void register_controllers(pybind11::module_& m);
// counts[idx] += 1 on a run's list of calls per module nobody waited on (the controllers' and the
// taps' count; an index past the list is not counted). -1 with a Python error set on failure.
int count_in(PyObject* counts, Py_ssize_t idx);

// A block's rows of a batched value, for tensors, tuples and lists (rows.cpp).
void register_rows(pybind11::module_& m);
// The same for C callers: a new reference, or nullptr with a Python error set.
PyObject* narrow_rows(PyObject* value, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t batch);

// ``await trap`` through a C iterator instead of a Python generator (trap_await.cpp).
void register_await(pybind11::module_& m);

// The C++ CPU kernel of the ``asyncpp::tap`` operator, a compiled vLLM engine's taps (tap_op.cpp).
void register_tap(pybind11::module_& m);

}  // namespace asyncpp
