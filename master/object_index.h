// ObjectIndex: key -> object (size, state, replicas, lease, pin, group,
// parent), plus the eviction order. The heart of the master.
//
// Sharded by key hash; each shard has its own lock, slot array and two
// leaf-LRU lists (unpinned, soft-pinned). An object is an eviction
// candidate only while it is COMPLETE and has no cached children (unless
// IndexOptions::eviction is kLru), which is what makes eviction
// prefix-aware in O(1): evicting a leaf decrements its parent's child
// count, and a parent whose count reaches zero joins the candidates.
// docs/eviction.md describes the order in full.
//
// States: PENDING (between PutStart and PutEnd; invisible, reclaimed after
// the put timeout) and COMPLETE (immutable, visible). Objects in a group
// are visible only while the group is; a group turns visible in one step
// when its last member completes and dies whole.
//
// Lock order: shard locks in ascending shard index, then the group table
// lock, then the segment registry's lock. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "master/persistence.h"
#include "master/segment_registry.h"
#include "master/tenants.h"

namespace tierkv::master {

// Told of every object that becomes stored and of every stored object that
// leaves (remove, eviction, a lost segment, a dead group, recovery dropping
// a partial group), so an outside party (the KV-event publisher,
// master/kv_events.h) can mirror the index. Calls come from the index's
// request and background threads with the key's shard lock held, which is
// what keeps a key's stored/removed order; implementations must therefore
// only copy and enqueue: never block, never call back into the index.
class IndexListener {
 public:
  virtual ~IndexListener() = default;
  // `key` reached PutEnd (or was restored by Recover). `parent_key` is the
  // parent the put named (empty: none); `size` its bytes.
  virtual void OnStored(absl::string_view key, absl::string_view parent_key, uint64_t size) = 0;
  // A stored `key` left the index (pending puts that never completed are
  // not reported: nobody was told of them).
  virtual void OnRemoved(absl::string_view key) = 0;
};

// How eviction picks among complete, unleased objects (docs/eviction.md).
enum class EvictionPolicy : uint8_t {
  // Every object is a candidate, in CLOCK order; parent keys are ignored.
  kLru,
  // Only objects with no cached child; a parent whose last child left
  // rejoins at the old end keeping the reference bit of its last touch, so
  // a chain read once long ago is sent round again (the first design; kept
  // for comparison).
  kPrefix,
  // Only objects with no cached child; a rejoining parent carries its
  // chain's recency: the child that just left was the oldest candidate, so
  // the parent is next unless it was touched after that child.
  kChain,
};
// "lru", "prefix", "chain"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(absl::string_view name);
absl::string_view EvictionPolicyName(EvictionPolicy policy);

// One object the evictor asks a daemon to copy from its DRAM extent to its
// SSD tier (the daemon's /tier/offload; store/daemon.h).
struct TierOrder {
  std::string key;
  uint64_t offset = 0;
  uint64_t length = 0;
};
// Sends the orders to the daemon whose tier answers at `tier_http`; one
// status per order, in order (a short answer fails the rest). Blocking,
// and bounded by `timeout`.
using OffloadFn = std::function<std::vector<absl::Status>(const std::string& tier_http,
                                                          const std::vector<TierOrder>& orders,
                                                          absl::Duration timeout)>;

struct IndexOptions {
  EvictionPolicy eviction = EvictionPolicy::kChain;
  int shards = 16;
  absl::Duration lease_ttl = absl::Seconds(5);
  absl::Duration put_timeout = absl::Seconds(30);
  // Space of a put that was revoked or timed out is reused only this long
  // after: a writer's bytes still in flight (a stalled peer, a slow copy)
  // must not land on the next object's extent. Transports also refuse
  // writes past their deadline; this covers clock skew and stragglers.
  absl::Duration revoke_grace = absl::Seconds(5);
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  int max_replicas = 8;
  size_t max_key_bytes = 4096;
  // Not owned; must outlive the index. Null: nobody listens.
  IndexListener* listener = nullptr;
  // Offload on eviction (docs/eviction.md, "SSD tier"): an object the
  // evictor picks that was read at least once since its put, has one
  // replica, no group, and whose daemon reports an SSD tier with room is
  // copied there instead of dropped, and stays readable as an SSD replica
  // once the daemon confirms. Its extent is not reused until the daemon
  // has answered (an object removed meanwhile frees it only
  // 2 x offload_timeout after the order went out); an order that fails or
  // does not answer within offload_timeout is a plain eviction. Empty: off.
  OffloadFn offload;
  absl::Duration offload_timeout = absl::Seconds(2);
  // Admission to the SSD tier: also objects never read since their put
  // (--ssd-admission=all), for a tier large enough that keeping every
  // evicted page beats keeping the pages proven reused (docs/eviction.md).
  bool offload_unread = false;
  // The read lease of a copy staged from SSD (at most lease_ttl). Staged
  // reads are counted (LookupOut::lease_token): a reader gives its lease
  // back when done, so this bounds only readers that never do (dead, or an
  // older client), whose copies must not keep the next prefix's pages out
  // of DRAM for a whole lease_ttl. A reader slower than its lease misses;
  // never wrong bytes (its trailer check, and no staged byte lands past it).
  absl::Duration stage_lease = absl::Seconds(2);
  // An evicted staged copy's extent is reused this long after its lease
  // ends (at most revoke_grace): daemons write no staged bytes past the
  // reader's lease (X-Tierkv-Stage-Within-Ms), so this covers only the
  // reader's request still in transit.
  absl::Duration stage_grace = absl::Seconds(1);
  // Memory pressure: while DRAM is evicted (past the high watermark), or
  // when the evictor cannot reach its target or an SSD hit finds no DRAM to
  // stage in, every read (from DRAM or staged) is counted and leased for
  // pressure_lease, for pressure_window after. Leases of seconds taken by
  // fast readers would otherwise hold more DRAM than a small tier has:
  // counted readers give theirs back when done, and the lease bounds the
  // rest. A reader slower than its lease misses, never gets wrong bytes.
  absl::Duration pressure_lease = absl::Seconds(2);
  absl::Duration pressure_window = absl::Seconds(10);
};

struct PutItem {
  std::string key;
  uint64_t size = 0;
  int replicas = 1;
  std::string preferred_segment;
  std::string group;
  bool soft_pin = false;
  std::string parent_key;
  std::string client;  // the writer, for the per-client count of puts in flight
  bool hard_pin = false;  // never evicted (an eviction candidate never)
  // The writer stores the put id in its trailer (PutStartRequest.put_ids);
  // false: the object gets put id 0, the older 8-byte trailer's.
  bool put_id = true;
};

struct ExtentOut {
  std::string segment;  // empty when names were not asked for
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t segment_id = 0;
  bool ssd = false;    // a record on the segment's daemon's SSD tier (no offset)
  bool stage = false;  // a staging extent: ask the daemon to fill it from SSD first
};

struct PutStartOut {
  absl::Status status;
  std::vector<ExtentOut> replicas;
  uint64_t put_id = 0;  // names this put; never 0 (the writer's trailer carries it)
};

// What a lookup saw of a key it found, for the master's query stats; read
// under the shard lock the lookup holds anyway.
struct KeyHit {
  bool found = false;
  uint64_t size = 0;
  // Seconds since the object was put or last read (PrefixMatch, GetReplicas),
  // or given a second chance by the evictor: its reuse distance.
  uint32_t idle_s = 0;
};

struct LookupOut {
  absl::Status status;  // NOT_FOUND for a miss
  uint64_t size = 0;
  uint64_t put_id = 0;  // the put that wrote it; 0 for one put before put ids
  std::vector<ExtentOut> replicas;
  absl::Time lease_expiry;
  uint32_t idle_s = 0;  // as KeyHit::idle_s, read before this lookup's access
  // Non-zero for a counted read (under memory pressure, or staged from
  // SSD): the reader gives the lease back with this token once it is done
  // with the extent (ReleaseLeases), so the DRAM is evictable at once
  // rather than at lease_expiry. Each read's token is its own and gives
  // back that read only, once (LeaseTokens).
  uint64_t lease_token = 0;
};

// A reader done with what GetReplicas gave it: the key, its lease_token
// and the lease_expiry it was given (unix ms, the master's clock).
struct LeaseRelease {
  std::string key;
  uint64_t token = 0;
  int64_t expiry_ms = 0;
};

struct ObjectInfo {
  uint64_t size = 0;
  uint64_t put_id = 0;
  std::string state;  // "pending", "complete"
  std::vector<ExtentOut> replicas;
  absl::Time lease_expiry;
  bool soft_pin = false;
  bool hard_pin = false;
  std::string group;
  bool visible = false;
  uint32_t children = 0;
};

struct IndexStats {
  uint64_t objects = 0;
  uint64_t pending = 0;
  uint64_t evictions = 0;
  uint64_t evicted_bytes = 0;
  uint64_t evictor_passes = 0;  // the background evictor's passes over the lists
  uint64_t groups = 0;
  uint64_t leased = 0;
  uint64_t pinned = 0;
  uint64_t memory_bytes = 0;
  uint64_t offloaded = 0;      // evictions that moved the object to an SSD tier
  uint64_t offload_failed = 0; // offload orders that failed (those objects were dropped)
  uint64_t staged = 0;         // reads of SSD replicas given a staging extent
  uint64_t stage_no_room = 0;  // reads of SSD replicas that missed: no DRAM to stage them
  uint64_t leases_released = 0;  // counted read leases given back by their readers (ReleaseLeases)
};

class ObjectIndex {
 public:
  // `registry`, `store` and `clock` must outlive the index.
  ObjectIndex(IndexOptions options, SegmentRegistry* registry, IndexStore* store, Clock* clock);
  ~ObjectIndex();
  ObjectIndex(const ObjectIndex&) = delete;
  ObjectIndex& operator=(const ObjectIndex&) = delete;

  // Allocates replicas for each item and records it PENDING. Per item:
  // INVALID_ARGUMENT (bad key, size 0 or larger than any segment, replica
  // count out of range), ALREADY_EXISTS (the key is complete or being put),
  // RESOURCE_EXHAUSTED (no room even after evicting). Items sharing a
  // non-empty group form that group; if one of them fails, the others are
  // revoked and answer ABORTED. A complete key whose every copy waits on an
  // absent daemon (its segment recovering after a master restart, or
  // dormant) is not taken: the put replaces it, but only once it commits
  // (PutEnd). Until then the object is set aside, its record untouched, and
  // a put that fails, is revoked or times out (or a master restart) brings
  // it back as it was, readable again once its daemon re-mounts.
  std::vector<PutStartOut> PutStart(const std::vector<PutItem>& items);

  // Makes each PENDING key COMPLETE and durable, dropping the object its
  // put set aside (PutStart) in the same step. OK for a key already
  // complete (a retried PutEnd); NOT_FOUND when the key is unknown or its
  // put timed out.
  std::vector<absl::Status> PutEnd(const std::vector<std::string>& keys);

  // Drops PENDING keys and frees their space. NOT_FOUND if not pending.
  std::vector<absl::Status> PutRevoke(const std::vector<std::string>& keys);

  // Visible replicas and a read lease (lease_ttl; pressure_lease while DRAM is
  // contended, stage_lease for a staged copy; those reads are counted, see
  // LookupOut::lease_token) per key; NOT_FOUND on a miss; UNAVAILABLE (saying
  // kAwaitingRemount) for an object whose copies all sit on segments
  // recovering after a master restart or election, whose daemons are
  // expected back. DRAM replicas when the object has any;
  // otherwise (an object on an SSD tier) a staging extent allocated on the SSD
  // replica's segment (ExtentOut::stage), which the reader asks the daemon to
  // fill before reading it. The extent stays the object's DRAM copy, handed to
  // later readers (stage set: each fills it again) and evicted like an object
  // (the SSD record stays). When the segment has no room the index evicts as a
  // put would and tries once more; NOT_FOUND if there is still none. Counts as
  // an access for LRU. With `resolve_names` false, extents carry only segment
  // ids (SegmentRegistry::LiveNames maps them), which saves a string per replica
  // on the RPC fast path.
  // With `counted`, every read is counted (lease_token), as under
  // pressure, and leased for lease_ttl: a reader holding the value for a
  // while (a read session) gives it back the moment it is done.
  std::vector<LookupOut> GetReplicas(const std::vector<std::string>& keys,
                                     bool resolve_names = true, bool counted = false);

  // Gives counted read leases back. A release whose token names an older
  // incarnation of the key, or that arrives at or after the expiry it
  // names, is ignored: that lease ended by itself, and its count with it.
  // When an object's last counted reader gives its lease back (and no
  // uncounted read holds it), the lease ends now and a staged copy of it
  // is freed on eviction without stage_grace. Returns releases applied.
  size_t ReleaseLeases(const std::vector<LeaseRelease>& releases);

  // Reads a client served from its replica cache, reported on a later
  // call: each visible key counts as an access (its eviction order), and
  // what was seen of it is returned, one per key (found false: gone since).
  std::vector<KeyHit> NoteCachedReads(const std::vector<std::string>& keys);

  // With `hits`, also what was seen of each key (one per key). A key is
  // present when it can be read now: one whose copies all wait on an
  // absent daemon is absent here (as in PrefixMatch), and a put of it, which
  // that answer invites, never loses it unless the put commits (PutStart).
  std::vector<bool> Exists(const std::vector<std::string>& keys, std::vector<KeyHit>* hits = nullptr);

  // How many leading keys are visible; stops at the first miss. Counts as an
  // access to the matched keys. With `hits`, also what was seen of each
  // matched key (one per matched key, appended).
  size_t PrefixMatch(const std::vector<std::string>& keys, std::vector<KeyHit>* hits = nullptr);

  // NOT_FOUND when absent; FAILED_PRECONDITION when leased (or pending)
  // and !force. Removing a group member removes its group; removing a put
  // in progress (force) also removes the object it set aside.
  std::vector<absl::Status> Remove(const std::vector<std::string>& keys, bool force);
  // Removes every complete object (unleased ones unless force), or only
  // `tenant`'s when one is given; the count.
  uint64_t RemoveAll(bool force, const std::string* tenant = nullptr);

  // Evicts candidates until used bytes are at most `target_used` or none
  // is left; returns bytes freed.
  uint64_t EvictTo(uint64_t target_used);
  // Evicts down to the low watermark when above the high one.
  void MaybeEvict();

  // The background evictor, run on a thread of the caller's until
  // StopEvictor: it evicts down to the low watermark whenever used bytes
  // pass the high one, so puts find headroom without waiting. While it
  // runs, PutStart only wakes it; PutStart still evicts inline, as a last
  // resort, when an item finds no room at all. Without it PutStart evicts
  // inline above the high watermark (tests that drive the index alone).
  void RunEvictor();
  // Makes RunEvictor return (at once if it has not started); idempotent.
  void StopEvictor();
  // True while RunEvictor runs.
  bool EvictorRunning() const;

  // Periodic work: reclaims timed-out puts, finishes dead groups, evicts.
  void Tick();

  // Drops replicas on these (departed) segments; objects left with none
  // leave the index. Returns the number of objects dropped. An SSD replica
  // on an id named in `keep_ssd` stays, moved to the id it maps to (the
  // same id for a segment turned dormant, the new id for a daemon that
  // re-mounted with the same SSD tier).
  uint64_t DropSegments(const std::vector<uint32_t>& ids,
                        const absl::flat_hash_map<uint32_t, uint32_t>& keep_ssd = {});

  // A daemon's SSD listing against the index (SyncSsdRecords). Per record:
  // true when the object has an SSD replica on segment `id` of that size; a
  // replica there of another size is dropped (counted in *dropped).
  std::vector<bool> ConfirmSsd(uint32_t id, const std::vector<std::pair<std::string, uint64_t>>& records,
                               uint64_t* dropped);
  // Drops the SSD replicas (and the copies staged from them) on segment
  // `id` of these keys, or of every key not in `keep` (DropSsdExcept);
  // objects left with no replica leave the index. Returns replicas dropped.
  uint64_t DropSsd(uint32_t id, const std::vector<std::string>& keys);
  uint64_t DropSsdExcept(uint32_t id, const absl::flat_hash_set<std::string>& keep);

  // Rebuilds from the store's "o/" records (segments must be recovered in
  // the registry first). Returns how many objects were restored.
  absl::StatusOr<uint64_t> Recover();

  // NOT_FOUND when absent. For operators: shows pending and invisible too.
  absl::StatusOr<ObjectInfo> Describe(const std::string& key);

  IndexStats Stats() const;
  // Per-tenant use and quotas (master/tenants.h); keys are index keys, so
  // the tenant of each is TenantOf(key).
  TenantTable& tenants();
  // PENDING objects put by `client` (PutStart without PutEnd, revoke or timeout).
  uint64_t PendingOf(const std::string& client);
  // PENDING objects put by `client` and by every client of its tenant (the
  // TenantOf of PutItem::client), read together under one lock.
  struct PendingCounts {
    uint64_t client = 0;
    uint64_t tenant = 0;
  };
  PendingCounts Pending(const std::string& client);

  // Checks internal invariants (slot/set agreement, list membership, child
  // counts); INTERNAL naming the first violation. For tests and start-up.
  absl::Status CheckInvariants();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// The key rules: non-empty, at most `max_len` bytes, no NUL bytes.
absl::Status ValidateKey(absl::string_view key, size_t max_len = 4096);
// An index key: a key as above, in the default tenant or prefixed by a
// valid tenant name and kTenantSeparator (TenantKey).
absl::Status ValidateIndexKey(absl::string_view key, size_t max_len = 4096);

}  // namespace tierkv::master
