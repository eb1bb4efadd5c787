// Tenants: each caller's keys live in its tenant's namespace, and each
// tenant's DRAM use is counted against its quota.
//
// The tenant comes from the caller's credential (auth::Identity::tenant),
// never from a request. The master's RPC faces map every key a caller
// names into the tenant's namespace before the index sees it (TenantKey),
// so two tenants' equal keys are different objects, and no tenant can
// name, probe, remove or evict another's. The default tenant (callers
// without a tenant, and every caller under --auth none) keeps keys as
// they are, so an index written before tenants reads the same.
//
// Usage is the DRAM the tenant's objects hold: size x DRAM replicas,
// charged at PutStart and released when the replicas go (revoke, put
// timeout, remove, eviction, a move to the SSD tier, a lost segment).
// Copies staged from SSD for a read are not charged: reads never fail
// for a quota. A put that would pass the tenant's quota first evicts the
// tenant's own least recently used objects (to the SSD tier where the
// evictor would move them), and fails RESOURCE_EXHAUSTED
// naming the tenant and the quota when that cannot make room. While a
// tenant uses no more than its guaranteed bytes, the evictor making room
// for others passes its objects by.
//
// Thread-safe; TenantTable's lock is a leaf (taken under shard locks).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "base/mutex.h"

namespace tierkv::master {

// Separates a tenant's name from its keys in the index. Keys never hold
// a NUL (ValidateKey), so a caller cannot spell another tenant's key.
inline constexpr char kTenantSeparator = '\0';
// The name the default tenant goes by in listings and in tenant admin
// (/v1/tenants/default); auth::ValidateTenant refuses it for a token.
inline constexpr char kDefaultTenantName[] = "default";

// `key` in `tenant`'s namespace ("" : the key itself). A key holding a
// NUL maps to "", which names no object (lookups miss, puts are refused).
std::string TenantKey(absl::string_view tenant, absl::string_view key);
// A client id in `tenant`'s namespace, for the caps and statistics kept per
// client. Unlike a key, an id holding a NUL still names a client of that
// tenant (its NULs read as '?'), so no id can step out of its tenant.
std::string ClientKey(absl::string_view tenant, absl::string_view client_id);
// The tenant of an index key ("" for the default tenant) and the key its
// tenant knows it by.
absl::string_view TenantOf(absl::string_view index_key);
absl::string_view UserKey(absl::string_view index_key);
// The name shown for `tenant` ("default" for "").
inline absl::string_view TenantName(absl::string_view tenant) {
  return tenant.empty() ? absl::string_view(kDefaultTenantName) : tenant;
}

struct TenantLimits {
  uint64_t quota_bytes = 0;       // 0: no quota
  uint64_t guaranteed_bytes = 0;  // kept from other tenants' evictions
};

struct TenantUsage {
  std::string tenant;  // "" for the default tenant
  TenantLimits limits;
  uint64_t used_bytes = 0;
  uint64_t puts_rejected = 0;     // puts refused for the quota
  uint64_t evicted_for_quota = 0; // bytes of its own evicted to fit its puts under its quota
};

class TenantTable {
 public:
  TenantTable() ABSL_NO_THREAD_SAFETY_ANALYSIS : default_(&tenants_[""]) {}
  // Charges `bytes` when the tenant stays within its quota (or has none)
  // and returns OK; RESOURCE_EXHAUSTED naming the tenant, its quota, its
  // use and the put's need otherwise (nothing charged).
  absl::Status TryCharge(absl::string_view tenant, uint64_t bytes);
  // Unconditional (recovery, and a quota lowered below use stays so).
  void Charge(absl::string_view tenant, uint64_t bytes);
  void Release(absl::string_view tenant, uint64_t bytes);
  // How many bytes the tenant must free for `bytes` more to fit its quota
  // (0: they fit, or no quota).
  uint64_t Excess(absl::string_view tenant, uint64_t bytes) const;
  // Whether the evictor must pass by a tenant's object charged `bytes`:
  // evicting it would take the tenant below its guaranteed bytes. Cheap
  // while no tenant has a guarantee.
  bool Protected(absl::string_view tenant, uint64_t bytes) const;
  // Whether any tenant has guaranteed bytes: the evictor's check of each
  // candidate is skipped (and so costs nothing) while none has.
  bool any_guarantee() const { return guarantees_.load(std::memory_order_relaxed) != 0; }
  void NoteRejected(absl::string_view tenant);
  void NoteEvictedForQuota(absl::string_view tenant, uint64_t bytes);

  // Limits of a tenant; zeros clear them.
  void SetLimits(absl::string_view tenant, TenantLimits limits);
  TenantLimits Limits(absl::string_view tenant) const;
  // Every tenant with limits or use, by name.
  std::vector<TenantUsage> Snapshot() const;
  uint64_t UsedBy(absl::string_view tenant) const;

 private:
  // Counters are atomics so a charge takes no lock once its entry is
  // found; entries never move (node map) and are never erased.
  struct Entry {
    std::atomic<uint64_t> quota{0};
    std::atomic<uint64_t> guaranteed{0};
    std::atomic<uint64_t> used{0};
    std::atomic<uint64_t> rejected{0};
    std::atomic<uint64_t> evicted{0};
  };
  // The tenant's entry, made on first use. The default tenant's (every
  // put without tenants) is found without the lock.
  Entry& Find(absl::string_view tenant) const;

  mutable Mutex mu_;
  mutable absl::node_hash_map<std::string, Entry> tenants_ ABSL_GUARDED_BY(mu_);
  Entry* const default_;
  std::atomic<int> guarantees_{0};  // tenants with guaranteed_bytes > 0
};

}  // namespace tierkv::master
