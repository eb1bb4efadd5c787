#include "master/query_stats.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "absl/hash/hash.h"
#include "master/tenants.h"

namespace tierkv::master {
namespace {

// Matched pages per PrefixMatch: 0, 1, 2, 4, ... 4096, +Inf.
std::vector<double> PageBounds() {
  std::vector<double> b{0};
  for (double v = 1; v <= 4096; v *= 2) b.push_back(v);
  return b;
}
// Reuse distance in seconds; the index keeps whole seconds.
std::vector<double> ReuseBounds() { return {0, 1, 5, 15, 60, 300, 900, 3600, 14400, 86400}; }

uint64_t Mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

KeySketch::KeySketch(size_t bytes)
    : words_(std::max<size_t>(1, (bytes + 7) / 8)),
      bits_(words_ * 64),
      w_(new std::atomic<uint64_t>[words_]()) {}

void KeySketch::Add(absl::string_view key) {
  const uint64_t h1 = absl::HashOf(key, uint8_t{0x17});
  const uint64_t h2 = Mix(h1) | 1;
  for (int i = 0; i < kHashes; ++i) {
    const uint64_t bit = (h1 + i * h2) % bits_;
    const uint64_t mask = uint64_t{1} << (bit % 64);
    if ((w_[bit / 64].fetch_or(mask, std::memory_order_relaxed) & mask) == 0) {
      set_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

bool KeySketch::MayContain(absl::string_view key) const {
  const uint64_t h1 = absl::HashOf(key, uint8_t{0x17});
  const uint64_t h2 = Mix(h1) | 1;
  for (int i = 0; i < kHashes; ++i) {
    const uint64_t bit = (h1 + i * h2) % bits_;
    if ((w_[bit / 64].load(std::memory_order_relaxed) & (uint64_t{1} << (bit % 64))) == 0) return false;
  }
  return true;
}

double KeySketch::FalsePositiveRate() const {
  return std::pow(static_cast<double>(bits_set()) / static_cast<double>(bits_), kHashes);
}

QueryStats::QueryStats(metrics::Registry* registry, QueryStatsOptions options)
    : options_(std::move(options)) {
  if (options_.sketch_bytes > 0) sketch_ = std::make_unique<KeySketch>(options_.sketch_bytes);
  if (registry == nullptr) {
    owned_.push_back(std::make_unique<metrics::Histogram>(PageBounds()));
    prefix_pages_ = owned_.back().get();
    for (int k = 0; k < kKinds; ++k) {
      owned_.push_back(std::make_unique<metrics::Histogram>(ReuseBounds()));
      reuse_[k] = owned_.back().get();
    }
    return;
  }
  auto family = [&](const std::string& name, const std::string& help) {
    return &metrics::BuildCounter().Name(name).Help(help).Register(*registry);
  };
  client_families_.asked = family("tierkv_master_query_pages_asked_total",
                                  "Pages (keys) clients asked about, by client and call (prefix, exists, get)");
  client_families_.found = family("tierkv_master_query_pages_found_total",
                                  "Pages (keys) clients asked about that were present, by client and call");
  client_families_.possible = family(
      "tierkv_master_query_pages_possible_total",
      "Pages asked that were ever stored (an infinite cache would have hit them; a Bloom filter, so may "
      "overcount by its false-positive rate), by client and call");
  client_families_.bytes_found = family("tierkv_master_query_bytes_found_total",
                                        "Bytes of the objects found, by client and call");
  if (!options_.key_prefix_separator.empty()) {
    prefix_families_.asked = family("tierkv_master_query_prefix_pages_asked_total",
                                    "Pages asked, by key prefix (model tag) and call");
    prefix_families_.found = family("tierkv_master_query_prefix_pages_found_total",
                                    "Pages found, by key prefix and call");
    prefix_families_.possible = family("tierkv_master_query_prefix_pages_possible_total",
                                       "Pages asked that were ever stored, by key prefix and call");
    prefix_families_.bytes_found = family("tierkv_master_query_prefix_bytes_found_total",
                                          "Bytes of the objects found, by key prefix and call");
  }
  prefix_pages_ = &metrics::BuildHistogram()
                              .Name("tierkv_master_prefix_match_pages")
                              .Help("Leading pages matched per PrefixMatch call")
                              .Register(*registry)
                              .Add({}, PageBounds());
  auto& reuse = metrics::BuildHistogram()
                    .Name("tierkv_master_hit_reuse_seconds")
                    .Help("Per hit: seconds since the object was put or last read, by call")
                    .Register(*registry);
  for (int k = 0; k < kKinds; ++k) {
    reuse_[k] = &reuse.Add({{"call", KindName(static_cast<Kind>(k))}}, ReuseBounds());
  }
  sketch_fp_metric_ = &metrics::BuildGauge()
                           .Name("tierkv_master_hit_bound_sketch_false_positive_rate")
                           .Help("Chance that a never-stored page counts as possible (the bound's overcount)")
                           .Register(*registry)
                           .Add({});
}

const char* QueryStats::KindName(Kind k) {
  switch (k) {
    case kPrefix:
      return "prefix";
    case kExists:
      return "exists";
    case kGet:
      return "get";
  }
  return "?";
}

std::string QueryStats::PrefixOf(absl::string_view key) const {
  size_t at = key.find(options_.key_prefix_separator);
  if (at == absl::string_view::npos) return "-";
  return std::string(key.substr(0, at));
}

int64_t QueryStats::Epoch(absl::Time now) const {
  return absl::ToInt64Milliseconds(now - absl::UnixEpoch()) /
         std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.window / kBuckets));
}

void QueryStats::NoteStored(const std::vector<std::string>& keys) {
  if (sketch_ == nullptr) return;
  for (const std::string& k : keys) sketch_->Add(k);
  if (sketch_fp_metric_ != nullptr) sketch_fp_metric_->Set(sketch_->FalsePositiveRate());
}

QueryStats::Entry& QueryStats::EntryFor(std::map<std::string, Entry>* map, std::map<std::string, size_t>* rows,
                                        const std::string& name, size_t cap, const Families& f, const char* label) {
  auto it = map->find(name);
  if (it != map->end()) return it->second;
  const absl::string_view tenant = TenantOf(name);
  size_t& held = (*rows)[std::string(tenant)];
  const std::string kept = held < cap ? name : TenantKey(tenant, "other");
  bool added = false;
  std::tie(it, added) = map->try_emplace(kept);
  if (added) ++held;
  Entry& e = it->second;
  if (f.asked != nullptr && e.metrics[0].asked == nullptr) {
    for (int k = 0; k < kKinds; ++k) {
      // A tenant's client or prefix is labelled by tenant and its own name
      // (never the index's "tenant\0name", which no scraper should see).
      metrics::Labels labels{{label, std::string(UserKey(kept))}, {"call", KindName(static_cast<Kind>(k))}};
      if (!TenantOf(kept).empty()) labels.emplace("tenant", std::string(TenantOf(kept)));
      e.metrics[k] = {&f.asked->Add(labels), &f.found->Add(labels), &f.possible->Add(labels),
                      &f.bytes_found->Add(labels)};
    }
  }
  return e;
}

void QueryStats::Add(Entry* e, Kind kind, const Counts& c, int64_t epoch) {
  auto add = [&](Counts& to) {
    to.asked += c.asked;
    to.found += c.found;
    to.possible += c.possible;
    to.bytes_found += c.bytes_found;
  };
  add(e->total[kind]);
  Bucket& b = e->buckets[epoch % kBuckets];
  if (b.epoch != epoch) b = Bucket{epoch, {}};
  add(b.counts[kind]);
  const Metrics& m = e->metrics[kind];
  if (m.asked != nullptr) {
    m.asked->Increment(static_cast<double>(c.asked));
    m.found->Increment(static_cast<double>(c.found));
    m.possible->Increment(static_cast<double>(c.possible));
    m.bytes_found->Increment(static_cast<double>(c.bytes_found));
  }
}

void QueryStats::Record(const std::string& client, Kind kind, const std::vector<std::string>& keys,
                        const std::vector<KeyHit>& hits, absl::Time now) {
  const int64_t epoch = Epoch(now);
  // Per key, outside the lock: found, possible, bytes. A PrefixMatch's
  // possible run is the leading keys ever stored; a matched key always is
  // (it may predate the sketch, e.g. recovered after a restart).
  std::vector<Counts> per_key(keys.size());
  Counts call;
  bool run = true;
  for (size_t i = 0; i < keys.size(); ++i) {
    const bool found = i < hits.size() && hits[i].found;
    bool possible = found || (sketch_ != nullptr && sketch_->MayContain(keys[i]));
    if (kind == kPrefix) {
      run = run && possible;
      possible = run;
    }
    per_key[i] = {1, found ? 1u : 0u, possible ? 1u : 0u, found ? hits[i].size : 0};
    call.asked += 1;
    call.found += per_key[i].found;
    call.possible += per_key[i].possible;
    call.bytes_found += per_key[i].bytes_found;
  }
  // The histograms are atomic: observed before the lock.
  if (kind == kPrefix) prefix_pages_->Observe(static_cast<double>(call.found));
  for (const KeyHit& h : hits) {
    if (h.found) reuse_[kind]->Observe(h.idle_s);
  }
  const std::string name = client.empty() ? "unnamed" : client;
  MutexLock lock(&mu_);
  Add(&EntryFor(&clients_, &client_rows_, name, options_.max_clients, client_families_, "client"), kind, call, epoch);
  if (!options_.key_prefix_separator.empty()) {
    // Keys of one call usually share a prefix: add runs, not keys.
    for (size_t i = 0; i < keys.size();) {
      std::string prefix = PrefixOf(keys[i]);
      Counts run_counts;
      for (; i < keys.size() && PrefixOf(keys[i]) == prefix; ++i) {
        run_counts.asked += per_key[i].asked;
        run_counts.found += per_key[i].found;
        run_counts.possible += per_key[i].possible;
        run_counts.bytes_found += per_key[i].bytes_found;
      }
      Add(&EntryFor(&prefixes_, &prefix_rows_, prefix, options_.max_prefixes, prefix_families_, "prefix"), kind, run_counts,
          epoch);
    }
  }
}

QueryStats::Row QueryStats::RowOf(const std::string& name, const Entry& e, int64_t epoch) {
  Row r;
  r.name = name;
  r.total = e.total;
  for (const Bucket& b : e.buckets) {
    if (b.epoch < 0 || b.epoch <= epoch - kBuckets || b.epoch > epoch) continue;
    for (int k = 0; k < kKinds; ++k) {
      r.window[k].asked += b.counts[k].asked;
      r.window[k].found += b.counts[k].found;
      r.window[k].possible += b.counts[k].possible;
      r.window[k].bytes_found += b.counts[k].bytes_found;
    }
  }
  return r;
}

QueryStats::View QueryStats::Snapshot(absl::Time now) const {
  const int64_t epoch = Epoch(now);
  View v;
  v.clients.resize(1);
  v.clients[0].name = "all";
  auto add = [](Counts& to, const Counts& c) {
    to.asked += c.asked;
    to.found += c.found;
    to.possible += c.possible;
    to.bytes_found += c.bytes_found;
  };
  if (sketch_ != nullptr) {
    v.sketch_bytes = sketch_->bits() / 8;
    v.sketch_false_positive_rate = sketch_->FalsePositiveRate();
  }
  MutexLock lock(&mu_);
  for (const auto& [name, e] : clients_) {
    Row r = RowOf(name, e, epoch);
    for (int k = 0; k < kKinds; ++k) {
      add(v.clients[0].total[k], r.total[k]);
      add(v.clients[0].window[k], r.window[k]);
    }
    v.clients.push_back(std::move(r));
  }
  for (const auto& [name, e] : prefixes_) v.prefixes.push_back(RowOf(name, e, epoch));
  // Per-bucket counts from prometheus-cpp's cumulative ones; its last
  // bucket is +Inf.
  auto histo = [](const metrics::Histogram& h) {
    const prometheus::ClientMetric m = h.Collect();
    Histo out;
    uint64_t below = 0;
    for (const prometheus::ClientMetric::Bucket& b : m.histogram.bucket) {
      if (!std::isinf(b.upper_bound)) out.bounds.push_back(b.upper_bound);
      out.counts.push_back(b.cumulative_count - below);
      below = b.cumulative_count;
    }
    out.count = m.histogram.sample_count;
    out.sum = m.histogram.sample_sum;
    return out;
  };
  v.prefix_match_pages = histo(*prefix_pages_);
  for (int k = 0; k < kKinds; ++k) v.reuse_seconds[k] = histo(*reuse_[k]);
  return v;
}

}  // namespace tierkv::master
