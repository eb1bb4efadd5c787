// The fixture of the high-availability tests (ha_test.cc,
// ha_failover_test.cc, ha_etcd_test.cc): a real etcd, masters of one
// cluster, a daemon and clients given every master, a writer that records
// what was acknowledged and when, and a prober of one master's answers.
// Skips, saying why, where etcd is not installed (scripts/install-deps.sh
// installs Debian's etcd-server).
#pragma once

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/auth.h"
#include "base/net/socket.h"
#include "base/status.h"
#include "client/client.h"
#include "client/master_client.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "proto/etcd_client.h"
#include "proto/master.grpc.pb.h"
#include "tests/support/fault_proxy.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/values.h"
#include "tests/support/wait.h"

namespace tierkv::integration {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::FaultProxy;
using testing::MakeTempDir;
using testing::Payload;
using testing::StaysFalse;
using testing::WaitFor;
using json = nlohmann::json;

inline constexpr char kEtcd[] = "/usr/bin/etcd";
inline constexpr size_t kValueBytes = 8192;

// Over HTTPS when given TLS files (masters with --tls-cert).
inline absl::StatusOr<json> GetJson(const std::string& host, int port, const std::string& path,
                                    const std::string& token = "", const auth::TlsFiles& tls = {}) {
  ASSIGN_OR_RETURN(auto cli, auth::NewHttpClient(absl::StrCat(tls.enabled() ? "https://" : "http://", host, ":", port),
                                                 tls, absl::Seconds(2)));
  cli->set_connection_timeout(1);
  if (!token.empty()) cli->set_bearer_token_auth(token);
  auto res = cli->Get(path);
  if (!res) return absl::UnavailableError(httplib::to_string(res.error()));
  if (res->status != 200) return absl::UnknownError(absl::StrCat("HTTP ", res->status, ": ", res->body));
  json j = json::parse(res->body, nullptr, false);
  if (j.is_discarded()) return absl::InternalError("not JSON: " + res->body);
  return j;
}

// An etcd cluster of `members` processes on loopback.
class Etcd {
 public:
  static absl::StatusOr<std::unique_ptr<Etcd>> Start(int members, const std::string& dir) {
    auto e = std::unique_ptr<Etcd>(new Etcd());
    std::vector<std::string> peers;
    for (int i = 0; i < members; ++i) {
      e->client_ports_.push_back(net::FreeLoopbackPort());
      e->peer_ports_.push_back(net::FreeLoopbackPort());
      peers.push_back(absl::StrCat("m", i, "=http://127.0.0.1:", e->peer_ports_[i]));
    }
    for (int i = 0; i < members; ++i) {
      const std::string client = absl::StrCat("http://127.0.0.1:", e->client_ports_[i]);
      const std::string peer = absl::StrCat("http://127.0.0.1:", e->peer_ports_[i]);
      // Short raft timeouts: a stopped member is replaced within a second.
      const std::string cmd = absl::StrCat(
          "echo listening port=", e->client_ports_[i], "; exec ", kEtcd, " --name m", i, " --data-dir ", dir, "/etcd", i,
          " --listen-client-urls ", client, " --advertise-client-urls ", client, " --listen-peer-urls ", peer,
          " --initial-advertise-peer-urls ", peer, " --initial-cluster ", absl::StrJoin(peers, ","),
          " --initial-cluster-state new --initial-cluster-token tierkv-test",
          " --heartbeat-interval 50 --election-timeout 500 --log-level warn");
      ASSIGN_OR_RETURN(auto p, ChildProcess::Start("/bin/sh", {"-c", cmd}));
      e->members_.push_back(std::move(p));
    }
    // Every member answers /health once the cluster has a raft leader.
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    for (int i = 0; i < members; ++i) {
      RETURN_IF_ERROR(WaitFor(absl::StrCat("etcd member ", i, " to be healthy"), deadline - absl::Now(), [&] {
        absl::StatusOr<json> h = GetJson("127.0.0.1", e->client_ports_[i], "/health");
        return h.ok() && h->value("health", "") == "true";
      }));
    }
    return e;
  }
  std::string endpoints() const {
    std::vector<std::string> out;
    for (int p : client_ports_) out.push_back(absl::StrCat("127.0.0.1:", p));
    return absl::StrJoin(out, ",");
  }
  int client_port(int i) const { return client_ports_[i]; }
  ChildProcess& member(int i) { return *members_[i]; }
  // The member that is etcd's raft leader (its maintenance status, over
  // etcd's JSON gateway), or an error.
  absl::StatusOr<int> raft_leader() const {
    for (size_t i = 0; i < client_ports_.size(); ++i) {
      httplib::Client cli("127.0.0.1", client_ports_[i]);
      cli.set_connection_timeout(1);
      cli.set_read_timeout(2);
      httplib::Result res = cli.Post("/v3/maintenance/status", "{}", "application/json");
      if (!res || res->status != 200) continue;
      json j = json::parse(res->body, nullptr, false);
      if (j.is_discarded() || !j.contains("leader") || !j.contains("header")) continue;
      if (j["leader"] == j["header"]["member_id"]) return static_cast<int>(i);
    }
    return absl::UnavailableError("no etcd member says it is the raft leader");
  }

 private:
  std::vector<int> client_ports_, peer_ports_;
  std::vector<std::unique_ptr<ChildProcess>> members_;
};

class HaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kEtcd, X_OK) != 0) GTEST_SKIP() << kEtcd << " is not installed (Debian etcd-server)";
    dir_ = MakeTempDir("tierkv-ha");
  }
  void TearDown() override {
    daemons_.clear();
    masters_.clear();
    etcd_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void StartEtcd(int members = 1) {
    auto e = Etcd::Start(members, dir_);
    ASSERT_TRUE(e.ok()) << e.status();
    etcd_ = std::move(*e);
  }

  // Picks master i's host and ports (and those of the masters before it),
  // once: kept across restarts.
  void ReserveMaster(int i) {
    while (static_cast<int>(masters_.size()) <= i) {
      const int n = static_cast<int>(masters_.size());
      masters_.emplace_back();
      hosts_.push_back(hosts_apart_ ? absl::StrCat("127.0.0.", 2 + n) : "127.0.0.1");
      rpc_.push_back(hosts_apart_ && n > 0 ? rpc_[0] : net::FreeLoopbackPort());
      http_.push_back(hosts_apart_ && n > 0 ? http_[0] : net::FreeLoopbackPort());
    }
  }
  // Master i's --advertise (its name in etcd), known before it starts.
  std::string Advertised(int i) {
    ReserveMaster(i);
    return absl::StrCat(hosts_[i], ":", rpc_[i]);
  }

  // Master i: ports picked once, kept across restarts. `etcd` replaces the
  // cluster's endpoints (a proxy in front of them). With `hosts_apart_`
  // master i is host 127.0.0.<2+i> and all use the same two ports, as
  // masters on hosts of their own do. `env`: extra environment (failpoints).
  void StartMaster(int i, std::vector<std::string> flags = {}, const std::string& etcd = "",
                   const std::map<std::string, std::string>& env = {}) {
    ReserveMaster(i);
    std::vector<std::string> args{"--etcd=" + (etcd.empty() ? etcd_->endpoints() : etcd),
                                  "--cluster-id=test",
                                  "--listen=" + hosts_[i],
                                  absl::StrCat("--advertise=", hosts_[i], ":", rpc_[i]),
                                  absl::StrCat("--rpc-port=", rpc_[i]),
                                  absl::StrCat("--http-port=", http_[i]),
                                  absl::StrCat("--data-dir=", dir_, "/master", i),
                                  "--ha-lease-ttl=2s",
                                  "--segment-ttl=10s",
                                  "--check-interval=100ms"};
    args.insert(args.end(), flags.begin(), flags.end());
    masters_[i].reset();
    auto m = ChildProcess::Start(BinaryPath("tierkv-master"), args, env);
    ASSERT_TRUE(m.ok()) << m.status();
    masters_[i] = std::move(*m);
  }

  std::string MasterList() const {
    std::vector<std::string> out;
    for (size_t i = 0; i < rpc_.size(); ++i) out.push_back(absl::StrCat(hosts_[i], ":", rpc_[i]));
    return absl::StrJoin(out, ",");
  }
  std::string MetadataList() const {
    std::vector<std::string> out;
    for (size_t i = 0; i < http_.size(); ++i) {
      out.push_back(absl::StrCat(http_tls_.enabled() ? "https://" : "http://", hosts_[i], ":", http_[i]));
    }
    return absl::StrJoin(out, ",");
  }

  // `where`: how the daemon is told of the masters (default: the list of
  // masters and their metadata URLs).
  void StartDaemon(std::vector<std::string> where = {}) {
    if (where.empty()) where = {"--master=" + MasterList(), "--metadata=" + MetadataList()};
    std::vector<std::string> args = {"--segment-size=64mib", "--port=0", "--http-port=0", "--heartbeat-interval=200ms",
                                     absl::StrCat("--name=daemon-", daemons_.size())};
    args.insert(args.end(), where.begin(), where.end());
    auto d = ChildProcess::Start(BinaryPath("tierkv-store"), args);
    ASSERT_TRUE(d.ok()) << d.status();
    daemons_.push_back(std::move(*d));
  }

  // `rpc_timeout`: the client's call timeout, when not the library's.
  std::unique_ptr<client::Client> NewClient(absl::Duration rpc_timeout = absl::ZeroDuration()) {
    client::ClientOptions o;
    o.master = MasterList();
    o.metadata = MetadataList();
    o.tls = http_tls_;
    o.transfer_timeout = absl::Seconds(10);
    if (rpc_timeout > absl::ZeroDuration()) o.rpc_timeout = rpc_timeout;
    auto c = client::Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::unique_ptr<client::Client> NewClientWithToken(const std::string& token) {
    client::ClientOptions o;
    o.master = MasterList();
    o.metadata = MetadataList();
    o.token = token;
    auto c = client::Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // /v1/ha of master i (an error while it is not serving).
  absl::StatusOr<json> Ha(int i) { return GetJson(hosts_[i], http_[i], "/v1/ha", http_token_, http_tls_); }

  // The master that serves as the leader now (the first found, not
  // `not_this`), or -1.
  int LeaderNow(int not_this = -1) {
    for (size_t i = 0; i < masters_.size(); ++i) {
      if (static_cast<int>(i) == not_this || masters_[i] == nullptr) continue;
      absl::StatusOr<json> h = Ha(static_cast<int>(i));
      if (h.ok() && h->value("role", "") == "leader") return static_cast<int>(i);
    }
    return -1;
  }

  // The master that serves as the leader (one only), within `timeout`; -1
  // if none does.
  int WaitForLeader(absl::Duration timeout = absl::Seconds(20), int not_this = -1) {
    int leader = -1;
    (void)WaitFor("a leader", timeout, [&] { return (leader = LeaderNow(not_this)) >= 0; });
    return leader;
  }

  // Until the leader waits for its standbys again (semi-sync) and
  // `standbys` of them have every batch.
  absl::Status WaitForSynced(int leader, int standbys, absl::Duration timeout = absl::Seconds(20)) {
    return WaitFor(absl::StrCat(standbys, " standbys of master ", leader, " to have every batch (semi-sync)"), timeout,
                   [&] {
                     absl::StatusOr<json> h = Ha(leader);
                     if (!h.ok() || h->value("sync", "") != "semi-sync") return false;
                     int caught_up = 0;
                     for (const json& s : (*h)["standbys"]) {
                       caught_up += !s.value("snapshotting", true) && s.value("lag_batches", 1) == 0 &&
                                    s.value("last_seen_seconds_ago", 99.0) < 1.0;
                     }
                     return caught_up >= standbys;
                   });
  }

  absl::Status WaitForLiveSegments(int leader, size_t n, absl::Duration timeout = absl::Seconds(20)) {
    return WaitFor(absl::StrCat(n, " segments live at master ", leader), timeout, [&] {
      absl::StatusOr<json> segs = GetJson(hosts_[leader], http_[leader], "/v1/segments", http_token_, http_tls_);
      if (!segs.ok() || !segs->is_array()) return false;
      size_t live = 0;
      for (const json& s : *segs) live += s.value("state", "") == "live";
      return live == n;
    });
  }

  // A sample of master i's /metrics (`name` with its labels, as exposed);
  // -1 when absent or unreadable.
  double Metric(int i, const std::string& name) {
    absl::StatusOr<std::unique_ptr<httplib::Client>> cli = auth::NewHttpClient(
        absl::StrCat(http_tls_.enabled() ? "https://" : "http://", hosts_[i], ":", http_[i]), http_tls_,
        absl::Seconds(2));
    if (!cli.ok()) return -1;
    if (!http_token_.empty()) (*cli)->set_bearer_token_auth(http_token_);
    httplib::Result res = (*cli)->Get("/metrics");
    if (!res || res->status != 200) return -1;
    const size_t at = res->body.find("\n" + name + " ");
    return at == std::string::npos ? -1 : std::strtod(res->body.c_str() + at + name.size() + 2, nullptr);
  }

  // etcd (`etcd_members`), two masters given `flags`, a leader whose
  // standby has caught up, and a daemon live at it: the leader's index, or
  // -1 with the failure recorded.
  int StartGroup(int etcd_members = 1, const std::vector<std::string>& flags = {}) {
    StartEtcd(etcd_members);
    if (HasFatalFailure()) return -1;
    StartMaster(0, flags);
    StartMaster(1, flags);
    if (HasFatalFailure()) return -1;
    const int leader = WaitForLeader();
    if (leader < 0 || !WaitForSynced(leader, 1).ok()) {
      ADD_FAILURE() << "no leader with a standby caught up\n" << Logs();
      return -1;
    }
    StartDaemon();
    if (HasFatalFailure()) return -1;
    if (!WaitForLiveSegments(leader, 1).ok()) {
      ADD_FAILURE() << "the daemon did not mount at the leader\n" << Logs();
      return -1;
    }
    return leader;
  }

  std::string Logs() {
    std::string out;
    for (size_t i = 0; i < masters_.size(); ++i) {
      if (masters_[i]) absl::StrAppend(&out, "--- master ", i, "\n", masters_[i]->Stderr());
    }
    for (size_t i = 0; i < daemons_.size(); ++i) absl::StrAppend(&out, "--- daemon ", i, "\n", daemons_[i]->Stderr());
    return out;
  }

  // Checks every acknowledged key reads back byte-identical.
  void ExpectAllReadable(client::Client* c, const std::vector<std::string>& keys) {
    size_t missing = 0, wrong = 0;
    for (const std::string& k : keys) {
      absl::StatusOr<std::string> v = c->Get(k);
      if (!v.ok()) {
        if (missing++ < 5) ADD_FAILURE() << k << ": " << v.status();
      } else if (*v != Payload(k, kValueBytes)) {
        ++wrong;
      }
    }
    EXPECT_EQ(missing, 0u) << "of " << keys.size() << " acknowledged puts\n" << Logs();
    EXPECT_EQ(wrong, 0u) << "of " << keys.size() << " acknowledged puts";
  }

  std::string dir_;
  std::unique_ptr<Etcd> etcd_;
  std::vector<std::unique_ptr<ChildProcess>> masters_;
  std::vector<int> rpc_, http_;
  std::vector<std::string> hosts_;
  bool hosts_apart_ = false;
  std::string http_token_;  // sent to the masters' HTTP ports (under --auth token)
  auth::TlsFiles http_tls_;  // presented to the masters' ports (with --tls-cert), and by NewClient
  std::vector<std::unique_ptr<ChildProcess>> daemons_;
};

// Puts distinct keys from one thread until told to stop (or `max` puts),
// keeping the acknowledged ones and when each was acknowledged.
class Writer {
 public:
  // `pause` between puts keeps a long test within the cluster's memory.
  Writer(client::Client* c, std::string prefix, int max = 4000, absl::Duration pause = absl::ZeroDuration())
      : c_(c), prefix_(std::move(prefix)), max_(max), pause_(pause) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Writer() { Stop(); }
  void Stop() {
    if (!stop_.HasBeenNotified()) stop_.Notify();
    if (thread_.joinable()) thread_.join();
  }
  size_t acked() {
    std::lock_guard<std::mutex> l(mu_);
    return keys_.size();
  }
  // When the first put begun after `t` was acknowledged (one begun before
  // may have had its answer on the way when the leader died), or
  // InfiniteFuture.
  absl::Time FirstAckAfter(absl::Time t) {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < begun_.size(); ++i) {
      if (begun_[i] > t) return times_[i];
    }
    return absl::InfiniteFuture();
  }
  std::vector<std::string> keys() {
    std::lock_guard<std::mutex> l(mu_);
    return keys_;
  }
  int failed() const { return failed_.load(); }

 private:
  void Run() {
    for (int i = 0; i < max_ && !stop_.HasBeenNotified(); ++i) {
      const std::string key = absl::StrCat(prefix_, "-", i);
      const absl::Time begun = absl::Now();
      absl::Status s = c_->Put(key, Payload(key, kValueBytes));
      if (s.ok()) {
        std::lock_guard<std::mutex> l(mu_);
        keys_.push_back(key);
        begun_.push_back(begun);
        times_.push_back(absl::Now());
      } else {
        // The first few, so a run that fails some says why.
        if (failed_.fetch_add(1) < 5) {
          std::printf("writer %s: put %s failed after %.0f ms: %s\n", prefix_.c_str(), key.c_str(),
                      absl::ToDoubleMilliseconds(absl::Now() - begun), s.ToString().c_str());
        }
        // No leader to take it (a failover): the next put after a pause.
        if (stop_.WaitForNotificationWithTimeout(absl::Milliseconds(20))) break;
      }
      // Pacing, ended at once by Stop.
      if (pause_ > absl::ZeroDuration() && stop_.WaitForNotificationWithTimeout(pause_)) break;
    }
  }
  client::Client* const c_;
  const std::string prefix_;
  const int max_;
  const absl::Duration pause_;
  absl::Notification stop_;
  std::atomic<int> failed_{0};
  std::mutex mu_;
  std::vector<std::string> keys_;
  std::vector<absl::Time> begun_, times_;  // of each acknowledged put
  std::thread thread_;
};

// Calls Stats on one master alone every few milliseconds, keeping when
// it last and first answered OK. Over a bare gRPC stub: a MasterClient
// would follow a standby's refusal to the leader it names.
class Prober {
 public:
  explicit Prober(int rpc_port)
      : stub_(v1::Master::NewStub(
            grpc::CreateChannel(absl::StrCat("127.0.0.1:", rpc_port), grpc::InsecureChannelCredentials()))) {
    thread_ = std::thread([this] {
      do {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
        v1::StatsRequest req;
        v1::StatsResponse resp;
        const bool ok = stub_->Stats(&ctx, req, &resp).ok();
        const absl::Time t = absl::Now();
        std::lock_guard<std::mutex> l(mu_);
        if (ok) {
          if (first_ok_ == absl::InfiniteFuture()) first_ok_ = t;
          last_ok_ = t;
          ++oks_;
        }
        ++probes_;
        // The next probe in 5 ms, or none once stopped.
      } while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(5)));
    });
  }
  ~Prober() { Stop(); }
  void Stop() {
    if (!stop_.HasBeenNotified()) stop_.Notify();
    if (thread_.joinable()) thread_.join();
  }
  absl::Time first_ok() {
    std::lock_guard<std::mutex> l(mu_);
    return first_ok_;
  }
  absl::Time last_ok() {
    std::lock_guard<std::mutex> l(mu_);
    return last_ok_;
  }
  int oks() {
    std::lock_guard<std::mutex> l(mu_);
    return oks_;
  }
  // Probes made, answered or not.
  int probes() {
    std::lock_guard<std::mutex> l(mu_);
    return probes_;
  }

 private:
  std::unique_ptr<v1::Master::Stub> stub_;
  absl::Notification stop_;
  std::mutex mu_;
  absl::Time first_ok_ = absl::InfiniteFuture();
  absl::Time last_ok_ = absl::InfinitePast();
  int oks_ = 0;
  int probes_ = 0;
  std::thread thread_;
};

// `condition`, asked at most once a `period` and answering its last answer
// in between: StaysFalse polls every millisecond, and these conditions ask
// the masters over HTTP.
inline std::function<bool()> Throttled(std::function<bool()> condition,
                                       absl::Duration period = absl::Milliseconds(50)) {
  return [condition = std::move(condition), period, next = absl::InfinitePast(), last = false]() mutable {
    if (absl::Now() >= next) {
      last = condition();
      next = absl::Now() + period;
    }
    return last;
  };
}

}  // namespace tierkv::integration
