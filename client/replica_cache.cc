#include "client/internal/replica_cache.h"

namespace tierkv::client::internal {

std::optional<Located> ReplicaCache::Lookup(const std::string& key, absl::Time now) {
  if (capacity_ == 0) return std::nullopt;
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  if (now >= it->second.lease_end) {
    entries_.erase(it);
    return std::nullopt;
  }
  Located hit = it->second;
  hit.cached = true;
  return hit;
}

uint64_t ReplicaCache::generation() const {
  MutexLock lock(&mu_);
  return generation_;
}

void ReplicaCache::Insert(const std::string& key, Located where, uint64_t since) {
  if (capacity_ == 0) return;
  MutexLock lock(&mu_);
  if (generation_ != since) return;
  if (entries_.size() >= capacity_ && !entries_.contains(key)) {
    const absl::Time now = absl::Now();
    absl::erase_if(entries_, [&](const auto& kv) { return now >= kv.second.lease_end; });
    if (entries_.size() >= capacity_) entries_.clear();
  }
  where.cached = false;
  entries_.insert_or_assign(key, std::move(where));
}

void ReplicaCache::Erase(const std::string& key) {
  MutexLock lock(&mu_);
  entries_.erase(key);
}

void ReplicaCache::Invalidate(const std::string& key) {
  MutexLock lock(&mu_);
  entries_.erase(key);
  ++generation_;
}

void ReplicaCache::Clear() {
  MutexLock lock(&mu_);
  entries_.clear();
  ++generation_;
}

size_t ReplicaCache::size() const {
  MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace tierkv::client::internal
