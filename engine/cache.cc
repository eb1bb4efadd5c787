#include "engine/cache.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/log.h"

namespace tierkv::engine {

absl::StatusOr<PrefetchPolicy> ParsePrefetchPolicy(const std::string& s) {
  if (s == "best_effort") return PrefetchPolicy::kBestEffort;
  if (s == "wait_complete") return PrefetchPolicy::kWaitComplete;
  if (s == "timeout") return PrefetchPolicy::kTimeout;
  return absl::InvalidArgumentError(absl::StrCat("prefetch policy '", s, "' is not best_effort, wait_complete or timeout"));
}

absl::StatusOr<WritePolicy> ParseWritePolicy(const std::string& s) {
  if (s == "write_through") return WritePolicy::kWriteThrough;
  if (s == "write_through_selective") return WritePolicy::kWriteThroughSelective;
  if (s == "write_back") return WritePolicy::kWriteBack;
  return absl::InvalidArgumentError(
      absl::StrCat("write policy '", s, "' is not write_through, write_through_selective or write_back"));
}

PrefixCache::PrefixCache(CacheConfig config, L3Store* l3)
    : config_(std::move(config)),
      l3_(l3),
      own_device_(config_.device == nullptr ? NewCpuDevice() : nullptr),
      device_(config_.device != nullptr ? config_.device : own_device_.get()),
      l1_(config_.l1_pages, config_.page_bytes, device_, KvPool::Tier::kDevice),
      l2_(std::max(config_.l2_pages, config_.l1_pages), config_.page_bytes, device_, KvPool::Tier::kHost),
      tree_(config_.page_tokens) {}

PrefixCache::~PrefixCache() = default;

std::vector<std::string> PrefixCache::RankKeys(const PageKey& key) const {
  std::vector<std::string> out;
  for (int r = 0; r < config_.tp; ++r) out.push_back(RankKey(key, r, config_.tp));
  return out;
}

void PrefixCache::Unindex(TreePage* p) {
  if (p->l1_indexed) l1_candidates_.erase({p->l1_indexed, p});
  if (p->l2_indexed) l2_candidates_.erase({p->l2_indexed, p});
  p->l1_indexed = p->l2_indexed = 0;
}

// Puts a page in the candidate sets its state allows, ordered by access.
void PrefixCache::Reindex(TreePage* p) {
  Unindex(p);
  if (p->pins > 0) return;
  if (p->l1_slot >= 0 && p->l1_children == 0) {
    p->l1_indexed = p->last_access;
    l1_candidates_.insert({p->l1_indexed, p});
  }
  if (p->l2_slot >= 0 && p->l1_slot < 0 && p->tree_children == 0) {
    p->l2_indexed = p->last_access;
    l2_candidates_.insert({p->l2_indexed, p});
  }
}

void PrefixCache::Touch(TreePage* p) {
  p->last_access = ++clock_;
  Reindex(p);
}

void PrefixCache::SetL1(TreePage* p, int slot) {
  bool was = p->l1_slot >= 0, is = slot >= 0;
  p->l1_slot = slot;
  if (p->parent != nullptr && was != is) {
    p->parent->l1_children += is ? 1 : -1;
    Reindex(p->parent);
  }
  Reindex(p);
}

bool PrefixCache::EvictL1() {
  if (l1_candidates_.empty()) return false;
  TreePage* p = l1_candidates_.begin()->second;
  int slot = p->l1_slot;
  SetL1(p, -1);  // L2 holds it (inclusive), so nothing is lost
  l1_.Free(slot);
  ++stats_.l1_evictions;
  return true;
}

bool PrefixCache::EvictL2() {
  if (l2_candidates_.empty()) return false;
  TreePage* p = l2_candidates_.begin()->second;
  if (config_.write == WritePolicy::kWriteBack && !p->in_l3 && l3_ != nullptr) PutToL3({p});
  Unindex(p);
  l2_.Free(p->l2_slot);
  TreePage* parent = p->parent;
  tree_.Remove(p);  // stays findable in L3
  if (parent != nullptr) Reindex(parent);
  ++stats_.l2_evictions;
  return true;
}

int PrefixCache::AllocateL1() {
  for (;;) {
    int s = l1_.Allocate();
    if (s >= 0 || !EvictL1()) return s;
  }
}

void PrefixCache::FreeL1(int slot) { l1_.Free(slot); }

int PrefixCache::AllocateL2() {
  for (;;) {
    int s = l2_.Allocate();
    if (s >= 0) return s;
    // L2 candidates are pages out of L1; free L1 pages to make some.
    if (!EvictL2() && !EvictL1()) return -1;
  }
}

void PrefixCache::PutToL3(const std::vector<TreePage*>& pages) {
  if (l3_ == nullptr || pages.empty()) return;
  std::vector<L3Put> items;
  std::vector<size_t> owner;
  const size_t slice = config_.page_bytes / config_.tp;
  for (size_t i = 0; i < pages.size(); ++i) {
    TreePage* p = pages[i];
    std::vector<std::string> keys = RankKeys(p->key);
    std::vector<std::string> parents = p->parent ? RankKeys(p->parent->key) : std::vector<std::string>();
    const char* data = l2_.Page(p->l2_slot);
    for (int r = 0; r < config_.tp; ++r) {
      items.push_back({keys[r], absl::string_view(data + r * slice, slice),
                       config_.tp > 1 ? p->key.Hex() : "", parents.empty() ? "" : parents[r]});
      owner.push_back(i);
    }
  }
  std::vector<absl::Status> st = l3_->Put(items);
  std::vector<bool> ok(pages.size(), true), wrote(pages.size(), true);
  for (size_t k = 0; k < st.size(); ++k) {
    // Present already (another worker put the same prefix) is success.
    if (!st[k].ok() && !absl::IsAlreadyExists(st[k])) ok[owner[k]] = false;
    if (!st[k].ok()) wrote[owner[k]] = false;
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    if (ok[i]) {
      pages[i]->in_l3 = true;
      ++stats_.l3_put_pages;
      stats_.l3_put_bytes += config_.page_bytes;
      if (wrote[i] && !written_.insert(pages[i]->key).second) {
        ++stats_.l3_reput_pages;
        stats_.l3_reput_bytes += config_.page_bytes;
      }
    } else {
      ++stats_.l3_put_failures;
    }
  }
}

const char* StopReasonName(StopReason r) {
  switch (r) {
    case StopReason::kComplete:
      return "complete";
    case StopReason::kFirstMiss:
      return "first_miss";
    case StopReason::kLost:
      return "lost";
    case StopReason::kTimeout:
      return "timeout";
    case StopReason::kStoreError:
      return "store_error";
    case StopReason::kCorrupt:
      return "corrupt";
    case StopReason::kL2Full:
      return "l2_full";
    case StopReason::kL1Full:
      return "l1_full";
  }
  return "?";
}

size_t PrefixCache::FetchFromL3(absl::Span<const int32_t> tokens, Lookup* lookup, size_t max_pages) {
  const size_t have = lookup->pages.size();
  const size_t whole = std::min(lookup->keys.size(), max_pages);
  if (have >= whole) return 0;
  lookup->stop = StopReason::kFirstMiss;
  if (l3_ == nullptr) return 0;
  absl::Time t0 = absl::Now();
  std::vector<std::string> probe;
  for (size_t i = have; i < whole; ++i) probe.push_back(RankKey(lookup->keys[i], 0, config_.tp));
  absl::StatusOr<size_t> present = l3_->PrefixMatch(probe);
  if (!present.ok()) {
    lookup->stop = StopReason::kStoreError;
    lookup->l3_error = true;
    ++stats_.l3_errors;
    lookup->fetch_time += absl::Now() - t0;
    return 0;
  }
  size_t want = *present;
  if (want >= probe.size()) lookup->stop = StopReason::kComplete;
  if (want == 0) {
    lookup->fetch_time += absl::Now() - t0;
    return 0;
  }
  // Room in L2; pages of the prefix are pinned, so they are not evicted.
  std::vector<int> slots;
  for (size_t i = 0; i < want; ++i) {
    int s = AllocateL2();
    if (s < 0) break;
    slots.push_back(s);
  }
  if (slots.size() < want) lookup->stop = StopReason::kL2Full;
  want = slots.size();
  std::vector<std::string> keys;
  std::vector<absl::Span<char>> outs;
  const size_t slice = config_.page_bytes / config_.tp;
  for (size_t i = 0; i < want; ++i) {
    std::vector<std::string> rk = RankKeys(lookup->keys[have + i]);
    for (int r = 0; r < config_.tp; ++r) {
      keys.push_back(rk[r]);
      outs.emplace_back(l2_.Page(slots[i]) + r * slice, slice);
    }
  }
  absl::Duration deadline = config_.wait_complete_timeout;
  if (config_.prefetch == PrefetchPolicy::kTimeout) deadline = config_.prefetch_timeout;
  if (config_.prefetch == PrefetchPolicy::kBestEffort) {
    // Worth waiting only as long as recomputing these pages would take.
    deadline = absl::Seconds(want * config_.page_tokens / config_.recompute_tokens_per_s);
    deadline = std::max(deadline, absl::Milliseconds(1));
  }
  std::vector<absl::Status> st = want > 0 ? l3_->Get(keys, outs, deadline) : std::vector<absl::Status>();
  // Only a leading run of complete, verified pages extends the prefix.
  size_t got = 0;
  for (; got < want; ++got) {
    bool ok = true;
    for (int r = 0; r < config_.tp; ++r) ok = ok && st[got * config_.tp + r].ok();
    if (ok && config_.verify && !config_.verify(lookup->keys[have + got], l2_.Page(slots[got]))) {
      TKV_LOG(ERROR) << "page " << lookup->keys[have + got].Hex() << " from the store failed verification";
      ++lookup->l3_corrupt;
      ++stats_.l3_corrupt_pages;
      lookup->stop = StopReason::kCorrupt;
      ok = false;
    } else if (!ok) {
      lookup->stop = StopReason::kStoreError;
      for (int r = 0; r < config_.tp; ++r) {
        const absl::Status& s = st[got * config_.tp + r];
        if (absl::IsNotFound(s)) lookup->stop = StopReason::kLost;
        if (absl::IsDeadlineExceeded(s)) lookup->stop = StopReason::kTimeout;
        if (!s.ok()) break;
      }
    }
    if (!ok) break;
  }
  if (got < want && !st.empty()) {
    for (size_t i = got; i < want; ++i) {
      for (int r = 0; r < config_.tp; ++r) {
        const absl::Status& s = st[i * config_.tp + r];
        if (!s.ok() && !absl::IsNotFound(s)) lookup->l3_error = true;
      }
    }
    if (lookup->l3_error) ++stats_.l3_errors;
  }
  for (size_t i = got; i < want; ++i) l2_.Free(slots[i]);
  if (got > 0) {
    std::vector<TreePage*> added = tree_.Insert(tokens, lookup->keys, have);
    size_t n = std::min(got, added.size());
    for (size_t i = 0; i < added.size(); ++i) {
      TreePage* p = added[i];
      if (i < n) {
        p->l2_slot = slots[i];
        p->in_l3 = true;
        ++p->pins;
        Touch(p);
        lookup->pages.push_back(p);
      }
    }
    // Pages inserted beyond what arrived were never filled: take them back
    // out, deepest first.
    for (size_t i = added.size(); i-- > n;) tree_.Remove(added[i]);
    for (size_t i = n; i < got; ++i) l2_.Free(slots[i]);
    if (have > 0) Reindex(lookup->pages[have - 1]);
    got = n;
  }
  lookup->l3_pages = got;
  lookup->fetch_bytes = got * config_.page_bytes;
  lookup->fetch_time += absl::Now() - t0;
  stats_.l3_fetch_bytes += lookup->fetch_bytes;
  stats_.l3_fetch_seconds += absl::ToDoubleSeconds(absl::Now() - t0);
  return got;
}

Lookup PrefixCache::Acquire(absl::Span<const int32_t> tokens, size_t max_pages) {
  Lookup l;
  ++stats_.lookups;
  const size_t P = config_.page_tokens;
  l.keys = PageKeys(tokens.subspan(0, tokens.size() / P * P), config_.page_tokens, config_.space);
  std::vector<TreePage*> hit = tree_.Match(tokens);
  if (hit.size() > max_pages) hit.resize(max_pages);
  std::vector<TreePage*> selective;
  for (TreePage* p : hit) {
    ++p->pins;
    ++p->hits;
    Touch(p);
    l.pages.push_back(p);
    if (config_.write == WritePolicy::kWriteThroughSelective && !p->in_l3 &&
        static_cast<int>(p->hits) >= config_.selective_hits) {
      selective.push_back(p);
    }
  }
  PutToL3(selective);
  FetchFromL3(tokens, &l, max_pages);
  // Bring the whole prefix into L1; stop where L1 has no room.
  for (size_t i = 0; i < l.pages.size(); ++i) {
    TreePage* p = l.pages[i];
    bool from_l3 = i >= hit.size();
    if (p->l1_slot >= 0) {
      ++l.l1_pages;
      continue;
    }
    int s = AllocateL1();
    if (s >= 0) {
      l.device_status = device_->CopyIn(l1_.Page(s), l2_.Page(p->l2_slot), config_.page_bytes);
      if (!l.device_status.ok()) {
        l1_.Free(s);
        s = -1;
      }
    }
    if (s < 0) {
      l.stop = StopReason::kL1Full;
      for (size_t j = i; j < l.pages.size(); ++j) {
        --l.pages[j]->pins;
        Reindex(l.pages[j]);
      }
      l.pages.resize(i);
      break;
    }
    ++stats_.l1_loads;
    SetL1(p, s);
    if (!from_l3) ++l.l2_pages;
  }
  l.l3_pages = std::min(l.l3_pages, l.pages.size() - std::min(l.pages.size(), hit.size()));
  stats_.l1_hit_pages += l.l1_pages;
  stats_.l2_hit_pages += l.l2_pages;
  stats_.l3_hit_pages += l.l3_pages;
  stats_.miss_pages += std::min(l.keys.size(), max_pages) - l.pages.size();
  stats_.lookup_pages += std::min(l.keys.size(), max_pages);
  ++stats_.stops[static_cast<int>(l.stop)];
  return l;
}

void PrefixCache::Commit(absl::Span<const int32_t> tokens, Lookup* lookup, const std::vector<int>& new_slots) {
  const size_t have = lookup->pages.size();
  std::vector<TreePage*> added = tree_.Insert(tokens, lookup->keys, have);
  std::vector<TreePage*> kept;
  size_t i = 0;
  for (; i < new_slots.size(); ++i) {
    if (i >= added.size()) {
      l1_.Free(new_slots[i]);  // partial last page, or not insertable
      continue;
    }
    TreePage* p = added[i];
    ++p->pins;  // keep it from being evicted while its L2 copy is made
    p->l1_slot = new_slots[i];
    if (p->parent != nullptr) {
      ++p->parent->l1_children;
      Reindex(p->parent);
    }
    int s = AllocateL2();
    if (s >= 0) {
      p->l2_slot = s;
      if (!device_->CopyOut(l2_.Page(s), l1_.Page(p->l1_slot), config_.page_bytes).ok()) {
        l2_.Free(s);
        p->l2_slot = -1;
      }
    }
    kept.push_back(p);
  }
  // The L2 copies, issued as one batch, land before anything reads L2.
  absl::Status synced = device_->Sync();
  if (!synced.ok()) TKV_LOG(ERROR) << "caching " << kept.size() << " new pages: " << synced.message();
  // A page that found no L2 room cannot stay (L2 is inclusive): drop it and
  // everything after it, deepest first.
  size_t ok = 0;
  while (synced.ok() && ok < kept.size() && kept[ok]->l2_slot >= 0) ++ok;
  stats_.l1_stores += ok;
  for (size_t j = kept.size(); j-- > ok;) {
    TreePage* p = kept[j];
    --p->pins;
    int slot = p->l1_slot;
    SetL1(p, -1);
    l1_.Free(slot);
    if (p->l2_slot >= 0) l2_.Free(p->l2_slot);
    p->l2_slot = -1;
    Unindex(p);
    TreePage* parent = p->parent;
    tree_.Remove(p);
    if (parent != nullptr) Reindex(parent);
  }
  kept.resize(ok);
  if (config_.write == WritePolicy::kWriteThrough) PutToL3(kept);
  for (TreePage* p : kept) {
    --p->pins;
    Touch(p);
  }
  Release(lookup);
}

void PrefixCache::Release(Lookup* lookup) {
  for (TreePage* p : lookup->pages) {
    --p->pins;
    Reindex(p);
  }
  lookup->pages.clear();
}

}  // namespace tierkv::engine
