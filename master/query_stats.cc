#include "master/query_stats.h"

namespace tierkv::master {

QueryStats::QueryStats(metrics::Registry* registry, absl::Duration window, size_t max_clients)
    : window_(window), max_clients_(max_clients) {
  if (registry == nullptr) return;
  asked_family_ = &metrics::BuildCounter()
                       .Name("tierkv_master_query_pages_asked_total")
                       .Help("Pages (keys) clients asked about, by client and call (prefix, exists, get)")
                       .Register(*registry);
  found_family_ = &metrics::BuildCounter()
                       .Name("tierkv_master_query_pages_found_total")
                       .Help("Pages (keys) clients asked about that were present, by client and call")
                       .Register(*registry);
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

int64_t QueryStats::Epoch(absl::Time now) const {
  return absl::ToInt64Milliseconds(now - absl::UnixEpoch()) /
         std::max<int64_t>(1, absl::ToInt64Milliseconds(window_ / kBuckets));
}

void QueryStats::Record(const std::string& client, Kind kind, uint64_t asked, uint64_t found,
                        absl::Time now) {
  const int64_t epoch = Epoch(now);
  MutexLock lock(&mu_);
  auto it = clients_.find(client.empty() ? "unnamed" : client);
  if (it == clients_.end()) {
    const std::string name = clients_.size() < max_clients_ ? (client.empty() ? "unnamed" : client) : "other";
    it = clients_.try_emplace(name).first;
    if (asked_family_ != nullptr && it->second.asked_metric[0] == nullptr) {
      for (int k = 0; k < kKinds; ++k) {
        metrics::Labels labels{{"client", name}, {"call", KindName(static_cast<Kind>(k))}};
        it->second.asked_metric[k] = &asked_family_->Add(labels);
        it->second.found_metric[k] = &found_family_->Add(labels);
      }
    }
  }
  Client& c = it->second;
  c.total[kind].asked += asked;
  c.total[kind].found += found;
  Bucket& b = c.buckets[epoch % kBuckets];
  if (b.epoch != epoch) b = Bucket{epoch, {}};
  b.counts[kind].asked += asked;
  b.counts[kind].found += found;
  if (c.asked_metric[kind] != nullptr) {
    c.asked_metric[kind]->Increment(static_cast<double>(asked));
    c.found_metric[kind]->Increment(static_cast<double>(found));
  }
}

void QueryStats::AddTo(std::array<Counts, kKinds>* window, const Client& c, int64_t epoch) const {
  for (const Bucket& b : c.buckets) {
    if (b.epoch < 0 || b.epoch <= epoch - kBuckets || b.epoch > epoch) continue;
    for (int k = 0; k < kKinds; ++k) {
      (*window)[k].asked += b.counts[k].asked;
      (*window)[k].found += b.counts[k].found;
    }
  }
}

std::vector<QueryStats::Row> QueryStats::Snapshot(absl::Time now) const {
  const int64_t epoch = Epoch(now);
  std::vector<Row> rows(1);
  rows[0].client = "all";
  MutexLock lock(&mu_);
  for (const auto& [name, c] : clients_) {
    Row r;
    r.client = name;
    r.total = c.total;
    AddTo(&r.window, c, epoch);
    for (int k = 0; k < kKinds; ++k) {
      rows[0].total[k].asked += r.total[k].asked;
      rows[0].total[k].found += r.total[k].found;
      rows[0].window[k].asked += r.window[k].asked;
      rows[0].window[k].found += r.window[k].found;
    }
    rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace tierkv::master
