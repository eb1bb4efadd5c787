#include "base/net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"

namespace tierkv::net {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}
Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}
int Fd::release() {
  int f = fd_;
  fd_ = -1;
  return f;
}

namespace {

// Moves past `sent` bytes of an iovec array after a partial sendmsg.
void Advance(iovec** iov, int* count, size_t sent) {
  while (*count > 0 && sent >= (*iov)->iov_len) {
    sent -= (*iov)->iov_len;
    ++*iov;
    --*count;
  }
  if (*count > 0) {
    (*iov)->iov_base = static_cast<char*>((*iov)->iov_base) + sent;
    (*iov)->iov_len -= sent;
  }
}

int PollMs(absl::Time deadline) {
  int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  if (ms < 0) return 0;
  return static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30));
}

absl::Status WaitFor(int fd, short events, absl::Time deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = PollMs(deadline);
    int r = ::poll(&p, 1, ms);
    if (r > 0) {
      if (p.revents & (POLLERR | POLLNVAL)) return absl::UnavailableError(absl::StrCat(what, ": socket error"));
      return absl::OkStatus();
    }
    if (r == 0) {
      if (absl::Now() >= deadline) return absl::DeadlineExceededError(absl::StrCat(what, ": deadline passed"));
      continue;
    }
    if (errno != EINTR) return ErrnoToStatus(errno, what);
  }
}

absl::Status ParseEndpoint(const std::string& endpoint, sockaddr_in* addr) {
  size_t colon = endpoint.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(endpoint.substr(colon + 1), &port) ||
      port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("endpoint '", endpoint, "' is not host:port"));
  }
  std::string host = endpoint.substr(0, colon);
  *addr = {};
  addr->sin_family = AF_INET;
  addr->sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr->sin_addr) == 1) return absl::OkStatus();
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve host '", host, "'"));
  }
  addr->sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Fd> Dial(const std::string& endpoint, absl::Time deadline) {
  sockaddr_in addr;
  RETURN_IF_ERROR(ParseEndpoint(endpoint, &addr));
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket");
  int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS) {
      return absl::UnavailableError(absl::StrCat("connect to ", endpoint, ": ", strerror(errno)));
    }
    absl::Status waited = WaitFor(fd.get(), POLLOUT, deadline, "connect");
    if (absl::IsDeadlineExceeded(waited)) {
      return absl::DeadlineExceededError(absl::StrCat("connect to ", endpoint, ": timed out"));
    }
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0 || !waited.ok()) {
      return absl::UnavailableError(
          absl::StrCat("connect to ", endpoint, ": ", err != 0 ? strerror(err) : waited.message()));
    }
  }
  return fd;
}

int FreeLoopbackPort() {
  int port = 0;
  absl::StatusOr<Fd> fd = Listen("127.0.0.1", 0, &port);
  return fd.ok() ? port : 0;  // closed again here: free for the caller's server
}

absl::StatusOr<Fd> Listen(const std::string& address, int port, int* bound) {
  // The IPv4 wildcard takes IPv6 too where the host has it, as gRPC's does.
  if (address == "0.0.0.0") {
    absl::StatusOr<Fd> both = Listen("::", port, bound);
    if (both.ok()) return both;
  }
  sockaddr_storage storage{};
  socklen_t addr_len;
  // An IPv6 literal ("::", "[::1]") binds IPv6; "::" also takes IPv4, as
  // gRPC's wildcard does.
  std::string host = address;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const bool v6 = host.find(':') != std::string::npos;
  if (v6) {
    auto* a6 = reinterpret_cast<sockaddr_in6*>(&storage);
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not an IPv6 address"));
    }
    addr_len = sizeof(sockaddr_in6);
  } else {
    sockaddr_in addr;
    RETURN_IF_ERROR(ParseEndpoint(absl::StrCat(address, ":", port == 0 ? 1 : port), &addr));
    addr.sin_port = htons(static_cast<uint16_t>(port));
    std::memcpy(&storage, &addr, sizeof addr);
    addr_len = sizeof addr;
  }
  Fd fd(::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket");
  int one = 1, zero = 0;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (v6) setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&storage), addr_len) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("bind ", address, ":", port));
  }
  if (::listen(fd.get(), SOMAXCONN) != 0) return ErrnoToStatus(errno, "listen");
  socklen_t len = sizeof storage;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&storage), &len);
  *bound = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port
                    : reinterpret_cast<sockaddr_in*>(&storage)->sin_port);
  return fd;
}

absl::Status ReadFull(int fd, void* buf, size_t len, absl::Time deadline) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, 0);
    if (n > 0) {
      p += n;
      len -= n;
      continue;
    }
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, "read"));
      continue;
    }
    if (errno != EINTR) return ErrnoToStatus(errno, "read");
  }
  return absl::OkStatus();
}

bool SpinUntilReadable(int fd, absl::Duration window) {
  if (window <= absl::ZeroDuration()) return false;
  // A monotonic clock: a wall-clock step must not stretch the spin.
  const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(std::min(window, absl::Seconds(1)));
  do {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return true;
    // A spinner offers its core to any thread waiting for it (often the
    // very peer it waits for, on a small or busy host), so spinning takes
    // mostly cycles nobody else wants.
    sched_yield();
  } while (std::chrono::steady_clock::now() < until);
  // One yield may outlast the window on a busy host: a last look, so bytes
  // that came during it are not taken for an empty spin.
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

ServerSpin::ServerSpin(absl::Duration window, size_t max_spinners)
    : window_(std::clamp(window, absl::ZeroDuration(), absl::Milliseconds(1))),
      max_spinners_(max_spinners) {}

ServerSpin::Outcome ServerSpin::Spin(int fd) {
  size_t n = spinning_.load(std::memory_order_relaxed);
  do {
    if (n >= max_spinners_) return Outcome::kCapped;
  } while (!spinning_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
  const bool arrived = SpinUntilReadable(fd, window_);
  spinning_.fetch_sub(1, std::memory_order_relaxed);
  return arrived ? Outcome::kCall : Outcome::kIdle;
}

void SpinTracker::Spun(ServerSpin::Outcome outcome) {
  if (outcome == ServerSpin::Outcome::kCall) {
    came_in_spin_ = true;
    backoff_ = 0;
  } else if (outcome == ServerSpin::Outcome::kIdle) {
    hot_ = false;
    backoff_ = std::min(std::max(1u, 2 * backoff_), 64u);
    skip_ = backoff_;
  }
}

void SpinTracker::Arrived() {
  if (spin_ == nullptr || !spin_->enabled()) return;
  if (came_in_spin_) {
    came_in_spin_ = false;
    return;
  }
  if (skip_ > 0) {
    --skip_;
    return;
  }
  hot_ = std::chrono::steady_clock::now() - replied_ <= 2 * absl::ToChronoNanoseconds(spin_->window());
}

void SpinTracker::Replied() {
  if (spin_ != nullptr && spin_->enabled()) replied_ = std::chrono::steady_clock::now();
}

absl::Status RecvAll(int fd, void* buf, size_t len) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, MSG_WAITALL);
    if (n > 0) {
      p += n;
      len -= n;
      continue;
    }
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::DeadlineExceededError("receive timed out");
    if (errno != EINTR) return ErrnoToStatus(errno, "read");
  }
  return absl::OkStatus();
}

absl::Status SendVecAll(int fd, iovec* iov, int count) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(std::min(count, 64));
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::DeadlineExceededError("send timed out");
      return ErrnoToStatus(errno, "write");
    }
    Advance(&iov, &count, static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::StatusOr<IoStep> RecvSome(int fd, void* buf, size_t len) {
  for (;;) {
    ssize_t n = ::recv(fd, buf, len, MSG_DONTWAIT);
    if (n > 0) return IoStep{static_cast<size_t>(n), 0};
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno == EAGAIN || errno == EWOULDBLOCK) return IoStep{0, POLLIN};
    if (errno != EINTR) return ErrnoToStatus(errno, "read");
  }
}

absl::StatusOr<IoStep> SendSome(int fd, const iovec* iov, int count) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(std::min(count, 64));
  for (;;) {
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) return IoStep{static_cast<size_t>(n), 0};
    if (n == 0 || errno == EAGAIN || errno == EWOULDBLOCK) return IoStep{0, POLLOUT};
    if (errno != EINTR) return ErrnoToStatus(errno, "write");
  }
}

void SetTimeouts(int fd, absl::Duration timeout) {
  timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

absl::Status WriteFull(int fd, const void* buf, size_t len, absl::Time deadline) {
  iovec iov{const_cast<void*>(buf), len};
  return WriteVecFull(fd, &iov, 1, deadline);
}

absl::Status WriteVecFull(int fd, iovec* iov, int count, absl::Time deadline) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(std::min(count, 64));
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, "write"));
        continue;
      }
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "write");
    }
    Advance(&iov, &count, static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace tierkv::net
