// The tcp backend: reaches any peer. Each peer channel keeps a small pool
// of connections; a worker takes one, runs its group of slices pipelined,
// and gives it back. A broken connection is dropped, and the channel then
// reports itself unhealthy (as it does when a dial fails) so the engine
// re-reads the peer's descriptor before the next use.
//
// A worker's batch may be abandoned by its caller mid-transfer (a Wait that
// timed out): the connection then drops its bytes and itself, leaving the
// channel healthy (transport/buffer_claim.h). A connection is used only
// while the data grant that admitted it outlives the batch's deadline,
// since the server refuses frames past the grant's expiry.
#include <deque>

#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/status.h"
#include "transport/buffer_claim.h"
#include "transport/internal/builtin.h"
#include "transport/tcp/connection.h"
#include "transport/tcp/server.h"

namespace tierkv::transport {
namespace internal {
namespace {

using tcp::Connection;

// Dials `endpoint` and, with `grant`, has the server admit the connection
// for segment (index, id). A refused grant is renewed and tried once more
// on a new connection: the daemon may have restarted with a new key since
// the cached grant was issued. A grant that cannot be had keeps the
// master's status (UNAUTHENTICATED for a client without a token).
absl::StatusOr<std::unique_ptr<Connection>> DialAdmitted(const std::string& endpoint, uint32_t segment,
                                                         uint64_t segment_id, const GrantFn& grant,
                                                         absl::Duration reply_spin, absl::Time deadline,
                                                         const std::string& tls_ca) {
  std::string address;
  const bool tls = net::SplitTlsEndpoint(endpoint, &address);
  for (int attempt = 0;; ++attempt) {
    ASSIGN_OR_RETURN(net::Fd fd, net::Dial(address, deadline));
    net::SslPtr ssl;
    if (tls) {
      ASSIGN_OR_RETURN(std::shared_ptr<SSL_CTX> ctx, net::ClientContext(tls_ca));
      ASSIGN_OR_RETURN(ssl, net::TlsConnect(fd.get(), ctx.get(), address.substr(0, address.rfind(':')), deadline));
    }
    auto conn = std::make_unique<Connection>(std::move(fd), endpoint, reply_spin, std::move(ssl));
    if (!grant) return conn;
    ASSIGN_OR_RETURN(DataGrant g, grant(/*renew=*/attempt > 0, deadline));
    absl::Status st = conn->Authenticate(segment, segment_id, g, deadline);
    if (st.ok()) return conn;
    if (!absl::IsUnauthenticated(st)) return st;
    if (attempt > 0) {
      // The master's fresh grant refused too: it and the daemon disagree on
      // the key, as while a restarted daemon has published its descriptor
      // but not yet mounted. Unavailable, so a read tries another replica
      // and a caller retries.
      return absl::UnavailableError(absl::StrCat("segment #", segment, " at ", endpoint,
                                                 " refused the master's data grant: ", st.message()));
    }
  }
}

class TcpChannel final : public PeerChannel {
 public:
  TcpChannel(std::string endpoint, uint32_t segment, uint64_t segment_id, int max_connections,
             absl::Duration reply_spin, GrantFn grant, bool extent_grants, std::string tls_ca)
      : extent_grants_(extent_grants),
        endpoint_(std::move(endpoint)),
        segment_(segment),
        segment_id_(segment_id),
        max_(max_connections),
        reply_spin_(reply_spin),
        grant_(std::move(grant)),
        tls_ca_(std::move(tls_ca)) {}

  void Post(absl::Span<Slice* const> slices, absl::Time deadline) override {
    absl::StatusOr<std::unique_ptr<Connection>> conn = Acquire(deadline);
    if (!conn.ok()) {
      for (Slice* s : slices) s->status = conn.status();
      return;
    }
    // A server that checks no extent grants would misread them.
    if (!extent_grants_) {
      for (Slice* s : slices) s->grant_size = 0;
    }
    (*conn)->RunBatch(segment_, segment_id_, slices, deadline, CurrentTaskClaim());
    Release(std::move(*conn));
    // The server does not serve this segment (any more): the descriptor is
    // stale, so the engine re-reads it before the next use.
    for (Slice* s : slices) {
      if (absl::IsNotFound(s->status)) healthy_.store(false);
    }
  }

  bool healthy() const override { return healthy_.load(); }

 private:
  absl::StatusOr<std::unique_ptr<Connection>> Acquire(absl::Time deadline) {
    {
      MutexLock lock(&mu_);
      while (idle_.empty() && open_ >= max_) {
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat("no free connection to ", endpoint_));
        }
        cv_.WaitFor(&mu_, absl::ToChronoMilliseconds(deadline - absl::Now()) + std::chrono::milliseconds(1));
      }
      // A connection the server closed while it sat idle (its idle timeout),
      // or one whose data grant expires before the batch's deadline, would
      // fail the batch; it is dropped and another taken or dialled.
      while (!idle_.empty()) {
        auto c = std::move(idle_.front());
        idle_.pop_front();
        if (!c->Stale() && c->admitted_until() > deadline) return c;
        --open_;
      }
      ++open_;
    }
    absl::StatusOr<std::unique_ptr<Connection>> conn =
        DialAdmitted(endpoint_, segment_, segment_id_, grant_, reply_spin_, deadline, tls_ca_);
    if (!conn.ok()) {
      MutexLock lock(&mu_);
      --open_;
      cv_.SignalAll();
      // Unreachable, or refused (a grant for the segment's previous
      // incarnation, a stale descriptor): re-read the descriptor first.
      if (!absl::IsDeadlineExceeded(conn.status())) healthy_.store(false);
    }
    return conn;
  }

  void Release(std::unique_ptr<Connection> c) {
    MutexLock lock(&mu_);
    if (c->broken()) {
      // The peer may have restarted at another address: have the engine
      // re-read its descriptor rather than redial this endpoint. Not so for
      // one its caller abandoned: the peer was only slow.
      --open_;
      if (!c->abandoned()) healthy_.store(false);
    } else {
      idle_.push_back(std::move(c));
    }
    cv_.SignalAll();
  }

  const bool extent_grants_;  // the server checks extent grants: send them
  const std::string endpoint_;
  const uint32_t segment_;
  const uint64_t segment_id_;
  const int max_;
  const absl::Duration reply_spin_;
  const GrantFn grant_;  // null: the server needs none
  const std::string tls_ca_;  // verifies a tls:// endpoint's certificate
  std::atomic<bool> healthy_{true};
  Mutex mu_;
  CondVar cv_;
  std::deque<std::unique_ptr<Connection>> idle_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;
};

class TcpBackend final : public Backend {
 public:
  explicit TcpBackend(const BackendOptions& o) : options_(o) {}
  ~TcpBackend() override { Stop(); }

  std::string name() const override { return "tcp"; }
  Capabilities capabilities() const override { return {.rank = 10, .bounded_post = true}; }

  absl::Status Start(ServedMemory* served) override {
    tcp::ServerOptions so;
    so.listen = options_.listen;
    so.port = options_.port;
    so.max_frame = options_.max_frame;
    so.max_connections = options_.max_connections;
    so.io_threads = options_.io_threads;
    so.idle_timeout = options_.idle_timeout;
    so.frame_timeout = options_.frame_timeout;
    so.handshake_timeout = options_.handshake_timeout;
    if (options_.serve_tls) {
      ASSIGN_OR_RETURN(so.tls, net::NewServerContext(options_.tls));
    }
    server_ = std::make_unique<tcp::Server>(so, served);
    return server_->Start();
  }
  void Stop() override {
    if (server_) server_->Stop();
  }
  std::string endpoint() const override {
    std::string host = options_.advertise.empty() ? options_.listen : options_.advertise;
    return absl::StrCat(options_.serve_tls ? net::kTlsScheme : "", host, ":", server_ ? server_->port() : 0);
  }
  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer&) override { return std::string(); }
  void UnregisterBuffer(const LocalBuffer&) override {}

  absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor& remote,
                                                       const PrepareContext& ctx) override {
    auto it = remote.transports.find("tcp");
    if (it == remote.transports.end()) {
      return absl::UnavailableError(absl::StrCat("segment ", remote.name, " offers no tcp endpoint"));
    }
    // Prove reachability with one connection now, so selection can fall back.
    std::string address;
    (void)net::SplitTlsEndpoint(it->second, &address);
    absl::StatusOr<net::Fd> probe = net::Dial(address, ctx.deadline);
    if (!probe.ok()) return absl::UnavailableError(probe.status().message());
    return std::unique_ptr<PeerChannel>(new TcpChannel(it->second, remote.segment_index, remote.segment_id,
                                                       options_.connections, options_.reply_spin,
                                                       remote.auth ? ctx.grant : nullptr, remote.extent_grants,
                                                       options_.tls.ca));
  }

 private:
  BackendOptions options_;
  std::unique_ptr<tcp::Server> server_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewTcpBackend(const BackendOptions& options) {
  return std::unique_ptr<Backend>(new TcpBackend(options));
}

absl::StatusOr<std::string> TcpHandshake(const std::string& control, const std::string& transport,
                                         const std::string& request, absl::Time deadline, const GrantFn& grant,
                                         uint32_t segment, uint64_t segment_id, const std::string& tls_ca) {
  ASSIGN_OR_RETURN(std::unique_ptr<Connection> conn,
                   DialAdmitted(control, segment, segment_id, grant, absl::ZeroDuration(), deadline, tls_ca));
  return conn->Handshake(transport, request, deadline, segment, segment_id);
}

}  // namespace internal
}  // namespace tierkv::transport
