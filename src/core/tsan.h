// ThreadSanitizer does not see ordering that goes through the kernel: bytes sent on a socket in
// one thread and received in another (both ends in one process in our tests). These
// annotations tell it: every successful send "releases", every successful receive "acquires".
// They compile to nothing outside TSan builds.
#pragma once

#include "core/sanitizers.h"

#if defined(FERRY_TSAN)
#include <sanitizer/tsan_interface.h>
namespace ferry {
inline char tsan_socket_sync;
}
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#define FERRY_TSAN_SOCKET_SENT() __tsan_release(&::ferry::tsan_socket_sync)
#define FERRY_TSAN_SOCKET_RECEIVED() __tsan_acquire(&::ferry::tsan_socket_sync)
// The kernel's reads of a send's buffers are ordered by the protocol (a peer acts on the bytes
// only after they arrived), not by anything TSan can see.
#define FERRY_TSAN_IGNORE_READS_BEGIN() AnnotateIgnoreReadsBegin(__FILE__, __LINE__)
#define FERRY_TSAN_IGNORE_READS_END() AnnotateIgnoreReadsEnd(__FILE__, __LINE__)
#else
#define FERRY_TSAN_SOCKET_SENT() ((void)0)
#define FERRY_TSAN_SOCKET_RECEIVED() ((void)0)
#define FERRY_TSAN_IGNORE_READS_BEGIN() ((void)0)
#define FERRY_TSAN_IGNORE_READS_END() ((void)0)
#endif
