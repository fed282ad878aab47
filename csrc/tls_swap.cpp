// asyncpp thread-local-state swap.
//
// Intervention blocks and the model's forward share one OS thread, and torch keeps grad mode,
// inference mode, autocast, dispatch-key sets, mode stacks and saved-tensor hooks per thread.
// Every switch into a block installs that block's state and every switch back restores the
// forward's. A full capture (at::ThreadLocalState) costs around a microsecond, so each side is
// summarised by a fingerprint of torch's state, read in place: when the block's fingerprint equals the
// thread's at entry, and the block changed nothing before it left, no state is copied at all.

#include <ATen/ThreadLocalState.h>
#include <ATen/Context.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/PythonDispatcherTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include "asyncpp_native.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include <pthread.h>

namespace {

constexpr size_t kWords = 15;  // see fingerprint()
using Fingerprint = std::array<uint64_t, kWords>;

int autocast_nesting() {
  at::autocast::increment_nesting();
  return at::autocast::decrement_nesting();
}

void set_autocast_nesting(int target) {
  int now = autocast_nesting();
  while (now < target) now = at::autocast::increment_nesting();
  while (now > target) now = at::autocast::decrement_nesting();
}

uint64_t ptr_bits(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// Words 0..3 summarise the "simple" state (dispatch-key sets, autograd modes, autocast dtypes, cache
// and nesting): what no_grad, inference_mode and autocast change, which can be set field by field.
// Words 4.. summarise the rest (mode stacks, saved-tensor hooks, python dispatcher, callbacks),
// which only a full at::ThreadLocalState capture and restore can carry.
constexpr size_t kSimpleWords = 4;

// Torch keeps the mode stacks' thread-local state in objects whose fields are private; an explicit
// template instantiation may name private members, which lets the fingerprint read those fields in
// place (one pointer cached per thread) instead of calling into torch for each.
template <typename Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type member(Tag) { return Member; }
};
using DispatchModePtr = std::shared_ptr<c10::impl::PyObject_TorchDispatchMode>;
struct TfStack {
  using type = std::vector<std::shared_ptr<c10::SafePyObject>> at::impl::PythonTorchFunctionTLS::*;
  friend type member(TfStack);
};
struct TfDisabled {
  using type = at::impl::TorchFunctionDisabledState at::impl::PythonTorchFunctionTLS::*;
  friend type member(TfDisabled);
};
struct DmStack {
  using type = std::vector<DispatchModePtr> c10::impl::TorchDispatchModeTLS::*;
  friend type member(DmStack);
};
struct DmInfra {
  using type = std::array<std::optional<DispatchModePtr>,
                          static_cast<size_t>(c10::impl::TorchDispatchModeKey::NUM_MODE_KEYS)>
      c10::impl::TorchDispatchModeTLS::*;
  friend type member(DmInfra);
};
struct PyData {
  using type = PyObject* c10::SafePyObject::*;
  friend type member(PyData);
};
template struct Expose<TfStack, &at::impl::PythonTorchFunctionTLS::stack_>;
template struct Expose<PyData, &c10::SafePyObject::data_>;
template struct Expose<TfDisabled, &at::impl::PythonTorchFunctionTLS::disabled_state_>;
template struct Expose<DmStack, &c10::impl::TorchDispatchModeTLS::stack_>;
template struct Expose<DmInfra, &c10::impl::TorchDispatchModeTLS::infra_modes_>;

// Where a thread keeps the state objects torch hands out by reference, so a fingerprint reads them
// directly instead of calling into torch for each (after a forward the caches are cold, and every
// call into another library is a miss or two). Each BlockState keeps the set of the thread it last
// ran on, checked by thread id: a thread_local here would cost a __tls_get_addr call per switch,
// since this library is loaded with dlopen.
//
// A new thread can get the id of one that has ended (glibc reuses a cached stack, and the id is
// its address) while the old thread's torch state objects are freed. So every thread that looked
// its sources up advances a global epoch when it ends, and sets from an earlier epoch are looked
// up again.
inline uintptr_t thread_id() {
#if defined(__x86_64__) && __has_builtin(__builtin_thread_pointer)
  return reinterpret_cast<uintptr_t>(__builtin_thread_pointer());  // one register read, no call
#else
  return static_cast<uintptr_t>(pthread_self());
#endif
}

std::atomic<uint64_t> thread_epoch{1};

struct EpochOnExit {
  bool armed = false;
  ~EpochOnExit() {
    if (armed) thread_epoch.fetch_add(1, std::memory_order_release);
  }
};

struct Sources {
  uintptr_t thread = 0;
  uint64_t epoch = 0;
  c10::impl::PODLocalDispatchKeySet* keys = nullptr;
  c10::AutogradState* autograd = nullptr;
  const at::impl::SavedTensorDefaultHooksTLS* hooks = nullptr;
  const at::impl::PythonTorchFunctionTLS* tf = nullptr;
  const c10::impl::TorchDispatchModeTLS* dm = nullptr;
  const at::RecordFunctionTLS* rf = nullptr;
  asyncpp::AutocastFields autocast;  // null where torch's getters must be called instead

  // the calling thread's
  __attribute__((noinline, cold)) static Sources here() {
    thread_local EpochOnExit on_exit;
    on_exit.armed = true;
    Sources s;
    s.epoch = thread_epoch.load(std::memory_order_acquire);
    s.thread = thread_id();
    s.keys = &c10::impl::raw_local_dispatch_key_set;
    s.autograd = &c10::AutogradState::get_tls_state();
    s.hooks = &at::SavedTensorDefaultHooks::get_tls_state();
    s.tf = &at::impl::PythonTorchFunctionTLS::get_state();
    s.dm = &c10::impl::TorchDispatchModeTLS::get_state();
    s.rf = &at::get_record_function_tls_();
    s.autocast = asyncpp::autocast_fields_here();
    return s;
  }
  // make these the calling thread's, if they are not
  __attribute__((hot)) void ensure_here() {
    if (__builtin_expect(thread != thread_id() || epoch != thread_epoch.load(std::memory_order_acquire), 0))
      *this = here();
  }
};

const uint64_t kPythonDispatcherKey = c10::DispatchKeySet(c10::DispatchKey::PythonDispatcher).raw_repr();

// Without CUDA, the CUDA autocast dtype cannot change what anything computes.
const bool kWatchCudaDtype = at::hasCUDA();

// Autocast's part of the thread's state (its enabled flags are dispatch keys, kept with those).
struct AutocastState {
  at::ScalarType cpu_dtype = at::kFloat, cuda_dtype = at::kFloat;
  bool cache = true;
  int nesting = 0;
};

// where autocast's fields could not be located: torch's getters (kept out of the hot code)
__attribute__((cold, noinline)) AutocastState autocast_by_getters() {
  return {at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA),
          at::autocast::is_autocast_cache_enabled(), autocast_nesting()};
}

inline AutocastState read_autocast(const Sources& src) {
  const asyncpp::AutocastFields& ac = src.autocast;
  if (__builtin_expect(ac.cache == nullptr, 0)) return autocast_by_getters();
  return {ac.dtype[static_cast<int>(at::kCPU)], ac.dtype[static_cast<int>(at::kCUDA)], *ac.cache, *ac.nesting};
}

__attribute__((hot)) Fingerprint fingerprint(const Sources& src) {
  Fingerprint f{};
  f[0] = src.keys->included_;  // raw (stored xor the default set): equal sets, equal words
  f[1] = src.keys->excluded_;
  const c10::AutogradState& ag = *src.autograd;
  const AutocastState ac = read_autocast(src);
  f[2] = (uint64_t)ag.get_grad_mode() | ((uint64_t)ag.get_fw_grad_mode() << 1) |
         ((uint64_t)ag.get_inference_mode() << 2) | ((uint64_t)ag.get_multithreading_enabled() << 3) |
         ((uint64_t)ag.get_view_replay_enabled() << 4) | ((uint64_t)ac.cache << 5);
  const uint64_t cuda_dtype = kWatchCudaDtype ? static_cast<int>(ac.cuda_dtype) : 0;
  f[3] = (uint64_t)static_cast<int>(ac.cpu_dtype) | (cuda_dtype << 16) |
         ((uint64_t)static_cast<uint32_t>(ac.nesting) << 32);
  const auto& tf_stack = src.tf->*member(TfStack{});
  f[4] = (uint64_t)tf_stack.size() | ((uint64_t)static_cast<int>(src.tf->*member(TfDisabled{})) << 48);
  f[5] = tf_stack.empty() ? 0 : ptr_bits(tf_stack.back().get());
  // Objects are told apart by address. An address can name another object only after the first
  // is freed, and every address in a block's fingerprint stays taken while the block lives: its
  // captured state holds a reference to each (the mode wrappers, the hook functions).
  const auto& dm_stack = src.dm->*member(DmStack{});
  f[6] = (uint64_t)dm_stack.size();
  f[7] = dm_stack.empty() ? 0 : ptr_bits(dm_stack.back().get());
  // the infra modes (fake tensor, proxy, functional) sit outside the stack
  const auto& infra = src.dm->*member(DmInfra{});
  static_assert(std::tuple_size_v<std::decay_t<decltype(infra)>> == 3, "fingerprint words 12-14");
  for (size_t i = 0; i < 3; i++) f[12 + i] = infra[i].has_value() ? ptr_bits(infra[i]->get()) | 1 : 0;
  // the python dispatcher's key is in the included set exactly while it is on: a complex part
  f[8] = f[0] & kPythonDispatcherKey;
  // saved-tensor hooks: the depth, and the pack and unpack functions on top (their Python objects;
  // an entry's own address is reused when one context replaces another at the same depth)
  const auto& hooks = src.hooks->stack;
  f[9] = hooks.size() | ((uint64_t)!src.hooks->disabled_error_message.has_value() << 48) |
         ((uint64_t)src.hooks->is_tracing << 50) | ((uint64_t)!src.rf->sorted_tls_callbacks_.empty() << 49) |
         ((uint64_t)src.rf->tls_record_function_enabled_ << 51);
  f[10] = hooks.empty() ? 0 : ptr_bits(hooks.top().first.*member(PyData{}));
  f[11] = hooks.empty() ? 0 : ptr_bits(hooks.top().second.*member(PyData{}));
  // c10::ThreadLocalDebugInfo is left out: reading it copies a shared_ptr (atomics) at every
  // switch, and only C++ code (profilers) sets it; a full capture still carries it.
  return f;
}

// word by word, without a call to memcmp (one more function, and its cache lines, per switch)
inline bool same_words(const Fingerprint& a, const Fingerprint& b, size_t from = 0) {
  uint64_t d = 0;
  for (size_t i = from; i < kWords; i++) d |= a[i] ^ b[i];
  return d == 0;
}

bool same_complex(const Fingerprint& a, const Fingerprint& b) { return same_words(a, b, kSimpleWords); }

// The simple part of the state, captured and applied field by field (tens of nanoseconds).
// Parts of the simple state, as a mask: a switch sets only the parts that differ (each part is a
// cache line or two of torch's, cold after a forward; without autocast's fields located, a call
// into torch too).
enum : unsigned { kKeys = 1, kGrad = 2, kCache = 4, kDtypes = 8, kNesting = 16, kAll = 31 };

// The simple parts in which two fingerprints differ (see fingerprint() for the words' layout).
unsigned simple_diff(const Fingerprint& a, const Fingerprint& b) {
  unsigned m = 0;
  if (a[0] != b[0] || a[1] != b[1]) m |= kKeys;
  const uint64_t g = a[2] ^ b[2];
  if (g & 0x1f) m |= kGrad;
  if (g & 0x20) m |= kCache;
  const uint64_t d = a[3] ^ b[3];
  if (d & 0xffffffffull) m |= kDtypes;
  if (d >> 32) m |= kNesting;
  return m;
}

struct Simple {
  c10::impl::PODLocalDispatchKeySet keys{};  // raw, as stored
  c10::AutogradState autograd{false, false, false, false};
  AutocastState autocast;

  // a copy of the thread's simple state
  static Simple capture(const Sources& src) { return {*src.keys, *src.autograd, read_autocast(src)}; }

  // install the parts in ``mask`` on the thread of ``src`` (the calling thread), in place where
  // autocast's fields were located
  void apply(const Sources& src, unsigned mask = kAll) const {
    if (mask & kKeys) *src.keys = keys;
    if (mask & kGrad) *src.autograd = autograd;
    if (const asyncpp::AutocastFields& ac = src.autocast; ac.cache != nullptr) {
      if (mask & kDtypes) {
        ac.dtype[static_cast<int>(at::kCPU)] = autocast.cpu_dtype;
        ac.dtype[static_cast<int>(at::kCUDA)] = autocast.cuda_dtype;
      }
      if (mask & kCache) *ac.cache = autocast.cache;
      if (mask & kNesting) *ac.nesting = autocast.nesting;
      return;
    }
    if (mask & kDtypes) {
      at::autocast::set_autocast_dtype(at::kCPU, autocast.cpu_dtype);
      at::autocast::set_autocast_dtype(at::kCUDA, autocast.cuda_dtype);
    }
    if (mask & kCache) at::autocast::set_autocast_cache_enabled(autocast.cache);
    if (mask & kNesting) set_autocast_nesting(autocast.nesting);
  }
};

// The torch state of one block.
struct BlockState {
  // what every switch reads, first and together (a switch after a model layer meets cold caches:
  // each cache line it touches is a miss)
  bool inside = false;
  // forked and not yet entered: the template's state, until the first entry checks that the thread
  // still has it (the block starts with the thread's state at that moment)
  bool unverified = false;
  enum class Entry : uint8_t { fast, simple, full } entry = Entry::fast;  // set while the block runs
  unsigned entry_mask = kAll;  // the simple parts installed at entry
  Fingerprint fp;
  Sources src;  // where the thread it last ran on keeps its state
  // the rest: used when a state is installed or captured
  // the block's full state (its simple part may be older than `simple`); immutable once captured,
  // so blocks forked from one template share it instead of copying it
  std::shared_ptr<const at::ThreadLocalState> state;
  Simple simple;                                  // the block's simple state, always current
  std::optional<Simple> outer_simple;             // the thread's simple state at a non-fast entry
  std::unique_ptr<at::ThreadLocalState> outer;    // the thread's full state at a full entry
  uint64_t slow_entries = 0;  // for the benchmark: entries that had to install another state
  uint64_t captures = 0;      // leaves where the block had changed its state

  BlockState() : src(Sources::here()), state(std::make_shared<const at::ThreadLocalState>()) {
    simple = Simple::capture(src);
    fp = fingerprint(src);
  }
  BlockState(const BlockState& t) : fp(t.fp), src(t.src), state(t.state), simple(t.simple) {}
};

// In-trace timing for the benchmark (benchmarks/tls_switch.py): when on, the time spent inside the
// swap (enter, leave, fork, free) is summed on the calling thread, cold caches and all.
struct Timing {
  bool on = false;
  uint64_t ns = 0, switches = 0, per_block_ns = 0;
};
thread_local Timing timing;
bool timing_any = false;  // some thread has timing on: checked first, a plain load (no TLS lookup)

uint64_t clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

template <typename F>
__attribute__((always_inline)) inline void timed(bool is_switch, F&& body) {
  if (__builtin_expect(!timing_any, 1) || !timing.on) return body();
  const uint64_t t0 = clock_ns();
  body();  // an exception skips the sum; timings of failing switches do not matter
  const uint64_t dt = clock_ns() - t0;
  timing.ns += dt;
  if (is_switch) timing.switches++;
  else timing.per_block_ns += dt;
}

// Switch into a block: install its state on the calling thread.
// The slow part of an entry: the block's state differs from the thread's.
__attribute__((noinline, cold)) void enter_slow(BlockState& b, const Fingerprint& now) {
  b.slow_entries++;
  b.outer_simple.emplace(Simple::capture(b.src));
  if (same_complex(now, b.fp)) {
    b.entry = BlockState::Entry::simple;  // only grad / inference / autocast differ: set those
    b.entry_mask = simple_diff(now, b.fp);
  } else {
    b.entry = BlockState::Entry::full;
    b.entry_mask = kAll;
    b.outer = std::make_unique<at::ThreadLocalState>();
    at::ThreadLocalState::setThreadLocalState(*b.state);
  }
  b.simple.apply(b.src, b.entry_mask);
}

// A forked block's first entry: the thread's state moved on since the template, so the block
// starts from the thread's.
__attribute__((noinline, cold)) void adopt_thread_state(BlockState& b, const Fingerprint& now) {
  b.state = std::make_shared<const at::ThreadLocalState>();
  b.simple = Simple::capture(b.src);
  b.fp = now;
}

[[noreturn]] __attribute__((noinline, cold)) void fail_switch(const char* what) { TORCH_CHECK(false, what); }

// Switch into a block: install its state on the calling thread.
__attribute__((hot)) inline void enter_impl(BlockState& b) {
  if (__builtin_expect(b.inside, 0))
    fail_switch("asyncpp: a block was entered twice without leaving (resumed on two threads at once?)");
  b.inside = true;
  b.src.ensure_here();
  const Fingerprint now = fingerprint(b.src);
  if (__builtin_expect(b.unverified, 0)) {
    b.unverified = false;
    if (!same_words(now, b.fp)) adopt_thread_state(b, now);
  }
  if (__builtin_expect(same_words(now, b.fp), 1)) {
    b.entry = BlockState::Entry::fast;  // the thread already has the block's state
    return;
  }
  enter_slow(b, now);
}

// Leaving after a slow entry: keep what the block changed, put back the thread's state.
__attribute__((noinline, cold)) void leave_after_slow_entry(BlockState& b, const Fingerprint& now) {
  const bool changed = !same_words(now, b.fp);
  const bool complex_changed = changed && !same_complex(now, b.fp);
  const Fingerprint old_fp = b.fp;
  std::optional<Simple> prev;  // the block's simple state before this run
  std::shared_ptr<const at::ThreadLocalState> prev_state;
  if (changed) {
    prev.emplace(b.simple);
    b.simple = Simple::capture(b.src);
    if (complex_changed) {
      prev_state = std::move(b.state);
      b.state = std::make_shared<const at::ThreadLocalState>();
    }
    b.fp = now;
    b.captures++;
  }
  if (b.entry == BlockState::Entry::full) {
    at::ThreadLocalState::setThreadLocalState(*b.outer);
    b.outer.reset();
  } else if (prev_state) {
    // a simple entry, and the block changed its mode stacks or hooks: before, they were the
    // thread's; the parts not installed at entry were the thread's too
    at::ThreadLocalState::setThreadLocalState(*prev_state);
    prev->apply(b.src);
  } else if (prev) {
    prev->apply(b.src, simple_diff(now, old_fp) & ~b.entry_mask);  // parts the block changed itself
  }
  b.outer_simple->apply(b.src, b.entry_mask);
  b.outer_simple.reset();
}

// Leaving after a fast entry, the block having changed its state: before that change, its state
// was the thread's, so that is what the thread gets back.
__attribute__((noinline, cold)) void leave_after_change(BlockState& b, const Fingerprint& now) {
  const bool complex_changed = !same_complex(now, b.fp);
  Simple previous_simple = b.simple;
  const Fingerprint old_fp = b.fp;
  b.simple = Simple::capture(b.src);
  b.captures++;
  b.fp = now;
  if (complex_changed) {
    auto previous = std::move(b.state);
    b.state = std::make_shared<const at::ThreadLocalState>();
    at::ThreadLocalState::setThreadLocalState(*previous);
    previous_simple.apply(b.src);
    return;
  }
  previous_simple.apply(b.src, simple_diff(now, old_fp));
}

// Switch out of a block: keep what it changed, give the thread back its state.
__attribute__((hot)) inline void leave_impl(BlockState& b) {
  if (__builtin_expect(!b.inside, 0)) fail_switch("asyncpp: a block was left without being entered");
  b.inside = false;
  b.src.ensure_here();
  const Fingerprint now = fingerprint(b.src);
  if (__builtin_expect(b.entry != BlockState::Entry::fast, 0)) {
    leave_after_slow_entry(b, now);
  } else if (__builtin_expect(!same_words(now, b.fp), 0)) {
    leave_after_change(b, now);
  }  // else the fast path: nothing changed on either side
}

void enter(BlockState& b) { timed(true, [&] { enter_impl(b); }); }
void leave(BlockState& b) { timed(true, [&] { leave_impl(b); }); }

// ------------------------------------------------------------------------------------------------
// Python binding as a plain CPython type (pybind11's call dispatch costs more than the swap itself).

struct PyBlockState {
  PyObject_HEAD
  BlockState* impl;
};

PyTypeObject PyBlockStateType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* wrap(BlockState* impl) {
  auto* o = reinterpret_cast<PyBlockState*>(PyBlockStateType.tp_alloc(&PyBlockStateType, 0));
  if (!o) {
    delete impl;
    return nullptr;
  }
  o->impl = impl;
  return reinterpret_cast<PyObject*>(o);
}

PyObject* state_new(PyTypeObject*, PyObject*, PyObject*) {
  try {
    return wrap(new BlockState());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

void state_dealloc(PyObject* o) {
  timed(false, [&] { delete reinterpret_cast<PyBlockState*>(o)->impl; });
  Py_TYPE(o)->tp_free(o);
}

// template.fork(): a new block's state. It starts as a copy of the template (sharing its full
// capture) and takes the thread's state instead at its first entry if the thread's state is no
// longer the template's, so forking costs no look at the thread's state of its own.
PyObject* state_fork(PyObject* o, PyObject*) {
  const BlockState& t = *reinterpret_cast<PyBlockState*>(o)->impl;
  try {
    BlockState* made = nullptr;
    timed(false, [&] {
      made = new BlockState(t);
      made->unverified = true;
    });
    return wrap(made);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* state_get(PyObject* o, void* which) {
  const BlockState& b = *reinterpret_cast<PyBlockState*>(o)->impl;
  switch (reinterpret_cast<intptr_t>(which)) {
    case 0:
      return PyLong_FromUnsignedLongLong(b.slow_entries);
    case 1:
      return PyLong_FromUnsignedLongLong(b.captures);
    default:
      return PyBool_FromLong(b.inside);
  }
}

PyMethodDef state_methods[] = {{"fork", state_fork, METH_NOARGS, "A new block state starting from this one."},
                               {nullptr, nullptr, 0, nullptr}};

PyGetSetDef state_getset[] = {
    {"slow_entries", state_get, nullptr, "entries that had to install a different state", (void*)0},
    {"captures", state_get, nullptr, "leaves where the block had changed its state", (void*)1},
    {"inside", state_get, nullptr, "whether the block is running now", (void*)2},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

BlockState* unwrap(PyObject* o) {
  if (Py_TYPE(o) != &PyBlockStateType) {
    PyErr_SetString(PyExc_TypeError, "expected a BlockState");
    return nullptr;
  }
  return reinterpret_cast<PyBlockState*>(o)->impl;
}

// enter/leave for C callers and Python: 0, or -1 with a Python error set
__attribute__((hot)) int switch_in(PyObject* o) {
  BlockState* b = unwrap(o);
  if (!b) return -1;
  try {
    enter(*b);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  return 0;
}

__attribute__((hot)) int switch_out(PyObject* o) {
  BlockState* b = unwrap(o);
  if (!b) return -1;
  try {
    leave(*b);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  return 0;
}

PyObject* py_enter(PyObject*, PyObject* o) {
  if (switch_in(o) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* py_leave(PyObject*, PyObject* o) {
  if (switch_out(o) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef tls_functions[] = {
    {"enter", py_enter, METH_O, "Install a block's state on the calling thread."},
    {"leave", py_leave, METH_O, "Save a block's state and restore the thread's."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

int asyncpp::tls_enter(PyObject* state) { return switch_in(state); }
int asyncpp::tls_leave(PyObject* state) { return switch_out(state); }

void asyncpp::register_tls(pybind11::module_& m) {
  PyBlockStateType.tp_name = "asyncpp_native.BlockState";
  PyBlockStateType.tp_basicsize = sizeof(PyBlockState);
  PyBlockStateType.tp_flags = Py_TPFLAGS_DEFAULT;
  PyBlockStateType.tp_doc = "A block's torch thread-local state; BlockState() captures the thread's.";
  PyBlockStateType.tp_new = state_new;
  PyBlockStateType.tp_dealloc = state_dealloc;
  PyBlockStateType.tp_methods = state_methods;
  PyBlockStateType.tp_getset = state_getset;
  if (PyType_Ready(&PyBlockStateType) < 0) throw pybind11::error_already_set();
  Py_INCREF(&PyBlockStateType);
  m.add_object("BlockState", reinterpret_cast<PyObject*>(&PyBlockStateType));
  for (PyMethodDef* d = tls_functions; d->ml_name; d++) {
    PyObject* f = PyCFunction_New(d, nullptr);
    if (!f) throw pybind11::error_already_set();
    m.add_object(d->ml_name, f);
  }
  m.def(
      "timing",
      [](bool on) {
        auto was = pybind11::make_tuple(timing.ns, timing.switches, timing.per_block_ns);
        timing = Timing{};
        timing.on = on;
        timing_any = on;
        return was;
      },
      "Benchmark probe: sum the time spent in the swap on this thread from now (on=True) or stop; "
      "returns the sums so far (ns, switches, ns of per-block work: fork and free) and resets them.");
  m.def(
      "autocast_in_place",
      []() { return asyncpp::autocast_fields_here().cache != nullptr; },
      "Whether the swap reads autocast's thread-local fields in place (else through torch's getters).");
  m.def("fingerprint", []() {
    auto f = fingerprint(Sources::here());
    return std::vector<uint64_t>(f.begin(), f.end());
  });
}
