// Where torch keeps autocast's thread-local fields (the dtype per device, the cache flag, the
// nesting depth), so that the swap can read and set them in place.
//
// Torch exposes them only through getters (and the nesting depth only through increment and
// decrement); each call goes into libtorch_cpu and through the dynamic loader's __tls_get_addr,
// and after a forward each is a few cache misses. The fields are file-local thread_locals of
// libtorch_cpu, named in its symbol table with their offsets in the library's thread-local block.
// Those offsets are read once from the library file; the calling thread's block comes from
// __tls_get_addr. The result is checked against the getters, with every field changed and put
// back; when anything does not match (a stripped or different build), callers use the getters.

#include <ATen/autocast_mode.h>
#include "asyncpp_native.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) && defined(__GLIBC__)
extern "C" void* __tls_get_addr(void*);  // glibc's dynamic loader: a module's block for this thread
#define ASYNCPP_AUTOCAST_IN_PLACE 1
#endif

#ifdef ASYNCPP_AUTOCAST_IN_PLACE
namespace {

struct TlsIndex {
  unsigned long module;
  unsigned long offset;
};

constexpr const char* kNames[3] = {
    "_ZN2at8autocast12_GLOBAL__N_113cache_enabledE",   // bool
    "_ZN2at8autocast12_GLOBAL__N_114autocast_dtypeE",  // std::array<ScalarType, max device types>
    "_ZN2at8autocast12_GLOBAL__N_17nestingE",          // int
};
constexpr size_t kSizes[3] = {sizeof(bool), sizeof(at::ScalarType) * at::COMPILE_TIME_MAX_DEVICE_TYPES,
                              sizeof(int)};

struct Layout {
  bool ok = false;
  unsigned long module = 0;  // libtorch_cpu's thread-local-storage module id
  size_t offsets[3] = {};
};

// The offsets of the fields in the library file's symbol table (thread-local symbols: offsets in
// the library's block); false when any is missing or has another size.
bool read_offsets(const char* path, size_t offsets[3]) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st{};
  if (fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof(Elf64_Ehdr)) {
    close(fd);
    return false;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return false;
  const auto* base = static_cast<const unsigned char*>(map);
  auto inside = [&](uint64_t off, uint64_t len) { return off <= size && len <= size - off; };
  bool found[3] = {false, false, false};
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
  if (std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
      inside(eh->e_shoff, uint64_t(eh->e_shnum) * sizeof(Elf64_Shdr))) {
    const auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
    for (unsigned i = 0; i < eh->e_shnum; i++) {
      if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
      const Elf64_Shdr& strs = sh[sh[i].sh_link];
      if (!inside(sh[i].sh_offset, sh[i].sh_size) || !inside(strs.sh_offset, strs.sh_size)) continue;
      const auto* syms = reinterpret_cast<const Elf64_Sym*>(base + sh[i].sh_offset);
      const char* names = reinterpret_cast<const char*>(base + strs.sh_offset);
      const size_t count = sh[i].sh_size / sizeof(Elf64_Sym);
      for (size_t k = 0; k < count && !(found[0] && found[1] && found[2]); k++) {
        const Elf64_Sym& s = syms[k];
        if (ELF64_ST_TYPE(s.st_info) != STT_TLS || s.st_name >= strs.sh_size) continue;
        const char* name = names + s.st_name;
        const size_t room = strs.sh_size - s.st_name;
        for (int j = 0; j < 3; j++) {
          if (!found[j] && s.st_size == kSizes[j] && strnlen(name, room) < room &&
              std::strcmp(name, kNames[j]) == 0) {
            offsets[j] = s.st_value;
            found[j] = true;
          }
        }
      }
    }
  }
  munmap(map, size);
  return found[0] && found[1] && found[2];
}

struct Find {
  const void* base;
  unsigned long module = 0;
};

int find_module(dl_phdr_info* info, size_t, void* data) {
  auto* f = static_cast<Find*>(data);
  if (reinterpret_cast<const void*>(info->dlpi_addr) != f->base) return 0;
  f->module = info->dlpi_tls_modid;
  return 1;
}

asyncpp::AutocastFields fields_for(const Layout& l) {
  TlsIndex index{l.module, 0};
  auto* block = static_cast<char*>(__tls_get_addr(&index));
  if (!block) return {};
  return {reinterpret_cast<bool*>(block + l.offsets[0]), reinterpret_cast<at::ScalarType*>(block + l.offsets[1]),
          reinterpret_cast<int*>(block + l.offsets[2])};
}

// The fields read in place agree with the getters, before and after each is changed (and put back).
bool agrees(const asyncpp::AutocastFields& f) {
  auto same = [&] {
    return *f.cache == at::autocast::is_autocast_cache_enabled() &&
           f.dtype[static_cast<int>(at::kCPU)] == at::autocast::get_autocast_dtype(at::kCPU) &&
           f.dtype[static_cast<int>(at::kCUDA)] == at::autocast::get_autocast_dtype(at::kCUDA);
  };
  bool ok = same();
  const bool cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(!cache);
  ok = ok && same();
  at::autocast::set_autocast_cache_enabled(cache);
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCPU);
  at::autocast::set_autocast_dtype(at::kCPU, dtype == at::kDouble ? at::kHalf : at::kDouble);
  ok = ok && same();
  at::autocast::set_autocast_dtype(at::kCPU, dtype);
  const int up = at::autocast::increment_nesting();
  ok = ok && *f.nesting == up;
  const int down = at::autocast::decrement_nesting();
  return ok && *f.nesting == down && same();
}

Layout locate() {
  Layout l;
  if (const char* off = std::getenv("ASYNCPP_AUTOCAST_GETTERS"); off && std::strcmp(off, "1") == 0)
    return l;  // tests: take the getters' way
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&at::autocast::is_autocast_cache_enabled), &info) || !info.dli_fname)
    return l;
  Find find{info.dli_fbase};
  dl_iterate_phdr(find_module, &find);
  if (find.module == 0 || !read_offsets(info.dli_fname, l.offsets)) return l;
  l.module = find.module;
  const asyncpp::AutocastFields f = fields_for(l);
  l.ok = f.cache && agrees(f);
  return l;
}

}  // namespace

asyncpp::AutocastFields asyncpp::autocast_fields_here() {
  static const Layout layout = locate();  // once per process (the offsets are the same on every thread)
  if (!layout.ok) return {};
  return fields_for(layout);
}
#else
asyncpp::AutocastFields asyncpp::autocast_fields_here() { return {}; }
#endif
