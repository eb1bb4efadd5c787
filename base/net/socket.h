// Socket helpers for every part that opens a connection: every blocking step has a deadline.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierkv::net {

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  ~Fd();
  int get() const { return fd_; }
  int release();
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// "host:port" -> a connected, non-blocking, TCP_NODELAY socket.
// UNAVAILABLE (naming the endpoint) when refused or unreachable;
// DEADLINE_EXCEEDED when the deadline passes first.
absl::StatusOr<Fd> Dial(const std::string& endpoint, absl::Time deadline);

// A listening socket on `address`:`port` (0 picks one); *bound gets the
// port. `address` is an IPv4 address or host name, or an IPv6 literal
// (bracketed or not). "::" takes IPv4 too, and "0.0.0.0" takes IPv6 too
// where the host has it (else IPv4 alone), as gRPC's wildcards do.
absl::StatusOr<Fd> Listen(const std::string& address, int port, int* bound);

// A loopback port nothing listens on now, for a test or benchmark to hand
// a server it starts (a lost race shows as a server that cannot bind). 0
// when none could be had.
int FreeLoopbackPort();

// Full reads and writes on a non-blocking socket, polling up to `deadline`.
// UNAVAILABLE on EOF or a socket error.
absl::Status ReadFull(int fd, void* buf, size_t len, absl::Time deadline);
absl::Status WriteFull(int fd, const void* buf, size_t len, absl::Time deadline);
// Writes every iovec fully (the array is modified).
absl::Status WriteVecFull(int fd, struct iovec* iov, int count, absl::Time deadline);

// Busy-polls `fd` for up to `window`: true as soon as it is readable (or
// has an error or hangup to report), false once the window has passed
// without either. A reply due within microseconds is cheaper to spin for
// than to sleep for: a sleeping thread's wake-up costs tens of
// microseconds on virtual machines. It offers its core to any thread
// waiting for it between polls. A zero window returns at once.
bool SpinUntilReadable(int fd, absl::Duration window);

// Server-side busy polling for clients that call back to back (a lookup, a
// copy, the next lookup). A server thread that sleeps for each request
// makes every call pay a wake-up, which the client's own spin cannot save;
// one that polls the connection a little after its reply takes the next
// call at once. ServerSpin holds the window (cut to 1 ms) and the cap on
// threads spinning at once, so spinning never takes more cores than that
// however many clients call; each connection keeps a SpinTracker, which
// says when spinning pays.
class ServerSpin {
 public:
  // A call came (or the peer closed); the window passed; no place was free.
  enum class Outcome { kCall, kIdle, kCapped };
  // How a server's spins ended, by outcome.
  struct Counts {
    uint64_t call = 0, idle = 0, capped = 0;
  };

  ServerSpin(absl::Duration window, size_t max_spinners);
  bool enabled() const { return window_ > absl::ZeroDuration() && max_spinners_ > 0; }
  absl::Duration window() const { return window_; }
  // Polls `fd` for up to the window, if fewer than max_spinners threads
  // are spinning. Thread-safe.
  Outcome Spin(int fd);

 private:
  const absl::Duration window_;
  const size_t max_spinners_;
  std::atomic<size_t> spinning_{0};
};

// One connection's record (used by the thread serving it): a call that
// came during a spin keeps the connection hot; a spin that saw nothing
// makes it sleep through the next 1, 2, 4 ... 64 calls, so a client whose
// calls come just past the window wastes few; after a sleep it is hot
// again if the call came within twice the window of the last reply (the
// gap then also holds the wake-up). A monotonic clock, read only while
// spinning is enabled.
class SpinTracker {
 public:
  // Without a ServerSpin (or with one disabled) it is never hot.
  explicit SpinTracker(const ServerSpin* spin = nullptr) : spin_(spin) {}
  bool hot() const { return hot_; }
  void Spun(ServerSpin::Outcome outcome);  // after ServerSpin::Spin
  void Arrived();                          // a call is here, after a spin or a sleep
  void Replied();                          // its reply went out

 private:
  const ServerSpin* spin_;
  std::chrono::steady_clock::time_point replied_{};
  bool hot_ = false;
  bool came_in_spin_ = false;
  unsigned skip_ = 0, backoff_ = 0;
};

// One step of non-blocking I/O for an event loop (the tcp server): moves
// what it can now and never waits. `n` > 0: bytes moved; `n` == 0: nothing
// could move, and `wait` says what to wait for (POLLIN or POLLOUT).
struct IoStep {
  size_t n = 0;
  short wait = 0;
};
// UNAVAILABLE on EOF or a socket error.
absl::StatusOr<IoStep> RecvSome(int fd, void* buf, size_t len);
absl::StatusOr<IoStep> SendSome(int fd, const struct iovec* iov, int count);

// For blocking sockets whose SO_RCVTIMEO/SO_SNDTIMEO bound each call (the
// server's connections): MSG_WAITALL receives a whole payload in one call
// and one wake-up instead of one per arriving segment. DEADLINE_EXCEEDED
// when a timeout fires, UNAVAILABLE on EOF or error.
absl::Status RecvAll(int fd, void* buf, size_t len);
absl::Status SendVecAll(int fd, struct iovec* iov, int count);
void SetTimeouts(int fd, absl::Duration timeout);

}  // namespace tierkv::net
