// The extension module: one build holding every native piece of asyncpp.
#include "asyncpp_native.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "asyncpp native pieces: thread-local-state swap and per-module controllers, the tap operator's kernel";
  asyncpp::register_tls(m);
  asyncpp::register_controllers(m);
  asyncpp::register_rows(m);
  asyncpp::register_await(m);
  asyncpp::register_tap(m);
}
