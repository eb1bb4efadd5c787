// SegmentRegistry: the segments daemons and clients lend, their liveness,
// and the allocation of extents inside them (placement).
//
// A segment is known by name; each mount gets a fresh numeric id that is
// never reused, so an object that points at an id whose segment left (or
// re-mounted as a new incarnation) can never be served from it again.
//
// States: LIVE (mounted, heartbeating) and RECOVERING (read back from the
// persisted registry after a master restart; its objects are not served
// until the daemon re-mounts with the same incarnation, and it is dropped
// if it does not come back within the TTL). A segment whose daemon has an
// SSD tier (ssd_id) turns DORMANT instead of leaving when it stops
// heartbeating or unmounts to restart: RECOVERING with its DRAM gone,
// holding only its SSD replicas' place, for the SSD grace; a mount with
// the same ssd_id (any incarnation) takes those replicas over. Offloads to
// such a segment wait until its daemon has listed its records
// (MarkSsdSynced).
//
// Cost per call (docs/performance.md): a master serves thousands of
// segments, so no RPC path walks them. Placement keeps the LIVE segments
// in order of free space, overall and per host, updated as each extent is
// taken or returned (O(log segments)), and walks only the head of that
// order: O(replicas log segments) per placed object. Readers of liveness
// and names (every lookup) never wait on the registry's mutex or on each
// other: they copy a pointer to an immutable LiveSegments snapshot under a
// shared lock, which membership changes (mount, unmount, expiry, dormancy)
// publish, and the totals (used, capacity, largest) are kept as atomics. Whole-registry walks are left to Snapshot, UsedById and
// Expire (operators, checks, the expiry tick).
//
// Thread-safe; its lock is the innermost in the master's lock order, held
// by writers (placement, frees, membership) for O(log segments) each.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "master/allocator.h"

namespace tierkv::master {

struct SegmentSpec {
  std::string name;
  std::string host;
  uint64_t capacity = 0;
  std::string incarnation;
  std::string endpoint;
  // The lending daemon's SSD tier (proto Segment fields 6-8): its HTTP
  // address for tier moves, empty without a working tier.
  std::string tier_http;
  uint64_t ssd_capacity = 0;
  uint64_t ssd_used = 0;
  std::string ssd_id;  // names the tier's file; empty without a tier
  std::string data_key;  // the daemon's key for data grants; empty: none needed
  // The authenticated identity that mounted it (set by the registry from
  // the mounting SegmentActor, persisted); empty: anyone may change it.
  std::string owner;
  // The owner's tenant (empty: none), set and kept with `owner`: only a
  // caller of this tenant may map the segment's memory (shm, rdma, cuda),
  // which no extent grant bounds (docs/security.md, "Extent grants").
  std::string owner_tenant;
};

// Who asks to change a segment (mount over it, unmount, heartbeat it, list
// its SSD records). Under authentication a segment belongs to the identity
// that mounted it: the `daemon` role alone, which every memory-lending
// client holds, must not let one identity drop or take over another's
// segment (and every tenant's objects on it). Only the owner or an admin
// may change an owned segment. An unowned one (mounted by an admin, or
// recovered from a record older than owners) only an admin may change,
// or claim it by mounting it as its own daemon: with the data key or SSD
// tier id the segment was mounted with, which only that daemon holds. An
// admin's mount leaves the owner as it was. Callers that are not
// authenticated (--auth none, in-process) are admins with no name.
struct SegmentActor {
  std::string identity;  // the caller's name (token file or certificate)
  bool admin = true;
  std::string tenant;    // the caller's tenant (empty: none)
  bool MayChange(const std::string& owner) const { return admin || (!owner.empty() && owner == identity); }
};

// An object's copy on a segment: an extent of its DRAM at `offset`, or
// (ssd) a record on the lending daemon's SSD tier, which takes no extent.
// A `stage` extent is a DRAM copy of an SSD record made on a read: every
// reader asks the daemon to fill it from the record before reading it.
struct Replica {
  uint32_t segment_id;
  bool ssd = false;
  bool stage = false;
  uint64_t offset;
};

struct SegmentSnapshot {
  uint32_t id;
  SegmentSpec spec;
  uint64_t used;
  bool recovering;
  absl::Time last_heartbeat;
  bool dormant = false;  // RECOVERING with only its SSD replicas held
  // "live", "recovering" or "dormant", as /v1/segments and tierkvctl say.
  const char* state() const { return dormant ? "dormant" : recovering ? "recovering" : "live"; }
};

// The LIVE segments' names at one moment: an immutable snapshot, cheap to
// take (one reference count) and to read (no lock), so a batch of lookups
// sees one membership. Safe to use from any thread; copies share it.
class LiveSegments {
 public:
  LiveSegments() = default;  // nothing live
  // The segment's name when it was LIVE at the snapshot, else nullptr;
  // valid while this snapshot (or a copy) lives.
  const std::string* Find(uint32_t id) const;
  bool Contains(uint32_t id) const { return Find(id) != nullptr; }

 private:
  friend class SegmentRegistry;
  // Ids are dense and never reused: a table of fixed-size chunks, so a
  // change copies one chunk and the chunk pointers, not every name.
  static constexpr uint32_t kChunkBits = 8;
  using Chunk = std::array<std::string, size_t{1} << kChunkBits>;  // "": not live
  using Table = std::vector<std::shared_ptr<const Chunk>>;
  explicit LiveSegments(std::shared_ptr<const Table> table) : table_(std::move(table)) {}
  std::shared_ptr<const Table> table_;
};

class SegmentRegistry {
 public:
  explicit SegmentRegistry(uint64_t alignment = 64) : alignment_(alignment) {}

  // Mounts (or re-mounts) a segment. A re-mount of a LIVE or RECOVERING
  // segment with the same incarnation and capacity keeps its id and
  // allocations (*restored = true). A different incarnation replaces it:
  // the old id is returned in *replaced_id (its objects must be dropped) —
  // a restarted daemon. ALREADY_EXISTS when the name is held by a LIVE
  // segment (heard from within `live_within`) of another host: two daemons
  // that chose one name must not drop each other's objects.
  // INVALID_ARGUMENT for an empty name or zero capacity.
  // *same_ssd (when given) says whether the replaced segment had the same
  // non-empty ssd_id: its SSD replicas belong to the new id.
  // PERMISSION_DENIED, naming the owner, when the name is held (in any
  // state) by a segment `actor` may not change or claim, or when another
  // segment serves the SSD tier at spec.tier_http (offloads are signed
  // with the key of the segment at that address). spec.owner and
  // spec.owner_tenant are ignored; *owner and *owner_tenant (when given)
  // are those the mounted segment has.
  absl::StatusOr<uint32_t> Mount(const SegmentSpec& spec, absl::Time now, bool* restored,
                                 std::optional<uint32_t>* replaced_id,
                                 absl::Duration live_within = absl::ZeroDuration(), bool* same_ssd = nullptr,
                                 const SegmentActor& actor = {}, std::string* owner = nullptr,
                                 std::string* owner_tenant = nullptr);

  // Adds a segment read back from persistence in RECOVERING state.
  uint32_t Recover(const SegmentSpec& spec, absl::Time now);

  // NOT_FOUND if no segment has that name. Returns the removed id.
  // PERMISSION_DENIED when `actor` may not change it.
  absl::StatusOr<uint32_t> Unmount(const std::string& name, const SegmentActor& actor = {});
  // OK when no segment has that name or `actor` may change it; else
  // PERMISSION_DENIED naming the owner.
  absl::Status MayChange(const std::string& name, const SegmentActor& actor) const;

  // Refreshes liveness. False when the segment must be mounted again
  // (unknown, recovering, or a different incarnation) or is not `actor`'s
  // to keep alive.
  bool Heartbeat(const std::string& name, const std::string& incarnation, absl::Time now,
                 const SegmentActor& actor = {});
  // Takes a heartbeat's SSD figures for the segment (same incarnation only).
  void UpdateTier(const SegmentSpec& spec);
  // The segment's SSD tier, when its daemon has a working one with at
  // least `size` bytes of capacity: its HTTP address for tier moves.
  std::optional<std::string> TierFor(uint32_t id, uint64_t size) const;

  // Removes LIVE segments not heard from since `now - ttl` and RECOVERING
  // ones older than `now - ttl`; returns the removed ids. With an SSD
  // tier (ssd_id) a LIVE segment turns DORMANT instead (its id appended to
  // *dormant: its DRAM replicas must be dropped, as must a RECOVERING
  // one's) and stays for `ssd_grace` from its last heartbeat.
  std::vector<uint32_t> Expire(absl::Time now, absl::Duration ttl, absl::Duration ssd_grace = absl::ZeroDuration(),
                               std::vector<uint32_t>* dormant = nullptr);
  // Turns the segment DORMANT now (its daemon stops to restart). False, and
  // no change, when it is unknown or has no SSD tier.
  bool MakeDormant(const std::string& name, absl::Time now, const SegmentActor& actor = {});
  // The LIVE segment's id when it is mounted with that incarnation.
  std::optional<uint32_t> LiveId(const std::string& name, const std::string& incarnation) const;
  // Its daemon has listed its SSD records: offloads may go to it, and
  // readers may stage from `tier_http` (when given, with the tier's size
  // and use) before a heartbeat names it.
  void MarkSsdSynced(uint32_t id, const std::string& tier_http = "", uint64_t ssd_capacity = 0,
                     uint64_t ssd_used = 0);

  // Picks `count` LIVE segments with room for `size` bytes and allocates an
  // extent in each: the preferred segment first when named and able, then
  // segments on hosts not yet used, most free space first, then any other
  // segment (ties in free space: the lower id first). O(count log
  // segments) while segments with the most free space have room. Fewer than `count` replicas are placed only when the cluster
  // has fewer segments with room; RESOURCE_EXHAUSTED if none has room,
  // UNAVAILABLE if no segment is live at all (eviction would not help).
  // `with`: the segments of an object this one belongs with (the first
  // member of its group), taken before all others, in order, when able: a
  // group then lives and dies on the same segments. `tenant`: the put's;
  // a segment owned by a tenant's identity (a tenant lending its own
  // memory, which its process can read) takes only that tenant's objects.
  absl::StatusOr<std::vector<Replica>> Allocate(uint64_t size, int count, const std::string& preferred,
                                                absl::Span<const uint32_t> with = {},
                                                absl::string_view tenant = {});
  // A `stage` extent of `size` bytes in the LIVE segment `id` (a copy of
  // an SSD record for a read), or nullopt when it has no room.
  std::optional<Replica> AllocateIn(uint32_t id, uint64_t size);
  // Returns an extent; a no-op for a segment that has left and for an SSD
  // replica (Reserve too: an SSD record holds no extent).
  void Free(const Replica& r, uint64_t size);
  // Marks an extent used while rebuilding from persistence.
  absl::Status Reserve(const Replica& r, uint64_t size);

  // True when the id names a LIVE segment. No lock.
  bool IsLive(uint32_t id) const;
  // True when the id names a RECOVERING segment whose DRAM is still held
  // (not dormant): its daemon is expected to re-mount (a master just
  // restarted or elected).
  bool AwaitsRemount(uint32_t id) const;
  // The segment's name ("" when it has left). No lock for a LIVE one.
  std::string Name(uint32_t id) const;
  // The identity that owns the segment ("" when none does or it has left).
  std::string OwnerOf(uint32_t id) const;
  std::optional<uint32_t> IdOf(const std::string& name) const;
  // The data key of a segment whose DRAM is served (live or recovering);
  // nullopt for an unknown or dormant one.
  // (With `owner_tenant`, the segment's owner's tenant too.)
  std::optional<std::string> DataKeyOf(const std::string& name, std::string* owner_tenant = nullptr) const;
  // The same by id: the key of that incarnation only.
  std::optional<std::string> DataKeyOfId(uint32_t id) const;
  // Whether segment `id`'s daemon checks data and extent grants (it sent a
  // data key); false for one that has left.
  bool ChecksGrants(uint32_t id) const;
  // The data key of the segment whose SSD tier answers at `tier_http`;
  // empty when none does or it needs no grants.
  std::string DataKeyOfTier(const std::string& tier_http) const;
  // The LIVE segments' names: one snapshot for a whole batch of reads,
  // taken without a lock in O(1).
  LiveSegments LiveNames() const;
  // Bytes an extent of `size` occupies after alignment.
  uint64_t Rounded(uint64_t size) const;
  // Allocated bytes per segment id.
  absl::flat_hash_map<uint32_t, uint64_t> UsedById() const;
  std::vector<SegmentSnapshot> Snapshot() const;
  // Sum over LIVE and RECOVERING segments. These three read counters kept
  // as extents come and go: no lock, O(1).
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t capacity() const { return capacity_.load(std::memory_order_relaxed); }
  uint64_t largest_segment() const { return largest_.load(std::memory_order_relaxed); }

 private:
  struct Segment {
    uint32_t id;
    SegmentSpec spec;
    std::unique_ptr<ExtentAllocator> allocator;
    absl::Time last_heartbeat;
    bool recovering;
    bool dormant = false;     // DRAM gone; counts no capacity
    bool ssd_synced = true;   // false from a mount with ssd_id until its listing is in
    bool filed = false;       // in the placement order, under `filed_free`
    uint64_t filed_free = 0;
    uint64_t counted_used = 0;      // its share of used_
    uint64_t counted_capacity = 0;  // of capacity_ (0 while dormant)
  };
  // (free bytes, id): most free first, then the lower id.
  using Key = std::pair<uint64_t, uint32_t>;
  struct MostFree {
    bool operator()(const Key& a, const Key& b) const {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    }
  };
  using Order = std::set<Key, MostFree>;

  uint32_t AddLocked(const SegmentSpec& spec, absl::Time now, bool recovering)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(uint32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when a segment other than `name` serves its SSD tier at `tier_http`.
  bool TierTakenLocked(const std::string& tier_http, const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DormantLocked(Segment& seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings the placement order, the counters and the live snapshot in line
  // with `seg` after a change to its state, spec or allocator (Unfile
  // before a change of spec, so the host's order is found by the old one).
  void Unfile(Segment& seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void File(Segment& seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Recount(Segment& seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes a snapshot with `id` LIVE as `name`, or not live ("").
  void PublishLive(uint32_t id, const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t alignment_;
  mutable Mutex mu_;
  uint32_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint32_t, Segment> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> by_name_ ABSL_GUARDED_BY(mu_);
  // LIVE segments by free space: all of them, each host's, and each host's
  // first (the order in which hosts are tried for distinct replicas).
  Order order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Order> by_host_ ABSL_GUARDED_BY(mu_);
  Order host_firsts_ ABSL_GUARDED_BY(mu_);
  std::multiset<uint64_t> capacities_ ABSL_GUARDED_BY(mu_);  // every segment's
  // Written under mu_, read without it.
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> capacity_{0};
  std::atomic<uint64_t> largest_{0};
  // The live set's current snapshot. A reader holds live_mu_ (shared) only
  // to copy the pointer, so readers never wait on each other or on mu_. Not
  // std::atomic<std::shared_ptr>: libstdc++'s is a lock bit ThreadSanitizer
  // cannot see, and a pthread rwlock costs the same here.
  mutable std::shared_mutex live_mu_;
  std::shared_ptr<const LiveSegments::Table> live_;  // guarded by live_mu_
};

}  // namespace tierkv::master
