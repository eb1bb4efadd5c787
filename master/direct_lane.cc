#include "master/direct_lane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/failpoint.h"
#include "base/log.h"
#include "master/replication.h"
#include "proto/direct_frame.h"

namespace tierkv::master {

using direct::DirectMethod;

// "ipv4:a.b.c.d:port" or "ipv6:[..]:port", as gRPC names a peer, so the
// per-client put cap keys a client the same way on both faces.
std::string PeerName(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    return absl::StrCat("ipv4:", host, ":", ntohs(a->sin_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
  if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
    // An IPv4 client of a dual-stack port is named as an IPv4 one.
    inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], host, sizeof host);
    return absl::StrCat("ipv4:", host, ":", ntohs(a->sin6_port));
  }
  inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
  return absl::StrCat("ipv6:[", host, "]:", ntohs(a->sin6_port));
}

std::string GrpcPeerName(const std::string& peer) {
  // Connections handed over by fd are named "fd:<n>" by gRPC; the socket
  // itself knows its peer (the call holds the connection open).
  int fd = -1;
  if (peer.rfind("fd:", 0) != 0 || !absl::SimpleAtoi(peer.substr(3), &fd)) return peer;
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return peer;
  return PeerName(addr);
}

namespace {

// How long a decided answer waits for etcd to confirm a lapsed lease: the
// client's default call timeout.
constexpr absl::Duration kHeldAnswerWait = absl::Seconds(5);

// Frames a reply in `buf`: header, status message, then `resp` (of `body`
// bytes, its sizes computed by ByteSizeLong) if given.
template <class Resp>
void FrameReply(const absl::Status& status, const Resp* resp, std::string* buf, size_t body = 0) {
  direct::ReplyHeader h;
  h.code = static_cast<uint8_t>(status.code());
  absl::string_view message = status.message().substr(0, direct::kMaxMessage);
  h.message_length = static_cast<uint32_t>(message.size());
  if (resp == nullptr || !status.ok()) body = 0;
  h.length = static_cast<uint32_t>(body);
  buf->resize(direct::kHeaderSize + message.size() + body);
  direct::EncodeReply(h, buf->data());
  if (!message.empty()) std::memcpy(buf->data() + direct::kHeaderSize, message.data(), message.size());
  if (body > 0) {
    resp->SerializeWithCachedSizesToArray(
        reinterpret_cast<uint8_t*>(buf->data() + direct::kHeaderSize + message.size()));
  }
}

absl::Status SendAll(int fd, const std::string& buf) {
  iovec iov{const_cast<char*>(buf.data()), buf.size()};
  return net::SendVecAll(fd, &iov, 1);
}

// Closing with unread bytes sends a reset, which can reach the client
// before the error reply it was sent after; so the write side closes
// first and what the client still sends is read and dropped (up to 1 MiB,
// for 200 ms), letting the reply arrive.
void DrainBeforeClose(int fd) {
  ::shutdown(fd, SHUT_WR);
  net::SetTimeouts(fd, absl::Milliseconds(200));
  char sink[16 << 10];
  for (size_t drained = 0; drained < (1u << 20);) {
    ssize_t n = ::recv(fd, sink, sizeof sink, 0);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
}

}  // namespace

DirectLane::DirectLane(Master* master, rpc::RpcMetrics* metrics, Options options)
    : master_(master), options_(options), spin_(options.spin, options.max_spinners) {
  // Pings and replication streams are not RPCs of the master's: they
  // count nowhere (a stream's state is in /v1/ha).
  for (uint8_t m = 1; m < static_cast<uint8_t>(DirectMethod::kPing); ++m) {
    stats_[m] = metrics->For(direct::MethodName(static_cast<DirectMethod>(m)));
  }
  connections_ = &metrics::BuildGauge()
                      .Name("tierkv_master_direct_connections")
                      .Help("Open direct RPC connections")
                      .Register(master->metrics())
                      .Add({});
  refused_ = &metrics::BuildCounter()
                  .Name("tierkv_master_direct_refused_total")
                  .Help("Direct RPC connections closed for a malformed frame or at the connection cap")
                  .Register(master->metrics())
                  .Add({});
  threads_ = &metrics::BuildGauge()
                  .Name("tierkv_master_direct_threads")
                  .Help("Direct-lane connection threads, serving a connection or waiting for the next")
                  .Register(master->metrics())
                  .Add({});
  threads_started_ = &metrics::BuildCounter()
                          .Name("tierkv_master_direct_threads_started_total")
                          .Help("Direct-lane connection threads started (a waiting one takes a new "
                                "connection without a start)")
                          .Register(master->metrics())
                          .Add({});
  auto& spins = metrics::BuildCounter()
                    .Name("tierkv_master_direct_spins_total")
                    .Help("Waits for a hot direct connection's next call by outcome: it arrived (or the "
                          "client closed) while the thread spun (call), the window passed (idle), or the "
                          "thread slept because --direct-spinners others spun (capped)")
                    .Register(master->metrics());
  spin_call_ = &spins.Add({{"outcome", "call"}});
  spin_idle_ = &spins.Add({{"outcome", "idle"}});
  spin_capped_ = &spins.Add({{"outcome", "capped"}});
}

net::ServerSpin::Counts DirectLane::spins() const {
  return {static_cast<uint64_t>(spin_call_->Value()), static_cast<uint64_t>(spin_idle_->Value()),
          static_cast<uint64_t>(spin_capped_->Value())};
}

DirectLane::ThreadCounts DirectLane::threads() const {
  return {static_cast<uint64_t>(threads_started_->Value()), static_cast<int64_t>(threads_->Value()),
          static_cast<int64_t>(connections_->Value())};
}

void DirectLane::SpinForNextCall(int fd, net::SpinTracker* tracker) {
  using Outcome = net::ServerSpin::Outcome;
  const Outcome outcome = spin_.Spin(fd);
  tracker->Spun(outcome);
  (outcome == Outcome::kCall ? spin_call_ : outcome == Outcome::kIdle ? spin_idle_ : spin_capped_)->Increment();
}

DirectLane::~DirectLane() { Stop(); }

void DirectLane::Start(net::Fd listener, grpc::Server* grpc) {
  listener_ = std::move(listener);
  grpc_ = grpc;
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

void DirectLane::StopAccepting() {
  if (accepting_stopped_) return;
  accepting_stopped_ = true;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  // Wakes accept(): it returns EINVAL on a shut-down listener.
  if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
}

void DirectLane::Stop() {
  if (stopped_) return;
  stopped_ = true;
  StopAccepting();
  // No worker starts once the acceptor is gone, so these are all of them.
  std::list<std::unique_ptr<Worker>> workers;
  {
    MutexLock lock(&mu_);
    // A blocked recv returns 0; a running handler finishes and its reply
    // fails; a connection not yet taken is closed by the worker that takes it.
    for (auto& c : conns_) {
      if (c->fd >= 0) ::shutdown(c->fd, SHUT_RDWR);
    }
    work_cv_.SignalAll();
    workers.swap(workers_);
  }
  for (auto& w : workers) w->thread.join();
}

void DirectLane::Close(Conn* conn) {
  MutexLock lock(&mu_);
  if (conn->fd >= 0) {
    ::close(conn->fd);
    conn->fd = -1;
  }
}

void DirectLane::AcceptLoop() {
  for (;;) {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINVAL || err == EBADF) return;  // the listener was shut down
      {
        MutexLock lock(&mu_);
        if (stopping_) return;
      }
      if (err == EINTR || err == ECONNABORTED) continue;
      // Out of descriptors or memory, or a network error accept(2) says to
      // retry: the port must never stop for good, so wait and try again.
      TKV_LOG(WARNING) << "master rpc port: accept: " << strerror(err);
      std::this_thread::sleep_for(std::chrono::milliseconds(err == EMFILE || err == ENFILE ? 50 : 5));
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    MutexLock lock(&mu_);
    if (stopping_) {
      ::close(fd);
      return;
    }
    // Threads past the spare ones that ended are joined here.
    for (auto it = workers_.begin(); it != workers_.end();) {
      if ((*it)->done.load()) {
        (*it)->thread.join();
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    if (unread_ >= options_.max_unread) {
      // A flood of silent connections must not lock new ones (gRPC's
      // included) out: the oldest still unread one goes instead.
      bool evicted = false;
      for (auto& c : conns_) {
        if (c->unread && c->fd >= 0) {
          ::shutdown(c->fd, SHUT_RDWR);
          c->unread = false;  // its thread still counts it until it ends
          evicted = true;
          break;
        }
      }
      refused_->Increment();
      if (!evicted) {
        ::close(fd);
        continue;
      }
    }
    auto conn = std::make_unique<Conn>();
    conn->fd = fd;
    conn->unread = true;
    conn->peer = PeerName(addr);
    Conn* c = conn.get();
    conns_.push_back(std::move(conn));
    c->self = std::prev(conns_.end());
    ++unread_;
    if (idle_ > 0) {
      --idle_;
      handoff_.push_back(c);
      work_cv_.Signal();
      continue;
    }
    auto worker = std::make_unique<Worker>();
    try {
      worker->thread = std::thread([this, w = worker.get(), c] { WorkerLoop(w, c); });
    } catch (const std::system_error& e) {
      // Out of threads (a pids cgroup, RLIMIT_NPROC): refuse this one.
      TKV_LOG(WARNING) << "master rpc port: no thread for a connection: " << e.what();
      refused_->Increment();
      --unread_;
      conns_.erase(c->self);
      ::close(fd);
      continue;
    }
    threads_started_->Increment();
    threads_->Increment();
    workers_.push_back(std::move(worker));
  }
}

void DirectLane::WorkerLoop(Worker* worker, Conn* conn) {
  for (;;) {
    Serve(conn);
    MutexLock lock(&mu_);
    conns_.erase(conn->self);
    if (stopping_ || idle_ >= options_.spare_threads) break;
    ++idle_;
    while (handoff_.empty() && !stopping_) work_cv_.Wait(&mu_);
    // Connections handed over before a stop are still taken (and closed).
    if (handoff_.empty()) break;
    conn = handoff_.front();
    handoff_.pop_front();
  }
  threads_->Decrement();
  worker->done.store(true);
}

void DirectLane::Serve(Conn* conn) {
  const std::string& peer = conn->peer;
  int fd;
  {
    MutexLock lock(&mu_);
    fd = conn->fd;
  }
  // The first four bytes say which protocol this is; both kinds of client
  // speak first (gRPC sends the HTTP/2 preface on connecting).
  net::SetTimeouts(fd, options_.first_bytes_timeout);
  char magic[4];
  ssize_t n;
  do {
    n = ::recv(fd, magic, sizeof magic, MSG_PEEK | MSG_WAITALL);
  } while (n < 0 && errno == EINTR);
  uint32_t first = 0;
  if (n == sizeof magic) std::memcpy(&first, magic, 4);
  enum { kDrop, kGrpc, kDirect, kOverCap } route = kDrop;
  {
    MutexLock lock(&mu_);
    if (n != sizeof magic || stopping_) {
      route = kDrop;
    } else if (first != direct::kCallMagic) {
      route = kGrpc;
      // gRPC expects the socket as it would have accepted it.
      net::SetTimeouts(fd, absl::ZeroDuration());
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
      grpc::AddInsecureChannelFromFd(grpc_, fd);
      conn->fd = -1;
    } else if (direct_ < options_.max_connections) {
      route = kDirect;
      ++direct_;
    } else {
      route = kOverCap;  // still unread (and evictable) until answered and closed
    }
    if (route != kOverCap) {
      conn->unread = false;
      --unread_;
    }
  }
  if (route == kGrpc) return;
  if (route == kOverCap) {
    refused_->Increment();
    // The first call (a client's ping) is read before the answer, so the
    // close that follows is a FIN the client reads after it, not a reset.
    char header[direct::kHeaderSize];
    if (net::RecvAll(fd, header, sizeof header).ok()) {
      std::string buf;
      FrameReply<v1::StatsResponse>(
          absl::ResourceExhaustedError(absl::StrCat("the master's direct lane is at its cap of ",
                                                    options_.max_connections, " connections; use gRPC")),
          nullptr, &buf);
      (void)SendAll(fd, buf);
    }
  }
  if (route != kDirect) {
    Close(conn);
    if (route == kOverCap) {
      MutexLock lock(&mu_);
      --unread_;
    }
    return;
  }
  connections_->Increment();
  net::SetTimeouts(fd, options_.idle_timeout);
  std::string buf;
  char header[direct::kHeaderSize];
  bool admitted = options_.auth == nullptr || !options_.auth->enabled();
  bool may_replicate = admitted;  // under --auth: a token with the admin role
  std::string tenant;
  net::SpinTracker spin(&spin_);
  for (;;) {
    if (spin.hot()) SpinForNextCall(fd, &spin);
    if (!net::RecvAll(fd, header, sizeof header).ok()) break;
    spin.Arrived();
    if (!Call(fd, peer, header, &buf, &admitted, &may_replicate, &tenant)) break;
    spin.Replied();
  }
  Close(conn);
  connections_->Decrement();
  MutexLock lock(&mu_);
  --direct_;
}

bool DirectLane::Call(int fd, const std::string& peer, const char* header, std::string* buf, bool* admitted,
                      bool* may_replicate, std::string* tenant) {
  absl::StatusOr<direct::CallHeader> h = direct::DecodeCall(header, options_.max_message);
  if (!h.ok()) {
    // The rest of the frame cannot be found: answer, then close.
    refused_->Increment();
    FrameReply<v1::StatsResponse>(h.status(), nullptr, buf);
    if (SendAll(fd, *buf).ok()) DrainBeforeClose(fd);
    return false;
  }
  // The buffer grows with the bytes that arrive (at most doubling), so a
  // header that claims a large request costs no memory until it is sent.
  buf->clear();
  while (buf->size() < h->length) {
    const size_t have = buf->size();
    const size_t next = std::min<size_t>(h->length, std::max<size_t>(have * 2, 64 << 10));
    buf->resize(next);
    if (!net::RecvAll(fd, buf->data() + have, next - have).ok()) return false;
  }
  if (!*admitted) {
    absl::Status refused = absl::UnauthenticatedError(
        "direct lane: the connection's first call must be a ping with a token (the master runs --auth token)");
    if (h->method == DirectMethod::kPing) {
      v1::DirectHello hello;
      if (!hello.ParseFromArray(buf->data(), static_cast<int>(buf->size()))) {
        refused = absl::InvalidArgumentError("direct lane: the ping does not parse");
      } else {
        absl::StatusOr<auth::Identity> id = options_.auth->Authorize(hello.token(), auth::kClient, "direct lane");
        refused = id.status();
        if (id.ok()) {
          *tenant = id->tenant;
          *may_replicate = (id->roles & auth::kAdmin) != 0;
        }
      }
    }
    if (!refused.ok()) {
      refused_->Increment();
      FrameReply<v1::StatsResponse>(refused, nullptr, buf);
      if (SendAll(fd, *buf).ok()) DrainBeforeClose(fd);
      return false;
    }
    *admitted = true;
  }
  if (h->method == DirectMethod::kPing) {
    // The reply's message is the idle timeout in ms, so a client never
    // reuses a connection the master is about to close.
    direct::ReplyHeader ping;
    const std::string idle = absl::StrCat(absl::ToInt64Milliseconds(options_.idle_timeout));
    ping.message_length = static_cast<uint32_t>(idle.size());
    buf->resize(direct::kHeaderSize);
    direct::EncodeReply(ping, buf->data());
    buf->append(idle);
    return SendAll(fd, *buf).ok();
  }
  if (h->method == DirectMethod::kReplicate) {
    v1::PullRequest first;
    absl::Status refused = master_->Serving();
    if (options_.replication == nullptr) {
      refused = absl::FailedPreconditionError(
          "direct lane: this master leads no standbys (no --etcd); there is no replication stream");
    } else if (!*may_replicate) {
      // A stream carries every tenant's index, and its reader counts as a standby.
      refused = absl::PermissionDeniedError(
          "direct lane: a replication stream needs a token with the admin role (a standby's --ha-token-file)");
    } else if (!first.ParseFromArray(buf->data(), static_cast<int>(buf->size()))) {
      refused = absl::InvalidArgumentError("direct lane: the replication request does not parse");
    }
    if (!refused.ok()) {
      FrameReply<v1::PullResponse>(refused, nullptr, buf);
      if (SendAll(fd, *buf).ok()) DrainBeforeClose(fd);
      return false;
    }
    options_.replication->Stream(fd, first);
    return false;  // the stream ended: so does the connection
  }
  const rpc::MethodStats& st = stats_[static_cast<uint8_t>(h->method)];
  const char* name = direct::MethodName(h->method);
  st.calls->Increment();
  // Parses, checks the item count, runs the handler and frames the reply.
  auto run = [&]<class Req, class Resp>(Req* req, Resp* resp, auto items, auto handler) {
    if (!req->ParseFromArray(buf->data(), static_cast<int>(buf->size()))) {
      st.errors->Increment();
      FrameReply<Resp>(absl::InvalidArgumentError(absl::StrCat(name, ": the request does not parse")), nullptr,
                       buf);
      return;
    }
    const int n = items(*req);
    if (static_cast<size_t>(n) > options_.limits.max_batch) {
      st.errors->Increment();
      FrameReply<Resp>(absl::ResourceExhaustedError(absl::StrCat(name, ": ", n, " items exceeds the batch limit of ",
                                                                 options_.limits.max_batch)),
                       nullptr, buf);
      return;
    }
    if (absl::Status serving = master_->Serving(); !serving.ok()) {
      st.errors->Increment();
      FrameReply<Resp>(serving, nullptr, buf);
      return;
    }
    st.items->Increment(n);
    absl::Time start = absl::Now();
    handler(*req, resp);
    st.latency->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    // As over gRPC: a lease that lapsed while it ran withholds the answer,
    // unless etcd confirms it soon. A direct frame carries no deadline; a
    // caller that gave up meanwhile has closed the connection.
    if (absl::Status serving = master_->ServingBy(absl::Now() + kHeldAnswerWait); !serving.ok()) {
      st.errors->Increment();
      FrameReply<Resp>(serving, nullptr, buf);
      return;
    }
    const size_t body = resp->ByteSizeLong();
    if (body > options_.max_message) {
      st.errors->Increment();
      FrameReply<Resp>(absl::ResourceExhaustedError(absl::StrCat(name, ": a response of ", body,
                                                                 " bytes exceeds the master's limit of ",
                                                                 options_.max_message)),
                       nullptr, buf);
      return;
    }
    FrameReply(absl::OkStatus(), resp, buf, body);
  };
  auto keys = [](const auto& r) { return r.keys_size(); };
  Master* m = master_;
  const std::string& t = *tenant;
  switch (h->method) {
    case DirectMethod::kPutStart: {
      v1::PutStartRequest req;
      v1::PutStartResponse resp;
      run(&req, &resp, [](const auto& r) { return r.items_size(); }, [&](const auto& r, auto* out) {
        rpc::PutStart(m, r, r.client_id().empty() ? peer : r.client_id(), t, out);
      });
      break;
    }
    case DirectMethod::kPutEnd: {
      v1::KeysRequest req;
      v1::KeysResponse resp;
      run(&req, &resp, keys, [m, &t](const auto& r, auto* out) { rpc::PutEnd(m, r, t, out); });
      break;
    }
    case DirectMethod::kPutRevoke: {
      v1::KeysRequest req;
      v1::KeysResponse resp;
      run(&req, &resp, keys, [m, &t](const auto& r, auto* out) { rpc::PutRevoke(m, r, t, out); });
      break;
    }
    case DirectMethod::kGetReplicas: {
      v1::KeysRequest req;
      v1::GetReplicasResponse resp;
      run(&req, &resp, keys, [m, &t](const auto& r, auto* out) { rpc::GetReplicas(m, r, t, out); });
      break;
    }
    case DirectMethod::kExists: {
      v1::KeysRequest req;
      v1::ExistsResponse resp;
      run(&req, &resp, keys, [m, &t](const auto& r, auto* out) { rpc::Exists(m, r, t, out); });
      break;
    }
    case DirectMethod::kPrefixMatch: {
      v1::KeysRequest req;
      v1::PrefixMatchResponse resp;
      run(&req, &resp, keys, [m, &t](const auto& r, auto* out) { rpc::PrefixMatch(m, r, t, out); });
      break;
    }
    case DirectMethod::kRemove: {
      v1::RemoveRequest req;
      v1::KeysResponse resp;
      run(&req, &resp, keys, [m, &t](const auto& r, auto* out) { rpc::Remove(m, r, t, out); });
      break;
    }
    case DirectMethod::kStats: {
      v1::StatsRequest req;
      v1::StatsResponse resp;
      run(&req, &resp, [](const auto&) { return 0; }, [m](const auto& r, auto* out) { rpc::Stats(m, r, out); });
      break;
    }
    case DirectMethod::kPing:
    case DirectMethod::kReplicate:
      break;  // answered above
  }
  // Lets a test lose a reply after its call ran, as a dying master would.
  if (TIERKV_FAILPOINT("master.direct.drop_reply")) return false;
  const bool sent = SendAll(fd, *buf).ok();
  // An idle connection keeps no large call's memory.
  if (buf->capacity() > (1u << 20)) std::string().swap(*buf);
  return sent;
}

}  // namespace tierkv::master
