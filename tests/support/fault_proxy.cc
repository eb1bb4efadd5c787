#include "tests/support/fault_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tierkv::testing {
namespace {

absl::StatusOr<sockaddr_in> Resolve(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("not an IPv4 address: ", host));
  }
  return a;
}

// Closes with RST instead of FIN.
void Reset(int fd) {
  linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  ::close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FaultProxy>> FaultProxy::Start(const std::string& listen_host, int listen_port,
                                                              const std::string& target) {
  std::unique_ptr<FaultProxy> p(new FaultProxy());
  p->target_ = target;
  auto addr = Resolve(listen_host, listen_port);
  if (!addr.ok()) return addr.status();
  p->listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(p->listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(p->listener_, reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) != 0 ||
      ::listen(p->listener_, 256) != 0) {
    absl::Status s = absl::UnavailableError(absl::StrCat("proxy cannot listen on ", listen_host, ":",
                                                         listen_port, ": ", std::strerror(errno)));
    ::close(p->listener_);
    p->listener_ = -1;
    return s;
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(p->listener_, reinterpret_cast<sockaddr*>(&bound), &len);
  p->port_ = ntohs(bound.sin_port);
  p->acceptor_ = std::thread([raw = p.get()] { raw->AcceptLoop(); });
  return p;
}

FaultProxy::~FaultProxy() {
  {
    MutexLock lock(&mu_);
    stopping_.store(true);
    fault_changed_.SignalAll();
  }
  if (listener_ >= 0) ::shutdown(listener_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  if (listener_ >= 0) ::close(listener_);
  std::list<PumpThread> pumps;
  {
    MutexLock lock(&mu_);
    pumps.swap(pumps_);
  }
  for (auto& p : pumps) p.thread.join();
}

void FaultProxy::Set(Fault fault) {
  MutexLock lock(&mu_);
  fault_ = fault;
  fault_changed_.SignalAll();
}

FaultProxy::Fault FaultProxy::Current() {
  MutexLock lock(&mu_);
  return fault_;
}

void FaultProxy::AcceptLoop() {
  std::string host = target_.substr(0, target_.rfind(':'));
  int port = 0;
  (void)absl::SimpleAtoi(target_.substr(target_.rfind(':') + 1), &port);
  while (!stopping_.load()) {
    pollfd p{listener_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    accepted_.fetch_add(1);
    int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    auto addr = Resolve(host, port);
    if (!addr.ok() || ::connect(server, reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) != 0) {
      Reset(client);
      ::close(server);
      continue;
    }
    open_.fetch_add(1);
    MutexLock lock(&mu_);
    // Join the connections that ended, so a long test holds no dead threads.
    for (auto it = pumps_.begin(); it != pumps_.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = pumps_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    pumps_.push_back({std::thread([this, client, server, done] {
                        Pump(client, server);
                        done->store(true);
                      }),
                      done});
  }
}

void FaultProxy::Pump(int client, int server) {
  uint64_t forwarded = 0;
  std::vector<char> buf(64 << 10);
  bool reset = false;
  while (!stopping_.load()) {
    Fault f = Current();
    if (f.mode == Mode::kStall) {
      // Hold everything until the fault changes: the peers see a connection
      // that went silent. (The timeout only bounds a missed signal.)
      MutexLock lock(&mu_);
      while (fault_.mode == Mode::kStall && !stopping_.load()) {
        fault_changed_.WaitFor(&mu_, std::chrono::milliseconds(100));
      }
      continue;
    }
    pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
    int rc = ::poll(fds, 2, 50);
    if (rc < 0 && errno != EINTR) break;
    if (rc <= 0) continue;
    bool done = false;
    for (int i = 0; i < 2 && !done; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      int from = i == 0 ? client : server, to = i == 0 ? server : client;
      size_t want = buf.size();
      if (f.mode == Mode::kTruncate || f.mode == Mode::kReset) {
        if (forwarded >= f.after_bytes) {
          reset = f.mode == Mode::kReset;
          done = true;
          break;
        }
        want = std::min<uint64_t>(want, f.after_bytes - forwarded);
      }
      ssize_t n = ::recv(from, buf.data(), want, 0);
      if (n <= 0) {
        done = true;
        break;
      }
      // The fault itself, not a synchronisation: a slow link delays each chunk.
      if (f.mode == Mode::kDelay) std::this_thread::sleep_for(absl::ToChronoMicroseconds(f.delay));
      for (ssize_t off = 0; off < n;) {
        ssize_t w = ::send(to, buf.data() + off, static_cast<size_t>(n - off), MSG_NOSIGNAL);
        if (w <= 0) {
          done = true;
          break;
        }
        off += w;
      }
      forwarded += static_cast<uint64_t>(n);
    }
    if (done) break;
  }
  if (reset) {
    Reset(client);
    Reset(server);
  } else {
    ::close(client);
    ::close(server);
  }
  open_.fetch_sub(1);
}

}  // namespace tierkv::testing
