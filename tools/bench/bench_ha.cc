// tierkv-bench master --ha: the figures of master high availability
// (docs/ha.md), in one run, against a real etcd started here (Debian's
// etcd-server):
//   - put rate of a semi-synchronous leader and standby, and of an
//     asynchronous pair, against a single master on the same kind of
//     store, alternated, same threads;
//   - failover: --ha-kills SIGKILLs of the leader (tierkv-master processes;
//     each killed master is restarted and caught up as a standby before the
//     next kill), the time from each kill to the first put acknowledged
//     after it (p50, p99), and the acknowledged puts the index lost (a
//     put caught by a failover is put again, as the client library does);
//   - promotion: for each --ha-objects size, the time from an election won
//     to serving (the index recovered from the standby's copy).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/master_client.h"
#include "config/flags.h"
#include "config/master_config.h"
#include "httplib.h"
#include "master/ha.h"
#include "master/server.h"
#include "nlohmann/json.hpp"
#include "tools/bench/harness.h"
#include "base/net/socket.h"
#include "tools/bench/subcommands.h"

extern char** environ;

namespace tierkv::bench {
namespace {

using json = nlohmann::json;

constexpr char kEtcd[] = "/usr/bin/etcd";
constexpr uint64_t kValue = 64 << 10;

// A child process with its output in `log`; SIGKILLed when dropped.
class Child {
 public:
  static absl::StatusOr<std::unique_ptr<Child>> Spawn(const std::string& binary, std::vector<std::string> args,
                                                      const std::string& log) {
    std::vector<char*> argv;
    args.insert(args.begin(), binary);
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    auto c = std::unique_ptr<Child>(new Child());
    const int rc = posix_spawn(&c->pid_, binary.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return absl::UnavailableError(absl::StrCat("cannot start ", binary, ": ", strerror(rc)));
    return c;
  }
  ~Child() { Kill(SIGKILL); }
  void Kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    if (sig == SIGKILL || sig == SIGTERM) {
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

 private:
  Child() = default;
  pid_t pid_ = -1;
};

absl::StatusOr<json> GetJson(int port, const std::string& path) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(1);
  cli.set_read_timeout(2);
  auto res = cli.Get(path);
  if (!res) return absl::UnavailableError(httplib::to_string(res.error()));
  json j = json::parse(res->body, nullptr, false);
  if (res->status != 200 || j.is_discarded()) return absl::UnknownError(absl::StrCat("HTTP ", res->status));
  return j;
}

bool WaitFor(const std::function<bool()>& cond, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    if (cond()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// A leader whose writes wait for a standby again, which has every batch.
bool Synced(const json& ha) {
  const std::string sync = ha.value("sync", "");
  if (ha.value("role", "") != "leader" || (sync != "semi-sync" && sync != "async")) return false;
  for (const json& s : ha["standbys"]) {
    if (!s.value("snapshotting", true) && s.value("lag_batches", 1) == 0 && s.value("last_seen_seconds_ago", 9.0) < 1) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<MasterConfig> Config(std::vector<std::string> flags) {
  flags.insert(flags.begin(), "tierkv-master");
  flags.push_back("--segment-ttl=86400s");  // the bench's segment sends no heartbeats
  std::vector<const char*> argv;
  for (const std::string& f : flags) argv.push_back(f.c_str());
  return MasterFlags().Parse(static_cast<int>(argv.size()), argv.data(), nullptr,
                             [](const char*) -> const char* { return nullptr; });
}

v1::Segment BenchSegment() {
  v1::Segment s;
  s.set_name("bench-ha-seg");
  s.set_host("bench-host");
  s.set_capacity(uint64_t{1} << 44);
  s.set_incarnation("bench");
  return s;
}

// One key's put (PutStart, PutEnd) on `mc`: OK once acknowledged.
absl::Status PutOne(client::MasterClient* mc, const std::string& key) {
  v1::PutStartRequest req;
  auto* item = req.add_items();
  item->set_key(key);
  item->set_size(kValue);
  absl::StatusOr<v1::PutStartResponse> r1 = mc->PutStart(req);
  if (!r1.ok()) return r1.status();
  if (const auto& st = r1->results(0).status(); st.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(st.code()), st.message());
  }
  absl::StatusOr<v1::KeysResponse> r2 = mc->PutEnd({key});
  if (!r2.ok()) return r2.status();
  if (const auto& st = r2->status(0); st.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(st.code()), st.message());
  }
  return absl::OkStatus();
}

// Puts per second from `threads` clients of `address` for `seconds`.
double PutRate(const std::string& address, int threads, absl::Duration seconds, const std::string& tag) {
  std::atomic<uint64_t> done{0};
  std::atomic<bool> failed{false};
  std::vector<std::thread> workers;
  const absl::Time start = absl::Now();
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      auto mc = client::MasterClient::Create(address);
      if (!mc.ok()) {
        failed = true;
        return;
      }
      for (uint64_t i = 0; absl::Now() - start < seconds; ++i) {
        if (!PutOne(mc->get(), absl::StrCat("rate-", tag, "-", t, "-", i)).ok()) {
          failed = true;
          return;
        }
        done.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  for (std::thread& w : workers) w.join();
  if (failed) return -1;
  return static_cast<double>(done.load()) / absl::ToDoubleSeconds(absl::Now() - start);
}

struct Run {
  std::string dir;
  std::string bin;  // the directory holding tierkv-master
  std::unique_ptr<Child> etcd;
  std::string etcd_endpoint;
  std::string direct_spin;  // "--direct-spin=...", for every master started
};

absl::Status StartEtcd(Run* run) {
  const int client = net::FreeLoopbackPort(), peer = net::FreeLoopbackPort();
  run->etcd_endpoint = absl::StrCat("127.0.0.1:", client);
  ASSIGN_OR_RETURN(run->etcd,
                   Child::Spawn(kEtcd,
                                {"--data-dir", run->dir + "/etcd", "--listen-client-urls",
                                 absl::StrCat("http://", run->etcd_endpoint), "--advertise-client-urls",
                                 absl::StrCat("http://", run->etcd_endpoint), "--listen-peer-urls",
                                 absl::StrCat("http://127.0.0.1:", peer), "--initial-advertise-peer-urls",
                                 absl::StrCat("http://127.0.0.1:", peer), "--initial-cluster",
                                 absl::StrCat("default=http://127.0.0.1:", peer), "--log-level", "warn"},
                                run->dir + "/etcd.log"));
  if (!WaitFor([&] {
        absl::StatusOr<json> h = GetJson(client, "/health");
        return h.ok() && h->value("health", "") == "true";
      }, absl::Seconds(20))) {
    return absl::UnavailableError("etcd did not become healthy (see " + run->dir + "/etcd.log)");
  }
  return absl::OkStatus();
}

// A leader and a standby in this process, in `sync` mode; the leader's
// RPC address once the standby has caught up.
absl::StatusOr<std::string> StartPair(Run* run, const std::string& sync,
                                      std::vector<std::unique_ptr<master::HaNode>>* nodes) {
  const std::vector<int> rpc{net::FreeLoopbackPort(), net::FreeLoopbackPort()}, http{net::FreeLoopbackPort(), net::FreeLoopbackPort()};
  for (int i = 0; i < 2; ++i) {
    ASSIGN_OR_RETURN(MasterConfig c,
                     Config({"--etcd=" + run->etcd_endpoint, "--cluster-id=rate-" + sync,
                             absl::StrCat("--advertise=127.0.0.1:", rpc[i]), absl::StrCat("--rpc-port=", rpc[i]),
                             absl::StrCat("--http-port=", http[i]),
                             absl::StrCat("--data-dir=", run->dir, "/rate-", sync, i), "--ha-sync=" + sync,
                             run->direct_spin}));
    ASSIGN_OR_RETURN(auto node, master::HaNode::Start(c));
    nodes->push_back(std::move(node));
  }
  int leader = -1;
  if (!WaitFor([&] {
        for (int i = 0; i < 2; ++i) {
          absl::StatusOr<json> h = GetJson(http[i], "/v1/ha");
          if (h.ok() && Synced(*h)) leader = i;
        }
        return leader >= 0;
      }, absl::Seconds(30))) {
    return absl::UnavailableError(absl::StrCat("the ", sync, " leader and its standby did not sync"));
  }
  const std::string address = absl::StrCat("127.0.0.1:", rpc[leader]);
  ASSIGN_OR_RETURN(auto mc, client::MasterClient::Create(address));
  RETURN_IF_ERROR(mc->Mount(BenchSegment()));
  return address;
}

// Put rates of a semi-synchronous pair and of an asynchronous one (what the
// standby's share of this machine costs, without the wait) against a single
// master on the same kind of store, alternated twice.
absl::Status PutRates(Run* run, int threads, json* out) {
  std::vector<std::unique_ptr<master::HaNode>> nodes;
  ASSIGN_OR_RETURN(const std::string semi, StartPair(run, "semi", &nodes));
  ASSIGN_OR_RETURN(const std::string async, StartPair(run, "async", &nodes));
  ASSIGN_OR_RETURN(MasterConfig single_cfg, Config({"--rpc-port=0", "--http-port=0",
                                                    absl::StrCat("--data-dir=", run->dir, "/single"), run->direct_spin}));
  ASSIGN_OR_RETURN(auto single, master::MasterServer::Start(single_cfg));
  const std::string single_address = absl::StrCat("127.0.0.1:", single->rpc_port());
  {
    ASSIGN_OR_RETURN(auto mc, client::MasterClient::Create(single_address));
    RETURN_IF_ERROR(mc->Mount(BenchSegment()));
  }
  const absl::Duration each = absl::Seconds(3);
  double rates[3] = {0, 0, 0};  // single, semi, async
  const std::string* addresses[3] = {&single_address, &semi, &async};
  for (int round = 0; round < 2; ++round) {
    for (int k = 0; k < 3; ++k) {
      const double r = PutRate(*addresses[k], threads, each, absl::StrCat(k, "-", round));
      if (r < 0) return absl::InternalError("a put failed while measuring rates");
      rates[k] += r / 2;
    }
  }
  (*out)["put_rate_single"] = rates[0];
  (*out)["put_rate_semi_sync"] = rates[1];
  (*out)["put_rate_async"] = rates[2];
  (*out)["put_rate_ratio"] = rates[1] / rates[0];
  (*out)["put_rate_async_ratio"] = rates[2] / rates[0];
  // What waiting for a standby costs on its own, the standby's share of
  // this machine's CPU being the same in both.
  (*out)["put_rate_semi_vs_async"] = rates[1] / rates[2];
  (*out)["put_rate_threads"] = threads;
  single->Shutdown();
  for (auto& n : nodes) n->Stop();
  return absl::OkStatus();
}

// Kills the leader `kills` times under a steady put load.
absl::Status Failovers(Run* run, int kills, json* out) {
  const std::vector<int> rpc{net::FreeLoopbackPort(), net::FreeLoopbackPort()}, http{net::FreeLoopbackPort(), net::FreeLoopbackPort()};
  std::vector<std::unique_ptr<Child>> masters(2);
  auto start = [&](int i) -> absl::Status {
    ASSIGN_OR_RETURN(masters[i],
                     Child::Spawn(run->bin + "/tierkv-master",
                                  {"--etcd=" + run->etcd_endpoint, "--cluster-id=failover",
                                   absl::StrCat("--advertise=127.0.0.1:", rpc[i]), absl::StrCat("--rpc-port=", rpc[i]),
                                   absl::StrCat("--http-port=", http[i]),
                                   absl::StrCat("--data-dir=", run->dir, "/failover", i), "--segment-ttl=30s",
                                   run->direct_spin},
                                  absl::StrCat(run->dir, "/master", i, ".log")));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(start(0));
  RETURN_IF_ERROR(start(1));
  auto leader = [&]() -> int {
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<json> h = GetJson(http[i], "/v1/ha");
      if (h.ok() && Synced(*h)) return i;
    }
    return -1;
  };
  if (!WaitFor([&] { return leader() >= 0; }, absl::Seconds(30))) {
    return absl::UnavailableError("no synced leader (see " + run->dir + "/master*.log)");
  }
  const std::string list = absl::StrCat("127.0.0.1:", rpc[0], ",127.0.0.1:", rpc[1]);
  std::atomic<bool> stop{false};
  // The segment, kept mounted at whichever master leads.
  std::thread keeper([&] {
    auto mc = client::MasterClient::Create(list);
    if (!mc.ok()) return;
    bool mounted = false;
    while (!stop) {
      if (!mounted) {
        mounted = (*mc)->Mount(BenchSegment()).ok();
      } else {
        absl::StatusOr<std::vector<std::string>> again = (*mc)->Heartbeat({BenchSegment()}, "bench-keeper");
        mounted = again.ok() && again->empty();
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  std::mutex mu;
  std::vector<std::string> acked;
  std::vector<absl::Time> begun_at, acked_at;  // of each acknowledged put, in order
  std::atomic<uint64_t> failed{0}, put_again{0};
  std::thread writer([&] {
    auto mc = client::MasterClient::Create(list);
    if (!mc.ok()) return;
    for (uint64_t i = 0; !stop && i < 10'000'000; ++i) {
      const std::string key = absl::StrCat("failover-", i);
      const absl::Time begun = absl::Now();
      absl::Status s = PutOne(mc->get(), key);
      // A put caught by a failover is put again at the next leader, as the
      // client library does (Client::BatchPut), for up to 30 s. Refused as
      // taken there and found in the index: its commit reached the standby
      // before the leader died and only the answer was lost, so it is stored.
      bool again = false;
      while (!s.ok() && !stop && absl::Now() - begun < absl::Seconds(30)) {
        again = true;
        absl::SleepFor(absl::Milliseconds(10));
        s = PutOne(mc->get(), key);
        if (absl::IsAlreadyExists(s)) {
          absl::StatusOr<std::vector<bool>> stored = (*mc)->Exists({key});
          if (stored.ok() && stored->at(0)) s = absl::OkStatus();
        }
      }
      if (s.ok()) {
        if (again) put_again.fetch_add(1);
        std::lock_guard<std::mutex> l(mu);
        acked.push_back(key);
        begun_at.push_back(begun);
        acked_at.push_back(absl::Now());
      } else if (!stop) {
        failed.fetch_add(1);
      }
    }
  });
  // When the first put begun after `t` was acknowledged (a put begun
  // before may have had its answer on the way when the leader died).
  auto first_ack_after = [&](absl::Time t) {
    std::lock_guard<std::mutex> l(mu);
    auto it = std::upper_bound(begun_at.begin(), begun_at.end(), t);
    return it == begun_at.end() ? absl::InfiniteFuture() : acked_at[it - begun_at.begin()];
  };
  std::vector<double> seconds;
  absl::Status result;
  for (int k = 0; k < kills && result.ok(); ++k) {
    int l = -1;
    if (!WaitFor([&] { return (l = leader()) >= 0 && first_ack_after(absl::Now() - absl::Milliseconds(200)) !=
                                                      absl::InfiniteFuture(); },
                 absl::Seconds(60))) {
      result = absl::UnavailableError(absl::StrCat("kill ", k, ": no synced leader taking puts"));
      break;
    }
    const absl::Time killed = absl::Now();
    masters[l]->Kill(SIGKILL);
    if (!WaitFor([&] { return first_ack_after(killed) != absl::InfiniteFuture(); }, absl::Seconds(60))) {
      result = absl::UnavailableError(absl::StrCat("kill ", k, ": no put acknowledged within 60 s"));
      break;
    }
    seconds.push_back(absl::ToDoubleSeconds(first_ack_after(killed) - killed));
    std::fprintf(stderr, "kill %d: master %d, first put acknowledged %.2f s later\n", k + 1, l, seconds.back());
    if (absl::Status s = start(l); !s.ok()) result = s;
  }
  stop = true;
  writer.join();
  keeper.join();
  RETURN_IF_ERROR(result);
  // Every acknowledged key must be in the index of the last leader.
  uint64_t lost = 0;
  {
    auto mc = client::MasterClient::Create(list);
    if (!mc.ok()) return mc.status();
    std::lock_guard<std::mutex> l(mu);
    for (size_t i = 0; i < acked.size(); i += 1000) {
      std::vector<std::string> keys(acked.begin() + i, acked.begin() + std::min(acked.size(), i + 1000));
      ASSIGN_OR_RETURN(std::vector<bool> present, (*mc)->Exists(keys));
      lost += static_cast<uint64_t>(std::count(present.begin(), present.end(), false));
    }
    (*out)["puts_acknowledged"] = acked.size();
  }
  std::sort(seconds.begin(), seconds.end());
  auto pct = [&](double p) {
    return seconds.empty() ? 0.0 : seconds[std::min(seconds.size() - 1, static_cast<size_t>(p * seconds.size()))];
  };
  (*out)["leader_kills"] = seconds.size();
  (*out)["failover_p50_s"] = pct(0.5);
  (*out)["failover_p99_s"] = pct(0.99);
  (*out)["failover_max_s"] = seconds.empty() ? 0.0 : seconds.back();
  (*out)["puts_lost"] = lost;
  (*out)["puts_put_again"] = put_again.load();
  (*out)["puts_failed"] = failed.load();
  return absl::OkStatus();
}

// Election won to serving, for an index of `objects`: the promotion path
// (MasterServer::Start on the standby's copy) over a store filled here.
absl::StatusOr<double> Promotion(Run* run, int64_t objects) {
  const std::string dir = absl::StrCat(run->dir, "/promote-", objects);
  {
    ASSIGN_OR_RETURN(MasterConfig c, Config({"--rpc-port=0", "--http-port=0", "--data-dir=" + dir}));
    ASSIGN_OR_RETURN(auto server, master::MasterServer::Start(c));
    ASSIGN_OR_RETURN(auto mc, client::MasterClient::Create(absl::StrCat("127.0.0.1:", server->rpc_port())));
    RETURN_IF_ERROR(mc->Mount(BenchSegment()));
    master::ObjectIndex& index = server->master().index();
    for (int64_t base = 0; base < objects; base += 4096) {
      std::vector<master::PutItem> items;
      std::vector<std::string> keys;
      for (int64_t i = base; i < std::min(objects, base + 4096); ++i) {
        master::PutItem item;
        item.key = absl::StrCat("promote-", i);
        item.size = 4096;
        keys.push_back(item.key);
        items.push_back(std::move(item));
      }
      for (const master::PutStartOut& o : index.PutStart(items)) RETURN_IF_ERROR(o.status);
      for (const absl::Status& s : index.PutEnd(keys)) RETURN_IF_ERROR(s);
    }
    server->Shutdown();
  }
  ASSIGN_OR_RETURN(MasterConfig c, Config({"--rpc-port=0", "--http-port=0", "--data-dir=" + dir}));
  // A standby's store is open already when it wins (its copier wrote to it).
  ASSIGN_OR_RETURN(std::unique_ptr<master::IndexStore> store, master::OpenRocksDbStore(dir));
  const absl::Time start = absl::Now();
  master::ReplicationOptions ro;
  ro.epoch = 1;
  master::ReplicationLog log(ro, store.get());
  store->SetReplicator(&log);
  master::ServingGate gate;
  gate.OpenUntil(std::chrono::steady_clock::now() + std::chrono::seconds(3600));
  ASSIGN_OR_RETURN(auto server, master::MasterServer::Start(c, Clock::Real(), {std::move(store), &log, &gate, nullptr, 1}));
  const double took = absl::ToDoubleSeconds(absl::Now() - start);
  const uint64_t recovered = server->master().index().Stats().objects;
  server->Shutdown();
  if (recovered != static_cast<uint64_t>(objects)) {
    return absl::DataLossError(absl::StrCat("promotion recovered ", recovered, " of ", objects, " objects"));
  }
  std::filesystem::remove_all(dir);
  return took;
}

}  // namespace

int RunHa(const BenchConfig& config) {
  if (access(kEtcd, X_OK) != 0) {
    std::fprintf(stderr, "tierkv-bench master --ha: %s is not installed (Debian etcd-server)\n", kEtcd);
    return 1;
  }
  Run run;
  run.dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/tierkv-bench-ha-", getpid());
  std::filesystem::create_directories(run.dir);
  run.bin = std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
  run.direct_spin = "--direct-spin=" + PrintDuration(config.direct_spin);
  json out;
  auto fail = [&](absl::string_view what, const absl::Status& s) {
    std::fprintf(stderr, "tierkv-bench master --ha: %s: %s (logs in %s)\n", std::string(what).c_str(),
                 std::string(s.message()).c_str(), run.dir.c_str());
    return 1;
  };
  if (absl::Status s = StartEtcd(&run); !s.ok()) return fail("etcd", s);
  if (absl::Status s = PutRates(&run, static_cast<int>(config.threads), &out); !s.ok()) return fail("put rates", s);
  if (config.ha_kills > 0) {
    if (absl::Status s = Failovers(&run, static_cast<int>(config.ha_kills), &out); !s.ok()) return fail("failover", s);
  }
  for (absl::string_view n : absl::StrSplit(config.ha_objects, ',', absl::SkipWhitespace())) {
    int64_t objects = 0;
    if (!absl::SimpleAtoi(n, &objects) || objects <= 0) return fail("--ha-objects", absl::InvalidArgumentError(std::string(n)));
    absl::StatusOr<double> took = Promotion(&run, objects);
    if (!took.ok()) return fail("promotion", took.status());
    out["promotion_s"][std::string(n)] = *took;
  }
  run.etcd.reset();
  std::filesystem::remove_all(run.dir);
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("put rate, %d threads: single master %.0f/s; leader+standby semi-sync %.0f/s = %.2fx (target >= 0.85), "
              "async %.0f/s = %.2fx; semi-sync / async %.2f\n",
              out.value("put_rate_threads", 0), out.value("put_rate_single", 0.0), out.value("put_rate_semi_sync", 0.0),
              out.value("put_rate_ratio", 0.0), out.value("put_rate_async", 0.0), out.value("put_rate_async_ratio", 0.0),
              out.value("put_rate_semi_vs_async", 0.0));
  if (out.contains("leader_kills")) {
    std::printf("failover over %d leader kills: p50 %.2f s, p99 %.2f s, max %.2f s (target < 5 s)\n",
                out.value("leader_kills", 0), out.value("failover_p50_s", 0.0), out.value("failover_p99_s", 0.0),
                out.value("failover_max_s", 0.0));
    std::printf("puts acknowledged %llu (%llu put again after a failover), lost %llu (must be 0), "
                "failed after 30 s of putting again %llu\n",
                static_cast<unsigned long long>(out.value("puts_acknowledged", uint64_t{0})),
                static_cast<unsigned long long>(out.value("puts_put_again", uint64_t{0})),
                static_cast<unsigned long long>(out.value("puts_lost", uint64_t{0})),
                static_cast<unsigned long long>(out.value("puts_failed", uint64_t{0})));
  }
  if (out.contains("promotion_s")) {
    for (auto& [n, s] : out["promotion_s"].items()) {
      std::printf("promotion with %s objects: %.2f s from the election won to serving\n", n.c_str(), s.get<double>());
    }
  }
  return out.value("puts_lost", uint64_t{0}) == 0 ? 0 : 1;
}

}  // namespace tierkv::bench
