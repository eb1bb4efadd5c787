#include "client/internal/replica_cache.h"

#include <algorithm>
#include <iterator>

namespace tierkv::client::internal {

ReplicaCache::~ReplicaCache() {
  MutexLock lock(&mu_);
  for (const auto& [key, where] : entries_) Drop(key, where);
}

void ReplicaCache::Drop(const std::string& key, const Located& where) {
  if (where.lease_token != 0 && release_) release_(key, where.lease_token, where.lease_expiry_ms);
}

void ReplicaCache::EraseEntry(absl::flat_hash_map<std::string, Located>::iterator it) {
  Drop(it->first, it->second);
  entries_.erase(it);
}

std::optional<Located> ReplicaCache::Lookup(const std::string& key, absl::Time now) {
  if (capacity_ == 0) return std::nullopt;
  MutexLock lock(&mu_);
  // Not forgotten: the next answer, if it names the same view, makes them
  // serve again.
  if (now - heard_ > fresh_) return std::nullopt;
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  if (now >= it->second.lease_end) {
    EraseEntry(it);
    return std::nullopt;
  }
  Located hit = it->second;
  hit.cached = true;
  hit.lease_token = 0;  // the entry keeps the count
  return hit;
}

uint64_t ReplicaCache::generation() const {
  MutexLock lock(&mu_);
  return generation_;
}

void ReplicaCache::Insert(const std::string& key, Located where, uint64_t since, absl::Time now) {
  MutexLock lock(&mu_);
  const bool counted = where.lease_token != 0;
  if (capacity_ == 0 || generation_ != since || (counted && hold_ <= absl::ZeroDuration())) {
    Drop(key, where);
    return;
  }
  if (entries_.size() >= capacity_ && !entries_.contains(key)) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto next = std::next(it);
      if (now >= it->second.lease_end) EraseEntry(it);
      it = next;
    }
    // Keeping more than half would bring the next full scan back within a
    // few inserts: a client reading more keys per lease than the cache
    // holds would scan it on every get.
    if (entries_.size() > capacity_ / 2) {
      for (const auto& [k, w] : entries_) Drop(k, w);
      entries_.clear();
      held_.clear();
    }
  }
  where.cached = false;
  if (counted) {
    where.lease_end = std::min(where.lease_end, now + hold_);
    held_.push_back({where.lease_end, key, where.lease_token});
  }
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    Drop(key, it->second);  // replaced: what it held goes back
    it->second = std::move(where);
  } else {
    entries_.emplace(key, std::move(where));
  }
}

void ReplicaCache::Heard(absl::Time asked, uint64_t epoch, uint64_t membership) {
  MutexLock lock(&mu_);
  const bool viewed = heard_ != absl::InfinitePast();  // an answer came before
  if (viewed && (epoch != epoch_ || membership != membership_)) {
    if (asked < view_changed_) return;  // from before the change this client already heard
    ForgetAll();
    view_changed_ = absl::Now();
  }
  epoch_ = epoch;
  membership_ = membership;
  heard_ = std::max(heard_, asked);
}

void ReplicaCache::ReleaseEnded(absl::Time now) {
  MutexLock lock(&mu_);
  while (!held_.empty() && held_.front().end <= now) {
    auto it = entries_.find(held_.front().key);
    if (it != entries_.end() && it->second.lease_token == held_.front().token) EraseEntry(it);
    held_.pop_front();
  }
}

void ReplicaCache::Erase(const std::string& key, bool give_back) {
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  if (give_back) {
    EraseEntry(it);
  } else {
    entries_.erase(it);
  }
}

void ReplicaCache::Invalidate(const std::string& key) {
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) EraseEntry(it);
  ++generation_;
}

void ReplicaCache::Clear() {
  MutexLock lock(&mu_);
  ForgetAll();
}

void ReplicaCache::ForgetAll() {
  for (const auto& [key, where] : entries_) Drop(key, where);
  entries_.clear();
  held_.clear();
  ++generation_;
}

size_t ReplicaCache::size() const {
  MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace tierkv::client::internal
