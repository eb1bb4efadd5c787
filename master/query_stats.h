// QueryStats: what clients ask the master, per client. Engines that are not
// ours (SGLang, LMCache through the Python package) report no hit rate of
// their own, so the master counts the pages (keys) each client asks about
// and how many it finds, for PrefixMatch, Exists and GetReplicas:
// cumulative, and over a sliding window of ten buckets.
//
//   QueryStats q(&registry);                       // adds the /metrics families
//   q.Record("worker-3", QueryStats::kPrefix, /*asked=*/64, /*found=*/40, now);
//   for (const auto& row : q.Snapshot(now)) ... row.window[kPrefix].found ...
//
// Thread-safe. At most `max_clients` clients are kept by name; later ones
// count under "other", so a flood of client ids cannot grow the master or
// the metrics without bound.
#pragma once

#include <array>
#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "config/base/metrics.h"
#include "config/base/mutex.h"

namespace tierkv::master {

class QueryStats {
 public:
  enum Kind { kPrefix = 0, kExists = 1, kGet = 2 };
  static constexpr int kKinds = 3;
  struct Counts {
    uint64_t asked = 0;
    uint64_t found = 0;
  };
  struct Row {
    std::string client;
    std::array<Counts, kKinds> total;
    std::array<Counts, kKinds> window;
  };

  // `registry` may be null (no metrics).
  explicit QueryStats(metrics::Registry* registry, absl::Duration window = absl::Minutes(5),
                      size_t max_clients = 1024);

  void Record(const std::string& client, Kind kind, uint64_t asked, uint64_t found, absl::Time now);
  // One row per client, by name, plus "all" first: the sum of every client.
  std::vector<Row> Snapshot(absl::Time now) const;
  absl::Duration window() const { return window_; }
  static const char* KindName(Kind k);

 private:
  static constexpr int kBuckets = 10;
  struct Bucket {
    int64_t epoch = -1;  // which bucket-length interval since the Unix epoch
    std::array<Counts, kKinds> counts;
  };
  struct Client {
    std::array<Counts, kKinds> total;
    std::array<Bucket, kBuckets> buckets;
    std::array<metrics::Counter*, kKinds> asked_metric{};
    std::array<metrics::Counter*, kKinds> found_metric{};
  };
  int64_t Epoch(absl::Time now) const;
  void AddTo(std::array<Counts, kKinds>* window, const Client& c, int64_t epoch) const;

  const absl::Duration window_;
  const size_t max_clients_;
  metrics::Family<metrics::Counter>* asked_family_ = nullptr;
  metrics::Family<metrics::Counter>* found_family_ = nullptr;
  mutable Mutex mu_;
  std::map<std::string, Client> clients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::master
