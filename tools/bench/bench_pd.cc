// tierkv-bench pd: prefill-to-decode KV transfer between two engines in
// peer mode (EngineOptions::peer_mode), as a P/D pair moves one request.
//
// The model shape is DeepSeek-style MLA: 61 layers, 576 bf16 values per
// token per layer (1,152 bytes), 64-token pages, pools laid out layer-major
// ([layer][page][token]). One request of 128, 4,096 or 32,768 tokens moves
// layer by layer, as prefill finishes each layer: one batch per layer with
// one entry per page (the decode side's pages scattered, so pages never
// coalesce), submitted back to back, then the completion notification.
// Its reference, in the same run, is the raw engine moving the same bytes
// as one entry in one batch. Then per-token entries: 100,000 one-token
// entries (1,152 bytes) in one call, scattered at the peer and adjacent
// there, against the same bytes in one entry. Over tcp and shm.
#include <algorithm>
#include <cstring>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tools/bench/harness.h"
#include "tools/bench/subcommands.h"
#include "base/status.h"
#include "transport/engine.h"
#include "transport/memory.h"

namespace tierkv::bench {
namespace {

using transport::Op;
using transport::Request;
using transport::TransferEngine;

constexpr uint64_t kLayers = 61;
constexpr uint64_t kTokenBytes = 576 * 2;  // per token per layer
constexpr uint64_t kPageTokens = 64;
constexpr uint64_t kPageBytes = kPageTokens * kTokenBytes;
constexpr uint64_t kMaxTokens = 32768;
constexpr uint64_t kPoolPages = kMaxTokens / kPageTokens;
constexpr uint64_t kLayerBytes = kPoolPages * kPageBytes;
constexpr uint64_t kPoolBytes = kLayers * kLayerBytes;
constexpr uint64_t kEntries = 100000;

// The two KV pools, shared by every transport's pair of engines.
struct Pools {
  std::unique_ptr<transport::SharedRegion> prefill, decode;
};

// A prefill engine and a decode engine over one transport, each with its
// KV pool registered.
struct Pair {
  std::unique_ptr<TransferEngine> prefill, decode;
  transport::SharedRegion* prefill_pool;
  transport::SharedRegion* decode_pool;
  std::string session;  // the decode engine's

  char* src(uint64_t layer, uint64_t page) const { return prefill_pool->data() + layer * kLayerBytes + page * kPageBytes; }
  uint64_t dst(uint64_t layer, uint64_t page) const {
    return reinterpret_cast<uintptr_t>(decode_pool->data()) + layer * kLayerBytes + page * kPageBytes;
  }
};

absl::StatusOr<Pools> MakePools() {
  Pools pools;
  ASSIGN_OR_RETURN(pools.prefill, transport::SharedRegion::Create(kPoolBytes, {}));
  ASSIGN_OR_RETURN(pools.decode, transport::SharedRegion::Create(kPoolBytes, {}));
  std::memset(pools.prefill->data(), 0x61, kPoolBytes);  // touched, so no case pays first faults
  std::memset(pools.decode->data(), 0, kPoolBytes);
  return pools;
}

absl::StatusOr<std::unique_ptr<Pair>> MakePair(const std::string& transport, const BenchConfig& config,
                                               const Pools& pools) {
  auto p = std::make_unique<Pair>();
  p->prefill_pool = pools.prefill.get();
  p->decode_pool = pools.decode.get();
  transport::EngineOptions o;
  o.peer_mode = true;
  o.transports = {transport};
  o.backend.connections = static_cast<int>(config.connections);
  o.workers = config.client_workers();
  ASSIGN_OR_RETURN(p->prefill, TransferEngine::Create(o));
  ASSIGN_OR_RETURN(p->decode, TransferEngine::Create(o));
  RETURN_IF_ERROR(p->prefill->RegisterMemory(p->prefill_pool->data(), kPoolBytes, "cpu:0", p->prefill_pool->fd()));
  RETURN_IF_ERROR(p->decode->RegisterMemory(p->decode_pool->data(), kPoolBytes, "cpu:0", p->decode_pool->fd()));
  p->session = p->decode->session_id();
  return p;
}

void Fail(benchmark::State& state, const absl::Status& s) { state.SkipWithError(std::string(s.message()).c_str()); }

// One request of `tokens` tokens, layer by layer, then its notification.
void RegisterLayerwise(const std::string& t, Pair* p, uint64_t tokens) {
  const uint64_t pages = (tokens + kPageTokens - 1) / kPageTokens;
  std::vector<std::vector<Request>> layers(kLayers);
  for (uint64_t l = 0; l < kLayers; ++l) {
    for (uint64_t pg = 0; pg < pages; ++pg) {
      // Decode's pages come from its free list: reversed, never adjacent.
      const uint64_t len = std::min(kPageBytes, (tokens - pg * kPageTokens) * kTokenBytes);
      layers[l].push_back({Op::kWrite, p->src(l, pg), p->session, p->dst(l, pages - 1 - pg), len});
    }
  }
  const uint64_t bytes = tokens * kTokenBytes * kLayers;
  benchmark::RegisterBenchmark(absl::StrCat("pd/", t, "/", tokens, "/layerwise").c_str(),
                               [p, layers, bytes](benchmark::State& state) {
    for (auto _ : state) {
      std::vector<std::shared_ptr<transport::Batch>> sent;
      for (const auto& layer : layers) sent.push_back(p->prefill->Submit(layer, absl::Seconds(60)));
      for (auto& b : sent) {
        (void)b->Wait(absl::Now() + absl::Seconds(65));
        for (const absl::Status& s : b->statuses()) {
          if (!s.ok()) return Fail(state, s);
        }
      }
      if (absl::Status s = p->prefill->Notify(p->session, "req", "done", absl::Now() + absl::Seconds(5)); !s.ok()) {
        return Fail(state, s);
      }
    }
    (void)p->decode->TakeNotifications();
    state.SetBytesProcessed(state.iterations() * bytes);
  })->UseRealTime();
  benchmark::RegisterBenchmark(absl::StrCat("pd/", t, "/", tokens, "/raw").c_str(), [p, bytes](benchmark::State& state) {
    std::vector<Request> one{{Op::kWrite, p->src(0, 0), p->session, p->dst(0, 0), bytes}};
    for (auto _ : state) {
      absl::Status s = p->prefill->Transfer(one, absl::Seconds(60))[0];
      if (!s.ok()) return Fail(state, s);
    }
    state.SetBytesProcessed(state.iterations() * bytes);
  })->UseRealTime();
}

// 100,000 one-token entries in one call: scattered at the peer (every
// other slot), adjacent there (they coalesce), and the same bytes as one.
void RegisterEntries(const std::string& t, Pair* p) {
  for (const std::string shape : {"scattered", "adjacent", "one"}) {
    std::vector<Request> reqs;
    if (shape == "one") {
      reqs.push_back({Op::kWrite, p->src(0, 0), p->session, p->dst(0, 0), kEntries * kTokenBytes});
    } else {
      const uint64_t stride = shape == "scattered" ? 2 : 1;
      for (uint64_t i = 0; i < kEntries; ++i) {
        reqs.push_back({Op::kWrite, p->src(0, 0) + i * kTokenBytes, p->session, p->dst(0, 0) + stride * i * kTokenBytes,
                        kTokenBytes});
      }
    }
    benchmark::RegisterBenchmark(absl::StrCat("entries/", t, "/", shape).c_str(), [p, reqs](benchmark::State& state) {
      for (auto _ : state) {
        for (const absl::Status& s : p->prefill->Transfer(reqs, absl::Seconds(120))) {
          if (!s.ok()) return Fail(state, s);
        }
      }
      state.SetBytesProcessed(state.iterations() * kEntries * kTokenBytes);
    })->UseRealTime();
  }
}

}  // namespace

int RunPd(const BenchConfig& config) {
  const std::vector<std::string> transports = {"tcp", "shm"};
  const std::vector<uint64_t> sizes = {128, 4096, kMaxTokens};
  absl::StatusOr<Pools> pools = MakePools();
  if (!pools.ok()) {
    std::fprintf(stderr, "tierkv-bench pd: %s\n", std::string(pools.status().message()).c_str());
    return 1;
  }
  std::vector<std::unique_ptr<Pair>> pairs;
  for (const std::string& t : transports) {
    absl::StatusOr<std::unique_ptr<Pair>> p = MakePair(t, config, *pools);
    if (!p.ok()) {
      std::fprintf(stderr, "tierkv-bench pd: %s: %s\n", t.c_str(), std::string(p.status().message()).c_str());
      return 1;
    }
    for (uint64_t tokens : sizes) RegisterLayerwise(t, p->get(), tokens);
    RegisterEntries(t, p->get());
    pairs.push_back(std::move(*p));
  }
  Figures f = RunRegistered(config.min_time, config.json, static_cast<int>(config.repetitions));
  auto gbps = [&](const std::string& prefix) { return Best(f, prefix, "bytes_per_second") / 1e9; };
  nlohmann::json out{{"model", {{"layers", kLayers}, {"token_bytes_per_layer", kTokenBytes}, {"page_tokens", kPageTokens}}},
                     {"connections", config.connections},
                     {"workers", config.client_workers()}};
  for (const std::string& t : transports) {
    for (uint64_t tokens : sizes) {
      const std::string at = absl::StrCat("pd/", t, "/", tokens);
      const double lw = gbps(at + "/layerwise"), raw = gbps(at + "/raw");
      out[t]["layerwise"][std::to_string(tokens)] = {{"GBps", lw}, {"raw_GBps", raw}, {"ratio", raw > 0 ? lw / raw : 0}};
    }
    const double one = gbps(absl::StrCat("entries/", t, "/one"));
    for (const std::string shape : {"scattered", "adjacent"}) {
      const double v = gbps(absl::StrCat("entries/", t, "/", shape));
      out[t]["entries_100k"][shape] = {{"GBps", v}, {"one_entry_GBps", one}, {"ratio", one > 0 ? v / one : 0}};
    }
  }
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  for (const std::string& t : transports) {
    std::printf("\n%s, one request layer by layer (61 layers, 1,152 B/token/layer, 64-token pages):\n", t.c_str());
    for (uint64_t tokens : sizes) {
      const auto& c = out[t]["layerwise"][std::to_string(tokens)];
      std::printf("  %6llu tokens: %.2f GB/s, raw engine %.2f GB/s, ratio %.2f (goal >= %.2f)\n",
                  static_cast<unsigned long long>(tokens), c["GBps"].get<double>(), c["raw_GBps"].get<double>(),
                  c["ratio"].get<double>(), tokens >= kMaxTokens ? 0.9 : tokens <= 128 ? 0.5 : 0.0);
    }
    for (const std::string shape : {"scattered", "adjacent"}) {
      const auto& c = out[t]["entries_100k"][shape];
      std::printf("  100,000 one-token entries, %s: %.2f GB/s, one entry %.2f GB/s, ratio %.2f (goal >= 0.50)\n",
                  shape.c_str(), c["GBps"].get<double>(), c["one_entry_GBps"].get<double>(), c["ratio"].get<double>());
    }
  }
  return 0;
}

}  // namespace tierkv::bench
