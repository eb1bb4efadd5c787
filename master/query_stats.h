// QueryStats: what clients ask the master, and how close the store comes
// to what any cache could have served. Engines that are not ours (SGLang,
// LMCache through the Python package) report no hit rate of their own, so
// the master counts, for PrefixMatch, Exists and GetReplicas, per client
// and per key prefix (a model tag): pages (keys) asked, pages found, bytes
// found, and pages "possible" (asked pages that were ever stored, by a
// sketch fed at PutEnd: an infinite cache would have hit them). Cumulative,
// and over a sliding window of ten buckets. Also, over all clients: a
// histogram of matched pages per PrefixMatch and of the reuse distance of
// hits (seconds since the object was put or last read).
//
//   QueryStats q(&registry, {});                  // adds the /metrics families
//   q.NoteStored(keys);                           // at PutEnd, the keys that completed
//   q.Record("worker-3", QueryStats::kPrefix, keys, hits, now);
//   QueryStats::View v = q.Snapshot(now);         // v.clients[0] is "all"
//
// Tenants (master/tenants.h): keys come as the index holds them, and a
// tenant's client id as TenantKey(tenant, id), so a tenant's clients and
// prefixes are rows of their own ("tenant\0name"); /metrics labels them
// with `tenant` and the name, and /v1/stats shows a tenant's caller its own.
//
// Thread-safe. At most `max_clients` clients and `max_prefixes` prefixes
// of each tenant are kept by name; later ones count under that tenant's
// "other", so a flood of client ids or keys cannot grow the master or the
// metrics without bound, and one tenant's flood pushes no other tenant's
// rows out (tenants come from credentials, so they are bounded by the
// token file). The sketch is lock-free.
#pragma once

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "master/object_index.h"

namespace tierkv::master {

// A Bloom filter over keys: MayContain is true for every key added (no
// false negatives) and for a fraction FalsePositiveRate() of others, which
// grows as it fills: with kHashes = 7 it is about 1 % while fewer than
// bits/9.6 distinct keys were added, 10 % at bits/4.8. Lock-free.
class KeySketch {
 public:
  static constexpr int kHashes = 7;
  // `bytes` of bits, rounded up to whole 64-bit words (at least one).
  explicit KeySketch(size_t bytes);
  void Add(absl::string_view key);
  bool MayContain(absl::string_view key) const;
  size_t bits() const { return bits_; }
  uint64_t bits_set() const { return set_.load(std::memory_order_relaxed); }
  // (bits set / bits)^kHashes: the chance that a key never added reads as present.
  double FalsePositiveRate() const;

 private:
  const size_t words_;
  const size_t bits_;
  std::unique_ptr<std::atomic<uint64_t>[]> w_;
  std::atomic<uint64_t> set_{0};
};

struct QueryStatsOptions {
  absl::Duration window = absl::Minutes(5);
  size_t max_clients = 1024;
  // Per-prefix rows: the part of each key before the first occurrence of
  // this separator ("llama3@..." -> "llama3" for "@"); a key without it
  // counts under "-". Empty: no per-prefix rows.
  std::string key_prefix_separator;
  size_t max_prefixes = 64;
  // The sketch of stored keys behind "possible"; 0: no bound (possible
  // stays 0).
  size_t sketch_bytes = 8u << 20;
};

class QueryStats {
 public:
  enum Kind { kPrefix = 0, kExists = 1, kGet = 2 };
  static constexpr int kKinds = 3;
  struct Counts {
    uint64_t asked = 0;     // pages asked
    uint64_t found = 0;     // pages found (PrefixMatch: the matched run)
    uint64_t possible = 0;  // asked pages ever stored (PrefixMatch: the leading run ever stored)
    uint64_t bytes_found = 0;  // sizes of the found objects
  };
  struct Row {
    std::string name;  // client id or key prefix
    std::array<Counts, kKinds> total;
    std::array<Counts, kKinds> window;
  };
  struct Histo {
    std::vector<double> bounds;    // upper bounds (le), ascending
    std::vector<uint64_t> counts;  // per bucket, not cumulative; last is +Inf
    uint64_t count = 0;
    double sum = 0;
  };
  struct View {
    std::vector<Row> clients;   // "all" first, then by name
    std::vector<Row> prefixes;  // by name; empty without a separator
    Histo prefix_match_pages;   // matched pages per PrefixMatch call
    std::array<Histo, kKinds> reuse_seconds;  // per hit, by call
    uint64_t sketch_bytes = 0;
    double sketch_false_positive_rate = 0;
  };

  // `registry` may be null (no metrics).
  QueryStats(metrics::Registry* registry, QueryStatsOptions options);

  // Keys that reached PutEnd: "ever stored" from now on.
  void NoteStored(const std::vector<std::string>& keys);
  // One call by `client`: `hits` is what the index saw, one per key for
  // kExists and kGet, one per matched key for kPrefix (keys past it missed).
  void Record(const std::string& client, Kind kind, const std::vector<std::string>& keys,
              const std::vector<KeyHit>& hits, absl::Time now);
  View Snapshot(absl::Time now) const;
  absl::Duration window() const { return options_.window; }
  static const char* KindName(Kind k);
  // The prefix a key counts under (see QueryStatsOptions).
  std::string PrefixOf(absl::string_view key) const;

 private:
  static constexpr int kBuckets = 10;
  struct Bucket {
    int64_t epoch = -1;  // which bucket-length interval since the Unix epoch
    std::array<Counts, kKinds> counts;
  };
  struct Metrics {
    metrics::Counter* asked = nullptr;
    metrics::Counter* found = nullptr;
    metrics::Counter* possible = nullptr;
    metrics::Counter* bytes_found = nullptr;
  };
  struct Entry {
    std::array<Counts, kKinds> total;
    std::array<Bucket, kBuckets> buckets;
    std::array<Metrics, kKinds> metrics{};
  };
  struct Families {
    metrics::Family<metrics::Counter>* asked = nullptr;
    metrics::Family<metrics::Counter>* found = nullptr;
    metrics::Family<metrics::Counter>* possible = nullptr;
    metrics::Family<metrics::Counter>* bytes_found = nullptr;
  };
  int64_t Epoch(absl::Time now) const;
  // Rows per tenant in `map`, counted in `rows`: at most `cap` by name per
  // tenant, the rest under that tenant's "other".
  Entry& EntryFor(std::map<std::string, Entry>* map, std::map<std::string, size_t>* rows, const std::string& name,
                  size_t cap, const Families& f, const char* label) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Add(Entry* e, Kind kind, const Counts& c, int64_t epoch);
  static Row RowOf(const std::string& name, const Entry& e, int64_t epoch);

  const QueryStatsOptions options_;
  std::unique_ptr<KeySketch> sketch_;  // null when options_.sketch_bytes == 0
  Families client_families_, prefix_families_;
  // The histograms /v1/stats reads back and /metrics exports: registered in
  // the registry, or owned here when there is none. Never null.
  std::vector<std::unique_ptr<metrics::Histogram>> owned_;
  metrics::Histogram* prefix_pages_ = nullptr;
  std::array<metrics::Histogram*, kKinds> reuse_{};
  metrics::Gauge* sketch_fp_metric_ = nullptr;
  mutable Mutex mu_;
  std::map<std::string, Entry> clients_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Entry> prefixes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, size_t> client_rows_ ABSL_GUARDED_BY(mu_);  // per tenant
  std::map<std::string, size_t> prefix_rows_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::master
