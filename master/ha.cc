#include "master/ha.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "config/base/log.h"
#include "config/base/status.h"
#include "nlohmann/json.hpp"

namespace tierkv::master {

namespace {

using SteadyClock = std::chrono::steady_clock;

// How often a master looks at the leader key (and a leader at its gate).
absl::Duration RoundOf(absl::Duration ttl) { return std::clamp(ttl / 30, absl::Milliseconds(50), absl::Milliseconds(100)); }

}  // namespace

HaNode::HaNode(const MasterConfig& config, Clock* clock)
    : config_(config), clock_(clock), self_(config.advertise), ttl_(config.ha_lease_ttl) {}

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
  node->lease_thread_ = std::thread([n = node.get()] { n->LeaseLoop(); });
  node->role_thread_ = std::thread([n = node.get()] { n->RoleLoop(); });
  return node;
}

HaNode::~HaNode() { Stop(); }

std::string HaNode::Key(absl::string_view name) const { return EtcdClusterKey(config_.cluster_id, name); }

absl::Status HaNode::OpenStandby() {
  ASSIGN_OR_RETURN(store_, OpenRocksDbStore(config_.data_dir));
  copier_ = std::make_unique<StandbyCopier>(store_.get(), self_);
  return absl::OkStatus();
}

void HaNode::LeaseLoop() {
  const auto period = absl::ToChronoMilliseconds(ttl_ / 4);
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
      lease_until_ = sent + absl::ToChronoNanoseconds(got->ttl - ttl_ / 3);
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
  if (!gate_.open()) return Depose("its etcd lease may have lapsed");
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
  // A leader that acknowledged writes no standby has: only it may lead
  // next, from its own store.
  absl::StatusOr<EtcdKey> ahead = etcd_->Get(Key("ahead"));
  if (ahead.ok()) {
    if (ahead->value == self_) return true;
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
  int64_t lease;
  {
    MutexLock lock(&mu_);
    lease = lease_;
  }
  if (lease == 0) return;  // nothing can be published or won without one
  const ReplPosition pos = copier_->position();
  (void)etcd_->Put(Key(absl::StrCat("members/", self_)), pos.valid ? EncodePosition(pos) : "", lease);
  absl::StatusOr<EtcdKey> key = etcd_->Get(Key("leader"));
  if (key.ok()) {
    leader_gone_since_ = absl::InfiniteFuture();
    if (key->value == self_) {
      // Our own key from before a restart: it is no one's to serve.
      if (key->lease != lease) (void)etcd_->DeleteIfCreatedAt(Key("leader"), key->create_revision);
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
  copier_->Stop();
  copier_.reset();
  if (had_copy && !ReadPosition(store_.get()).valid) {
    // A snapshot began between the campaign and now: the copy is not whole.
    {
      MutexLock lock(&mu_);
      epoch_ = static_cast<uint64_t>(epoch);
    }
    Depose("its copy of the store became incomplete while it campaigned");
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
  ro.mark_ahead = [this](bool ahead) {
    return ahead ? etcd_->Put(Key("ahead"), self_) : etcd_->DeleteIfValue(Key("ahead"), self_);
  };
  log_ = std::make_unique<ReplicationLog>(ro, store_.get());
  {
    MutexLock lock(&mu_);
    leader_ = true;
    epoch_ = static_cast<uint64_t>(epoch);
    leader_address_ = self_;
    leader_lease_ = lease;
    if (lease_ == lease) gate_.OpenUntil(lease_until_);  // else the round after deposes it
  }
  (void)etcd_->Put(Key("initialized"), "1");
  absl::StatusOr<std::unique_ptr<MasterServer>> server = absl::InternalError("not started");
  if (marked.ok()) {
    store_->SetReplicator(log_.get());
    server = MasterServer::Start(config_, clock_,
                                 {std::move(store_), log_.get(), &gate_, [this] { return StatusJson(); },
                                  static_cast<uint64_t>(epoch)});
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
  nlohmann::json j{{"role", v.role}, {"epoch", v.epoch}, {"leader", v.leader}, {"self", self_},
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
  }
  return j.dump();
}

}  // namespace tierkv::master
