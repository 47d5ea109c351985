// The reason behind the last kInvalidValue a launcher returned on this thread, so the
// binding layer can report "why" instead of only "invalid argument".
#include <cstdarg>
#include <cstdio>

#include "dsv41/kernels.h"

namespace dsv41 {
namespace {
thread_local char g_reason[512] = "";
}  // namespace

const char* last_launch_error() { return g_reason; }

void clear_launch_error() { g_reason[0] = '\0'; }

int launch_fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_reason, sizeof(g_reason), fmt, ap);
  va_end(ap);
  return kInvalidValue;
}

}  // namespace dsv41
