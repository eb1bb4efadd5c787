#include "transport/tcp/server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/auth.h"
#include "base/failpoint.h"
#include "base/log.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

constexpr size_t kScratch = 64 << 10;

WireStatus ToWire(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOutOfRange:
      return WireStatus::kOutOfRange;
    case absl::StatusCode::kNotFound:
      return WireStatus::kNoSegment;
    case absl::StatusCode::kResourceExhausted:
      return WireStatus::kTooLarge;
    case absl::StatusCode::kInvalidArgument:
      return WireStatus::kBadRequest;
    case absl::StatusCode::kDeadlineExceeded:
      return WireStatus::kExpired;
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      return WireStatus::kUnauthenticated;
    case absl::StatusCode::kFailedPrecondition:
      return WireStatus::kStaleEpoch;
    default:
      return WireStatus::kInternal;
  }
}

// Server sockets are blocking with per-call timeouts (net::SetTimeouts); `ssl`
// set: the connection is TLS.
absl::Status Recv(int fd, SSL* ssl, void* buf, size_t len) {
  return ssl != nullptr ? net::TlsRecvAll(ssl, buf, len) : net::RecvAll(fd, buf, len);
}

absl::Status SendReply(int fd, SSL* ssl, uint64_t id, const absl::Status& status, const char* payload,
                       uint64_t length) {
  ReplyHeader h;
  h.id = id;
  std::string text;
  if (!status.ok()) {
    h.status = ToWire(status);
    text = std::string(status.message()).substr(0, kMaxErrorText);
    payload = text.data();
    length = text.size();
  }
  h.length = length;
  uint8_t head[kReplySize];
  EncodeReply(h, head);
  iovec iov[2] = {{head, kReplySize}, {const_cast<char*>(payload), length}};
  return ssl != nullptr ? net::TlsSendVecAll(ssl, iov, length > 0 ? 2 : 1) : net::SendVecAll(fd, iov, length > 0 ? 2 : 1);
}

constexpr uint64_t kWakeId = 0;
constexpr uint64_t kListenerId = 1;

}  // namespace

Server::Server(ServerOptions options, ServedMemory* served) : options_(std::move(options)), served_(served) {}

Server::~Server() { Stop(); }

absl::Status Server::Start() {
  absl::StatusOr<net::Fd> l = net::Listen(options_.listen, options_.port, &port_);
  if (!l.ok()) return absl::UnavailableError(l.status().message());
  listener_ = std::move(*l);
  ::fcntl(listener_.get(), F_SETFL, ::fcntl(listener_.get(), F_GETFL) | O_NONBLOCK);
  epoll_ = net::Fd(::epoll_create1(EPOLL_CLOEXEC));
  wake_ = net::Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  reserve_ = net::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!epoll_.valid() || !wake_.valid()) return absl::InternalError("tcp server: cannot create its epoll set");
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered: every thread sees Stop
  ev.data.u64 = kWakeId;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &ev);
  ev.events = EPOLLIN | EPOLLONESHOT;  // one thread accepts at a time
  ev.data.u64 = kListenerId;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, listener_.get(), &ev);
  {
    MutexLock lock(&mu_);
    last_sweep_ = absl::Now();
  }
  const int n = std::max(1, options_.io_threads);
  for (int i = 0; i < n; ++i) scratch_.emplace_back(new uint8_t[kScratch]);
  for (int i = 0; i < n; ++i) threads_.emplace_back([this, i] { IoLoop(i); });
  return absl::OkStatus();
}

void Server::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_.valid()) {
    uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
  }
  {
    // Unblock threads inside a frame; they close their connection.
    MutexLock lock(&mu_);
    for (auto& [id, c] : conns_) ::shutdown(c->fd.get(), SHUT_RDWR);
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
  MutexLock lock(&mu_);
  conns_.clear();
  open_.store(0);
  listener_ = net::Fd();
  epoll_ = net::Fd();
  wake_ = net::Fd();
}

void Server::IoLoop(int index) {
  uint8_t* scratch = scratch_[index].get();
  while (!stopping_.load()) {
    // One event per wait: the kernel hands the next ready connection to
    // whichever thread is free, rather than queueing it behind this one.
    epoll_event ev{};
    int n = ::epoll_wait(epoll_.get(), &ev, 1, 250);
    if (stopping_.load()) break;
    if (index == 0) ReapIdle();
    if (n <= 0) continue;
    // epoll_event is packed on x86-64: copy the id out rather than bind a
    // reference to its misaligned field.
    const uint64_t id = ev.data.u64;
    if (id == kWakeId) continue;
    if (id == kListenerId) {
      AcceptSome();
      epoll_event again{};
      again.events = EPOLLIN | EPOLLONESHOT;
      again.data.u64 = kListenerId;
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listener_.get(), &again);
      continue;
    }
    Conn* conn = nullptr;
    {
      MutexLock lock(&mu_);
      auto it = conns_.find(id);
      // Gone (reaped) or not parked: the event is stale.
      if (it == conns_.end() || !it->second->parked) continue;
      conn = it->second.get();
      conn->parked = false;
    }
    ServeConn(conn, scratch);
  }
}

void Server::AcceptSome() {
  // Bounded per turn, so the accepting thread returns to serving.
  for (int i = 0; i < 256 && !stopping_.load(); ++i) {
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if ((errno == EMFILE || errno == ENFILE) && reserve_.valid()) {
        // Out of descriptors: the pending connection would keep the
        // listener readable forever. Free the reserve, refuse it, re-arm.
        reserve_ = net::Fd();
        net::Fd doomed(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (doomed.valid()) Refuse(std::move(doomed), "the process is out of file descriptors");
        reserve_ = net::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        continue;
      }
      return;  // EAGAIN: the backlog is empty
    }
    net::Fd conn_fd(fd);
    if (open_.load() >= static_cast<size_t>(std::max(1, options_.max_connections))) {
      Refuse(std::move(conn_fd), "at the connection cap (--max-connections)");
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    net::SetTimeouts(fd, options_.frame_timeout);
    auto conn = std::make_unique<Conn>();
    conn->fd = std::move(conn_fd);
    Conn* raw = conn.get();
    {
      MutexLock lock(&mu_);
      conn->id = next_id_++;
      conns_.emplace(conn->id, std::move(conn));
    }
    open_.fetch_add(1);
    Park(raw);
  }
}

void Server::Refuse(net::Fd fd, const char* why) {
  uint64_t n = refused_.fetch_add(1) + 1;
  // One BUSY reply, best effort (the socket buffer of a fresh connection
  // has room), so the client reports the reason rather than a bare EOF.
  std::string text = absl::StrCat("tcp server ", options_.listen, ":", port_, " refused the connection: ", why);
  ReplyHeader h;
  h.status = WireStatus::kBusy;
  h.length = text.size();
  uint8_t head[kReplySize];
  EncodeReply(h, head);
  iovec iov[2] = {{head, kReplySize}, {text.data(), text.size()}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = 2;
  (void)::sendmsg(fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  int64_t now_ms = absl::ToUnixMillis(absl::Now());
  int64_t last = last_refusal_log_ms_.load();
  if (now_ms - last >= 10000 && last_refusal_log_ms_.compare_exchange_strong(last, now_ms)) {
    TKV_LOG(WARNING) << "tcp server: refusing connections: " << why << " (" << open_.load() << " open, cap "
                     << options_.max_connections << "; " << n << " refused so far)";
  }
}

void Server::ServeConn(Conn* conn, uint8_t* scratch) {
  const int fd = conn->fd.get();
  for (int i = 0; i < kFramesPerTurn; ++i) {
    if (stopping_.load() || !ServeOne(conn, scratch)) {
      Close(conn);
      return;
    }
    // Bytes TLS has read already are invisible to the poller.
    if (conn->ssl != nullptr && net::TlsPending(conn->ssl.get())) continue;
    // Frames already buffered (a pipelining client) are served now; none
    // buffered: back to the poller.
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) break;
  }
  Park(conn);
}

void Server::Park(Conn* conn) {
  MutexLock lock(&mu_);
  conn->last_active = absl::Now();
  conn->parked = true;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  // Frames TLS holds already (the turn ended first): a writable socket
  // wakes a thread for them at once, as new bytes would.
  if (conn->ssl != nullptr && net::TlsPending(conn->ssl.get())) ev.events |= EPOLLOUT;
  ev.data.u64 = conn->id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, conn->fd.get(), &ev) != 0 &&
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, conn->fd.get(), &ev) != 0) {
    TKV_LOG(WARNING) << "tcp server: cannot watch a connection: " << strerror(errno);
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, conn->fd.get(), nullptr);
    if (conns_.erase(conn->id) > 0) open_.fetch_sub(1);
  }
}

void Server::Close(Conn* conn) {
  MutexLock lock(&mu_);
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, conn->fd.get(), nullptr);
  if (conns_.erase(conn->id) > 0) open_.fetch_sub(1);  // closes the fd
}

void Server::ReapIdle() {
  absl::Time now = absl::Now();
  MutexLock lock(&mu_);
  // A sweep a second is plenty for timeouts of seconds to minutes.
  if (now - last_sweep_ < std::min(absl::Seconds(1), options_.idle_timeout / 2)) return;
  last_sweep_ = now;
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn* c = it->second.get();
    // Only parked connections: one a thread is serving is not idle, and
    // its thread owns it.
    if (c->parked && now - c->last_active > options_.idle_timeout) {
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c->fd.get(), nullptr);
      conns_.erase(it++);
      open_.fetch_sub(1);
      reaped_.fetch_add(1);
    } else {
      ++it;
    }
  }
}

bool Server::ServeGrant(Conn* conn, const RequestHeader& h) {
  const int fd = conn->fd.get();
  SSL* const ssl = conn->ssl.get();
  if (h.op == WireOp::kChallenge) {
    if (h.length != 0) {
      (void)SendReply(fd, ssl, h.id, absl::InvalidArgumentError("a challenge carries no payload"), nullptr, 0);
      return false;
    }
    conn->nonce = auth::RandomBytes(auth::kNonceBytes);
    return SendReply(fd, ssl, h.id, absl::OkStatus(), conn->nonce.data(), conn->nonce.size()).ok();
  }
  if (h.length != auth::kGrantBytes + auth::kProofBytes) {
    (void)SendReply(fd, ssl, h.id, absl::InvalidArgumentError("an auth frame carries a grant and a proof"), nullptr, 0);
    return false;
  }
  std::string body(h.length, '\0');
  if (!Recv(fd, ssl, body.data(), body.size()).ok()) return false;
  // A nonce answers one AUTH: a second try on the connection needs a new challenge.
  const std::string nonce = std::move(conn->nonce);
  conn->nonce.clear();
  absl::StatusOr<std::string> key = served_->DataKey(h.segment, h.segment_id);
  // A segment gone from here is a stale descriptor, as for READ: the
  // client re-reads it and the connection stays.
  if (!key.ok()) return SendReply(fd, ssl, h.id, key.status(), nullptr, 0).ok();
  absl::Status ok = auth::CheckGrant(*key, absl::string_view(body).substr(0, auth::kGrantBytes),
                                     absl::string_view(body).substr(auth::kGrantBytes), nonce, h.segment,
                                     h.segment_id, absl::Now());
  if (!ok.ok()) {
    (void)SendReply(fd, ssl, h.id, ok, nullptr, 0);
    return false;
  }
  conn->admitted = std::make_pair(h.segment, h.segment_id);
  return SendReply(fd, ssl, h.id, absl::OkStatus(), nullptr, 0).ok();
}

bool Server::ServeOne(Conn* conn, uint8_t* scratch) {
  const int fd = conn->fd.get();
  if (options_.tls != nullptr && conn->ssl == nullptr) {
    // The first bytes of a TLS connection: its handshake, within the
    // socket's timeouts. A peer that fails it (plain frames, a client that
    // does not trust us) is closed.
    absl::StatusOr<net::SslPtr> ssl = net::TlsAccept(fd, options_.tls->Current().get());
    if (!ssl.ok()) return false;
    conn->ssl = *std::move(ssl);
    return true;
  }
  SSL* const ssl = conn->ssl.get();
  uint8_t head[kRequestSize];
  // The poller saw bytes (or EOF) arrive; a started frame must complete
  // within the socket's frame timeout per blocking call.
  if (!Recv(fd, ssl, head, kRequestSize).ok()) return false;
  absl::StatusOr<RequestHeader> req = DecodeRequest(head, kRequestSize);
  if (!req.ok()) {
    // The stream cannot be trusted any more: explain, then close.
    (void)SendReply(fd, ssl, 0, absl::InvalidArgumentError(req.status().message()), nullptr, 0);
    return false;
  }
  const RequestHeader& h = *req;
  if (h.op == WireOp::kChallenge || h.op == WireOp::kAuth) return ServeGrant(conn, h);
  if (h.op != WireOp::kPing && served_->DataGrantsRequired()) {
    // Unadmitted, or naming another segment than the one admitted: refused
    // without a byte written, and the connection closes. A small payload
    // is drained first, so the refusal reaches the peer instead of being
    // lost to the reset that unread bytes cause.
    const bool same = conn->admitted.has_value() && (h.op == WireOp::kHandshake ||
                                                     *conn->admitted == std::make_pair(h.segment, h.segment_id));
    if (!same) {
      // At most a handshake's worth: a peer without a grant must not hold
      // an I/O thread with a large, slow payload.
      if (h.op != WireOp::kRead && h.length <= kMaxHandshake) {
        for (uint64_t left = h.length; left > 0;) {
          size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
          if (!Recv(fd, ssl, scratch, n).ok()) return false;
          left -= n;
        }
      }
      (void)SendReply(fd, ssl, h.id,
                      absl::UnauthenticatedError(
                          conn->admitted ? absl::StrCat("this connection's data grant is for segment #",
                                                        conn->admitted->first, ", not #", h.segment)
                                         : std::string("this daemon needs a data grant (--auth token): "
                                                       "CHALLENGE and AUTH first")),
                      nullptr, 0);
      return false;
    }
  }
  // A fault inside a transfer: `error` fails this request (its payload
  // still drained), `sleep` stalls it, `abort` kills the server mid-stream.
  if ((h.op == WireOp::kRead || h.op == WireOp::kWrite) && TIERKV_FAILPOINT("transport.tcp.serve")) {
    if (h.op == WireOp::kWrite) {
      for (uint64_t left = std::min<uint64_t>(h.length, options_.max_frame); left > 0;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
        if (!Recv(fd, ssl, scratch, n).ok()) return false;
        left -= n;
      }
      if (h.length > options_.max_frame) return false;
    }
    return SendReply(fd, ssl, h.id, absl::InternalError("failpoint transport.tcp.serve"), nullptr, 0).ok();
  }
  switch (h.op) {
    case WireOp::kPing:
      return SendReply(fd, ssl, h.id, absl::OkStatus(), nullptr, 0).ok();
    case WireOp::kRead: {
      if (h.length > options_.max_frame) {
        return SendReply(fd, ssl, h.id,
                         absl::ResourceExhaustedError(absl::StrCat("read of ", h.length,
                                                                   " bytes exceeds the frame cap ",
                                                                   options_.max_frame)),
                         nullptr, 0)
            .ok();
      }
      absl::StatusOr<ServedMemory::Pin> pin = served_->Resolve(h.segment, h.segment_id, h.offset, h.length);
      if (!pin.ok()) return SendReply(fd, ssl, h.id, pin.status(), nullptr, 0).ok();
      return SendReply(fd, ssl, h.id, absl::OkStatus(), pin->addr, h.length).ok();
    }
    case WireOp::kWrite: {
      if (h.length > options_.max_frame) {
        // Draining this much is not worth it; the connection closes.
        (void)SendReply(fd, ssl, h.id,
                        absl::ResourceExhaustedError(absl::StrCat("write of ", h.length,
                                                                  " bytes exceeds the frame cap ",
                                                                  options_.max_frame)),
                        nullptr, 0);
        return false;
      }
      absl::StatusOr<ServedMemory::Pin> pin = served_->Resolve(h.segment, h.segment_id, h.offset, h.length);
      if (pin.ok() && (h.flags & kHasDeadline) && DeadlinePassed(h.deadline_ms32, absl::Now())) {
        // The writer gave up (and its put may be revoked, the extent reused).
        pin = absl::DeadlineExceededError(absl::StrCat("write of ", h.length, " bytes arrived after its deadline"));
      }
      if (pin.ok()) {
        if (absl::Status admitted = served_->AdmitWrite(h.epoch); !admitted.ok()) pin = admitted;
      }
      if (!pin.ok()) {
        for (uint64_t left = h.length; left > 0;) {
          size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
          if (!Recv(fd, ssl, scratch, n).ok()) return false;
          left -= n;
        }
        return SendReply(fd, ssl, h.id, pin.status(), nullptr, 0).ok();
      }
      if (!Recv(fd, ssl, pin->addr, h.length).ok()) return false;
      return SendReply(fd, ssl, h.id, absl::OkStatus(), nullptr, 0).ok();
    }
    case WireOp::kHandshake: {
      if (h.length > kMaxHandshake || h.offset > h.length) {
        (void)SendReply(fd, ssl, h.id, absl::InvalidArgumentError("bad handshake frame"), nullptr, 0);
        return false;
      }
      std::string body(h.length, '\0');
      if (!Recv(fd, ssl, body.data(), body.size()).ok()) return false;
      std::string transport = body.substr(0, h.offset);
      absl::StatusOr<std::string> answer = served_->Handshake(transport, body.substr(h.offset), conn->admitted);
      if (!answer.ok()) {
        // A handshake for a segment the grant does not cover closes, as any frame beyond the grant does.
        return SendReply(fd, ssl, h.id, answer.status(), nullptr, 0).ok() && !absl::IsUnauthenticated(answer.status());
      }
      return SendReply(fd, ssl, h.id, absl::OkStatus(), answer->data(), answer->size()).ok();
    }
    case WireOp::kChallenge:
    case WireOp::kAuth:
      break;  // answered by ServeGrant before this switch
  }
  return false;
}

}  // namespace tierkv::transport::tcp
