#include "engine/engine.h"

#include <cstring>

#include "absl/strings/str_format.h"

namespace tierkv::engine {

void InferenceEngine::FillSynthetic(const PageKey& key, char* page, size_t bytes) {
  uint64_t x = key.hi ^ (key.lo * 0x9e3779b97f4a7c15ull);
  for (size_t i = 0; i < bytes; i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(page + i, &z, std::min<size_t>(8, bytes - i));
  }
}

InferenceEngine::InferenceEngine(EngineConfig config, L3Store* l3)
    : config_(std::move(config)), device_(config_.device ? config_.device : NewCpuDevice()) {
  CacheConfig cc;
  cc.device = device_.get();
  cc.page_tokens = config_.page_tokens;
  cc.tp = config_.tp;
  if (config_.synthetic) {
    layout_ = {1, config_.tp, 1, config_.page_tokens, config_.tp};
    cc.page_bytes = config_.synthetic_bytes_per_token * config_.page_tokens;
    cc.page_bytes = (cc.page_bytes + 8 * config_.tp - 1) / (8 * config_.tp) * (8 * config_.tp);
    space_ = {absl::StrFormat("synthetic-%dB", config_.synthetic_bytes_per_token), "bf16",
              absl::StrFormat("p%d-tp%d", config_.page_tokens, config_.tp)};
    size_t bytes = cc.page_bytes;
    cc.verify = [bytes](const PageKey& key, const char* page) {
      std::vector<char> want(bytes);
      FillSynthetic(key, want.data(), bytes);
      return std::memcmp(want.data(), page, bytes) == 0;
    };
    tokens_per_s_ = config_.tokens_per_s > 0 ? config_.tokens_per_s : 20000;
  } else {
    model_.emplace(config_.model);
    layout_ = model_->Layout(config_.page_tokens, config_.tp);
    cc.page_bytes = layout_.PageBytes();
    const ModelConfig& m = config_.model;
    space_ = {absl::StrFormat("tiny-l%d-h%d-q%d-kv%d-d%d-v%d-s%d", m.layers, m.hidden, m.heads, m.kv_heads,
                              m.head_dim, m.vocab, m.seed),
              "bf16", absl::StrFormat("p%d-tp%d", config_.page_tokens, config_.tp)};
    tokens_per_s_ = config_.tokens_per_s;  // 0 until measured
  }
  cc.space = space_;
  cc.l1_pages = config_.l1_pages;
  cc.l2_pages = config_.l2_pages;
  cc.prefetch = config_.prefetch;
  cc.prefetch_timeout = config_.prefetch_timeout;
  cc.recompute_tokens_per_s = tokens_per_s_ > 0 ? tokens_per_s_ : 5000;
  cc.write = config_.write;
  cc.selective_hits = config_.selective_hits;
  cache_ = std::make_unique<PrefixCache>(cc, l3);
  RegisterMetrics();
}

void InferenceEngine::RegisterMetrics() {
  requests_ = &metrics::BuildCounter().Name("tierkv_engine_requests_total").Help("Prompts served").Register(metrics_).Add({});
  prompt_tokens_ = &metrics::BuildCounter().Name("tierkv_engine_prompt_tokens_total").Help("Prompt tokens served").Register(metrics_).Add({});
  hit_tokens_ = &metrics::BuildCounter().Name("tierkv_engine_hit_tokens_total").Help("Prompt tokens served from the cache, by tier").Register(metrics_);
  lookup_tokens_ = &metrics::BuildCounter().Name("tierkv_engine_lookup_tokens_total").Help("Prompt tokens the cache was asked for (whole pages before each prompt's last token); minus the hits, the misses").Register(metrics_).Add({});
  auto& stops = metrics::BuildCounter().Name("tierkv_engine_lookup_stops_total").Help("Cache lookups by why the cached prefix ended (complete, first_miss, lost, timeout, store_error, corrupt, l2_full, l1_full)").Register(metrics_);
  for (int i = 0; i < kStopReasons; ++i) stops_[i] = &stops.Add({{"reason", StopReasonName(static_cast<StopReason>(i))}});
  hit_pages_ = &metrics::BuildCounter().Name("tierkv_engine_hit_pages_total").Help("Pages served from the cache, by tier").Register(metrics_);
  prefetch_seconds_ = &metrics::BuildHistogram().Name("tierkv_engine_prefetch_seconds").Help("Time spent looking up and fetching from the store per request").Register(metrics_).Add({}, metrics::ExponentialBuckets(1e-5, 4, 10));
  prefetch_bytes_ = &metrics::BuildCounter().Name("tierkv_engine_prefetch_bytes_total").Help("Bytes fetched from the store").Register(metrics_).Add({});
  window_rate_ = &metrics::BuildGauge().Name("tierkv_engine_window_hit_rate").Help("Token hit rate over the last requests (sliding window)").Register(metrics_).Add({});
  ttft_ = &metrics::BuildHistogram().Name("tierkv_engine_ttft_seconds").Help("Time to first token").Register(metrics_).Add({}, metrics::ExponentialBuckets(1e-4, 2, 20));
  auto& copies = metrics::BuildCounter().Name("tierkv_engine_page_copies_total").Help("Pages copied between L2 (host) and L1 (the device pool)").Register(metrics_);
  copies_in_ = &copies.Add({{"direction", "l2_to_l1"}});
  copies_out_ = &copies.Add({{"direction", "l1_to_l2"}});
  failed_ = &metrics::BuildCounter().Name("tierkv_engine_failed_requests_total").Help("Requests the device failed (nothing of them was cached)").Register(metrics_).Add({});
  metrics::BuildGauge().Name("tierkv_engine_l1_device").Help("Where L1 lives and attention runs (the label; always 1)").Register(metrics_).Add({{"device", device_->name()}}).Set(1);
  auto& lookups = metrics::BuildGauge().Name("tierkv_engine_lookups").Help("Cache lookups since start").Register(metrics_);
  auto& used = metrics::BuildGauge().Name("tierkv_engine_pool_pages").Help("Pages in use per pool").Register(metrics_);
  metrics_.AddCollectHook([this, &lookups, &used] {
    lookups.Add({}).Set(static_cast<double>(cache_->stats().lookups));
    used.Add({{"tier", "l1"}}).Set(static_cast<double>(cache_->l1_used()));
    used.Add({{"tier", "l2"}}).Set(static_cast<double>(cache_->l2_used()));
  });
}

double InferenceEngine::window_hit_rate() const {
  return window_tokens_ == 0 ? 0 : static_cast<double>(window_cached_) / window_tokens_;
}

RequestResult InferenceEngine::Serve(absl::Span<const int32_t> prompt, const PageHook& on_page) {
  RequestResult r;
  r.tokens = prompt.size();
  const uint64_t loads = cache_->stats().l1_loads, stores = cache_->stats().l1_stores;
  const size_t P = config_.page_tokens;
  // The last token is always computed (its logits are the point), so the
  // page holding it is never taken from the cache.
  Lookup lookup = cache_->Acquire(prompt, prompt.empty() ? 0 : (prompt.size() - 1) / P);
  const size_t have = lookup.pages.size();
  r.cached_tokens = have * P;
  r.l1_tokens = lookup.l1_pages * P;
  r.l2_tokens = lookup.l2_pages * P;
  r.l3_tokens = lookup.l3_pages * P;
  r.fetch_s = absl::ToDoubleSeconds(lookup.fetch_time);
  r.fetch_bytes = lookup.fetch_bytes;
  r.store_error = lookup.l3_error;
  r.corrupt_pages = lookup.l3_corrupt;
  r.lookup_tokens = std::min(lookup.keys.size(), prompt.empty() ? 0 : (prompt.size() - 1) / P) * P;
  r.stop = lookup.stop;

  const size_t pages_needed = (prompt.size() + P - 1) / P;
  std::vector<int> new_slots;
  for (size_t i = have; i < pages_needed; ++i) {
    int s = cache_->AllocateL1();
    if (s < 0) break;
    new_slots.push_back(s);
  }
  std::vector<int> prefix_slots;
  for (TreePage* p : lookup.pages) prefix_slots.push_back(p->l1_slot);
  auto page_of = [&](size_t i) -> char* {
    return cache_->L1Page(i < have ? prefix_slots[i] : new_slots[i - have]);
  };
  const size_t computed = prompt.size() - r.cached_tokens;
  size_t pages_told = 0;  // pages handed to on_page so far
  auto tell = [&](size_t complete) {
    if (!on_page || complete <= pages_told) return;
    if (absl::Status s = device_->Sync(); !s.ok()) {
      if (r.status.ok()) r.status = s;
      return;
    }
    for (; pages_told < complete; ++pages_told) on_page(pages_told, page_of(pages_told));
  };
  if (new_slots.size() + have < pages_needed) {
    // L1 is full of pinned pages (a prompt longer than L1): serve without
    // caching this request.
    for (int s : new_slots) cache_->FreeL1(s);
    new_slots.clear();
    cache_->Release(&lookup);
    r.compute_s = computed / (tokens_per_s_ > 0 ? tokens_per_s_ : 5000);
  } else if (config_.synthetic) {
    tell(have);
    const size_t bytes = cache_->config().page_bytes;
    // Pages are made on the host; on a GPU they are staged and copied in
    // (and the staging lives until Commit's sync).
    std::vector<char> staging(device_->host_addressable() ? 0 : (prompt.size() / P - have) * bytes);
    for (size_t i = have; i < prompt.size() / P && r.status.ok(); ++i) {
      if (device_->host_addressable()) {
        FillSynthetic(lookup.keys[i], page_of(i), bytes);
      } else {
        char* host = staging.data() + (i - have) * bytes;
        FillSynthetic(lookup.keys[i], host, bytes);
        r.status = device_->CopyIn(page_of(i), host, bytes);
      }
      if (r.status.ok()) tell(i + 1);
    }
    if (r.status.ok()) r.status = device_->Sync();
    r.compute_s = computed / tokens_per_s_;
  } else {
    absl::Time t0 = absl::Now();
    tell(have);
    absl::StatusOr<std::vector<float>> logits =
        model_->Prefill(prompt, r.cached_tokens, layout_, page_of, *device_, [&](size_t done) { tell(done); });
    r.compute_s = absl::ToDoubleSeconds(absl::Now() - t0);
    if (logits.ok()) {
      r.logits = std::move(*logits);
    } else {
      r.status = logits.status();
    }
    // The cost model follows what the model measures.
    double rate = computed / std::max(r.compute_s, 1e-9);
    tokens_per_s_ = tokens_per_s_ > 0 ? 0.8 * tokens_per_s_ + 0.2 * rate : rate;
  }
  if (r.status.ok() && !lookup.device_status.ok()) r.status = lookup.device_status;
  if (!r.status.ok()) {
    // Pages the device may not have written are not cached.
    for (int s : new_slots) cache_->FreeL1(s);
    new_slots.clear();
    cache_->Release(&lookup);
  }
  if (!new_slots.empty()) cache_->Commit(prompt, &lookup, new_slots);
  // Nothing of this request stays in flight: the next one may reuse the
  // L2 slots its copies read.
  if (absl::Status s = device_->Sync(); !s.ok() && r.status.ok()) r.status = s;
  r.ttft_s = r.fetch_s + r.compute_s;
  r.ttft_nocache_s = prompt.size() / (tokens_per_s_ > 0 ? tokens_per_s_ : 5000);
  // A model-mode request that hit nothing measured its no-cache TTFT.
  if (!config_.synthetic && r.cached_tokens == 0) r.ttft_nocache_s = r.ttft_s;

  Account(r, loads, stores);
  return r;
}

void InferenceEngine::Account(const RequestResult& r, uint64_t loads, uint64_t stores) {
  const size_t P = config_.page_tokens;
  requests_->Increment();
  copies_in_->Increment(static_cast<double>(cache_->stats().l1_loads - loads));
  copies_out_->Increment(static_cast<double>(cache_->stats().l1_stores - stores));
  if (!r.status.ok()) failed_->Increment();
  prompt_tokens_->Increment(static_cast<double>(r.tokens));
  lookup_tokens_->Increment(static_cast<double>(r.lookup_tokens));
  stops_[static_cast<int>(r.stop)]->Increment();
  hit_tokens_->Add({{"tier", "l1"}}).Increment(static_cast<double>(r.l1_tokens));
  hit_tokens_->Add({{"tier", "l2"}}).Increment(static_cast<double>(r.l2_tokens));
  hit_tokens_->Add({{"tier", "l3"}}).Increment(static_cast<double>(r.l3_tokens));
  hit_pages_->Add({{"tier", "l1"}}).Increment(static_cast<double>(r.l1_tokens / P));
  hit_pages_->Add({{"tier", "l2"}}).Increment(static_cast<double>(r.l2_tokens / P));
  hit_pages_->Add({{"tier", "l3"}}).Increment(static_cast<double>(r.l3_tokens / P));
  prefetch_seconds_->Observe(r.fetch_s);
  prefetch_bytes_->Increment(static_cast<double>(r.fetch_bytes));
  ttft_->Observe(r.ttft_s);
  window_.emplace_back(r.tokens, r.cached_tokens);
  window_tokens_ += r.tokens;
  window_cached_ += r.cached_tokens;
  while (window_.size() > config_.window) {
    window_tokens_ -= window_.front().first;
    window_cached_ -= window_.front().second;
    window_.pop_front();
  }
  window_rate_->Set(window_hit_rate());
}

}  // namespace tierkv::engine
