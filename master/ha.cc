#include "master/ha.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "base/failpoint.h"
#include "base/http_server.h"
#include "base/log.h"
#include "base/status.h"
#include "master/grpc_service.h"
#include "nlohmann/json.hpp"
#include "proto/channel_credentials.h"
#include "proto/direct_frame.h"

namespace tierkv::master {

namespace {

using SteadyClock = std::chrono::steady_clock;

// The leader serves until the send time of its last answered keepalive
// plus the TTL, less this share of the TTL (docs/ha.md, "Fencing").
constexpr double kLeaseMargin = 1.0 / 3;

// How often a master looks at the leader key (and a leader at its gate).
absl::Duration RoundOf(absl::Duration ttl) { return std::clamp(ttl / 30, absl::Milliseconds(50), absl::Milliseconds(100)); }

// Answers every gRPC call with `refusal`'s status.
class RefuseAll final : public grpc::CallbackGenericService {
 public:
  explicit RefuseAll(std::function<absl::Status()> refusal) : refusal_(std::move(refusal)) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Refused final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refused(const absl::Status& s) {
        Finish(ToGrpcStatus(s));
      }
      void OnDone() override { delete this; }
    };
    return new Refused(refusal_());
  }

 private:
  const std::function<absl::Status()> refusal_;
};

}  // namespace

// A standby's ports (master/ha.h): the RPC listener it will hand over, a
// thread accepting on it, a gRPC server that refuses every call, and an
// HTTP server with /v1/ha and the probes. Under TLS there is no listener:
// the gRPC server owns the RPC port with the master's TLS credentials (a
// TLS port has no direct lane) and gives it up on Release, for the
// leader's server to bind.
class StandbyFront {
 public:
  StandbyFront(net::Fd listener, std::function<absl::Status()> refusal)
      : listener_(std::move(listener)), refusal_(std::move(refusal)), grpc_service_(refusal_) {}
  ~StandbyFront() { (void)Release(); }

  absl::Status Start(const MasterConfig& config, std::function<std::string()> status_json) {
    grpc::ServerBuilder builder;
    builder.RegisterCallbackGenericService(&grpc_service_);
    const auth::TlsFiles tls{config.tls_ca, config.tls_cert, config.tls_key};
    int bound = 0;
    if (tls.enabled()) {
      ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> creds, MasterServerCredentials(tls));
      builder.AddListeningPort(absl::StrCat(config.listen, ":", config.rpc_port), creds, &bound);
    }
    grpc_ = builder.BuildAndStart();
    if (grpc_ == nullptr || (tls.enabled() && bound == 0)) {
      return absl::UnavailableError(
          absl::StrCat("the standby's gRPC server did not start on ", config.listen, ":", config.rpc_port));
    }
    HttpServer::Options o;
    o.threads = 1;
    o.tls = {config.tls_ca, config.tls_cert, config.tls_key};
    http_ = std::make_unique<HttpServer>(o);
    http_->Get("/v1/ha", [status_json](const httplib::Request&, httplib::Response& res) {
      res.set_content(status_json(), "application/json");
    });
    for (const char* probe : {"/healthz", "/livez"}) {
      http_->Get(probe, [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
    }
    // Anything else is the leader's to answer: 503, which metadata clients
    // take as "try the next master", naming it.
    auto refuse = [this](const httplib::Request&, httplib::Response& res) {
      res.status = 503;
      res.set_content(std::string(refusal_().message()) + "\n", "text/plain");
    };
    http_->Get(".*", refuse);
    http_->Put(".*", refuse);
    http_->Post(".*", refuse);
    http_->Delete(".*", refuse);
    if (http_->Bind(config.listen, static_cast<int>(config.http_port)) <= 0) {
      return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", config.listen, ":", config.http_port));
    }
    http_->Start();
    if (listener_.valid()) acceptor_ = std::thread([this] { AcceptLoop(); });
    return absl::OkStatus();
  }

  // Stops answering and returns the RPC listener, still listening: the
  // connections that arrive meanwhile wait in its backlog for the server.
  // Under TLS the port is closed and none is returned.
  net::Fd Release() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    if (grpc_) grpc_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    grpc_.reset();
    if (http_) http_->Stop();
    http_.reset();
    return std::move(listener_);
  }

 private:
  void AcceptLoop() {
    while (!stop_) {
      pollfd p{listener_.get(), POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) continue;
      Answer(fd);
    }
  }

  // A direct call is answered with the refusal and closed (each carries
  // one call: a client's ping is enough to learn where the leader is);
  // anything else goes to the gRPC server, which refuses its calls.
  void Answer(int fd) {
    const absl::Time deadline = absl::Now() + absl::Seconds(1);  // a silent peer holds no one up long
    char h[direct::kHeaderSize];
    uint32_t magic = 0;
    ssize_t n = -1;
    while (absl::Now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) < 0 && errno != EINTR) break;
      n = ::recv(fd, &magic, 4, MSG_PEEK);
      if (n == 4 || n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) break;
      if (n > 0) absl::SleepFor(absl::Milliseconds(1));  // the rest of the four bytes is on its way
    }
    if (n != 4) {
      ::close(fd);
      return;
    }
    if (magic != direct::kCallMagic) {
      grpc::AddInsecureChannelFromFd(grpc_.get(), fd);
      return;
    }
    absl::StatusOr<direct::CallHeader> call;
    if (net::ReadFull(fd, h, sizeof h, deadline).ok() && (call = direct::DecodeCall(h, 1 << 20)).ok()) {
      std::string body(call->length, '\0');
      if (net::ReadFull(fd, body.data(), body.size(), deadline).ok()) {
        const absl::Status refused = refusal_();
        const std::string message(refused.message().substr(0, direct::kMaxMessage));
        direct::EncodeReply({static_cast<uint8_t>(refused.code()), static_cast<uint32_t>(message.size()), 0}, h);
        if (net::WriteFull(fd, h, sizeof h, deadline).ok()) {
          (void)net::WriteFull(fd, message.data(), message.size(), deadline);
        }
        ::shutdown(fd, SHUT_WR);  // the reply first, then the close
      }
    }
    ::close(fd);
  }

  net::Fd listener_;
  const std::function<absl::Status()> refusal_;
  RefuseAll grpc_service_;
  std::unique_ptr<grpc::Server> grpc_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
};

HaNode::HaNode(const MasterConfig& config, Clock* clock)
    : config_(config), clock_(clock), self_(config.advertise), ttl_(config.ha_lease_ttl) {
  gate_.set_grace(kLeaseMargin * ttl_);
}

absl::StatusOr<std::unique_ptr<HaNode>> HaNode::Start(const MasterConfig& config, Clock* clock) {
  if (config.etcd.empty() || config.advertise.empty() || config.data_dir.empty()) {
    return absl::InvalidArgumentError("high availability needs --etcd, --advertise and --data-dir");
  }
  if (config.advertise.find(':') == std::string::npos || config.advertise.find(',') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--advertise '", config.advertise, "' is not one host:port"));
  }
  std::unique_ptr<HaNode> node(new HaNode(config, clock));
  // Calls to etcd get a third of the TTL at most: a keepalive stuck on a
  // stalled member leaves time for the next before the lease runs out.
  ASSIGN_OR_RETURN(node->etcd_, EtcdClient::Create(EtcdClient::SplitEndpoints(config.etcd),
                                                    std::min(absl::Seconds(1), config.ha_lease_ttl / 3)));
  RETURN_IF_ERROR(node->OpenStandby());
  node->OpenFront();
  node->lease_thread_ = std::thread([n = node.get()] { n->LeaseLoop(); });
  node->role_thread_ = std::thread([n = node.get()] { n->RoleLoop(); });
  return node;
}

HaNode::~HaNode() { Stop(); }

std::string HaNode::Key(absl::string_view name) const { return EtcdClusterKey(config_.cluster_id, name); }

void HaNode::OpenFront() {
  if (front_ != nullptr) return;
  int port = 0;
  // Under TLS the front's gRPC server binds the port itself.
  absl::StatusOr<net::Fd> listener =
      config_.tls_cert.empty() ? net::Listen(config_.listen, static_cast<int>(config_.rpc_port), &port)
                               : absl::StatusOr<net::Fd>(net::Fd());
  auto front = listener.ok() ? std::make_unique<StandbyFront>(std::move(*listener), [this] {
    const View v = view();
    return absl::UnavailableError(absl::StrCat(
        "tierkv master ", self_, ": ", kNotLeader, " (a standby of cluster ", config_.cluster_id, "); ",
        v.leader.empty() ? std::string("no leader is elected now") : absl::StrCat(kLeaderIs, v.leader)));
  }) : nullptr;
  absl::Status started = listener.status();
  if (front != nullptr) started = front->Start(config_, [this] { return StatusJson(); });
  if (!started.ok()) {
    if (!said_no_front_) {
      TKV_LOG(WARNING) << "ha: a standby answers on its ports; binding them: " << started
                       << " (tried again each round)";
      said_no_front_ = true;
    }
    return;
  }
  said_no_front_ = false;
  front_ = std::move(front);
}

absl::Status HaNode::OpenStandby() {
  std::string token;
  if (!config_.ha_token_file.empty()) {
    // Read at each start as a standby, so a rotated token is picked up then.
    ASSIGN_OR_RETURN(token, auth::ReadTokenFile(config_.ha_token_file));
  }
  // A standby calls its leader as a client would, with this master's TLS
  // files: the CA verifies the leader, and under --auth mtls the
  // certificate is who the standby is (it needs the admin role there).
  const auth::TlsFiles tls{config_.tls_ca, config_.tls_cert, config_.tls_key};
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                   MasterChannelCredentials(tls, "tierkv-master (as a standby)"));
  ASSIGN_OR_RETURN(store_, OpenRocksDbStore(config_.data_dir));
  copier_ = std::make_unique<StandbyCopier>(store_.get(), self_, StandbyCopier::kDefaultPageBytes,
                                             config_.direct_spin, std::move(token), std::move(creds), tls.enabled());
  return absl::OkStatus();
}

void HaNode::LeaseLoop() {
  // Six renewals a TTL: one that fails is tried again well before the
  // gate closes, and a lapse that etcd later confirms was harmless is short.
  const auto period = absl::ToChronoMilliseconds(ttl_ / 6);
  int failures = 0;  // in a row: only the first is logged
  MutexLock lock(&mu_);
  while (!stop_) {
    const int64_t lease = lease_;
    mu_.Unlock();
    const SteadyClock::time_point sent = SteadyClock::now();
    absl::StatusOr<EtcdLease> got = lease == 0 ? etcd_->Grant(ttl_) : etcd_->KeepAlive(lease);
    mu_.Lock();
    if (got.ok()) {
      if (failures > 0) TKV_LOG(INFO) << "ha: etcd lease renewed again after " << failures << " failed tries";
      failures = 0;
      lease_ = got->id != 0 ? got->id : lease;
      // etcd counts the TTL from when it took the call, which was after
      // `sent`; the margin covers the two clocks' rates.
      lease_until_ = sent + absl::ToChronoNanoseconds(got->ttl - kLeaseMargin * ttl_);
      // Only the lease the leader key is bound to opens the gate: after
      // it expired, a new one proves nothing about the key.
      if (leader_ && lease_ == leader_lease_) gate_.OpenUntil(lease_until_);
    } else if (absl::IsNotFound(got.status())) {
      TKV_LOG(WARNING) << "ha: etcd lease " << lease << " expired" << (leader_ ? "; no longer the leader" : "");
      lease_ = 0;
      gate_.Close();
      cv_.SignalAll();
      continue;  // a new lease at once
    } else {
      // The gate closes by itself once lease_until_ passes; until then
      // another member may answer (etcd electing a new raft leader takes
      // about a second), so the next try comes soon.
      if (failures++ == 0) TKV_LOG(WARNING) << "ha: renewing the etcd lease: " << got.status();
      cv_.WaitFor(&mu_, std::chrono::milliseconds(100));
      continue;
    }
    cv_.WaitFor(&mu_, period);
  }
}

void HaNode::RoleLoop() {
  const auto round = absl::ToChronoMilliseconds(RoundOf(ttl_));
  for (;;) {
    bool leader;
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      leader = leader_;
    }
    if (leader) {
      LeaderRound();
    } else {
      StandbyRound();
    }
    MutexLock lock(&mu_);
    if (!stop_) cv_.WaitFor(&mu_, round);
  }
}

void HaNode::LeaderRound() {
  if (!gate_.open()) {
    // The lease is unconfirmed: no answer from etcd in time (most often
    // etcd electing a raft leader, which takes a second or more). Nothing
    // is served meanwhile. A keepalive etcd answers for this same lease
    // proves the key never expired, so no other master can have led, and
    // the lease thread opens the gate again at this epoch; an expired
    // lease, or no answer for a further TTL, and it steps down.
    std::chrono::steady_clock::time_point until;
    bool same_lease;
    {
      MutexLock lock(&mu_);
      until = lease_until_;
      same_lease = lease_ == leader_lease_;
    }
    if (!same_lease) return Depose("its etcd lease expired");
    if (SteadyClock::now() >= until + absl::ToChronoNanoseconds(ttl_)) {
      return Depose("etcd has not confirmed its lease for a TTL past the lease's end");
    }
    if (!holding_) {
      TKV_LOG(WARNING) << "ha: not serving until etcd confirms the lease (it may have lapsed); still the leader "
                          "while etcd holds the key";
      holding_ = true;
      held_since_ = SteadyClock::now();
    }
    return;
  }
  if (holding_) {
    TKV_LOG(INFO) << "ha: etcd confirmed the lease; serving again at the same epoch after "
                  << absl::FormatDuration(absl::FromChrono(SteadyClock::now() - held_since_));
    holding_ = false;
    last_key_check_ = absl::InfinitePast();  // and the key is read again now
  }
  log_->UnmarkIfSynced();
  // The key itself, now and then: an operator may have deleted it.
  if (clock_->Now() - last_key_check_ < absl::Seconds(1)) return;
  last_key_check_ = clock_->Now();
  uint64_t epoch;
  {
    MutexLock lock(&mu_);
    epoch = epoch_;
  }
  absl::StatusOr<EtcdKey> key = etcd_->Get(Key("leader"));
  if (absl::IsNotFound(key.status()) || (key.ok() && static_cast<uint64_t>(key->create_revision) != epoch)) {
    Depose("its leader key is gone");
  }
}

bool HaNode::Eligible(const ReplPosition& mine) {
  own_ahead_revision_ = 0;
  // A leader that acknowledged writes no standby has: only it may lead
  // next, from its own store.
  absl::StatusOr<EtcdKey> ahead = etcd_->Get(Key("ahead"));
  if (ahead.ok()) {
    if (ahead->value == self_) {
      // Its store holds those writes only while it is a complete copy: one
      // lost, replaced or cut short by a snapshot would start the cluster
      // without them.
      if (!mine.valid) {
        if (!said_no_copy_) {
          TKV_LOG(WARNING) << "ha: not campaigning: " << Key("ahead") << " names this master, but its store is not "
                           << "a complete copy (with that store lost, delete " << Key("ahead")
                           << " in etcd to accept losing the writes only it had)";
          said_no_copy_ = true;
        }
        return false;
      }
      own_ahead_revision_ = ahead->mod_revision;
      return true;
    }
    if (!said_ahead_) {
      TKV_LOG(WARNING) << "ha: not campaigning: the last leader, " << ahead->value
                       << ", acknowledged writes no standby has; it must come back (or, with its store lost, "
                       << "delete " << Key("ahead") << " in etcd to accept losing them)";
      said_ahead_ = true;
    }
    return false;
  }
  if (!absl::IsNotFound(ahead.status())) return false;
  if (!mine.valid) {
    // No complete copy: only the first leader a cluster ever has starts
    // from whatever its store holds.
    absl::StatusOr<EtcdKey> init = etcd_->Get(Key("initialized"));
    if (!absl::IsNotFound(init.status())) {
      if (init.ok() && !said_no_copy_) {
        TKV_LOG(WARNING) << "ha: not campaigning: this master has no complete copy of the store and the cluster "
                         << "has had a leader (with every copy lost, delete " << Key("initialized")
                         << " in etcd to start the cluster afresh)";
        said_no_copy_ = true;
      }
      return false;
    }
  }
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> members = etcd_->List(Key("members/"));
  if (!members.ok()) return false;
  const std::string me = Key(absl::StrCat("members/", self_));
  for (const auto& [name, value] : *members) {
    if (name == me) continue;
    const ReplPosition theirs = ParsePosition(value);
    if (!theirs.valid) continue;
    if (!mine.valid || mine < theirs) return false;  // theirs is further along
    if (!(theirs < mine) && name < me) return false;  // as far: the first by name takes it
  }
  return true;
}

void HaNode::StandbyRound() {
  OpenFront();
  int64_t lease;
  {
    MutexLock lock(&mu_);
    lease = lease_;
  }
  if (lease == 0) return;  // nothing can be published or won without one
  const ReplPosition pos = copier_->position();
  const uint64_t streamed = copier_->streamed();
  {
    MutexLock lock(&mu_);
    copy_ = pos;
    copy_streamed_ = streamed;
  }
  (void)etcd_->Put(Key(absl::StrCat("members/", self_)), pos.valid ? EncodePosition(pos) : "", lease);
  absl::StatusOr<EtcdKey> key = etcd_->Get(Key("leader"));
  if (key.ok()) {
    leader_gone_since_ = absl::InfiniteFuture();
    if (key->value == self_) {
      // A key naming this master, which does not serve: from before a
      // restart, from a step-down whose delete failed, or from a campaign
      // etcd applied but answered late (then under this very lease, which
      // keeps it alive forever). It is no one's to serve, under any lease:
      // it goes, and the rounds after campaign again.
      (void)etcd_->DeleteIfCreatedAt(Key("leader"), key->create_revision);
      return;
    }
    copier_->Follow(key->value);
    MutexLock lock(&mu_);
    leader_address_ = key->value;
    epoch_ = static_cast<uint64_t>(key->create_revision);
    return;
  }
  if (!absl::IsNotFound(key.status())) return;  // etcd unreachable: nothing changes
  const absl::Time now = clock_->Now();
  if (leader_gone_since_ == absl::InfiniteFuture()) {
    leader_gone_since_ = now;
    return;  // a round for the others' last positions to come in
  }
  if (!Eligible(pos)) return;
  absl::StatusOr<EtcdCreate> won = etcd_->CreateIfAbsent(Key("leader"), self_, lease);
  if (!won.ok() || !won->created) return;
  Promote(won->key.create_revision, lease, pos.valid);
}

void HaNode::Promote(int64_t epoch, int64_t lease, bool had_copy) {
  TKV_LOG(INFO) << "ha: elected leader of " << config_.cluster_id << " at epoch " << epoch;
  // The standby's answers stop first. Its RPC listener goes to the server
  // as it is: connections made meanwhile wait in its backlog, none is
  // refused.
  net::Fd listener = front_ != nullptr ? front_->Release() : net::Fd();
  front_.reset();
  copier_->Stop();
  copier_.reset();
  if (had_copy && !ReadPosition(store_.get()).valid) {
    // A snapshot began between the campaign and now: the copy is not whole.
    {
      MutexLock lock(&mu_);
      epoch_ = static_cast<uint64_t>(epoch);
    }
    listener = net::Fd();  // the standby binds it again
    Depose("its copy of the store became incomplete while it campaigned");
    return;
  }
  // From here on the cluster has had a leader, so a standby without a
  // complete copy must never start it afresh: that is recorded before
  // anything is served, or the takeover fails (and is tried again by a
  // later campaign), with this store still the copy it was.
  const absl::Status initialized = TIERKV_FAILPOINT("master.ha.initialized")
                                       ? absl::UnavailableError("failpoint master.ha.initialized")
                                       : etcd_->Put(Key("initialized"), "1");
  if (!initialized.ok()) {
    TKV_LOG(ERROR) << "ha: cannot record " << Key("initialized") << " in etcd: " << initialized;
    {
      MutexLock lock(&mu_);
      epoch_ = static_cast<uint64_t>(epoch);
    }
    listener = net::Fd();  // the standby binds it again
    Depose("the cluster's first leader could not be recorded in etcd");
    return;
  }
  const auto started = SteadyClock::now();
  // This epoch's batches start from the store as it is now.
  absl::Status marked = store_->Write({{kHaPositionKey, EncodePosition({static_cast<uint64_t>(epoch), 0, true}), false},
                                       {kHaSnapshotKey, "", true}});
  ReplicationOptions ro;
  ro.epoch = static_cast<uint64_t>(epoch);
  ro.semi_sync = config_.ha_sync == "semi";
  ro.sync_timeout = config_.ha_sync_timeout;
  ro.caught_up = [this] { cv_.SignalAll(); };  // the role thread clears the mark now
  ro.spin = config_.direct_spin;
  ro.mark_ahead = [this] { return etcd_->PutRevision(Key("ahead"), self_); };
  ro.unmark_ahead = [this](int64_t revision) { return etcd_->DeleteIfModifiedAt(Key("ahead"), revision); };
  ro.ahead_revision = own_ahead_revision_;  // this master's mark from an earlier term, if it campaigned on one
  log_ = std::make_unique<ReplicationLog>(ro, store_.get());
  {
    MutexLock lock(&mu_);
    leader_ = true;
    epoch_ = static_cast<uint64_t>(epoch);
    leader_address_ = self_;
    leader_lease_ = lease;
    if (lease_ == lease) gate_.OpenUntil(lease_until_);  // else the round after deposes it
  }
  absl::StatusOr<std::unique_ptr<MasterServer>> server = absl::InternalError("not started");
  if (marked.ok()) {
    store_->SetReplicator(log_.get());
    server = MasterServer::Start(config_, clock_,
                                 {std::move(store_), log_.get(), &gate_, [this] { return StatusJson(); },
                                  static_cast<uint64_t>(epoch), std::move(listener)});
  } else {
    server = marked;
  }
  if (!server.ok()) {
    TKV_LOG(ERROR) << "ha: cannot serve as the leader: " << server.status();
    Depose("its server did not start");
    return;
  }
  server_ = std::move(*server);
  MutexLock lock(&mu_);
  rpc_port_ = server_->rpc_port();
  http_port_ = server_->http_port();
  TKV_LOG(INFO) << "ha: serving as the leader " << absl::FormatDuration(absl::FromChrono(SteadyClock::now() - started))
                << " after the election; rpc=" << rpc_port_ << " http=" << http_port_;
}

void HaNode::Depose(absl::string_view why) {
  TKV_LOG(WARNING) << "ha: stepping down: " << why;
  gate_.Close();
  holding_ = false;
  if (log_ != nullptr) log_->Close();
  uint64_t epoch;
  {
    MutexLock lock(&mu_);
    epoch = epoch_;
    leader_ = false;
    leader_address_.clear();
    rpc_port_ = http_port_ = 0;
  }
  // A successor need not wait for the key to expire (only ours is deleted).
  (void)etcd_->DeleteIfCreatedAt(Key("leader"), static_cast<int64_t>(epoch));
  if (server_ != nullptr) server_->Shutdown();
  server_.reset();  // closes the store
  store_.reset();
  log_.reset();
  leader_gone_since_ = absl::InfiniteFuture();
  OpenFront();
  for (;;) {
    absl::Status s = OpenStandby();
    if (s.ok()) return;
    TKV_LOG(ERROR) << "ha: reopening the store as a standby: " << s;
    MutexLock lock(&mu_);
    if (stop_) return;
    cv_.WaitFor(&mu_, std::chrono::seconds(1));
  }
}

void HaNode::Stop() {
  {
    MutexLock lock(&mu_);
    if (stop_ && !role_thread_.joinable()) return;
    stop_ = true;
    cv_.SignalAll();
  }
  if (role_thread_.joinable()) role_thread_.join();
  if (lease_thread_.joinable()) lease_thread_.join();
  bool leader;
  int64_t lease;
  {
    MutexLock lock(&mu_);
    leader = leader_;
    lease = lease_;
  }
  if (leader) Depose("stopping");
  if (copier_ != nullptr) copier_->Stop();
  copier_.reset();
  store_.reset();
  front_.reset();
  // Our member key goes with the lease, and a standby need not wait out the TTL.
  if (lease != 0) (void)etcd_->Revoke(lease);
}

absl::Status HaNode::ReloadAuth() {
  // Called from the signal thread while the role thread may swap servers;
  // the token file is read again when the next leader's server starts.
  MutexLock lock(&mu_);
  return leader_ && server_ != nullptr ? server_->ReloadAuth() : absl::OkStatus();
}

HaNode::View HaNode::view() {
  View v;
  MutexLock lock(&mu_);
  v.role = leader_ ? "leader" : "standby";
  v.epoch = epoch_;
  v.leader = leader_address_;
  v.rpc_port = rpc_port_;
  v.http_port = http_port_;
  return v;
}

std::string HaNode::StatusJson() {
  const View v = view();
  nlohmann::json j{{"role", v.role}, {"serving", v.role == "leader" && gate_.open()},
                   {"epoch", v.epoch}, {"leader", v.leader}, {"self", self_},
                   {"cluster_id", config_.cluster_id}, {"lease_ttl_seconds", absl::ToDoubleSeconds(ttl_)}};
  if (log_ != nullptr) {
    const ReplicationState s = log_->State();
    j["sync"] = s.sync;
    j["last_seq"] = s.last_seq;
    j["degraded_writes"] = s.degraded_writes;
    nlohmann::json standbys = nlohmann::json::array();
    for (const StandbyInfo& sb : s.standbys) {
      standbys.push_back({{"name", sb.name},
                          {"acked_seq", sb.acked},
                          {"lag_batches", sb.snapshotting ? s.last_seq : s.last_seq - std::min(s.last_seq, sb.acked)},
                          {"snapshotting", sb.snapshotting},
                          {"last_seen_seconds_ago", absl::ToDoubleSeconds(absl::Now() - sb.last_seen)}});
    }
    j["standbys"] = std::move(standbys);
  } else {
    MutexLock lock(&mu_);
    // How far behind it is shows on the leader's /v1/ha (its standbys).
    j["copy"] = {{"complete", copy_.valid},
                 {"epoch", copy_.epoch},
                 {"seq", copy_.seq},
                 {"streamed_batches", copy_streamed_}};
  }
  // Addresses come from etcd's values, which need not be UTF-8.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace tierkv::master
