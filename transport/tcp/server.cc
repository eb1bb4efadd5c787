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
#include "base/status.h"
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
      return WireStatus::kUnauthenticated;
    case absl::StatusCode::kPermissionDenied:
      return WireStatus::kDenied;
    case absl::StatusCode::kFailedPrecondition:
      return WireStatus::kStaleEpoch;
    default:
      return WireStatus::kInternal;
  }
}

// A READ reply this small travels in the reply's own buffer: one TLS
// record with its header, and no pin held past the copy.
constexpr uint64_t kGather = 16 << 10;
// A large TLS payload is written this much per call.
constexpr uint64_t kTlsChunk = 1 << 20;
// Waiting in the thread for a bulk frame (ServeConn).
constexpr absl::Duration kBulkWait = absl::Milliseconds(2);
constexpr uint64_t kBulkBytes = 64 << 10;

absl::StatusOr<net::IoStep> RecvSome(int fd, SSL* ssl, void* buf, size_t len) {
  return ssl != nullptr ? net::TlsRecvSome(ssl, buf, len) : net::RecvSome(fd, buf, len);
}

absl::StatusOr<net::IoStep> RecvVec(int fd, iovec* iov, size_t count) {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = count;
  for (;;) {
    const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
    if (n > 0) return net::IoStep{static_cast<size_t>(n), 0};
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno == EAGAIN || errno == EWOULDBLOCK) return net::IoStep{0, POLLIN};
    if (errno != EINTR) return absl::UnavailableError(absl::StrCat("recvmsg: ", strerror(errno)));
  }
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
    if (index == 0) Sweep();
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
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
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
    auto conn = std::make_unique<Conn>();
    conn->fd = std::move(conn_fd);
    const absl::Time now = absl::Now();
    if (options_.tls != nullptr) {
      conn->stage = Stage::kTlsAccept;
      conn->deadline = now + options_.handshake_timeout;
    }
    if (served_->DataGrantsRequired()) conn->admit_by = now + options_.handshake_timeout;
    Conn* raw = conn.get();
    {
      MutexLock lock(&mu_);
      conn->id = next_id_++;
      conns_.emplace(conn->id, std::move(conn));
    }
    open_.fetch_add(1);
    Park(raw, /*yielded=*/false);
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
  absl::Duration wait_left = kBulkWait;
  uint64_t moved_at_wait = conn->moved;
  for (int i = 0; i < kFramesPerTurn; ++i) {
    const Step step = stopping_.load() ? Step::kClose : Advance(conn, scratch);
    if (step == Step::kFrameDone) continue;
    // A frame moving bulk bytes that would block is waited for here a
    // little rather than parked: a 1 MiB payload crosses the socket buffer
    // in several rounds, each a wake-up through the poller otherwise. Only
    // while the peer keeps bytes flowing (kBulkBytes since the last wait),
    // so one that trickles is parked at once, and at most kBulkWait a turn,
    // so no peer keeps a thread long.
    if (step == Step::kBlocked && (conn->stage == Stage::kBody || conn->stage == Stage::kReply) &&
        conn->moved - moved_at_wait >= kBulkBytes && wait_left > absl::ZeroDuration()) {
      const absl::Time start = absl::Now();
      pollfd p{conn->fd.get(), static_cast<short>(conn->want_write ? POLLOUT : POLLIN), 0};
      const timespec ts = absl::ToTimespec(std::min(wait_left, absl::Milliseconds(1)));
      const int ready = ::ppoll(&p, 1, &ts, nullptr);
      wait_left -= absl::Now() - start;
      moved_at_wait = conn->moved;
      if (ready > 0) {
        --i;  // the same frame goes on
        continue;
      }
    }
    // A parked frame pins nothing: unregistering memory never waits for a peer.
    conn->pin.reset();
    if (step == Step::kClose) {
      Close(conn);
    } else {
      Park(conn, /*yielded=*/false);
    }
    return;
  }
  conn->pin.reset();
  Park(conn, /*yielded=*/true);
}

void Server::Park(Conn* conn, bool yielded) {
  MutexLock lock(&mu_);
  conn->last_active = absl::Now();
  conn->parked = true;
  epoll_event ev{};
  // Waiting to write, not for EPOLLRDHUP: a peer that half-closed after its
  // request would raise it at once, again and again.
  ev.events = EPOLLONESHOT | (conn->want_write ? EPOLLOUT : EPOLLIN | EPOLLRDHUP);
  // Frames TLS holds already (the turn ended first): a writable socket
  // wakes a thread for them at once, as new bytes would.
  if (yielded && conn->ssl != nullptr && net::TlsPending(conn->ssl.get())) ev.events |= EPOLLOUT;
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

void Server::Sweep() {
  absl::Time now = absl::Now();
  MutexLock lock(&mu_);
  // A sweep a second at most: deadlines are seconds to minutes.
  const absl::Duration every = std::min({absl::Seconds(1), options_.idle_timeout / 2, options_.frame_timeout / 4,
                                         options_.handshake_timeout / 4});
  if (now - last_sweep_ < every) return;
  last_sweep_ = now;
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn* c = it->second.get();
    // Only parked connections: one a thread is serving is checked by that
    // thread, which owns it.
    const bool expired = c->parked && (now >= c->deadline || now >= c->admit_by);
    // Idle: between frames (no deadline running).
    const bool idle = c->parked && c->deadline == absl::InfiniteFuture() && now - c->last_active > options_.idle_timeout;
    if (expired || idle) {
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c->fd.get(), nullptr);
      conns_.erase(it++);
      open_.fetch_sub(1);
      (expired ? expired_ : reaped_).fetch_add(1);
    } else {
      ++it;
    }
  }
}

Server::Step Server::Advance(Conn* c, uint8_t* scratch) {
  if (std::min(c->deadline, c->admit_by) != absl::InfiniteFuture() &&
      absl::Now() >= std::min(c->deadline, c->admit_by)) {
    expired_.fetch_add(1);
    return Step::kClose;
  }
  for (;;) {
    Step step = Step::kClose;
    switch (c->stage) {
      case Stage::kTlsAccept:
        step = AcceptTls(c);
        break;
      case Stage::kHeader:
        step = ReadHeader(c);
        break;
      case Stage::kBody:
        step = ReadBody(c, scratch);
        break;
      case Stage::kReply:
        step = SendReply(c);
        break;
    }
    if (step != Step::kContinue) return step;
  }
}

Server::Step Server::AcceptTls(Conn* c) {
  if (c->ssl == nullptr) {
    absl::StatusOr<net::SslPtr> ssl = net::TlsServerSession(c->fd.get(), options_.tls->Current().get());
    if (!ssl.ok()) return Step::kClose;
    c->ssl = *std::move(ssl);
  }
  // A peer that fails it (plain frames, a client that does not trust us)
  // is closed.
  absl::StatusOr<short> want = net::TlsAcceptSome(c->ssl.get());
  if (!want.ok()) return Step::kClose;
  if (*want != 0) {
    c->want_write = *want == POLLOUT;
    return Step::kBlocked;
  }
  c->stage = Stage::kHeader;
  c->deadline = absl::InfiniteFuture();
  return Step::kContinue;
}

Server::Step Server::ReadHeader(Conn* c) {
  while (c->head_got < HeadSize(c)) {
    absl::StatusOr<net::IoStep> got =
        RecvSome(c->fd.get(), c->ssl.get(), c->head + c->head_got, HeadSize(c) - c->head_got);
    if (!got.ok()) return Step::kClose;
    if (got->n == 0) {
      // Part of a TLS record starts the frame too: a peer must not trickle
      // records forever as an idle connection.
      if (c->head_got == 0 && c->deadline == absl::InfiniteFuture() && c->ssl != nullptr &&
          net::TlsPending(c->ssl.get())) {
        c->deadline = absl::Now() + options_.frame_timeout;
      }
      c->want_write = got->wait == POLLOUT;
      return Step::kBlocked;
    }
    // The frame's one deadline runs from its first byte.
    if (c->head_got == 0 && c->deadline == absl::InfiniteFuture()) c->deadline = absl::Now() + options_.frame_timeout;
    c->head_got += got->n;
  }
  return Dispatch(c);
}

Server::Step Server::Dispatch(Conn* c) {
  absl::StatusOr<RequestHeader> req = DecodeRequest(c->head, kRequestSize);
  if (!req.ok()) {
    // The stream cannot be trusted any more: explain, then close.
    return StartReply(c, absl::InvalidArgumentError(req.status().message()), {}, /*close_after=*/true);
  }
  c->req = *req;
  c->grant_until = absl::InfiniteFuture();  // until this frame's grant is checked
  const RequestHeader& h = c->req;
  if (h.op == WireOp::kChallenge) {
    if (h.length != 0) return StartReply(c, absl::InvalidArgumentError("a challenge carries no payload"), {}, true);
    c->nonce = auth::RandomBytes(auth::kNonceBytes);
    return StartReply(c, absl::OkStatus(), c->nonce);
  }
  if (h.op == WireOp::kAuth) {
    if (h.length != auth::kGrantBytes + auth::kProofBytes) {
      return StartReply(c, absl::InvalidArgumentError("an auth frame carries a grant and a proof"), {}, true);
    }
    return StartBody(c, Sink::kBuffer);
  }
  if (std::optional<Step> refused = RefuseUnadmitted(c)) return *refused;
  // A fault inside a transfer: `error` fails this request (its payload
  // still drained), `sleep` stalls it, `abort` kills the server mid-stream.
  const bool vectored = h.op == WireOp::kWriteV || h.op == WireOp::kReadV;
  if ((h.op == WireOp::kRead || h.op == WireOp::kWrite || vectored) && TIERKV_FAILPOINT("transport.tcp.serve")) {
    absl::Status failed = absl::InternalError("failpoint transport.tcp.serve");
    if (h.op == WireOp::kRead) return StartReply(c, failed, {});
    if (h.length > options_.max_frame + (vectored ? kMaxRanges * RangeEntryBytes(h) : 0)) return Step::kClose;
    return StartBody(c, Sink::kDrain, failed);
  }
  switch (h.op) {
    case WireOp::kPing:
      return StartReply(c, absl::OkStatus(), {});
    case WireOp::kRead: {
      if (h.length > options_.max_frame) {
        return StartReply(c, absl::ResourceExhaustedError(absl::StrCat("read of ", h.length,
                                                                       " bytes exceeds the frame cap ",
                                                                       options_.max_frame)),
                          {});
      }
      if (absl::Status granted = ExtentAdmitted(c, {{h.offset, h.length}}); !granted.ok()) {
        return StartReply(c, granted, {});
      }
      absl::StatusOr<ServedMemory::Pin> pin = served_->Resolve(h.segment, h.segment_id, h.offset, h.length);
      if (!pin.ok()) return StartReply(c, pin.status(), {});
      return StartMemoryReply(c, *std::move(pin));
    }
    case WireOp::kWrite: {
      if (h.length > options_.max_frame) {
        // Draining this much is not worth it; the connection closes.
        return StartReply(c, absl::ResourceExhaustedError(absl::StrCat("write of ", h.length,
                                                                       " bytes exceeds the frame cap ",
                                                                       options_.max_frame)),
                          {}, true);
      }
      absl::Status granted = ExtentAdmitted(c, {{h.offset, h.length}});
      absl::StatusOr<ServedMemory::Pin> pin = granted.ok()
                                                  ? served_->Resolve(h.segment, h.segment_id, h.offset, h.length)
                                                  : absl::StatusOr<ServedMemory::Pin>(granted);
      if (pin.ok()) {
        if (absl::Status admitted = WriteAdmitted(c); !admitted.ok()) pin = admitted;
      }
      if (!pin.ok()) return StartBody(c, Sink::kDrain, pin.status());
      c->pin = *std::move(pin);
      c->pin_from = 0;
      return StartBody(c, Sink::kMemory);
    }
    case WireOp::kWriteV:
    case WireOp::kReadV:
      return DispatchVector(c);
    case WireOp::kHandshake:
      if (h.length > kMaxHandshake || h.offset > h.length) {
        return StartReply(c, absl::InvalidArgumentError("bad handshake frame"), {}, true);
      }
      return StartBody(c, Sink::kBuffer);
    case WireOp::kChallenge:
    case WireOp::kAuth:
      break;  // answered above
  }
  return Step::kClose;
}

Server::Step Server::StartBody(Conn* c, Sink sink, absl::Status verdict, bool close_after) {
  c->stage = Stage::kBody;
  c->sink = sink;
  c->body_got = 0;
  c->verdict = std::move(verdict);
  c->close_after = close_after;
  if (sink == Sink::kBuffer) c->body.assign(c->req.length, '\0');
  if (sink == Sink::kTable) c->body.assign(c->req.offset * RangeEntryBytes(c->req), '\0');
  return Step::kContinue;
}

Server::Step Server::DispatchVector(Conn* c) {
  // A frame of the wrong shape cannot be followed with confidence (or is
  // not worth draining): an error reply, and the connection closes.
  if (absl::Status shape = CheckVectorHeader(c->req, options_.max_frame); !shape.ok()) {
    return StartReply(c, shape, {}, true);
  }
  if (c->req.op == WireOp::kWriteV) {
    // Late or fenced at its header already: nothing of it is looked at.
    if (absl::Status admitted = WriteAdmitted(c); !admitted.ok()) return StartBody(c, Sink::kDrain, admitted);
  }
  return StartBody(c, Sink::kTable);
}

void Server::StartRanges(Conn* c) {
  const RequestHeader& h = c->req;
  std::vector<WireRange> ranges;
  std::vector<absl::string_view> grants;  // views into c->body, checked before it is cleared
  absl::StatusOr<uint64_t> total = DecodeRanges(h, c->body, options_.max_frame, &ranges, &grants);
  absl::Status verdict = total.ok() ? ExtentAdmitted(c, ranges, grants) : total.status();
  c->body.clear();
  c->ranges.Start(served_, h.segment, h.segment_id, std::move(ranges));
  if (verdict.ok()) verdict = c->ranges.CheckAll();
  if (verdict.ok() && h.op == WireOp::kWriteV) verdict = WriteAdmitted(c);
  if (!verdict.ok()) {
    c->ranges.Clear();
    c->sink = Sink::kDrain;
    c->close_after = absl::IsUnauthenticated(verdict);
    c->verdict = std::move(verdict);
    return;
  }
  // A READV's table is its whole payload: FinishBody sends the reply.
  c->sink = h.op == WireOp::kWriteV ? Sink::kRanges : Sink::kDrain;
  c->staged_left = h.op == WireOp::kWriteV ? 0 : *total;
}

absl::Status Server::StageReply(Conn* c) {
  const uint64_t n = std::min(c->staged_left, kVectorChunk);
  const size_t at = c->out.size();
  c->out.resize(at + n);
  RETURN_IF_ERROR(c->ranges.Copy(c->out.data() + at, n, /*into_memory=*/false));
  c->staged_left -= n;
  return absl::OkStatus();
}

absl::Status Server::WriteAdmitted(const Conn* c) {
  const RequestHeader& h = c->req;
  const absl::Time now = absl::Now();
  if ((h.flags & kHasDeadline) && DeadlinePassed(h.deadline_ms32, now)) {
    // The writer gave up (and its put may be revoked, the extent reused).
    return absl::DeadlineExceededError(
        c->body_got == 0 ? absl::StrCat("write of ", h.length, " bytes arrived after its deadline")
                         : absl::StrCat("write of ", h.length, " bytes: its deadline passed after ", c->body_got,
                                        " of them had landed; the rest was drained"));
  }
  if (now >= c->admitted_until) {
    return absl::UnauthenticatedError(absl::StrCat("this connection's data grant expired at ",
                                                   absl::FormatTime(c->admitted_until), " during a write"));
  }
  if (now >= c->grant_until) {
    // The master may have given the extent to another put since.
    return absl::PermissionDeniedError(absl::StrCat("the write's extent grant expired at ",
                                                    absl::FormatTime(c->grant_until), " during the write"));
  }
  return served_->AdmitWrite(h.epoch);
}

absl::Status Server::Repin(Conn* c, uint64_t done) {
  const RequestHeader& h = c->req;
  // Inside the range Resolve checked when the frame began: no overflow.
  ASSIGN_OR_RETURN(ServedMemory::Pin pin, served_->Resolve(h.segment, h.segment_id, h.offset + done, h.length - done));
  c->pin = std::move(pin);
  c->pin_from = done;
  return absl::OkStatus();
}

Server::Step Server::ReadBody(Conn* c, uint8_t* scratch) {
  const uint64_t length = c->req.length;
  while (c->body_got < length) {
    const uint64_t left = length - c->body_got;
    void* into = scratch;
    size_t want = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
    if (c->sink == Sink::kRanges && c->ssl == nullptr) {
      // Straight into a run of ranges in one buffer, checked before every
      // receive into served memory as for WRITE; other runs go through
      // scratch (below).
      if (absl::Status refused = WriteAdmitted(c); !refused.ok()) {
        c->sink = Sink::kDrain;
        c->close_after = absl::IsUnauthenticated(refused);
        c->verdict = std::move(refused);
        continue;
      }
      std::optional<ServedMemory::Pin> run;
      iovec iov[RangeCursor::kMaxRun];
      if (const size_t count = c->ranges.PinRun(RangeCursor::kMaxRun, &run, iov); count > 0) {
        absl::StatusOr<net::IoStep> got = RecvVec(c->fd.get(), iov, count);
        run.reset();
        if (!got.ok()) return Step::kClose;
        if (got->n == 0) {
          c->want_write = false;
          return Step::kBlocked;
        }
        c->ranges.Skip(got->n);
        c->body_got += got->n;
        c->moved += got->n;
        continue;
      }
    }
    if (c->sink == Sink::kMemory) {
      // Before every receive into served memory, not only at the header: a
      // payload that trickles in past its deadline (or its grant, or a
      // newer master) must not land in an extent that may be another put's
      // by now. The rest is drained and the write refused.
      if (absl::Status refused = WriteAdmitted(c); !refused.ok()) {
        c->pin.reset();
        c->sink = Sink::kDrain;
        c->close_after = absl::IsUnauthenticated(refused);
        c->verdict = std::move(refused);
        continue;
      }
      if (!c->pin.has_value()) {
        // Pinned again after a wait; a range unregistered meanwhile has the
        // rest drained and the write refused.
        if (absl::Status st = Repin(c, c->body_got); !st.ok()) {
          c->sink = Sink::kDrain;
          c->verdict = std::move(st);
          continue;
        }
      }
      into = c->pin->addr + (c->body_got - c->pin_from);
      want = static_cast<size_t>(std::min<uint64_t>(left, 1 << 30));
    } else if (c->sink == Sink::kBuffer || c->sink == Sink::kTable) {
      into = c->body.data() + c->body_got;
      want = c->body.size() - c->body_got;
    }
    absl::StatusOr<net::IoStep> got = RecvSome(c->fd.get(), c->ssl.get(), into, want);
    if (!got.ok()) return Step::kClose;
    if (got->n == 0) {
      c->want_write = got->wait == POLLOUT;
      return Step::kBlocked;
    }
    c->body_got += got->n;
    c->moved += got->n;
    if (c->sink == Sink::kTable && c->body_got == c->body.size()) {
      StartRanges(c);
    } else if (c->sink == Sink::kRanges) {
      // Checked after the receive and before any of it lands, so no byte
      // that arrived past the deadline (grant, epoch) is written.
      absl::Status st = WriteAdmitted(c);
      if (st.ok()) st = c->ranges.Copy(reinterpret_cast<char*>(scratch), got->n, /*into_memory=*/true);
      if (!st.ok()) {
        c->sink = Sink::kDrain;
        c->close_after = absl::IsUnauthenticated(st);
        c->verdict = std::move(st);
      }
    }
  }
  c->pin.reset();
  return FinishBody(c);
}

Server::Step Server::FinishBody(Conn* c) {
  const RequestHeader& h = c->req;
  if (!c->verdict.ok()) return StartReply(c, c->verdict, {}, c->close_after);
  switch (h.op) {
    case WireOp::kWrite:
    case WireOp::kWriteV:
      return StartReply(c, absl::OkStatus(), {});
    case WireOp::kReadV: {
      // The header, then the data staged a chunk at a time (SendReply).
      ReplyHeader r;
      r.id = h.id;
      r.length = c->staged_left;
      c->out.resize(kReplySize);
      EncodeReply(r, reinterpret_cast<uint8_t*>(c->out.data()));
      if (absl::Status st = StageReply(c); !st.ok()) {
        c->staged_left = 0;  // nothing was sent: the refusal replaces the data
        return StartReply(c, st, {});
      }
      c->out_sent = 0;
      c->payload = c->payload_sent = 0;
      c->close_after = false;
      c->stage = Stage::kReply;
      return Step::kContinue;
    }
    case WireOp::kAuth:
      return FinishAuth(c);
    case WireOp::kHandshake: {
      const absl::string_view body(c->body);
      const absl::Status may = MapAdmitted(c);
      absl::StatusOr<std::string> answer =
          may.ok() ? served_->Handshake(std::string(body.substr(0, h.offset)), std::string(body.substr(h.offset)),
                                        c->admitted)
                   : absl::StatusOr<std::string>(may);
      // A handshake for a segment the grant does not cover closes, as any
      // frame beyond the grant does.
      if (!answer.ok()) return StartReply(c, answer.status(), {}, absl::IsUnauthenticated(answer.status()));
      return StartReply(c, absl::OkStatus(), *answer);
    }
    default:
      return Step::kClose;
  }
}

Server::Step Server::StartReply(Conn* c, const absl::Status& status, absl::string_view payload, bool close_after,
                                uint64_t memory_bytes) {
  ReplyHeader h;
  h.id = c->req.id;
  std::string text;
  if (!status.ok()) {
    h.status = ToWire(status);
    text = std::string(status.message().substr(0, kMaxErrorText));
    payload = text;
    memory_bytes = 0;
  }
  h.length = payload.size() + memory_bytes;
  c->out.resize(kReplySize);
  EncodeReply(h, reinterpret_cast<uint8_t*>(c->out.data()));
  c->out.append(payload.data(), payload.size());
  c->out_sent = 0;
  c->payload = memory_bytes;
  c->payload_sent = 0;
  c->close_after = close_after;
  c->stage = Stage::kReply;
  return Step::kContinue;
}

Server::Step Server::StartMemoryReply(Conn* c, ServedMemory::Pin pin) {
  const uint64_t length = c->req.length;
  if (length <= kGather) return StartReply(c, absl::OkStatus(), absl::string_view(pin.addr, length));
  c->pin = std::move(pin);
  c->pin_from = 0;
  return StartReply(c, absl::OkStatus(), {}, false, length);
}

Server::Step Server::SendReply(Conn* c) {
  while (c->out_sent < c->out.size() || c->payload_sent < c->payload || c->staged_left > 0) {
    // Bytes read past the frame's extent grant may be another put's now: a
    // reply still unsent at its expiry is cut off.
    if ((c->payload_sent < c->payload || c->staged_left > 0) && absl::Now() >= c->grant_until) return Step::kClose;
    if (c->out_sent == c->out.size() && c->staged_left > 0) {
      // A READV's next chunk; a range unregistered meanwhile cannot finish
      // its reply, and the connection closes.
      c->out.clear();
      c->out_sent = 0;
      if (!StageReply(c).ok()) return Step::kClose;
    }
    // Pinned again after a wait; a range unregistered meanwhile cannot
    // finish its reply, and the connection closes.
    if (c->payload_sent < c->payload && !c->pin.has_value() && !Repin(c, c->payload_sent).ok()) return Step::kClose;
    char* const data = c->payload_sent < c->payload ? c->pin->addr + (c->payload_sent - c->pin_from) : nullptr;
    absl::StatusOr<net::IoStep> sent;
    if (c->ssl != nullptr) {
      // After a wait, each call is repeated with the same bytes (TlsSendSome).
      if (c->out_sent < c->out.size()) {
        sent = net::TlsSendSome(c->ssl.get(), c->out.data() + c->out_sent, c->out.size() - c->out_sent);
      } else {
        sent = net::TlsSendSome(c->ssl.get(), data, std::min(c->payload - c->payload_sent, kTlsChunk));
      }
    } else {
      iovec iov[2];
      int n = 0;
      if (c->out_sent < c->out.size()) iov[n++] = {c->out.data() + c->out_sent, c->out.size() - c->out_sent};
      if (data != nullptr) iov[n++] = {data, c->payload - c->payload_sent};
      sent = net::SendSome(c->fd.get(), iov, n);
    }
    if (!sent.ok()) return Step::kClose;
    if (sent->n == 0) {
      c->want_write = sent->wait == POLLOUT;
      return Step::kBlocked;
    }
    const size_t from_out = std::min(sent->n, c->out.size() - c->out_sent);
    c->out_sent += from_out;
    c->payload_sent += sent->n - from_out;
    c->moved += sent->n;
  }
  c->pin.reset();
  if (c->close_after) return Step::kClose;
  // The next frame starts from scratch; buffers a large reply or body grew
  // are given back, as thousands of connections would hold them.
  c->stage = Stage::kHeader;
  c->want_write = false;
  c->deadline = absl::InfiniteFuture();
  c->head_got = 0;
  c->req = RequestHeader();
  c->body_got = 0;
  c->verdict = absl::OkStatus();
  c->ranges.Clear();
  c->staged_left = 0;
  if (c->out.capacity() > 1024) std::string().swap(c->out);
  if (c->body.capacity() > 1024) std::string().swap(c->body);
  c->out.clear();
  c->body.clear();
  c->out_sent = 0;
  c->payload = c->payload_sent = 0;
  return Step::kFrameDone;
}

}  // namespace tierkv::transport::tcp
