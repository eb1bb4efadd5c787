// PrefixCache: HiCache-style tiered KV cache. L1 (device pool) and L2 (host
// pool) hold pages indexed by a radix tree; L3 is tierkv.
//
//   Lookup l = cache.Acquire(tokens);     // longest cached prefix, now in L1
//   ... compute the rest into cache.AllocateL1() slots ...
//   cache.Commit(tokens, &l, new_slots); // cache new pages, apply write policy
//
// L1 lives on the cache's Device (GPU memory with cuda): pages move between
// L1 and L2 only through the device's batched copies, never by the CPU.
//
// Acquire matches the longest prefix in L1/L2, asks L3 with one PrefixMatch
// how many following pages it holds, fetches those with one batched read
// straight into L2 slots (bounded by the prefetch policy: a miss never
// blocks), and issues the copies of L2 pages up to L1 (they land before
// the device's next attention reads them). L2 is inclusive of L1, so
// dropping a page from L1 never loses it. Eviction is leaf-first LRU in
// each tier: a page goes only after every cached page extending it. Pages
// evicted from L2 stay findable in L3.
//
// Write policies (L2 -> L3): write_through puts every new page;
// write_through_selective puts a page once it has been hit N times;
// write_back puts a page when it is evicted from L2.
//
// With tp > 1 each page is `tp` keys, one per rank's slice, put as one
// group, so L3 holds a page wholly or not at all.
//
// Not thread-safe: one engine thread drives it.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/kv_pool.h"
#include "engine/l3.h"
#include "engine/page_key.h"
#include "engine/radix_tree.h"

namespace tierkv::engine {

enum class PrefetchPolicy { kBestEffort, kWaitComplete, kTimeout };
enum class WritePolicy { kWriteThrough, kWriteThroughSelective, kWriteBack };

absl::StatusOr<PrefetchPolicy> ParsePrefetchPolicy(const std::string& s);
absl::StatusOr<WritePolicy> ParseWritePolicy(const std::string& s);

struct CacheConfig {
  int page_tokens = 64;
  size_t page_bytes = 0;  // a whole page, all ranks
  int tp = 1;
  size_t l1_pages = 256;
  size_t l2_pages = 1024;
  KeySpace space;
  PrefetchPolicy prefetch = PrefetchPolicy::kWaitComplete;
  // kTimeout: the fetch deadline. kBestEffort: the deadline is what
  // recomputing the pages would cost at recompute_tokens_per_s.
  absl::Duration prefetch_timeout = absl::Milliseconds(200);
  double recompute_tokens_per_s = 50000;
  absl::Duration wait_complete_timeout = absl::Seconds(10);
  WritePolicy write = WritePolicy::kWriteThrough;
  int selective_hits = 2;
  // Checks a page fetched from L3 (synthetic mode compares it with the
  // content its key determines); null accepts every page.
  std::function<bool(const PageKey&, const char* page)> verify;
  // Where L1 lives; null: host memory. Must outlive the cache.
  Device* device = nullptr;
};

// Why a lookup's prefix ended where it did (the last stage that cut it).
// kFirstMiss is the master's PrefixMatch stopping short (its asked minus
// found pages), or no store; the rest are pages the store matched but the
// engine could not use.
enum class StopReason : uint8_t {
  kComplete = 0,  // every page the lookup could match hit
  kFirstMiss,     // the next page is in no tier
  kLost,          // matched, then NOT_FOUND at the read: evicted since, or its read lease ran out
  kTimeout,       // the read missed its prefetch deadline
  kStoreError,    // the store failed (lookup or read)
  kCorrupt,       // a page came back with the wrong bytes
  kL2Full,        // no L2 room for the pages to fetch
  kL1Full,        // no L1 room (or a failed copy into L1) for the prefix
};
inline constexpr int kStopReasons = 8;
// The metric label: "complete", "first_miss", "lost", "timeout", "store_error",
// "corrupt", "l2_full", "l1_full".
const char* StopReasonName(StopReason r);

struct Lookup {
  std::vector<PageKey> keys;     // every whole page of the request
  std::vector<TreePage*> pages;  // the cached prefix, in L1, pinned
  size_t l1_pages = 0, l2_pages = 0, l3_pages = 0;
  absl::Duration fetch_time;
  uint64_t fetch_bytes = 0;
  bool l3_error = false;         // the store failed (the request recomputes)
  size_t l3_corrupt = 0;         // pages the store returned with the wrong bytes (never used)
  absl::Status device_status;    // a failed copy into L1 (the prefix stops there)
  StopReason stop = StopReason::kComplete;
};

struct CacheStats {
  uint64_t lookups = 0;
  uint64_t l1_hit_pages = 0, l2_hit_pages = 0, l3_hit_pages = 0, miss_pages = 0;
  uint64_t l3_fetch_bytes = 0, l3_put_pages = 0, l3_put_bytes = 0, l3_put_failures = 0;
  // Pages this cache wrote to L3 once already and wrote again: the store
  // had evicted them, and a later request needed them.
  uint64_t l3_reput_pages = 0, l3_reput_bytes = 0;
  uint64_t l3_errors = 0;
  uint64_t l3_corrupt_pages = 0;  // read back, failed verification, not used
  uint64_t l1_evictions = 0, l2_evictions = 0;
  uint64_t l1_loads = 0, l1_stores = 0;  // pages copied L2 -> L1, L1 -> L2
  double l3_fetch_seconds = 0;
  uint64_t lookup_pages = 0;  // pages lookups could have matched (before the last token)
  std::array<uint64_t, kStopReasons> stops{};  // lookups by StopReason
};

class PrefixCache {
 public:
  // `l3` may be null (no offload tier); it must outlive the cache.
  PrefixCache(CacheConfig config, L3Store* l3);
  ~PrefixCache();

  // At most `max_pages` prefix pages are matched (a caller that must
  // compute the last token passes (tokens - 1) / page_tokens).
  Lookup Acquire(absl::Span<const int32_t> tokens, size_t max_pages = SIZE_MAX);
  // An L1 slot for a page being computed, evicting if needed; -1 when every
  // L1 page is pinned.
  int AllocateL1();
  void FreeL1(int slot);
  // An L1 page's device address (not host-addressable on a GPU device).
  char* L1Page(int slot) const { return l1_.Page(slot); }
  char* L2Page(int slot) const { return l2_.Page(slot); }
  // `new_slots[i]` holds page lookup.pages.size() + i of `tokens`; whole
  // pages are cached, any trailing partial page's slot is freed. Unpins the
  // prefix. The lookup must not be used afterwards. The pages' L1 contents
  // must be complete on the device (they are copied to L2 from there).
  void Commit(absl::Span<const int32_t> tokens, Lookup* lookup, const std::vector<int>& new_slots);
  // Unpins without caching anything new.
  void Release(Lookup* lookup);

  const CacheStats& stats() const { return stats_; }
  const CacheConfig& config() const { return config_; }
  size_t tree_pages() const { return tree_.size(); }
  size_t l1_used() const { return l1_.used(); }
  size_t l2_used() const { return l2_.used(); }
  KvPool& l2_pool() { return l2_; }
  KvPool& l1_pool() { return l1_; }
  Device& device() { return *device_; }

 private:
  void Touch(TreePage* p);
  void Reindex(TreePage* p);
  void Unindex(TreePage* p);
  bool EvictL1();
  bool EvictL2();
  int AllocateL2();
  void SetL1(TreePage* p, int slot);
  void PutToL3(const std::vector<TreePage*>& pages);
  std::vector<std::string> RankKeys(const PageKey& key) const;
  size_t FetchFromL3(absl::Span<const int32_t> tokens, Lookup* lookup, size_t max_pages);

  CacheConfig config_;
  L3Store* l3_;
  std::unique_ptr<Device> own_device_;  // when config.device is null
  Device* device_;
  KvPool l1_, l2_;
  RadixTree tree_;
  uint64_t clock_ = 0;
  std::set<std::pair<uint64_t, TreePage*>> l1_candidates_, l2_candidates_;
  absl::flat_hash_set<PageKey, PageKeyHash> written_;  // pages this cache wrote to L3
  CacheStats stats_;
};

}  // namespace tierkv::engine
