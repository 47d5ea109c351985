// GPUDirect Storage through libcufile, loaded with dlopen on first use so that nothing links
// against it: a machine without the library, the nvidia-fs driver or a GPU gets a clear
// "unavailable" reason and the POSIX path. Compiled in only when dsv41 is built with CUDA
// and setup.py found cufile.h (DSV41_WITH_CUFILE); the types come from that header, the
// functions from the library at run time.
//
// Never run on a GPU in the project's CI (it has none).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "dsv41/io.h"

#if defined(DSV41_WITH_CUDA) && defined(DSV41_WITH_CUFILE)
#include <dlfcn.h>

#include DSV41_CUFILE_HEADER  // cufile.h by full path (see setup.py)

namespace dsv41 {
namespace io {
namespace {

struct CuFileApi {
  void* lib = nullptr;
  decltype(&cuFileDriverOpen) driver_open = nullptr;
  decltype(&cuFileHandleRegister) handle_register = nullptr;
  decltype(&cuFileHandleDeregister) handle_deregister = nullptr;
  decltype(&cuFileRead) read = nullptr;
  decltype(&cuFileWrite) write = nullptr;
  GdsStatus status;
};

template <typename F>
bool sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

CuFileApi& api() {
  static CuFileApi a;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("DSV41_GDS");
    if (env && std::strcmp(env, "0") == 0) {
      a.status.reason = "disabled by DSV41_GDS=0";
      return;
    }
    if (cuda_device_count() <= 0) {
      a.status.reason = "no CUDA device";
      return;
    }
    std::string tried;
    const char* override_lib = std::getenv("DSV41_CUFILE_LIB");
    for (const char* name : {override_lib, "libcufile.so.0", "libcufile.so"}) {
      if (!name || !*name) continue;
      a.lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (a.lib) {
        a.status.reason = name;
        break;
      }
      const char* err = dlerror();
      tried += std::string(tried.empty() ? "" : "; ") + (err ? err : name);
    }
    if (!a.lib) {
      a.status.reason = "libcufile not found (" + tried + ")";
      return;
    }
    if (!sym(a.lib, "cuFileDriverOpen", &a.driver_open) ||
        !sym(a.lib, "cuFileHandleRegister", &a.handle_register) ||
        !sym(a.lib, "cuFileHandleDeregister", &a.handle_deregister) ||
        !sym(a.lib, "cuFileRead", &a.read) || !sym(a.lib, "cuFileWrite", &a.write)) {
      a.status.reason = "libcufile lacks an expected symbol";
      return;
    }
    const CUfileError_t e = a.driver_open();
    if (e.err != CU_FILE_SUCCESS) {
      a.status.reason = "cuFileDriverOpen failed: " + gds_error_string(e.err);
      return;
    }
    a.status.available = true;
    a.status.reason = "cuFile from " + a.status.reason;
  });
  return a;
}

}  // namespace

GdsStatus gds_status() { return api().status; }

GdsFile::GdsFile(const std::string& path, bool write) {
  CuFileApi& a = api();
  if (!a.status.available) throw std::runtime_error("GPUDirect Storage unavailable: " + a.status.reason);
  const int flags = (write ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC;
  fd_ = ::open(path.c_str(), flags | O_DIRECT, 0644);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL) fd_ = ::open(path.c_str(), flags, 0644);  // no O_DIRECT here
  if (fd_ < 0) throw std::runtime_error("open " + path + ": " + std::strerror(errno));
  CUfileDescr_t descr;
  std::memset(&descr, 0, sizeof(descr));
  descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
  descr.handle.fd = fd_;
  CUfileHandle_t h = nullptr;
  const CUfileError_t e = a.handle_register(&h, &descr);
  if (e.err != CU_FILE_SUCCESS) {
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error("cuFileHandleRegister(" + path + (direct_ ? "" : ", without O_DIRECT") +
                             ") failed: " + gds_error_string(e.err));
  }
  handle_ = h;
}

GdsFile::~GdsFile() {
  if (handle_) api().handle_deregister(static_cast<CUfileHandle_t>(handle_));
  if (fd_ >= 0) ::close(fd_);
}

// cuFile returns -1 with errno set for a system error, and -CUfileOpError for its own:
// -1 becomes -errno here, before anything else can change errno.
int64_t GdsFile::read(void* dev_ptr, uint64_t size, uint64_t file_offset, uint64_t dev_offset) {
  errno = 0;
  const ssize_t n = api().read(static_cast<CUfileHandle_t>(handle_), dev_ptr, size,
                               static_cast<off_t>(file_offset), static_cast<off_t>(dev_offset));
  if (n == -1) return errno ? -errno : -EIO;
  return n;
}

int64_t GdsFile::write(const void* dev_ptr, uint64_t size, uint64_t file_offset,
                       uint64_t dev_offset) {
  errno = 0;
  const ssize_t n = api().write(static_cast<CUfileHandle_t>(handle_), dev_ptr, size,
                                static_cast<off_t>(file_offset), static_cast<off_t>(dev_offset));
  if (n == -1) return errno ? -errno : -EIO;
  return n;
}

// The CUfileOpError's enum name (CU_FILE_HANDLE_NOT_REGISTERED), from cufile.h's own
// X-macro list, so that a log names the error as the header and NVIDIA's docs do; nullptr
// for a code the header does not list (a newer library) or a header without the list.
namespace {
const char* cufile_error_name(int64_t c) {
#ifdef CUFILEOP_STATUS_ENTRIES
  switch (c) {
#define CUFILE_OP(code, name, string) \
  case code:                          \
    return #name;
    CUFILEOP_STATUS_ENTRIES
#undef CUFILE_OP
    default:
      break;
  }
#endif
  (void)c;
  return nullptr;
}
}  // namespace

std::string gds_error_string(int64_t code) {
  const int64_t c = code < 0 ? -code : code;
  if (c < CUFILEOP_BASE_ERR) return std::strerror(static_cast<int>(c));
  const char* name = cufile_error_name(c);
  const std::string head = "cuFile error " + std::to_string(c);
  if (!name) return head + " (not listed in the cufile.h dsv41 was built with)";
  return head + " " + name + " (" + cufileop_status_error(static_cast<CUfileOpError>(c)) + ")";
}

}  // namespace io
}  // namespace dsv41

#else  // no CUDA or no cufile.h at build time

namespace dsv41 {
namespace io {

GdsStatus gds_status() {
  GdsStatus s;
#ifndef DSV41_WITH_CUDA
  s.reason = "dsv41 was built without CUDA";
#else
  s.reason = "dsv41 was built without cufile.h";
#endif
  return s;
}

GdsFile::GdsFile(const std::string&, bool) {
  throw std::runtime_error("GPUDirect Storage unavailable: " + gds_status().reason);
}
GdsFile::~GdsFile() = default;
int64_t GdsFile::read(void*, uint64_t, uint64_t, uint64_t) { return -ENOSYS; }
std::string gds_error_string(int64_t code) {
  const int64_t c = code < 0 ? -code : code;
  return c < 5000 ? std::string(std::strerror(static_cast<int>(c))) : "cuFile error " + std::to_string(c);
}
int64_t GdsFile::write(const void*, uint64_t, uint64_t, uint64_t) { return -ENOSYS; }

}  // namespace io
}  // namespace dsv41

#endif
