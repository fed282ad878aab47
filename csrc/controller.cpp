// Per-module controllers: what runs instead of a module's forward during a run.
//
// A controller shadows one module's ``forward`` (as an instance attribute, so the module's own
// __call__ machinery still runs). A call nobody waits on costs two set lookups and a counter bump,
// done here in C because the Python equivalent costs more than many small modules' own forward.
// A call some block waits on goes to the interleaver's ``visit`` (Python).
//
// The contract with Python (documented with the Python twin, asyncpp/native/controllers.py): the
// RunLink is shared by all controllers of a model. ``attach(fields)`` hands it the fields of a run
// by name (the dict of the interleaver's ``link_fields()``): the containers the kernel mutates in place (hot_in,
// hot_out, counts, waits, refs_out, ready), the kernel's entry points (visit, visit_output, resume,
// complete, fail, serve, budget_enter, budget_leave), the modules the fast path leaves to the
// kernel (special) and whether the fast path may serve at all (fast, derived from the run's hooks).
// Besides these the fast path reads and writes named __slots__ of the kernel's own classes, whose
// offsets set_types() looks up once: Location (key, occ, keys), Block (coro, state, rows, step,
// order, waiting, done), Wait (every field) and Interleaver (current, position, batch_size, budget).
// While a block's own code runs, ``bypass`` is set: a block that calls the model's modules itself
// (a logit lens through ``lm_head``) runs them plainly, unseen by the run.

#include "asyncpp_native.h"

#include <structmember.h>
#include <algorithm>
#include <descrobject.h>

namespace {

struct RunLink {
  PyObject_HEAD
  PyObject* kernel;        // the interleaver of the run in progress, or None
  PyObject* hot_in;        // set of module indices with waits on their input stage (or step starts)
  PyObject* hot_out;       // set of module indices with waits on their output
  PyObject* counts;        // list: completed calls per module index in the current step
  PyObject* visit;         // kernel.visit
  PyObject* visit_output;  // kernel.visit_output
  // the single-read fast path (see fast_serve)
  PyObject* waits;         // dict: wait key -> list of Wait
  PyObject* refs_out;      // list: output waits per module index
  PyObject* ready;         // deque of woken blocks
  PyObject* resume;        // resume(block, value, exc, msg, entered): the kernel steps a block on
  PyObject* complete;      // complete(block, value): a block returned
  PyObject* fail;          // fail(block, exc): a block raised
  PyObject* serve;         // serve(): resume the woken blocks
  PyObject* budget_enter;  // budget_enter(block) / budget_leave(block): a run whose blocks have a
  PyObject* budget_leave;  // time budget (kernel.budget not None) times each outermost resume
  PyObject* special;       // set of module indices the fast path leaves to the kernel (or nullptr)
  PyObject* guarded;       // set of module indices whose output waits the kernel must park itself
  PyObject* visit_out;     // the output of the call being served by the fast path
  Py_ssize_t visit_index;
  Py_ssize_t visit_n;
  long step;               // the kernel's current generation step (kept in sync by the kernel)
  PyObject* pool[64];      // served Waits nobody else holds, reused by try_park (as tuples are)
  int npool;
  int fast;                // the fast path may serve (the run's hooks allow it)
  int in_visit;            // the fast path is serving visit_index / visit_n
  int bypass;
};

PyObject* location_type = nullptr;  // asyncpp's Location class, registered from Python
PyObject* block_type = nullptr;     // the interleaver's Block class
PyObject* wait_type = nullptr;      // the interleaver's Wait class
PyObject* gate_type = nullptr;      // the kernel's StepGate trap (a step loop's next iteration)
PyObject* view_type = nullptr;      // the kernel's ValueView (a location key that presents the value)
PyObject* present_name = nullptr;   // "present", interned

bool is_location(PyObject* o) {  // a Location or a subclass (a standard point): same slots, same reads
  return PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(location_type));
}

// Offsets of the __slots__ the fast path reads and writes (looked up once, at registration).
struct {
  Py_ssize_t key, occ, keys;
} loc_off;
struct {
  Py_ssize_t coro, state, rows, step, order, waiting, done, ended, req_step;
} blk_off;
struct {
  Py_ssize_t order, block, trap, step, occ, gather, item;
} wait_off;
struct {
  Py_ssize_t current, position, batch_size, budget, gates;
} ker_off;
struct {
  Py_ssize_t after, every;
} gate_off;

inline PyObject* slot_get(PyObject* o, Py_ssize_t off) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
}

inline void slot_set(PyObject* o, Py_ssize_t off, PyObject* v) {
  PyObject** p = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
  Py_INCREF(v);
  Py_XSETREF(*p, v);
}

int link_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* s = reinterpret_cast<RunLink*>(o);
  Py_VISIT(s->kernel);
  Py_VISIT(s->hot_in);
  Py_VISIT(s->hot_out);
  Py_VISIT(s->counts);
  Py_VISIT(s->visit);
  Py_VISIT(s->visit_output);
  Py_VISIT(s->waits);
  Py_VISIT(s->refs_out);
  Py_VISIT(s->ready);
  Py_VISIT(s->resume);
  Py_VISIT(s->complete);
  Py_VISIT(s->fail);
  Py_VISIT(s->serve);
  Py_VISIT(s->budget_enter);
  Py_VISIT(s->budget_leave);
  Py_VISIT(s->visit_out);
  Py_VISIT(s->special);
  Py_VISIT(s->guarded);
  for (int i = 0; i < s->npool; i++) Py_VISIT(s->pool[i]);
  return 0;
}

// Drop what the link holds of the run it served.
void drop_run(RunLink* s) {
  Py_CLEAR(s->visit);
  Py_CLEAR(s->visit_output);
  Py_CLEAR(s->waits);
  Py_CLEAR(s->refs_out);
  Py_CLEAR(s->ready);
  Py_CLEAR(s->resume);
  Py_CLEAR(s->complete);
  Py_CLEAR(s->fail);
  Py_CLEAR(s->serve);
  Py_CLEAR(s->budget_enter);
  Py_CLEAR(s->budget_leave);
  Py_CLEAR(s->visit_out);
  Py_CLEAR(s->special);
  Py_CLEAR(s->guarded);
  s->fast = s->in_visit = 0;
  s->bypass = 0;
}

int link_clear(PyObject* o) {
  auto* s = reinterpret_cast<RunLink*>(o);
  Py_CLEAR(s->kernel);
  Py_CLEAR(s->hot_in);
  Py_CLEAR(s->hot_out);
  Py_CLEAR(s->counts);
  drop_run(s);
  while (s->npool > 0) Py_CLEAR(s->pool[--s->npool]);
  return 0;
}

void link_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  link_clear(o);
  Py_TYPE(o)->tp_free(o);
}

PyObject* link_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* s = reinterpret_cast<RunLink*>(type->tp_alloc(type, 0));
  if (!s) return nullptr;
  Py_INCREF(Py_None);
  s->kernel = Py_None;
  s->hot_in = PySet_New(nullptr);
  s->hot_out = PySet_New(nullptr);
  s->counts = PyList_New(0);
  s->visit = nullptr;
  s->visit_output = nullptr;
  s->waits = s->refs_out = s->ready = s->resume = s->complete = s->fail = s->serve = nullptr;
  s->budget_enter = s->budget_leave = nullptr;
  s->visit_out = nullptr;
  s->special = nullptr;
  s->guarded = nullptr;
  s->npool = 0;
  s->visit_index = s->visit_n = -1;
  s->step = 0;
  s->fast = s->in_visit = 0;
  s->bypass = 0;
  if (!s->hot_in || !s->hot_out || !s->counts) {
    Py_DECREF(s);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(s);
}

// link.attach(fields): attach a run, its fields given by name in a dict (the interleaver's
// link_fields(); see the comment at the top). The containers are read once, here, so the kernel
// must mutate them in place. link.detach(): detach it.
const char* field_names[] = {"kernel",  "hot_in",   "hot_out", "counts",       "waits",
                             "refs_out", "ready",   "visit",   "visit_output", "resume",
                             "complete", "fail",    "serve",   "budget_enter", "budget_leave",
                             "special",  "fast",    "step",    "guarded"};
constexpr int n_fields = sizeof(field_names) / sizeof(field_names[0]);
PyObject* field_keys[n_fields];

PyObject* link_attach(PyObject* o, PyObject* fields) {
  if (!PyDict_Check(fields)) return PyErr_Format(PyExc_TypeError, "attach() takes a dict of the run's fields");
  PyObject* v[n_fields];
  for (int i = 0; i < n_fields; i++) {
    v[i] = PyDict_GetItemWithError(fields, field_keys[i]);  // borrowed
    if (!v[i]) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "attach(): the run's fields lack %s", field_names[i]);
      return nullptr;
    }
  }
  if (!PySet_Check(v[1]) || !PySet_Check(v[2]) || !PyList_Check(v[3]) || !PyDict_Check(v[4]) || !PyList_Check(v[5])) {
    return PyErr_Format(PyExc_TypeError, "attach(): hot_in/hot_out must be sets, counts/refs_out lists, waits a dict");
  }
  const int fast = PyObject_IsTrue(v[16]);
  const long step = PyLong_AsLong(v[17]);
  if (fast < 0 || (step == -1 && PyErr_Occurred())) return nullptr;
  PyObject* special_set = PySet_New(v[15]);  // a set of the link's own (any iterable is taken)
  if (!special_set) return nullptr;
  // a set is shared (its owner may change it between steps); any other iterable is copied
  PyObject* guarded_set = PySet_CheckExact(v[18]) ? Py_NewRef(v[18]) : PySet_New(v[18]);
  if (!guarded_set) {
    Py_DECREF(special_set);
    return nullptr;
  }
  auto* s = reinterpret_cast<RunLink*>(o);
  drop_run(s);
  PyObject** kept[] = {&s->kernel, &s->hot_in,       &s->hot_out, &s->counts,   &s->waits,
                       &s->refs_out, &s->ready,      &s->visit,   &s->visit_output, &s->resume,
                       &s->complete, &s->fail,       &s->serve,   &s->budget_enter, &s->budget_leave};
  for (size_t i = 0; i < sizeof(kept) / sizeof(kept[0]); i++) {
    Py_INCREF(v[i]);
    Py_XSETREF(*kept[i], v[i]);
  }
  s->special = special_set;
  s->guarded = guarded_set;
  s->fast = fast && location_type && wait_type && view_type;
  s->step = step;
  Py_RETURN_NONE;
}

PyObject* link_detach(PyObject* o, PyObject*) {
  auto* s = reinterpret_cast<RunLink*>(o);
  Py_INCREF(Py_None);
  Py_SETREF(s->kernel, Py_None);
  drop_run(s);
  Py_RETURN_NONE;
}

int resume_block(RunLink* s, PyObject* block, PyObject* value);

// link.resume(block, value): resume a parked block with ``value`` as the kernel's _resume would,
// parking its next plain output read natively (the kernel calls it only while ``fast`` holds).
PyObject* link_resume(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  auto* s = reinterpret_cast<RunLink*>(o);
  if (nargs != 2) return PyErr_Format(PyExc_TypeError, "resume() takes a block and a value");
  if (s->kernel == Py_None || !s->resume || Py_TYPE(args[0]) != reinterpret_cast<PyTypeObject*>(block_type)) {
    return PyErr_Format(PyExc_RuntimeError, "resume(): no run attached, or not a block");
  }
  if (resume_block(s, args[0], args[1]) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef link_methods[] = {
    {"attach", link_attach, METH_O, "Attach a run, its fields given by name in a dict (Interleaver.link_fields())."},
    {"detach", link_detach, METH_NOARGS, "Detach the run."},
    {"resume", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(link_resume)), METH_FASTCALL,
     "Resume a parked block with a value, parking its next plain read natively."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef link_members[] = {
    {"kernel", T_OBJECT, offsetof(RunLink, kernel), READONLY, "the interleaver of the run, or None"},
    {"bypass", T_BOOL, offsetof(RunLink, bypass), 0, "set while a block's own code runs"},
    {"step", T_LONG, offsetof(RunLink, step), 0, "the kernel's current generation step"},
    {"fast", T_BOOL, offsetof(RunLink, fast), 0, "whether the native single-read fast path may serve"},
    {"in_visit", T_BOOL, offsetof(RunLink, in_visit), READONLY, "the fast path is serving a call"},
    {"visit_index", T_PYSSIZET, offsetof(RunLink, visit_index), READONLY, "module of that call"},
    {"visit_n", T_PYSSIZET, offsetof(RunLink, visit_n), READONLY, "call number of that call"},
    {"visit_out", T_OBJECT, offsetof(RunLink, visit_out), 0, "the output of that call (writable)"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject RunLinkType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ------------------------------------------------------------------------------------------------

struct Controller {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  RunLink* link;
  PyObject* forward;   // the module's real forward
  PyObject* index;     // module index (int)
  PyObject* out_key;   // wait key of its output: index * 4 + 2
  Py_ssize_t idx;
  PyObject* replaced;  // the instance-level forward this controller shadows, or None
  PyObject* owner;     // the module's __dict__ (where the controller is installed)
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
  PyObject* visit = c->link->visit;
  Py_INCREF(visit);
  PyObject* call_args[4] = {c->index, c->forward, tuple, kwargs};
  PyObject* out = PyObject_Vectorcall(visit, call_args, 4, nullptr);
  Py_DECREF(visit);
  Py_DECREF(tuple);
  Py_DECREF(kwargs);
  return out;
}

// ------------------------------------------------------------------------------------------------
// The fast path's helpers: parking a block's next plain output read (try_park) or step-loop
// iteration (try_gate) natively, and resuming a block (resume_block). What the path serves is said
// at fast_serve.


bool ready_empty(RunLink* s) {
  Py_ssize_t n = PyObject_Length(s->ready);
  if (n < 0) {
    PyErr_Clear();
    return false;
  }
  return n == 0;
}

// A Wait (the kernel's class, filled as its __init__ would, without running it; one served
// earlier and pooled when there is one), or nullptr.
PyObject* new_wait(RunLink* s, PyObject* order, PyObject* block, PyObject* trap, PyObject* step, PyObject* occ) {
  PyObject* w;
  if (s->npool > 0) {
    w = s->pool[--s->npool];
  } else {
    auto* type = reinterpret_cast<PyTypeObject*>(wait_type);
    w = type->tp_alloc(type, 0);
    if (!w) return nullptr;
  }
  static PyObject* zero = PyLong_FromLong(0);
  slot_set(w, wait_off.order, order);
  slot_set(w, wait_off.block, block);
  slot_set(w, wait_off.trap, trap);
  slot_set(w, wait_off.step, step);
  slot_set(w, wait_off.occ, occ);
  slot_set(w, wait_off.gather, Py_None);
  slot_set(w, wait_off.item, zero);
  return w;
}

// Park ``block`` on ``msg`` if it is a plain output read of a later call in the current step.
// 1: parked; 0: not handled (the Python kernel will handle it); never raises.
int try_park(RunLink* s, PyObject* block, PyObject* msg) {
  if (!is_location(msg)) return 0;
  PyObject *key = slot_get(msg, loc_off.key), *occ = slot_get(msg, loc_off.occ);
  PyObject *bstep = slot_get(block, blk_off.step), *order = slot_get(block, blk_off.order);
  if (!key || !occ || !bstep || !order) return 0;
  const Py_ssize_t k = PyLong_AsSsize_t(key);
  const Py_ssize_t idx = k >> 2;
  const Py_ssize_t o = PyLong_AsSsize_t(occ);
  if ((k & 3) != 2 || PyLong_AsLong(bstep) != s->step || PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  if (s->in_visit && idx == s->visit_index && o == s->visit_n) return 0;  // the call being served
  if (idx < 0 || idx >= PyList_GET_SIZE(s->counts) || idx >= PyList_GET_SIZE(s->refs_out)) return 0;
  if (o < PyLong_AsSsize_t(PyList_GET_ITEM(s->counts, idx))) return 0;  // passed: an order error
  if (s->guarded && PySet_GET_SIZE(s->guarded) > 0) {  // the kernel's refuse hook decides these
    PyObject* index = PyLong_FromSsize_t(idx);
    const int g = index ? PySet_Contains(s->guarded, index) : -1;
    Py_XDECREF(index);
    if (g != 0) {
      PyErr_Clear();
      return 0;
    }
  }
  PyObject* lst = PyDict_GetItemWithError(s->waits, key);
  if (lst) {
    Py_ssize_t n = PyList_GET_SIZE(lst);
    if (n > 0 && PyLong_AsLong(slot_get(PyList_GET_ITEM(lst, n - 1), wait_off.order)) > PyLong_AsLong(order)) {
      return 0;  // keeping invoke order needs a sort: the kernel does it
    }
  } else if (PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  PyObject* w = new_wait(s, order, block, msg, bstep, occ);
  if (!w) {
    PyErr_Clear();
    return 0;
  }
  int ok;
  if (lst) {
    ok = PyList_Append(lst, w);
  } else {
    PyObject* fresh = PyList_New(1);
    if (fresh) {
      Py_INCREF(w);
      PyList_SET_ITEM(fresh, 0, w);
      ok = PyDict_SetItem(s->waits, key, fresh);
      Py_DECREF(fresh);
    } else {
      ok = -1;
    }
  }
  Py_DECREF(w);
  if (ok < 0) {
    PyErr_Clear();
    return 0;
  }
  const Py_ssize_t r = PyLong_AsSsize_t(PyList_GET_ITEM(s->refs_out, idx));
  PyList_SetItem(s->refs_out, idx, PyLong_FromSsize_t(r + 1));
  if (r == 0) {
    PyObject* index = PyLong_FromSsize_t(idx);
    if (index) {
      PySet_Add(s->hot_out, index);
      Py_DECREF(index);
    }
  }
  slot_set(block, blk_off.waiting, msg);
  PyErr_Clear();
  return 1;
}

// Park ``block`` on ``msg`` if it is the next iteration of a step loop over every step (a StepGate
// with ``every``) that opens at a later step: what the kernel's _on_step does in that case.
// 1: parked; 0: not handled (the Python kernel will handle it); never raises.
int try_gate(RunLink* s, PyObject* block, PyObject* msg) {
  if (Py_TYPE(msg) != reinterpret_cast<PyTypeObject*>(gate_type)) return 0;
  if (slot_get(msg, gate_off.every) != Py_True || slot_get(block, blk_off.ended) != Py_False) return 0;
  PyObject *after_obj = slot_get(msg, gate_off.after), *current_obj = slot_get(block, blk_off.req_step);
  PyObject* gates = slot_get(s->kernel, ker_off.gates);
  if (!after_obj || !current_obj || !gates || !PyList_CheckExact(gates)) return 0;
  const long after = PyLong_AsLong(after_obj), current = PyLong_AsLong(current_obj);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  const long target = std::max(std::max(after, current), 0L);
  if (target == current) return 0;  // that step is under way: the kernel enters it at once
  PyObject* entry = Py_BuildValue("(OOl)", block, msg, target);
  if (!entry) {
    PyErr_Clear();
    return 0;
  }
  const int ok = PyList_Append(gates, entry);
  Py_DECREF(entry);
  if (ok < 0) {
    PyErr_Clear();
    return 0;
  }
  slot_set(block, blk_off.waiting, msg);
  return 1;
}

// Resume ``block`` with ``value`` (the read it waited for). 0 on success, -1 with an error set.
int resume_block(RunLink* s, PyObject* block, PyObject* value) {
  PyObject* kernel = s->kernel;
  PyObject* coro = slot_get(block, blk_off.coro);
  PyObject* state = slot_get(block, blk_off.state);
  PyObject* prev = slot_get(kernel, ker_off.current);
  if (!coro || !state || !prev) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "asyncpp: a block without coroutine or state");
    return -1;
  }
  // a time budget: the outermost resume is timed, as the kernel's _resume does
  const bool timed = prev == Py_None && slot_get(kernel, ker_off.budget) != Py_None && s->budget_enter;
  if (timed) {
    PyObject* go = PyObject_CallOneArg(s->budget_enter, block);
    if (!go) return -1;
    const int closed = go == Py_False;  // it ran out of time before: the kernel closed it
    Py_DECREF(go);
    if (closed) return 0;
  }
  Py_INCREF(coro);
  Py_INCREF(state);
  Py_INCREF(prev);
  slot_set(block, blk_off.waiting, Py_None);
  slot_set(kernel, ker_off.current, block);
  int status = 0;
  if (state != Py_None && asyncpp::tls_enter(state) < 0) {
    status = -1;
  } else {
    int outer_bypass = s->bypass;
    s->bypass = 1;
    PyObject* msg = nullptr;
    PySendResult r = PyIter_Send(coro, value, &msg);
    PyObject* handoff = nullptr;  // a message the Python kernel must handle
    if (r == PYGEN_NEXT) {
      if (!try_park(s, block, msg) && !try_gate(s, block, msg)) {
        handoff = msg;
        msg = nullptr;
      }
    } else if (r == PYGEN_RETURN) {
      PyObject* args[2] = {block, msg};
      PyObject* done = PyObject_Vectorcall(s->complete, args, 2, nullptr);
      if (!done) status = -1;
      Py_XDECREF(done);
    } else {
      PyObject *type, *exc, *tb;
      PyErr_Fetch(&type, &exc, &tb);
      PyErr_NormalizeException(&type, &exc, &tb);
      if (tb) PyException_SetTraceback(exc, tb);
      bool plain = PyErr_GivenExceptionMatches(type, PyExc_Exception);
      PyObject* args[2] = {block, exc};
      PyObject* done = PyObject_Vectorcall(s->fail, args, 2, nullptr);
      if (!done) {
        status = -1;
        Py_XDECREF(type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
      } else if (!plain) {  // KeyboardInterrupt and friends end the run, as in the kernel
        status = -1;
        PyErr_Restore(type, exc, tb);
      } else {
        Py_XDECREF(type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
      }
      Py_XDECREF(done);
    }
    Py_XDECREF(msg);
    if (handoff) {  // the kernel's _resume handles it, with the block's state still entered
      if (status == 0) {
        PyObject* args[5] = {block, Py_None, Py_None, handoff, Py_True};
        PyObject* done = PyObject_Vectorcall(s->resume, args, 5, nullptr);
        if (!done) status = -1;
        Py_XDECREF(done);
      }
      Py_DECREF(handoff);
    }
    s->bypass = outer_bypass;
    if (state != Py_None) {
      PyObject *et, *ev, *etb;
      PyErr_Fetch(&et, &ev, &etb);
      if (asyncpp::tls_leave(state) < 0) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(etb);
        status = -1;
      } else {
        PyErr_Restore(et, ev, etb);
      }
    }
  }
  if (timed) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyObject* left = PyObject_CallOneArg(s->budget_leave, block);
    if (!left) {
      Py_XDECREF(et);
      Py_XDECREF(ev);
      Py_XDECREF(etb);
      status = -1;
    } else {
      Py_DECREF(left);
      PyErr_Restore(et, ev, etb);
    }
  }
  slot_set(kernel, ker_off.current, prev);
  Py_DECREF(coro);
  Py_DECREF(state);
  Py_DECREF(prev);
  return status;
}

// Whether ``w`` (a Wait) is a plain read of call ``n`` of this module in the current step,
// by a block that sees the whole batch or a plain row range: what the fast path can serve (the
// location's keys, indices or a value view, are applied as the kernel's batching.get_item does).
bool plain_wait(RunLink* s, PyObject* w, Py_ssize_t n) {
  if (Py_TYPE(w) != reinterpret_cast<PyTypeObject*>(wait_type)) return false;
  PyObject *block = slot_get(w, wait_off.block), *trap = slot_get(w, wait_off.trap);
  PyObject *occ = slot_get(w, wait_off.occ), *step = slot_get(w, wait_off.step);
  if (!block || !trap || !occ || !step) return false;
  if (slot_get(w, wait_off.gather) != Py_None || !is_location(trap) ||
      Py_TYPE(block) != reinterpret_cast<PyTypeObject*>(block_type)) {
    return false;
  }
  if (PyLong_AsSsize_t(occ) != n || PyLong_AsLong(step) != s->step) {
    PyErr_Clear();
    return false;
  }
  PyObject* keys = slot_get(trap, loc_off.keys);
  if (!keys || !PyTuple_CheckExact(keys)) return false;
  PyObject* rows = slot_get(block, blk_off.rows);
  if (!rows) return false;
  return rows == Py_None || (PyTuple_CheckExact(rows) && PyTuple_GET_SIZE(rows) == 2 &&
                             PyLong_CheckExact(PyTuple_GET_ITEM(rows, 0)) &&
                             PyLong_CheckExact(PyTuple_GET_ITEM(rows, 1)));
}

// What a block with ``rows`` reads of ``value``: the kernel's batching.narrow for the values it
// hands to the native narrowing (tensors, tuples, lists). New reference, or nullptr with an error.
PyObject* rows_of(PyObject* value, PyObject* rows, Py_ssize_t batch) {
  if (rows == Py_None) {
    Py_INCREF(value);
    return value;
  }
  const Py_ssize_t a = PyLong_AsSsize_t(PyTuple_GET_ITEM(rows, 0));
  const Py_ssize_t b = PyLong_AsSsize_t(PyTuple_GET_ITEM(rows, 1));
  if (PyErr_Occurred()) return nullptr;
  return asyncpp::narrow_rows(value, a, b, batch);
}

// ``value`` at ``keys`` as ``block`` reads it: the kernel's batching.get_item (a ValueView key
// presents the value reached so far, any other key indexes it). Consumes ``value``; new
// reference, or nullptr with an error.
PyObject* at_keys(PyObject* value, PyObject* keys, PyObject* block) {
  const Py_ssize_t nk = PyTuple_GET_SIZE(keys);
  for (Py_ssize_t i = 0; i < nk && value; i++) {
    PyObject* k = PyTuple_GET_ITEM(keys, i);
    PyObject* next;
    if (PyObject_TypeCheck(k, reinterpret_cast<PyTypeObject*>(view_type))) {
      PyObject* args[3] = {k, value, block};
      next = PyObject_VectorcallMethod(present_name, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    } else {
      next = PyObject_GetItem(value, k);
    }
    Py_DECREF(value);
    value = next;
  }
  return value;
}

// Resume ``block`` with the error its read raised (a key that does not fit the value), through
// the kernel's _resume, as its _serve_waits does. The error is set on entry; 0, or -1 with an
// error set (the read's own error when it is not an Exception: it ends the run).
int throw_read_error(RunLink* s, PyObject* block) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
  PyObject *type, *exc, *tb;
  PyErr_Fetch(&type, &exc, &tb);
  PyErr_NormalizeException(&type, &exc, &tb);
  if (tb) PyException_SetTraceback(exc, tb);
  PyObject* args[3] = {block, Py_None, exc};
  PyObject* done = PyObject_Vectorcall(s->resume, args, 3, nullptr);
  Py_XDECREF(type);
  Py_XDECREF(exc);
  Py_XDECREF(tb);
  if (!done) return -1;
  Py_DECREF(done);
  return 0;
}

// The fast path: a module call whose output waits are all plain reads of this very call (one
// block or many, each seeing the whole batch or its own rows; the case of every decoder layer on
// a batching engine; at an index or a standard point's view too) is served here, in invoke order,
// and a block whose next wait is another plain output read is parked here too (try_park).
// Everything else (inputs, writes awaited on a
// later call, steps, gathers, request-level values, TP shards, errors) goes through the
// interleaver's Python code, which owns the semantics; this path repeats what that code does in
// these cases only.
// 1 when served (``*result`` is the call's output to return, or nullptr with an error set);
// 0 when the Python kernel must serve this call. Consumes ``out`` only when it returns 1.
int fast_serve(Controller* c, RunLink* s, PyObject* out, PyObject** result) {
  PyObject* lst = PyDict_GetItemWithError(s->waits, c->out_key);
  if (!lst) {
    PyErr_Clear();
    return 0;
  }
  const Py_ssize_t nw = PyList_CheckExact(lst) ? PyList_GET_SIZE(lst) : 0;
  if (nw == 0 || !ready_empty(s)) return 0;
  const Py_ssize_t idx = c->idx;
  if (idx >= PyList_GET_SIZE(s->counts) || idx >= PyList_GET_SIZE(s->refs_out)) return 0;
  if (s->special) {
    int sp = PySet_Contains(s->special, c->index);
    if (sp != 0) {
      PyErr_Clear();
      return 0;
    }
  }
  const Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(s->counts, idx));
  bool narrowing = false;
  for (Py_ssize_t i = 0; i < nw; i++) {
    PyObject* w = PyList_GET_ITEM(lst, i);
    if (!plain_wait(s, w, n)) return 0;
    narrowing = narrowing || slot_get(slot_get(w, wait_off.block), blk_off.rows) != Py_None;
  }
  if (narrowing) {  // the native narrowing takes tensors, tuples and lists; the kernel the rest
    if (!(THPVariable_CheckExact(out) || PyTuple_CheckExact(out) || PyList_CheckExact(out))) return 0;
  }
  PyObject* batch_obj = slot_get(s->kernel, ker_off.batch_size);
  const Py_ssize_t batch = batch_obj && PyLong_Check(batch_obj) ? PyLong_AsSsize_t(batch_obj) : -1;
  if (batch < 0) {
    PyErr_Clear();
    return 0;
  }

  // take the waits: the same bookkeeping as the kernel's visit_output
  Py_INCREF(lst);
  PyObject* first = slot_get(PyList_GET_ITEM(lst, 0), wait_off.trap);
  Py_INCREF(first);
  int ok = PyDict_DelItem(s->waits, c->out_key);
  if (ok == 0) {
    Py_ssize_t r = PyLong_AsSsize_t(PyList_GET_ITEM(s->refs_out, idx)) - nw;
    ok = PyList_SetItem(s->refs_out, idx, PyLong_FromSsize_t(r));
    if (ok == 0 && r == 0) ok = PySet_Discard(s->hot_out, c->index) < 0 ? -1 : 0;
  }
  if (ok == 0) ok = PyList_SetItem(s->counts, idx, PyLong_FromSsize_t(n + 1));
  if (ok == 0) slot_set(s->kernel, ker_off.position, first);
  Py_DECREF(first);
  if (ok < 0) {
    Py_DECREF(lst);
    Py_DECREF(out);
    *result = nullptr;
    return 1;
  }
  Py_XSETREF(s->visit_out, out);  // steals: a block's write replaces it through the link
  s->visit_index = idx;
  s->visit_n = n;
  s->in_visit = 1;
  int status = 0;
  for (Py_ssize_t i = 0; i < nw && status == 0; i++) {
    PyObject* w = PyList_GET_ITEM(lst, i);
    PyObject* block = slot_get(w, wait_off.block);
    if (slot_get(block, blk_off.done) == Py_True) continue;
    Py_INCREF(block);
    // each block reads the value as the blocks before it left it (a write replaces visit_out)
    PyObject* keys = slot_get(slot_get(w, wait_off.trap), loc_off.keys);
    PyObject* value = rows_of(s->visit_out, slot_get(block, blk_off.rows), batch);
    if (value && PyTuple_GET_SIZE(keys) > 0) value = at_keys(value, keys, block);
    if (!value) {
      status = throw_read_error(s, block);
    } else {
      status = resume_block(s, block, value);
      Py_DECREF(value);
    }
    Py_DECREF(block);
  }
  if (Py_REFCNT(lst) == 1) {  // the served waits nobody else holds go to the pool
    for (Py_ssize_t i = 0; i < nw && s->npool < 64; i++) {
      PyObject* w = PyList_GET_ITEM(lst, i);
      if (Py_REFCNT(w) == 1 && Py_TYPE(w) == reinterpret_cast<PyTypeObject*>(wait_type)) {
        Py_INCREF(w);
        slot_set(w, wait_off.block, Py_None);  // (holds no block or trap while pooled)
        slot_set(w, wait_off.trap, Py_None);
        s->pool[s->npool++] = w;
      }
    }
  }
  Py_DECREF(lst);
  s->in_visit = 0;
  PyObject* served = s->visit_out;
  s->visit_out = nullptr;
  if (status == 0 && !ready_empty(s)) {  // a block set an asyncpp.Slot another block waits on
    PyObject* done = PyObject_CallNoArgs(s->serve);
    if (!done) status = -1;
    Py_XDECREF(done);
  }
  if (status < 0) {
    Py_XDECREF(served);
    *result = nullptr;
    return 1;
  }
  *result = served;
  return 1;
}

// Count a completed call of ``c``'s module nobody waited on (counts[idx] += 1). -1 on an error.
int count_call(Controller* c, RunLink* s) { return asyncpp::count_in(s->counts, c->idx); }

PyObject* controller_vectorcall(PyObject* o, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* c = reinterpret_cast<Controller*>(o);
  RunLink* s = c->link;
  if (s->kernel == Py_None || s->bypass) {
    return PyObject_Vectorcall(c->forward, args, nargsf, kwnames);
  }
  int hot = PySet_Contains(s->hot_in, c->index);
  if (hot < 0) return nullptr;
  if (hot) return visit_full(c, args, nargsf, kwnames);
  PyObject* out = PyObject_Vectorcall(c->forward, args, nargsf, kwnames);
  if (!out) return nullptr;
  if (s->kernel == Py_None) return out;  // the run ended while this call ran (an aborted run)
  hot = PySet_Contains(s->hot_out, c->index);
  if (hot < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  if (hot) {  // a block waits on this call's output (perhaps since the call began)
    if (s->fast) {
      PyObject* result;
      if (fast_serve(c, s, out, &result)) return result;
    }
    PyObject* visit_output = s->visit_output;
    Py_INCREF(visit_output);
    PyObject* call_args[2] = {c->index, out};
    PyObject* r = PyObject_Vectorcall(visit_output, call_args, 2, nullptr);
    Py_DECREF(visit_output);
    Py_DECREF(out);
    return r;
  }
  if (count_call(c, s) < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

// controller.after(out): what the controller does once its module's call has returned ``out``, for
// a call that ran where no controller can (a compiled engine's tap): serve the output waits
// (natively when the fast path may) or count the call; returns the output the model goes on with.
PyObject* controller_after(PyObject* o, PyObject* out) {
  auto* c = reinterpret_cast<Controller*>(o);
  RunLink* s = c->link;
  if (s->kernel == Py_None || s->bypass) return Py_NewRef(out);
  int hot = PySet_Contains(s->hot_out, c->index);
  if (hot < 0) return nullptr;
  if (hot) {
    Py_INCREF(out);
    if (s->fast) {
      PyObject* result;
      if (fast_serve(c, s, out, &result)) return result;  // (it took our reference)
    }
    PyObject* call_args[2] = {c->index, out};
    PyObject* visit_output = s->visit_output;
    Py_INCREF(visit_output);
    PyObject* r = PyObject_Vectorcall(visit_output, call_args, 2, nullptr);
    Py_DECREF(visit_output);
    Py_DECREF(out);
    return r;
  }
  if (count_call(c, s) < 0) return nullptr;
  return Py_NewRef(out);
}

PyMethodDef controller_methods[] = {
    {"after", controller_after, METH_O, "Serve (or count) a call of the module that returned the argument."},
    {nullptr, nullptr, 0, nullptr}};

int controller_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* c = reinterpret_cast<Controller*>(o);
  Py_VISIT(c->link);
  Py_VISIT(c->forward);
  Py_VISIT(c->index);
  Py_VISIT(c->out_key);
  Py_VISIT(c->replaced);
  Py_VISIT(c->owner);
  return 0;
}

int controller_clear(PyObject* o) {
  auto* c = reinterpret_cast<Controller*>(o);
  Py_CLEAR(c->link);
  Py_CLEAR(c->forward);
  Py_CLEAR(c->index);
  Py_CLEAR(c->out_key);
  Py_CLEAR(c->replaced);
  Py_CLEAR(c->owner);
  return 0;
}

void controller_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  controller_clear(o);
  Py_TYPE(o)->tp_free(o);
}

// Controller(link, index, forward, replaced, owner): ``owner`` is the module's __dict__, where
// install() puts the controller as ``forward``.
PyObject* controller_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  PyObject *link, *forward, *replaced, *owner;
  Py_ssize_t idx;
  if (!PyArg_ParseTuple(args, "O!nOOO!", &RunLinkType, &link, &idx, &forward, &replaced, &PyDict_Type, &owner)) {
    return nullptr;
  }
  auto* c = reinterpret_cast<Controller*>(type->tp_alloc(type, 0));
  if (!c) return nullptr;
  c->vectorcall = controller_vectorcall;
  Py_INCREF(link);
  c->link = reinterpret_cast<RunLink*>(link);
  Py_INCREF(forward);
  c->forward = forward;
  c->index = PyLong_FromSsize_t(idx);
  c->out_key = PyLong_FromSsize_t(idx * 4 + 2);
  c->idx = idx;
  Py_INCREF(replaced);
  c->replaced = replaced;
  Py_INCREF(owner);
  c->owner = owner;
  if (!c->index || !c->out_key) {
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
    {"owner", T_OBJECT, offsetof(Controller, owner), READONLY, "the module's __dict__"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject ControllerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

Controller* as_controller(PyObject* o) {
  if (Py_TYPE(o) != &ControllerType) {
    PyErr_SetString(PyExc_TypeError, "install()/remove() take a list of Controller");
    return nullptr;
  }
  return reinterpret_cast<Controller*>(o);
}

// install(controllers): each shadows its module's forward. remove(controllers): undo that,
// restoring the instance-level forward a controller shadowed.
PyObject* py_install(PyObject*, PyObject* controllers) {
  static PyObject* key = PyUnicode_InternFromString("forward");
  if (!PyList_Check(controllers)) return PyErr_Format(PyExc_TypeError, "install() takes a list");
  Py_ssize_t n = PyList_GET_SIZE(controllers);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* o = PyList_GET_ITEM(controllers, i);
    Controller* c = as_controller(o);
    if (!c || PyDict_SetItem(c->owner, key, o) < 0) return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* py_remove(PyObject*, PyObject* controllers) {
  static PyObject* key = PyUnicode_InternFromString("forward");
  if (!PyList_Check(controllers)) return PyErr_Format(PyExc_TypeError, "remove() takes a list");
  Py_ssize_t n = PyList_GET_SIZE(controllers);
  for (Py_ssize_t i = 0; i < n; i++) {
    Controller* c = as_controller(PyList_GET_ITEM(controllers, i));
    if (!c) return nullptr;
    if (c->replaced == Py_None) {
      if (PyDict_DelItem(c->owner, key) < 0) PyErr_Clear();
    } else if (PyDict_SetItem(c->owner, key, c->replaced) < 0) {
      return nullptr;
    }
  }
  Py_RETURN_NONE;
}

PyMethodDef module_functions[] = {
    {"install", py_install, METH_O, "Shadow each module's forward with its controller."},
    {"remove", py_remove, METH_O, "Remove the controllers, restoring any forward they shadowed."},
    {nullptr, nullptr, 0, nullptr}};

Py_ssize_t member_offset(PyObject* type, const char* name) {
  PyObject* d = PyObject_GetAttrString(type, name);
  if (!d) return -1;
  Py_ssize_t off = -1;
  if (Py_TYPE(d) == &PyMemberDescr_Type) {
    off = reinterpret_cast<PyMemberDescrObject*>(d)->d_member->offset;
  } else {
    PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member", reinterpret_cast<PyTypeObject*>(type)->tp_name, name);
  }
  Py_DECREF(d);
  return off;
}

// set_types(Location, Block, Wait, Interleaver, StepGate, ValueView): the classes the fast path recognises, and where
// the named fields it reads and writes live.
PyObject* py_set_types(PyObject*, PyObject* args) {
  PyObject *loc, *blk, *wt, *ker, *gate, *view;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!", &PyType_Type, &loc, &PyType_Type, &blk, &PyType_Type, &wt,
                        &PyType_Type, &ker, &PyType_Type, &gate, &PyType_Type, &view)) {
    return nullptr;
  }
  const char* ker_names[] = {"current", "position", "batch_size", "budget", "gates"};
  const char* loc_names[] = {"key", "occ", "keys"};
  const char* blk_names[] = {"coro", "state", "rows", "step", "order", "waiting", "done", "ended", "req_step"};
  const char* wait_names[] = {"order", "block", "trap", "step", "occ", "gather", "item"};
  const char* gate_names[] = {"after", "every"};
  Py_ssize_t k[5], l[3], b[9], w[7], g[2];
  for (int i = 0; i < 5; i++) {
    if ((k[i] = member_offset(ker, ker_names[i])) < 0) return nullptr;
  }
  for (int i = 0; i < 3; i++) {
    if ((l[i] = member_offset(loc, loc_names[i])) < 0) return nullptr;
  }
  for (int i = 0; i < 9; i++) {
    if ((b[i] = member_offset(blk, blk_names[i])) < 0) return nullptr;
  }
  for (int i = 0; i < 7; i++) {
    if ((w[i] = member_offset(wt, wait_names[i])) < 0) return nullptr;
  }
  for (int i = 0; i < 2; i++) {
    if ((g[i] = member_offset(gate, gate_names[i])) < 0) return nullptr;
  }
  ker_off = {k[0], k[1], k[2], k[3], k[4]};
  loc_off = {l[0], l[1], l[2]};
  blk_off = {b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8]};
  wait_off = {w[0], w[1], w[2], w[3], w[4], w[5], w[6]};
  gate_off = {g[0], g[1]};
  Py_INCREF(gate);
  Py_XSETREF(gate_type, gate);
  Py_INCREF(loc);
  Py_XSETREF(location_type, loc);
  Py_INCREF(blk);
  Py_XSETREF(block_type, blk);
  Py_INCREF(wt);
  Py_XSETREF(wait_type, wt);
  Py_INCREF(view);
  Py_XSETREF(view_type, view);
  if (!present_name && !(present_name = PyUnicode_InternFromString("present"))) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef more_functions[] = {
    {"set_types", py_set_types, METH_VARARGS, "Register the Location, Block, Wait, Interleaver, StepGate and ValueView classes."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

namespace asyncpp {

int count_in(PyObject* counts, Py_ssize_t idx) {
  if (idx < 0 || idx >= PyList_GET_SIZE(counts)) return 0;
  PyObject* old = PyList_GET_ITEM(counts, idx);
  PyObject* next = PyLong_FromSsize_t(PyLong_AsSsize_t(old) + 1);
  if (!next) return -1;
  PyList_SET_ITEM(counts, idx, next);
  Py_DECREF(old);
  return 0;
}

}  // namespace asyncpp

void asyncpp::register_controllers(pybind11::module_& m) {
  for (int i = 0; i < n_fields; i++) field_keys[i] = PyUnicode_InternFromString(field_names[i]);
  for (PyMethodDef* d = more_functions; d->ml_name; d++) {
    PyObject* f = PyCFunction_New(d, nullptr);
    if (!f) throw pybind11::error_already_set();
    m.add_object(d->ml_name, f);
  }

  RunLinkType.tp_name = "asyncpp_native.RunLink";
  RunLinkType.tp_basicsize = sizeof(RunLink);
  RunLinkType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  RunLinkType.tp_doc = "The link between a model's controllers and the run they serve (shared by all of them).";
  RunLinkType.tp_new = link_new;
  RunLinkType.tp_dealloc = link_dealloc;
  RunLinkType.tp_traverse = link_traverse;
  RunLinkType.tp_clear = link_clear;
  RunLinkType.tp_methods = link_methods;
  RunLinkType.tp_members = link_members;
  if (PyType_Ready(&RunLinkType) < 0) throw pybind11::error_already_set();

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
  ControllerType.tp_methods = controller_methods;
  ControllerType.tp_members = controller_members;
  if (PyType_Ready(&ControllerType) < 0) throw pybind11::error_already_set();

  Py_INCREF(&RunLinkType);
  m.add_object("RunLink", reinterpret_cast<PyObject*>(&RunLinkType));
  Py_INCREF(&ControllerType);
  m.add_object("Controller", reinterpret_cast<PyObject*>(&ControllerType));
  for (PyMethodDef* d = module_functions; d->ml_name; d++) {
    PyObject* f = PyCFunction_New(d, nullptr);
    if (!f) throw pybind11::error_already_set();
    m.add_object(d->ml_name, f);
  }
}
