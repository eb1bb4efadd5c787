// Shared by the fuzz targets: a check that reports and aborts, so libFuzzer
// saves the input that broke a property (not only inputs that crash).
#pragma once

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: property violated: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)

// As FUZZ_CHECK for an absl::Status, printing what it says.
#define FUZZ_CHECK_OK(expr)                                                                       \
  do {                                                                                            \
    const absl::Status fuzz_status_ = (expr);                                                     \
    if (!fuzz_status_.ok()) {                                                                     \
      std::fprintf(stderr, "%s:%d: property violated: %s: %s\n", __FILE__, __LINE__, #expr,        \
                   fuzz_status_.ToString().c_str());                                              \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)

namespace tierkv::fuzz {

// Reads (and drops) what a server sends on `fd` until it closes or
// `deadline` passes, waiting in poll, so a target returns only once the
// server is done with its input (the fd may be non-blocking). A signal
// (libFuzzer's timeout alarm) does not end the wait: a target that went
// on early would check the server's state while it still works.
inline void DrainUntilClosed(int fd, absl::Time deadline) {
  char buf[65536];
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return;
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(ms));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return;
    if (::recv(fd, buf, sizeof buf, MSG_DONTWAIT) == 0) return;
    if (p.revents & (POLLERR | POLLNVAL)) return;
  }
}

}  // namespace tierkv::fuzz
