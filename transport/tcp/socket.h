// Socket helpers for the tcp backend: every blocking step has a deadline.
#pragma once

#include <sys/uio.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierkv::transport::tcp {

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
// microseconds on virtual machines. A zero window returns at once.
bool SpinUntilReadable(int fd, absl::Duration window);

// For blocking sockets whose SO_RCVTIMEO/SO_SNDTIMEO bound each call (the
// server's connections): MSG_WAITALL receives a whole payload in one call
// and one wake-up instead of one per arriving segment. DEADLINE_EXCEEDED
// when a timeout fires, UNAVAILABLE on EOF or error.
absl::Status RecvAll(int fd, void* buf, size_t len);
absl::Status SendVecAll(int fd, struct iovec* iov, int count);
void SetTimeouts(int fd, absl::Duration timeout);

}  // namespace tierkv::transport::tcp
