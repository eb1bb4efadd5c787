// tierkv-bench master: the master's RPC rates over loopback against an
// in-process MasterServer (RocksDB in a temp dir, as in production), through
// the client's MasterClient on the direct lane and on gRPC in the same run,
// and the index's memory per object measured from the heap.
#include <grpcpp/grpcpp.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/auth.h"
#include "base/extent_grant.h"
#include "client/master_client.h"
#include "base/mutex.h"
#include "config/master_config.h"
#include "master/server.h"
#include "nlohmann/json.hpp"
#include "proto/master.grpc.pb.h"
#include "tools/bench/harness.h"
#include "tools/bench/subcommands.h"

namespace tierkv::bench {
namespace {

constexpr int kGetKeys = 100'000;
constexpr uint64_t kValue = 64 << 10;

std::string GetKey(int i) { return absl::StrFormat("bench-get-%08d", i); }

// Keys are formatted once, so the measured loop is the RPC, not StrFormat.
const std::vector<std::string>& GetKeys() {
  static const auto* keys = [] {
    auto* v = new std::vector<std::string>();
    for (int i = 0; i < kGetKeys; ++i) v->push_back(GetKey(i));
    return v;
  }();
  return *keys;
}

grpc::ClientContext* Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return ctx;
}

// A store that keeps nothing: isolates the index's own memory.
class NullStore final : public master::IndexStore {
 public:
  absl::Status Write(const std::vector<master::Mutation>&) override { return absl::OkStatus(); }
  absl::StatusOr<std::string> Get(const std::string& k) override { return absl::NotFoundError(k); }
  absl::Status Scan(const std::string&,
                    const std::function<bool(absl::string_view, absl::string_view)>&) override {
    return absl::OkStatus();
  }
  absl::Status Flush() override { return absl::OkStatus(); }
};

// Heap bytes per object beyond its key's characters, at `n` objects of
// 32-character hex keys (the engine's page keys), committed in batches.
nlohmann::json MeasureMemory(int64_t n) {
  master::SegmentRegistry registry;
  NullStore store;
  ManualClock clock;
  bool restored;
  std::optional<uint32_t> replaced;
  for (int i = 0; i < 8; ++i) {
    (void)registry.Mount({absl::StrCat("seg", i), absl::StrCat("host", i), 1ull << 44, "x", ""},
                         clock.Now(), &restored, &replaced);
  }
  auto index = std::make_unique<master::ObjectIndex>(master::IndexOptions(), &registry, &store, &clock);
  malloc_trim(0);
  size_t before = mallinfo2().uordblks;
  std::mt19937_64 rng(1);
  uint64_t key_bytes = 0;
  constexpr int kBatch = 1024;
  for (int64_t done = 0; done < n; done += kBatch) {
    std::vector<master::PutItem> items;
    std::vector<std::string> keys;
    for (int64_t i = done; i < std::min(n, done + kBatch); ++i) {
      std::string key = absl::StrFormat("%016x%016x", rng(), rng());
      key_bytes += key.size();
      items.push_back({key, 256 << 10});
      keys.push_back(key);
    }
    index->PutStart(items);
    index->PutEnd(keys);
  }
  size_t after = mallinfo2().uordblks;
  double per_object = (static_cast<double>(after - before) - key_bytes) / n;
  return {{"objects", n},
          {"heap_bytes", after - before},
          {"key_bytes", key_bytes},
          {"bytes_per_object_beyond_key", per_object},
          {"index_reported_bytes", index->Stats().memory_bytes}};
}

// Time of one /metrics scrape (the master's Serialize, which runs the
// collect hook), median of 31, with `n` objects in the index, all leased:
// it must not grow with the object count.
double ScrapeMicros(int64_t n) {
  ManualClock clock;
  master::MasterOptions options;
  options.index.lease_ttl = absl::Hours(1);
  auto m = master::Master::Create(options, std::make_unique<NullStore>(), &clock);
  if (!m.ok()) return -1;
  for (int i = 0; i < 8; ++i) {
    (*m)->Mount({{absl::StrCat("seg", i), absl::StrCat("host", i), 1ull << 44, "x", ""}});
  }
  constexpr int kBatch = 1024;
  for (int64_t done = 0; done < n; done += kBatch) {
    std::vector<master::PutItem> items;
    std::vector<std::string> keys;
    for (int64_t i = done; i < std::min(n, done + kBatch); ++i) {
      keys.push_back(absl::StrFormat("scrape-%016d", i));
      items.push_back({keys.back(), 4096});
    }
    (*m)->index().PutStart(items);
    (*m)->index().PutEnd(keys);
    (*m)->index().GetReplicas(keys, false);
  }
  std::vector<double> us;
  for (int i = 0; i < 31; ++i) {
    absl::Time start = absl::Now();
    std::string text = (*m)->metrics().Serialize();
    benchmark::DoNotOptimize(text);
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// p50/p99 per RPC method across a case's threads, for the per-RPC table.
class MethodLatencies {
 public:
  void Add(const std::string& method, const std::vector<double>& micros) {
    MutexLock lock(&mu_);
    auto& all = micros_[method];
    all.insert(all.end(), micros.begin(), micros.end());
  }
  nlohmann::json Json() {
    MutexLock lock(&mu_);
    nlohmann::json out = nlohmann::json::object();
    for (auto& entry : micros_) {
      std::vector<double>& v = entry.second;
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      auto at = [&v](double q) { return v[static_cast<size_t>(q * (v.size() - 1))]; };
      // "lane/Method" -> out[lane][Method]
      const size_t slash = entry.first.find('/');
      out[entry.first.substr(0, slash)][entry.first.substr(slash + 1)] = {
          {"p50_us", at(0.5)}, {"p99_us", at(0.99)}, {"calls", v.size()}};
    }
    return out;
  }

 private:
  Mutex mu_;
  std::map<std::string, std::vector<double>> micros_ ABSL_GUARDED_BY(mu_);
};

// The single-operation cases run on each lane a client can use.
constexpr int kLanes = 2;
constexpr const char* kLaneNames[kLanes] = {"direct", "grpc"};

struct Cluster {
  std::unique_ptr<master::MasterServer> server;
  std::unique_ptr<v1::Master::Stub> stub;
  std::unique_ptr<client::MasterClient> lanes[kLanes];
  std::string data_dir;
  std::atomic<uint64_t> put_counter{0};
  MethodLatencies methods;
};

absl::Status StartCluster(Cluster* c, absl::Duration reply_spin, absl::Duration direct_spin, bool data_keys) {
  c->data_dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/tierkv-bench-",
                             getpid());
  // No daemon heartbeats here: a long segment TTL keeps the segments (and
  // the looked-up keys) for the whole run.
  const std::string spin = "--direct-spin=" + PrintDuration(direct_spin);
  const char* argv[] = {"tierkv-master", "--rpc-port=0", "--http-port=0", "--segment-ttl=86400s", spin.c_str()};
  absl::StatusOr<MasterConfig> cfg = MasterFlags().Parse(5, argv, nullptr, [](const char*) -> const char* { return nullptr; });
  if (!cfg.ok()) return cfg.status();
  cfg->data_dir = c->data_dir;
  auto server = master::MasterServer::Start(*cfg);
  if (!server.ok()) return server.status();
  c->server = std::move(*server);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  const std::string address = absl::StrCat("127.0.0.1:", c->server->rpc_port());
  c->stub = v1::Master::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  for (int lane = 0; lane < kLanes; ++lane) {
    client::MasterClientOptions o;
    o.rpc_timeout = absl::Seconds(10);
    o.direct = lane == 0;
    o.reply_spin = reply_spin;
    auto mc = client::MasterClient::Create(address, o);
    if (!mc.ok()) return mc.status();
    c->lanes[lane] = std::move(*mc);
  }
  v1::MountSegmentRequest mount;
  for (int i = 0; i < 4; ++i) {
    v1::Segment* s = mount.add_segments();
    s->set_name(absl::StrCat("bench-seg-", i));
    s->set_host(absl::StrCat("bench-host-", i));
    s->set_capacity(1ull << 40);
    s->set_incarnation("bench");
    // A daemon with --auth token sends one: every answer then signs an
    // extent grant per replica.
    if (data_keys) s->set_data_key(auth::RandomBytes(auth::kDataKeyBytes));
  }
  v1::MountSegmentResponse mounted;
  grpc::ClientContext ctx;
  if (!c->stub->MountSegment(Deadline(&ctx), mount, &mounted).ok()) {
    return absl::UnavailableError("mount failed");
  }
  // Keys for the lookups, put in batches.
  for (int base = 0; base < kGetKeys; base += 1000) {
    v1::PutStartRequest req;
    v1::KeysRequest end;
    for (int i = base; i < base + 1000; ++i) {
      auto* item = req.add_items();
      item->set_key(GetKey(i));
      item->set_size(kValue);
      end.add_keys(GetKey(i));
    }
    v1::PutStartResponse r1;
    v1::KeysResponse r2;
    grpc::ClientContext c1, c2;
    if (!c->stub->PutStart(Deadline(&c1), req, &r1).ok() ||
        !c->stub->PutEnd(Deadline(&c2), end, &r2).ok()) {
      return absl::UnavailableError("preloading keys failed");
    }
  }
  return absl::OkStatus();
}

}  // namespace

// tierkv-bench master --scale (bench_master_scale.cc).
int RunMasterScale(const BenchConfig& config);

int RunMaster(const BenchConfig& config) {
  if (config.ha) return RunHa(config);
  if (config.scale) return RunMasterScale(config);
  auto cluster = std::make_shared<Cluster>();
  if (absl::Status s = StartCluster(cluster.get(), config.reply_spin, config.direct_spin, config.extent_grants);
      !s.ok()) {
    std::fprintf(stderr, "tierkv-bench: starting the master: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  int threads = static_cast<int>(config.threads);
  int batch = static_cast<int>(config.batch);

  for (int lane = 0; lane < kLanes; ++lane) {
    const std::string suffix = absl::StrCat("_", kLaneNames[lane]);
    const std::string tag = absl::StrCat(kLaneNames[lane], "/");
    // PutStart + PutEnd of one key; each RPC is also timed on its own, and
    // every other put is removed again (timed too), so the index stays put.
    benchmark::RegisterBenchmark(("master/put_single" + suffix).c_str(), [cluster, lane, tag](benchmark::State& state) {
      client::MasterClient* mc = cluster->lanes[lane].get();
      LatencyRecorder lat;
      std::vector<double> starts, ends, removes;
      uint64_t n = 0;
      for (auto _ : state) {
        std::string key = absl::StrCat("bench-put-", cluster->put_counter.fetch_add(1));
        absl::Time start = absl::Now();
        v1::PutStartRequest req;
        auto* item = req.add_items();
        item->set_key(key);
        item->set_size(kValue);
        auto r1 = mc->PutStart(req);
        absl::Time started = absl::Now();
        auto r2 = mc->PutEnd({key});
        absl::Time ended = absl::Now();
        lat.Add(ended - start);
        starts.push_back(absl::ToDoubleMicroseconds(started - start));
        ends.push_back(absl::ToDoubleMicroseconds(ended - started));
        if (!r1.ok() || !r2.ok() || r1->results(0).status().code() != 0 || r2->status(0).code() != 0) {
          state.SkipWithError("put failed");
          break;
        }
        if (++n % 2 == 0) {
          absl::Time t = absl::Now();
          auto r3 = mc->Remove({key}, false);
          removes.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
          if (!r3.ok()) {
            state.SkipWithError("remove failed");
            break;
          }
        }
      }
      state.SetItemsProcessed(state.iterations());
      lat.Publish(state);
      cluster->methods.Add(tag + "PutStart", starts);
      cluster->methods.Add(tag + "PutEnd", ends);
      cluster->methods.Add(tag + "Remove", removes);
    })->UseRealTime()->Threads(threads);

    benchmark::RegisterBenchmark(("master/get_single" + suffix).c_str(), [cluster, lane, tag](benchmark::State& state) {
      client::MasterClient* mc = cluster->lanes[lane].get();
      LatencyRecorder lat;
      std::vector<double> micros;
      std::mt19937 rng(state.thread_index());
      for (auto _ : state) {
        std::vector<std::string> keys{GetKeys()[rng() % kGetKeys]};
        absl::Time start = absl::Now();
        auto resp = mc->GetReplicas(keys);
        absl::Duration took = absl::Now() - start;
        lat.Add(took);
        micros.push_back(absl::ToDoubleMicroseconds(took));
        if (!resp.ok() || resp->sizes(0) == 0) {
          state.SkipWithError("lookup missed");
          break;
        }
      }
      state.SetItemsProcessed(state.iterations());
      lat.Publish(state);
      cluster->methods.Add(tag + "GetReplicas", micros);
    })->UseRealTime()->Threads(threads);

    // Exists and PrefixMatch of one key, alternately.
    benchmark::RegisterBenchmark(("master/query_single" + suffix).c_str(), [cluster, lane, tag](benchmark::State& state) {
      client::MasterClient* mc = cluster->lanes[lane].get();
      LatencyRecorder lat;
      std::vector<double> exists, prefix;
      std::mt19937 rng(state.thread_index() + 50);
      uint64_t n = 0;
      for (auto _ : state) {
        std::vector<std::string> keys{GetKeys()[rng() % kGetKeys]};
        absl::Time start = absl::Now();
        bool hit;
        if (++n % 2 == 0) {
          auto resp = mc->Exists(keys);
          hit = resp.ok() && (*resp)[0];
          exists.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
        } else {
          auto resp = mc->PrefixMatch(keys);
          hit = resp.ok() && *resp == 1;
          prefix.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
        }
        lat.Add(absl::Now() - start);
        if (!hit) {
          state.SkipWithError("query missed");
          break;
        }
      }
      state.SetItemsProcessed(state.iterations());
      lat.Publish(state);
      cluster->methods.Add(tag + "Exists", exists);
      cluster->methods.Add(tag + "PrefixMatch", prefix);
    })->UseRealTime()->Threads(threads);
  }

  // Batched lookups as a client makes them: MasterClient, direct lane.
  benchmark::RegisterBenchmark(absl::StrCat("master/get_batch", batch).c_str(), [cluster, batch](benchmark::State& state) {
    client::MasterClient* mc = cluster->lanes[0].get();
    LatencyRecorder lat;
    std::mt19937 rng(state.thread_index() + 100);
    std::vector<std::string> keys(batch);
    for (auto _ : state) {
      for (int i = 0; i < batch; ++i) keys[i] = GetKeys()[rng() % kGetKeys];
      absl::Time start = absl::Now();
      auto resp = mc->GetReplicas(keys);
      lat.Add(absl::Now() - start);
      if (!resp.ok() || resp->sizes_size() != batch) {
        state.SkipWithError("batch lookup failed");
        break;
      }
    }
    state.SetItemsProcessed(state.iterations() * batch);
    lat.Publish(state);
  })->UseRealTime()->Threads(threads);

  // The same lookups straight into the index, no RPC: the ceiling the
  // gRPC path is measured against.
  benchmark::RegisterBenchmark(absl::StrCat("index/get_batch", batch).c_str(), [cluster, batch](benchmark::State& state) {
    std::mt19937 rng(state.thread_index() + 200);
    std::vector<std::string> keys(batch);
    for (auto _ : state) {
      for (int i = 0; i < batch; ++i) keys[i] = GetKeys()[rng() % kGetKeys];
      auto found = cluster->server->master().index().GetReplicas(keys);
      benchmark::DoNotOptimize(found);
    }
    state.SetItemsProcessed(state.iterations() * batch);
  })->UseRealTime()->Threads(threads);

  // A put (PutStart, PutEnd, Remove) straight into the index, in the
  // default tenant and in a tenant with a quota, in the same run: what
  // namespacing and quota charging add to the index's own work.
  cluster->server->master().index().tenants().SetLimits("bench", {uint64_t{1} << 50, 0});
  for (const char* tenant : {"", "bench"}) {
    benchmark::RegisterBenchmark(absl::StrCat("index/put_", *tenant ? "tenant" : "default").c_str(),
                                 [cluster, tenant](benchmark::State& state) {
      master::ObjectIndex& index = cluster->server->master().index();
      uint64_t n = 0;
      for (auto _ : state) {
        const std::string key =
            master::TenantKey(tenant, absl::StrCat("bench-index-put-", state.thread_index(), "-", n++));
        master::PutItem item;
        item.key = key;
        item.size = kValue;
        if (!index.PutStart({item})[0].status.ok() || !index.PutEnd({key})[0].ok() ||
            !index.Remove({key}, /*force=*/true)[0].ok()) {
          state.SkipWithError("index put failed");
          break;
        }
      }
      state.SetItemsProcessed(state.iterations());
    })->UseRealTime()->Threads(threads);
  }

  // One extent grant signed (the master, per replica of an answer under
  // --auth) and checked (the daemon, per tcp frame), in the same run.
  benchmark::RegisterBenchmark("grants/sign", [](benchmark::State& state) {
    const auth::ExtentMac mac(std::string(auth::kDataKeyBytes, 'k'));
    char out[auth::kExtentGrantBytes];
    uint64_t n = 0;
    for (auto _ : state) {
      benchmark::DoNotOptimize(mac.SignInto({n++ * 4096, kValue + 16, 1'800'000'000'000, auth::kExtentRead}, out));
    }
    state.SetItemsProcessed(state.iterations());
  })->UseRealTime();
  benchmark::RegisterBenchmark("grants/check", [](benchmark::State& state) {
    const auth::ExtentMac mac(std::string(auth::kDataKeyBytes, 'k'));
    const std::string grant = mac.Sign({4096, kValue + 16, 4'000'000'000'000, auth::kExtentRead});
    const absl::Time now = absl::Now();
    for (auto _ : state) benchmark::DoNotOptimize(mac.Check(grant, auth::kExtentRead, 4096, kValue, now));
    state.SetItemsProcessed(state.iterations());
  })->UseRealTime();

  Figures figures = RunRegistered(config.min_time, config.json);
  // Server-side handling time per RPC, from the master's own histogram:
  // the rest of an RPC's latency is gRPC and the kernel.
  std::map<std::string, double> handler_us;
  {
    std::string text = cluster->server->master().metrics().Serialize();
    for (const char* m : {"PutStart", "PutEnd", "GetReplicas"}) {
      auto value = [&](const std::string& series) {
        size_t at = text.find(series);
        return at == std::string::npos ? 0.0 : std::stod(text.substr(at + series.size() + 1));
      };
      std::string labels = absl::StrCat("{method=\"", m, "\"}");
      double count = value("tierkv_master_rpc_seconds_count" + labels);
      if (count > 0) handler_us[m] = 1e6 * value("tierkv_master_rpc_seconds_sum" + labels) / count;
    }
  }
  cluster->server->Shutdown();
  std::filesystem::remove_all(cluster->data_dir);

  nlohmann::json out;
  for (const auto& [name, f] : figures) {
    std::string short_name = name.substr(0, name.find('/', 7));
    nlohmann::json j;
    for (const auto& [k, v] : f) j[k] = v;
    out["rpc"][short_name] = j;
  }
  out["server_handler_mean_us"] = handler_us;
  out["per_rpc"] = cluster->methods.Json();
  out["memory"] = MeasureMemory(config.objects);
  const int64_t small = std::min<int64_t>(10'000, config.objects);
  const double scrape_small = ScrapeMicros(small), scrape_large = ScrapeMicros(config.objects);
  out["metrics_scrape"] = {{"objects_small", small},
                           {"us_small", scrape_small},
                           {"objects_large", config.objects},
                           {"us_large", scrape_large},
                           {"ratio", scrape_small > 0 ? scrape_large / scrape_small : 0.0}};
  double batched = 0;
  for (const auto& [name, f] : figures) {
    if (name.find("get_batch") != std::string::npos && f.contains("items_per_second")) {
      batched = f.at("items_per_second");
    }
  }
  double per_object = out["memory"]["bytes_per_object_beyond_key"];
  auto p50 = [&out](const char* lane, const char* method) {
    const nlohmann::json& j = out["per_rpc"];
    return j.contains(lane) && j[lane].contains(method) ? j[lane][method]["p50_us"].get<double>() : 0.0;
  };
  const double get_p50 = p50("direct", "GetReplicas");
  out["targets"] = {{"single_lookup_p50_us", get_p50},
                    {"single_lookup_p50_grpc_us", p50("grpc", "GetReplicas")},
                    {"single_lookup_p50_target_us", 60},
                    {"single_lookup_p50_met", get_p50 > 0 && get_p50 <= 60},
                    {"batched_lookup_keys_per_s", batched},
                    {"batched_lookup_target", 500000},
                    {"batched_lookup_met", batched >= 500000},
                    {"bytes_per_object", per_object},
                    {"bytes_per_object_target", 150},
                    {"bytes_per_object_met", per_object <= 150}};
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    for (const auto& [m, us] : handler_us) std::printf("server-side %s: %.1f us per RPC (mean)\n", m.c_str(), us);
    std::printf("\n%-12s %12s %12s %12s %12s\n", "rpc", "direct p50", "direct p99", "gRPC p50", "gRPC p99");
    const nlohmann::json& per = out["per_rpc"];
    for (const char* m : {"GetReplicas", "Exists", "PrefixMatch", "PutStart", "PutEnd", "Remove"}) {
      auto at = [&](const char* lane, const char* q) {
        return per.contains(lane) && per[lane].contains(m) ? per[lane][m][q].get<double>() : 0.0;
      };
      std::printf("%-12s %12.1f %12.1f %12.1f %12.1f\n", m, at("direct", "p50_us"), at("direct", "p99_us"),
                  at("grpc", "p50_us"), at("grpc", "p99_us"));
    }
    std::printf("\nsingle lookup p50, direct lane: %.1f us (target <= 60: %s); gRPC: %.1f us\n", get_p50,
                get_p50 > 0 && get_p50 <= 60 ? "met" : "MISSED", p50("grpc", "GetReplicas"));
    std::printf("/metrics scrape: %.1f us at %lld objects, %.1f us at %lld (ratio %.2f)\n", scrape_small,
                static_cast<long long>(small), scrape_large, static_cast<long long>(config.objects),
                scrape_small > 0 ? scrape_large / scrape_small : 0.0);
    std::printf("\nbatched lookups: %.0f keys/s (target >= 500000: %s)\n", batched,
                batched >= 500000 ? "met" : "MISSED");
    std::printf("master memory: %.1f bytes/object beyond the key at %lld objects (target <= 150: %s)\n",
                per_object, static_cast<long long>(config.objects), per_object <= 150 ? "met" : "MISSED");
  }
  return 0;
}

}  // namespace tierkv::bench
