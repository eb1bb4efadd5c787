// tierkv-bench master: the master's RPC rates over loopback gRPC against an
// in-process MasterServer (RocksDB in a temp dir, as in production), and
// the index's memory per object measured from the heap.
#include <grpcpp/grpcpp.h>
#include <malloc.h>

#include <atomic>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

struct Cluster {
  std::unique_ptr<master::MasterServer> server;
  std::unique_ptr<v1::Master::Stub> stub;
  std::string data_dir;
  std::atomic<uint64_t> put_counter{0};
};

absl::Status StartCluster(Cluster* c) {
  c->data_dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/tierkv-bench-",
                             getpid());
  const char* argv[] = {"tierkv-master", "--rpc-port=0", "--http-port=0"};
  absl::StatusOr<MasterConfig> cfg = MasterFlags().Parse(3, argv, nullptr, [](const char*) -> const char* { return nullptr; });
  if (!cfg.ok()) return cfg.status();
  cfg->data_dir = c->data_dir;
  auto server = master::MasterServer::Start(*cfg);
  if (!server.ok()) return server.status();
  c->server = std::move(*server);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  c->stub = v1::Master::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", c->server->rpc_port()), grpc::InsecureChannelCredentials(), args));
  v1::MountSegmentRequest mount;
  for (int i = 0; i < 4; ++i) {
    v1::Segment* s = mount.add_segments();
    s->set_name(absl::StrCat("bench-seg-", i));
    s->set_host(absl::StrCat("bench-host-", i));
    s->set_capacity(1ull << 40);
    s->set_incarnation("bench");
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

int RunMaster(const BenchConfig& config) {
  auto cluster = std::make_shared<Cluster>();
  if (absl::Status s = StartCluster(cluster.get()); !s.ok()) {
    std::fprintf(stderr, "tierkv-bench: starting the master: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  int threads = static_cast<int>(config.threads);
  int batch = static_cast<int>(config.batch);

  benchmark::RegisterBenchmark("master/put_single", [cluster](benchmark::State& state) {
    LatencyRecorder lat;
    for (auto _ : state) {
      std::string key = absl::StrCat("bench-put-", cluster->put_counter.fetch_add(1));
      absl::Time start = absl::Now();
      v1::PutStartRequest req;
      auto* item = req.add_items();
      item->set_key(key);
      item->set_size(kValue);
      v1::PutStartResponse r1;
      grpc::ClientContext c1;
      cluster->stub->PutStart(Deadline(&c1), req, &r1);
      v1::KeysRequest end;
      end.add_keys(key);
      v1::KeysResponse r2;
      grpc::ClientContext c2;
      cluster->stub->PutEnd(Deadline(&c2), end, &r2);
      lat.Add(absl::Now() - start);
      if (r1.results(0).status().code() != 0 || r2.status(0).code() != 0) {
        state.SkipWithError("put failed");
        break;
      }
    }
    state.SetItemsProcessed(state.iterations());
    lat.Publish(state);
  })->UseRealTime()->Threads(threads);

  benchmark::RegisterBenchmark("master/get_single", [cluster](benchmark::State& state) {
    LatencyRecorder lat;
    std::mt19937 rng(state.thread_index());
    for (auto _ : state) {
      v1::KeysRequest req;
      req.add_keys(GetKeys()[rng() % kGetKeys]);
      v1::GetReplicasResponse resp;
      grpc::ClientContext ctx;
      absl::Time start = absl::Now();
      cluster->stub->GetReplicas(Deadline(&ctx), req, &resp);
      lat.Add(absl::Now() - start);
      if (resp.sizes_size() != 1 || resp.sizes(0) == 0) {
        state.SkipWithError("lookup missed");
        break;
      }
    }
    state.SetItemsProcessed(state.iterations());
    lat.Publish(state);
  })->UseRealTime()->Threads(threads);

  benchmark::RegisterBenchmark(absl::StrCat("master/get_batch", batch).c_str(), [cluster, batch](benchmark::State& state) {
    LatencyRecorder lat;
    std::mt19937 rng(state.thread_index() + 100);
    for (auto _ : state) {
      v1::KeysRequest req;
      for (int i = 0; i < batch; ++i) req.add_keys(GetKeys()[rng() % kGetKeys]);
      // An arena per call: how a client should parse big responses.
      google::protobuf::Arena arena;
      auto* resp = google::protobuf::Arena::CreateMessage<v1::GetReplicasResponse>(&arena);
      grpc::ClientContext ctx;
      absl::Time start = absl::Now();
      cluster->stub->GetReplicas(Deadline(&ctx), req, resp);
      lat.Add(absl::Now() - start);
      if (resp->sizes_size() != batch) {
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
  out["memory"] = MeasureMemory(config.objects);
  double batched = 0;
  for (const auto& [name, f] : figures) {
    if (name.find("get_batch") != std::string::npos && f.contains("items_per_second")) {
      batched = f.at("items_per_second");
    }
  }
  double per_object = out["memory"]["bytes_per_object_beyond_key"];
  out["targets"] = {{"batched_lookup_keys_per_s", batched},
                    {"batched_lookup_target", 500000},
                    {"batched_lookup_met", batched >= 500000},
                    {"bytes_per_object", per_object},
                    {"bytes_per_object_target", 150},
                    {"bytes_per_object_met", per_object <= 150}};
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    for (const auto& [m, us] : handler_us) std::printf("server-side %s: %.1f us per RPC (mean)\n", m.c_str(), us);
    std::printf("\nbatched lookups: %.0f keys/s (target >= 500000: %s)\n", batched,
                batched >= 500000 ? "met" : "MISSED");
    std::printf("master memory: %.1f bytes/object beyond the key at %lld objects (target <= 150: %s)\n",
                per_object, static_cast<long long>(config.objects), per_object <= 150 ? "met" : "MISSED");
  }
  return 0;
}

}  // namespace tierkv::bench
