// InferenceEngine: serves prompts through the prefix cache, computing
// what the cache does not hold, and keeps the numbers operators judge a
// cache by (hit rate per tier, TTFT with and without the cache).
//
// Two modes share the cache path byte for byte:
//   model:     the small transformer computes the missing KV and logits;
//   synthetic: pages are filled deterministically from their key (and
//              verified when they come back from the store), and compute
//              time comes from a cost model (tokens/s), so large traces
//              replay at realistic data volumes in seconds.
//
// Not thread-safe: one request at a time (as one scheduler step would).
#pragma once

#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "base/metrics.h"
#include "engine/cache.h"
#include "engine/model.h"

namespace tierkv::engine {

struct EngineConfig {
  bool synthetic = false;
  ModelConfig model;
  int page_tokens = 64;
  int tp = 1;
  size_t l1_pages = 256;
  size_t l2_pages = 1024;
  uint64_t synthetic_bytes_per_token = 64;  // synthetic mode's KV size
  double tokens_per_s = 0;                  // cost model; 0 = measure the model
  PrefetchPolicy prefetch = PrefetchPolicy::kWaitComplete;
  absl::Duration prefetch_timeout = absl::Milliseconds(200);
  WritePolicy write = WritePolicy::kWriteThrough;
  int selective_hits = 2;
  size_t window = 100;  // requests in the sliding-window hit rate
  // Where L1 lives and attention runs (NewDevice); null: the CPU.
  std::shared_ptr<Device> device;
};

struct RequestResult {
  size_t tokens = 0;
  size_t cached_tokens = 0;
  size_t l1_tokens = 0, l2_tokens = 0, l3_tokens = 0;
  size_t lookup_tokens = 0;  // tokens the cache was asked for: whole pages before the last token
  StopReason stop = StopReason::kComplete;  // why the cached prefix ended there
  double fetch_s = 0;
  double compute_s = 0;
  double ttft_s = 0;          // fetch + compute
  // Computing every token: measured when nothing was cached in model mode,
  // else from the cost model (tokens / tokens_per_s).
  double ttft_nocache_s = 0;
  uint64_t fetch_bytes = 0;
  bool store_error = false;
  size_t corrupt_pages = 0;  // from the store with the wrong bytes (recomputed; must stay 0)
  // A device failure: the request was not served (nothing new is cached).
  absl::Status status;
  std::vector<float> logits;  // model mode
  // Prefill-to-decode (engine/pd.h): computed by a prefill peer; its
  // pushes' span (first page sent to last landed, overlapping compute),
  // and the part of it after the last page was computed (in ttft_s).
  bool pd = false;
  double pd_transfer_s = 0;
  double pd_exposed_s = 0;
};

// Called with each page of a request as its KV becomes complete in L1 (the
// cached prefix at once, computed pages as their chunk finishes, a partial
// last page in model mode at the end), in page order, with the device
// synchronised: prefill-to-decode transfer pushes pages from it.
using PageHook = std::function<void(size_t page, char* l1_page)>;

class InferenceEngine {
 public:
  // `l3` may be null (L1/L2 only).
  InferenceEngine(EngineConfig config, L3Store* l3);

  RequestResult Serve(absl::Span<const int32_t> prompt, const PageHook& on_page = {});
  // Counts a request in the metrics and the hit-rate window: Serve does,
  // and so does a caller that served one around it through the cache
  // (engine/pd.h), giving the page copy counts before it began.
  void Account(const RequestResult& r, uint64_t l1_loads_before, uint64_t l1_stores_before);

  double tokens_per_s() const { return tokens_per_s_; }
  bool synthetic() const { return config_.synthetic; }
  double window_hit_rate() const;
  const CacheStats& cache_stats() const { return cache_->stats(); }
  PrefixCache& cache() { return *cache_; }
  metrics::Registry& metrics() { return metrics_; }
  const KvLayout& layout() const { return layout_; }
  Device& device() { return *device_; }
  KeySpace key_space() const { return space_; }

  // The deterministic content of a synthetic page.
  static void FillSynthetic(const PageKey& key, char* page, size_t bytes);

 private:
  void RegisterMetrics();

  EngineConfig config_;
  std::shared_ptr<Device> device_;
  std::optional<Model> model_;
  KvLayout layout_;
  KeySpace space_;
  std::unique_ptr<PrefixCache> cache_;
  double tokens_per_s_;
  std::deque<std::pair<size_t, size_t>> window_;  // (tokens, cached)
  size_t window_tokens_ = 0, window_cached_ = 0;
  metrics::Registry metrics_;
  metrics::Counter* requests_ = nullptr;
  metrics::Counter* prompt_tokens_ = nullptr;
  metrics::Family<metrics::Counter>* hit_tokens_ = nullptr;
  metrics::Family<metrics::Counter>* hit_pages_ = nullptr;
  metrics::Counter* lookup_tokens_ = nullptr;
  std::array<metrics::Counter*, kStopReasons> stops_{};
  metrics::Histogram* prefetch_seconds_ = nullptr;
  metrics::Counter* prefetch_bytes_ = nullptr;
  metrics::Gauge* window_rate_ = nullptr;
  metrics::Histogram* ttft_ = nullptr;
  metrics::Counter* copies_in_ = nullptr;   // pages L2 -> L1
  metrics::Counter* copies_out_ = nullptr;  // pages L1 -> L2
  metrics::Counter* failed_ = nullptr;
};

}  // namespace tierkv::engine
