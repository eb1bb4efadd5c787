// Shared by the fuzz targets: a check that reports and aborts, so libFuzzer
// saves the input that broke a property (not only inputs that crash).
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstdlib>

#include "absl/time/clock.h"
#include "absl/time/time.h"

#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: property violated: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)

namespace tierkv::fuzz {

// Reads (and drops) what a server sends on `fd` until it closes or
// `deadline` passes, waiting in poll, so a target returns only once the
// server is done with its input (the fd may be non-blocking).
inline void DrainUntilClosed(int fd, absl::Time deadline) {
  char buf[65536];
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(ms)) <= 0) return;
    if (::recv(fd, buf, sizeof buf, MSG_DONTWAIT) == 0) return;
    if (p.revents & (POLLERR | POLLNVAL)) return;
  }
}

}  // namespace tierkv::fuzz
