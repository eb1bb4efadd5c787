#include "transport/tcp/server.h"

#include "config/base/failpoint.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "config/base/failpoint.h"
#include "config/base/log.h"
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
    default:
      return WireStatus::kInternal;
  }
}

// Server sockets are blocking with per-call timeouts (SetTimeouts).
absl::Status SendReply(int fd, uint64_t id, const absl::Status& status, const char* payload,
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
  return SendVecAll(fd, iov, length > 0 ? 2 : 1);
}

}  // namespace

Server::Server(ServerOptions options, ServedMemory* served) : options_(std::move(options)), served_(served) {}

Server::~Server() { Stop(); }

absl::Status Server::Start() {
  absl::StatusOr<Fd> l = Listen(options_.listen, options_.port, &port_);
  if (!l.ok()) return absl::UnavailableError(l.status().message());
  listener_ = std::move(*l);
  if (pipe2(wake_, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  acceptor_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void Server::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_[1] >= 0) {
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
  }
  if (acceptor_.joinable()) acceptor_.join();
  std::list<std::unique_ptr<Conn>> conns;
  {
    MutexLock lock(&mu_);
    conns.swap(conns_);
  }
  // Unblock every connection thread, then join.
  for (auto& c : conns) ::shutdown(c->fd.get(), SHUT_RDWR);
  for (auto& c : conns) {
    if (c->thread.joinable()) c->thread.join();
  }
  listener_ = Fd();
  for (int& f : wake_) {
    if (f >= 0) ::close(f);
    f = -1;
  }
}

void Server::ReapFinished() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void Server::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd p[2] = {{listener_.get(), POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(p, 2, 1000) <= 0) {
      MutexLock lock(&mu_);
      ReapFinished();
      continue;
    }
    if (p[1].revents) break;
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Fd conn_fd(fd);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    SetTimeouts(fd, options_.frame_timeout);
    MutexLock lock(&mu_);
    ReapFinished();
    if (static_cast<int>(conns_.size()) >= options_.max_connections) {
      TKV_LOG(WARNING) << "tcp server: refusing a connection, " << conns_.size() << " open";
      continue;  // closes conn_fd
    }
    auto conn = std::make_unique<Conn>();
    conn->fd = std::move(conn_fd);
    conn->scratch.reset(new uint8_t[kScratch]);
    Conn* raw = conn.get();
    conn->thread = std::thread([this, raw] { Serve(raw); });
    conns_.push_back(std::move(conn));
  }
}

void Server::Serve(Conn* conn) {
  while (!stopping_.load() && ServeOne(conn->fd.get(), conn->scratch.get())) {
  }
  ::shutdown(conn->fd.get(), SHUT_RDWR);
  conn->done.store(true);
}

bool Server::ServeOne(int fd, uint8_t* scratch) {
  uint8_t head[kRequestSize];
  // Waiting for the next request may take long; a started frame may not
  // (each blocking call is bounded by the socket's frame timeout).
  pollfd p{fd, POLLIN, 0};
  int idle_ms = static_cast<int>(absl::ToInt64Milliseconds(options_.idle_timeout));
  if (::poll(&p, 1, idle_ms) <= 0) return false;
  if (!RecvAll(fd, head, kRequestSize).ok()) return false;
  absl::StatusOr<RequestHeader> req = DecodeRequest(head, kRequestSize);
  if (!req.ok()) {
    // The stream cannot be trusted any more: explain, then close.
    (void)SendReply(fd, 0, absl::InvalidArgumentError(req.status().message()), nullptr, 0);
    return false;
  }
  const RequestHeader& h = *req;
  // A fault inside a transfer: `error` fails this request (its payload
  // still drained), `sleep` stalls it, `abort` kills the server mid-stream.
  if ((h.op == WireOp::kRead || h.op == WireOp::kWrite) && TIERKV_FAILPOINT("transport.tcp.serve")) {
    if (h.op == WireOp::kWrite) {
      for (uint64_t left = std::min<uint64_t>(h.length, options_.max_frame); left > 0;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
        if (!RecvAll(fd, scratch, n).ok()) return false;
        left -= n;
      }
      if (h.length > options_.max_frame) return false;
    }
    return SendReply(fd, h.id, absl::InternalError("failpoint transport.tcp.serve"), nullptr, 0).ok();
  }
  switch (h.op) {
    case WireOp::kPing:
      return SendReply(fd, h.id, absl::OkStatus(), nullptr, 0).ok();
    case WireOp::kRead: {
      if (h.length > options_.max_frame) {
        return SendReply(fd, h.id,
                         absl::ResourceExhaustedError(absl::StrCat("read of ", h.length,
                                                                   " bytes exceeds the frame cap ",
                                                                   options_.max_frame)),
                         nullptr, 0)
            .ok();
      }
      absl::StatusOr<ServedMemory::Pin> pin = served_->Resolve(h.segment, h.segment_id, h.offset, h.length);
      if (!pin.ok()) return SendReply(fd, h.id, pin.status(), nullptr, 0).ok();
      return SendReply(fd, h.id, absl::OkStatus(), pin->addr, h.length).ok();
    }
    case WireOp::kWrite: {
      if (h.length > options_.max_frame) {
        // Draining this much is not worth it; the connection closes.
        (void)SendReply(fd, h.id,
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
      if (!pin.ok()) {
        for (uint64_t left = h.length; left > 0;) {
          size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
          if (!RecvAll(fd, scratch, n).ok()) return false;
          left -= n;
        }
        return SendReply(fd, h.id, pin.status(), nullptr, 0).ok();
      }
      if (!RecvAll(fd, pin->addr, h.length).ok()) return false;
      return SendReply(fd, h.id, absl::OkStatus(), nullptr, 0).ok();
    }
    case WireOp::kHandshake: {
      if (h.length > kMaxHandshake || h.offset > h.length) {
        (void)SendReply(fd, h.id, absl::InvalidArgumentError("bad handshake frame"), nullptr, 0);
        return false;
      }
      std::string body(h.length, '\0');
      if (!RecvAll(fd, body.data(), body.size()).ok()) return false;
      std::string transport = body.substr(0, h.offset);
      absl::StatusOr<std::string> answer = served_->Handshake(transport, body.substr(h.offset));
      if (!answer.ok()) return SendReply(fd, h.id, answer.status(), nullptr, 0).ok();
      return SendReply(fd, h.id, absl::OkStatus(), answer->data(), answer->size()).ok();
    }
  }
  return false;
}

}  // namespace tierkv::transport::tcp
