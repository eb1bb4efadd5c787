// Private to master/: the ObjectIndex's data structures, shared by the
// files that implement ObjectIndex::Impl: object_index.cc (core, helpers,
// the public forwarders), object_index_put.cc, object_index_read.cc,
// object_index_lease.cc, object_index_remove.cc, object_index_recovery.cc,
// object_index_check.cc, eviction.cc and eviction_offload.cc. See
// object_index.h for the contract.
#pragma once

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cstddef>
#include <initializer_list>
#include <new>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/hash/hash.h"
#include "base/extent_grant.h"
#include "master/object_index.h"
#include "master/tenants.h"


namespace tierkv::master {

inline constexpr uint32_t kNil = UINT32_MAX;

enum class ObjState : uint8_t { kFree, kPending, kComplete };
enum class ListId : uint8_t { kNone = 0, kLeaf = 1, kPinnedLeaf = 2 };

struct Group {
  std::string id;
  uint64_t serial;
  uint32_t members;    // declared by the PutStart that made it
  uint32_t completed;  // members that reached PutEnd
  uint32_t alive;      // members still in the index
  std::atomic<bool> visible{false};
  bool dead = false;   // a member left; the rest must follow
  std::vector<std::string> keys;
};

// An object's replicas: one inline (nearly every object has one), more on
// the heap. 16 bytes where absl::InlinedVector<Replica, 1> takes 24: the
// list's state is kept in the first word, which a replica uses for its
// segment id, so segment ids kEmptyTag and kHeapTag are never stored.
class ReplicaList {
 public:
  using iterator = Replica*;
  using const_iterator = const Replica*;

  ReplicaList() { SetEmpty(); }
  ReplicaList(std::initializer_list<Replica> replicas) : ReplicaList() { assign(replicas.begin(), replicas.end()); }
  ReplicaList(const ReplicaList& other) : ReplicaList() { assign(other.begin(), other.end()); }
  ReplicaList(ReplicaList&& other) noexcept : u_(other.u_) { other.SetEmpty(); }
  ReplicaList& operator=(const ReplicaList& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  ReplicaList& operator=(ReplicaList&& other) noexcept {
    if (this != &other) {
      clear();
      u_ = other.u_;
      other.SetEmpty();
    }
    return *this;
  }
  ~ReplicaList() { clear(); }

  size_t size() const { return tag() == kEmptyTag ? 0 : tag() == kHeapTag ? u_.heap.size : 1; }
  bool empty() const { return tag() == kEmptyTag; }
  Replica* begin() { return tag() == kHeapTag ? u_.heap.data : &u_.one; }
  const Replica* begin() const { return tag() == kHeapTag ? u_.heap.data : &u_.one; }
  Replica* end() { return begin() + size(); }
  const Replica* end() const { return begin() + size(); }
  Replica& operator[](size_t i) { return begin()[i]; }
  const Replica& operator[](size_t i) const { return begin()[i]; }

  void push_back(const Replica& r) {
    const size_t n = size();
    if (n == 0) {
      SetOne(r);
      return;
    }
    if (n == 1 && tag() != kHeapTag) {
      Replica* d = new Replica[2]{u_.one, r};
      SetHeap(2, 2, d);
      return;
    }
    if (n == u_.heap.cap) {
      Replica* d = new Replica[2 * n];
      std::copy(u_.heap.data, u_.heap.data + n, d);
      delete[] u_.heap.data;
      u_.heap.data = d;
      u_.heap.cap = static_cast<uint16_t>(2 * n);
    }
    u_.heap.data[n] = r;
    u_.heap.size = static_cast<uint16_t>(n + 1);
  }
  // Removes [first, last); one replica left goes back inline.
  Replica* erase(const Replica* first, const Replica* last) {
    const size_t at = static_cast<size_t>(first - begin());
    const size_t gone = static_cast<size_t>(last - first);
    if (gone == 0) return begin() + at;
    const size_t n = size();
    Replica* b = begin();
    for (size_t i = at; i + gone < n; ++i) b[i] = b[i + gone];
    Shrink(n - gone);
    return begin() + at;
  }
  Replica* erase(const Replica* pos) { return erase(pos, pos + 1); }
  void clear() {
    if (tag() == kHeapTag) delete[] u_.heap.data;
    SetEmpty();
  }
  template <class It>
  void assign(It first, It last) {
    clear();
    for (; first != last; ++first) push_back(*first);
  }

 private:
  static constexpr uint32_t kEmptyTag = UINT32_MAX;
  static constexpr uint32_t kHeapTag = UINT32_MAX - 1;
  // Shares its first member with Replica (segment_id), so the tag may be
  // read whichever of the two is active.
  struct Heap {
    uint32_t tag;
    uint16_t size;
    uint16_t cap;
    Replica* data;
  };
  union U {
    U() : heap{kEmptyTag, 0, 0, nullptr} {}
    Replica one;
    Heap heap;
  };
  static_assert(sizeof(U) == 16 && offsetof(Replica, segment_id) == 0);

  uint32_t tag() const { return u_.heap.tag; }
  // Placement new makes the member written the union's active one.
  void SetEmpty() { SetHeapState(kEmptyTag, 0, 0, nullptr); }
  void SetHeap(uint16_t size, uint16_t cap, Replica* data) { SetHeapState(kHeapTag, size, cap, data); }
  void SetHeapState(uint32_t tag, uint16_t size, uint16_t cap, Replica* data) {
    new (&u_.heap) Heap{tag, size, cap, data};
  }
  void SetOne(const Replica& r) {
    assert(r.segment_id != kEmptyTag && r.segment_id != kHeapTag);
    new (&u_.one) Replica(r);
  }
  // Keeps the first `n` of the heap list (n < its size).
  void Shrink(size_t n) {
    if (tag() != kHeapTag) {
      if (n == 0) SetEmpty();
      return;
    }
    if (n > 1) {
      u_.heap.size = static_cast<uint16_t>(n);
      return;
    }
    Replica* d = u_.heap.data;
    if (n == 1) {
      SetOne(d[0]);
    } else {
      SetEmpty();
    }
    delete[] d;
  }

  U u_;
};
static_assert(sizeof(ReplicaList) == 16);

// ~112 bytes; the key's characters live in the std::string (heap for keys
// longer than 15 bytes). Field order packs the small ones together.
struct Object {
  std::string key;
  uint64_t size = 0;
  // Names the put that wrote the bytes (PutStartOut::put_id); 0 for an
  // object recovered from a record older than put ids.
  uint64_t put_id = 0;
  ReplicaList replicas;
  int64_t deadline_ms = 0;  // lease expiry (complete) or put deadline (pending)
  Group* group = nullptr;
  uint32_t prev = kNil, next = kNil;  // leaf-LRU links within the shard
  uint32_t parent_slot = kNil;
  uint32_t parent_gen = 0;
  uint32_t children = 0;
  uint32_t gen = 0;     // bumped when the slot is freed, to detect stale refs
  uint32_t access = 0;  // AccessTick() of the last access
  uint8_t parent_shard = 0;
  // Counted reads still under way (see LookupOut::lease_token): each
  // reader gives its count back when done. kStickyReaders is too many to
  // count; the lease then lasts to deadline_ms.
  uint8_t readers = 0;
  ObjState state : 2 = ObjState::kFree;
  ListId list : 2 = ListId::kNone;
  bool soft_pin : 1 = false;
  bool hard_pin : 1 = false;  // never on an eviction list
  // Set by an access, cleared when the evictor gives the object a second
  // chance: touching writes one bit of the object instead of relinking
  // the list (CLOCK-style approximate LRU). Bit fields keep the slot at
  // 112 bytes.
  bool referenced : 1 = false;
  bool read : 1 = false;    // read since its put: admitted to an SSD tier on eviction
  bool moving : 1 = false;  // an offload order is out: off the eviction lists, its extent held
  bool hard_lease : 1 = false;  // a read not counted in `readers` holds the lease to deadline_ms
  // Its last lease ended when its last counted reader gave it back, so no
  // reader or stage can still reach a copy of it.
  bool released : 1 = false;
  // A counted reader of this staged copy let its lease run out without
  // giving it back: its stage may still land, so `released` never skips
  // stage_grace for this copy.
  bool unreturned : 1 = false;
  // A complete object a put of its key has set aside (its copies wait on
  // an absent daemon): out of the key set and off the eviction lists, its
  // record and extents kept, until that put commits (it is then dropped)
  // or fails (it comes back). PendingInfo::displaced names it.
  bool displaced : 1 = false;
};
inline constexpr uint8_t kStickyReaders = UINT8_MAX;
// One counted read's lease token, good for one give-back: a 24-bit read
// number of its shard in the top bits, and below it a 40-bit tag, a
// two-block AES-128 CBC-MAC under a key the shard draws at start, of
// (slot, generation, lease expiry) and the read number. Another reader's token cannot be made from one's own
// (nor one for a recovered index's renumbered slots), and the shard
// remembers the tokens given back until their leases end, so sending one
// many times ends no other reader's lease. One per shard, used under its
// lock. 0 is no token.
class LeaseTokens {
 public:
  LeaseTokens();

  // A fresh token for a read of (slot, gen) whose lease ends at expiry_ms.
  uint64_t Issue(uint32_t slot, uint32_t gen, int64_t expiry_ms);
  // True the first time a token Issue made for (slot, gen, expiry_ms) is
  // given back before `now_ms`; false for a forged, altered or repeated one.
  bool Redeem(uint64_t token, uint32_t slot, uint32_t gen, int64_t expiry_ms, int64_t now_ms);

 private:
  static constexpr int kTagBits = 40;
  // nullopt when the cipher is unusable (then no token is issued).
  std::optional<uint64_t> Tag(uint32_t slot, uint32_t gen, uint32_t seq, int64_t expiry_ms);

  auth::BlockMac mac_;
  uint32_t seq_ = 0;
  // Tokens given back, with their lease's expiry; pruned of ended leases
  // whenever it doubles, so it holds about the give-backs of one lease.
  absl::flat_hash_map<uint64_t, int64_t> redeemed_;
  size_t prune_at_ = 1024;
};
static_assert(sizeof(Object) <= 112, "an index slot grew: check tierkv-bench master's bytes per object");

// Object slots in fixed chunks: references stay valid as it grows (the
// LRU links and the set point at slots), and unlike std::deque it costs no
// allocation per handful of objects.
class SlotArray {
 public:
  static constexpr size_t kChunk = 256;
  Object& operator[](size_t i) { return chunks_[i / kChunk][i % kChunk]; }
  const Object& operator[](size_t i) const { return chunks_[i / kChunk][i % kChunk]; }
  size_t size() const { return size_; }
  Object& emplace_back() {
    if (size_ == chunks_.size() * kChunk) chunks_.push_back(std::make_unique<Object[]>(kChunk));
    return (*this)[size_++];
  }

 private:
  std::vector<std::unique_ptr<Object[]>> chunks_;
  size_t size_ = 0;
};

struct Shard;

// Hash and equality over slot numbers that resolve to the slot's key, so
// the set stores 4 bytes per object and looks up by string_view.
struct SlotHash {
  using is_transparent = void;
  const SlotArray* objects;
  size_t operator()(uint32_t slot) const { return absl::HashOf(absl::string_view((*objects)[slot].key)); }
  size_t operator()(absl::string_view key) const { return absl::HashOf(key); }
};
struct SlotEq {
  using is_transparent = void;
  const SlotArray* objects;
  bool operator()(uint32_t a, uint32_t b) const { return a == b; }
  bool operator()(uint32_t a, absl::string_view b) const { return (*objects)[a].key == b; }
  bool operator()(absl::string_view a, uint32_t b) const { return a == (*objects)[b].key; }
};

struct LruList {
  uint32_t head = kNil;  // most recent
  uint32_t tail = kNil;  // least recent
  size_t size = 0;
};

struct PendingInfo {
  std::string parent_key;
  std::string client;  // who is writing it (the per-client cap counts it)
  // The object this put replaces once it commits (Object::displaced), as
  // its slot and that slot's generation; kNil: none.
  uint32_t displaced = kNil;
  uint32_t displaced_gen = 0;
};

struct Shard {
  Shard() : index(0, SlotHash{&objects}, SlotEq{&objects}) {}
  Mutex mu;
  SlotArray objects ABSL_GUARDED_BY(mu);
  std::vector<uint32_t> free_slots ABSL_GUARDED_BY(mu);
  absl::flat_hash_set<uint32_t, SlotHash, SlotEq> index ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<uint32_t, PendingInfo> pending ABSL_GUARDED_BY(mu);
  LruList lists[3] ABSL_GUARDED_BY(mu);  // indexed by ListId; [0] unused
  uint64_t leased_hint ABSL_GUARDED_BY(mu) = 0;
  LeaseTokens lease_tokens ABSL_GUARDED_BY(mu);
  // Bytes of the slot array and the set, kept current under `mu` so Stats
  // reads them without the lock.
  std::atomic<uint64_t> footprint{0};
};

// Complete objects' read leases counted by expiry tick (100 ms), so Stats
// (and so each /metrics scrape) counts the leased objects without visiting
// one or taking a shard lock. A bucket holds one tick and its count packed
// in one word: a bucket still holding an expired tick is reused by the
// next lease that maps to it, and a decrement for a tick the bucket no
// longer holds is dropped (that lease already expired). Leases end at most
// lease_ttl ahead, so ticks alive at once never share a bucket.
class LeaseWheel {
 public:
  static constexpr int64_t kTickMs = 100;
  LeaseWheel(absl::Duration lease_ttl, int64_t start_ms);
  // The tick of a lease ending at `deadline_ms` (> 0).
  uint32_t TickOf(int64_t deadline_ms) const;
  // Whether a lease ending at `deadline_ms` is still counted at `now_ms`:
  // its tick has not passed. Leases end by tick, so this errs long by
  // under a tick.
  bool Counted(int64_t deadline_ms, int64_t now_ms) const;
  void Add(uint32_t tick);
  void Remove(uint32_t tick);
  // Leases counted at `now_ms`.
  uint64_t Count(int64_t now_ms) const;
  // Counted leases per tick, for CheckInvariants.
  absl::flat_hash_map<uint32_t, uint64_t> Buckets(int64_t now_ms) const;

 private:
  const int64_t start_ms_;
  std::vector<std::atomic<uint64_t>> buckets_;  // tick << 32 | count
};

// Holds the locks of the shards named in `shard_ids` (any order, repeats
// allowed), taken in ascending index: the index's lock order.
class ShardLocks {
 public:
  ShardLocks(const std::vector<std::unique_ptr<Shard>>& shards, const std::vector<size_t>& shard_ids)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ids_.assign(shard_ids.begin(), shard_ids.end());
    std::sort(ids_.begin(), ids_.end());
    ids_.erase(std::unique(ids_.begin(), ids_.end()), ids_.end());
    for (size_t id : ids_) {
      shards[id]->mu.Lock();
      held_.push_back(&shards[id]->mu);
    }
  }
  ~ShardLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) (*it)->Unlock();
  }
  ShardLocks(const ShardLocks&) = delete;
  ShardLocks& operator=(const ShardLocks&) = delete;

 private:
  absl::InlinedVector<size_t, 8> ids_;
  absl::InlinedVector<Mutex*, 8> held_;
};

// Work to do after a shard lock is released: parents whose child left, and
// groups whose member left.
struct FollowUp {
  struct ParentRef {
    uint8_t shard;
    uint32_t slot;
    uint32_t gen;
    uint32_t child_access;  // the departed child's last access tick
  };
  std::vector<ParentRef> parents;
  std::vector<Group*> groups;  // each holds a pin (see ReleaseGroupPin)
  // Extents of erased complete objects, freed only once the deletion of
  // their record is durable: freed earlier, a crash before the write would
  // bring the record back over extents another put has since overwritten.
  struct Extents {
    ReplicaList replicas;
    uint64_t size;
  };
  std::vector<Extents> freed;
};

class ObjectIndex::Impl {
 public:
  Impl(IndexOptions options, SegmentRegistry* registry, IndexStore* store, Clock* clock);
  ~Impl();

  // --- The request paths (object_index_put.cc, _read.cc, _lease.cc, _remove.cc).
  std::vector<PutStartOut> PutStart(const std::vector<PutItem>& items);
  std::vector<absl::Status> PutEnd(const std::vector<std::string>& keys);
  std::vector<absl::Status> PutRevoke(const std::vector<std::string>& keys);
  std::vector<LookupOut> GetReplicas(const std::vector<std::string>& keys, bool resolve_names, bool counted);
  size_t ReleaseLeases(const std::vector<LeaseRelease>& releases);
  std::vector<KeyHit> NoteCachedReads(const std::vector<std::string>& keys);
  std::vector<bool> Exists(const std::vector<std::string>& keys, std::vector<KeyHit>* hits);
  size_t PrefixMatch(const std::vector<std::string>& keys, std::vector<KeyHit>* hits);
  std::vector<absl::Status> Remove(const std::vector<std::string>& keys, bool force);
  uint64_t RemoveAll(bool force, const std::string* tenant);
  absl::StatusOr<ObjectInfo> Describe(const std::string& key);
  IndexStats Stats() const;
  uint64_t PendingOf(const std::string& client);
  ObjectIndex::PendingCounts Pending(const std::string& client);

  // GetReplicas' lookups. Keys of SSD hits that found no room for a
  // staging extent go to *no_room, their bytes to *staged_bytes; both
  // null: none is collected.
  std::vector<LookupOut> Lookup(const std::vector<std::string>& keys, bool resolve_names,
                                std::vector<size_t>* no_room, uint64_t* staged_bytes, bool counted);

  TenantTable& tenants() { return tenants_; }

  // --- Eviction (eviction.cc, eviction_offload.cc), leases and removal
  // (object_index_lease.cc, _remove.cc), liveness and recovery
  // (object_index_recovery.cc), checks (object_index_check.cc).
  // What an eviction pass is for, which decides how it treats bytes that
  // offload orders out will free, and tiers that have an order out
  // (docs/eviction.md, "SSD tier").
  enum class PassFor {
    // Room for a request that waits (a put, a staging extent): the room
    // must be there now, so other passes' bytes in flight do not count
    // as freed; each round's orders go out at once. A tier with an order
    // out is waited on for at most kTierStalledAfter, then, still busy,
    // taken for stalled: its candidates are dropped, so a stalled daemon
    // holds the request that long at most.
    kRoom,
    // The watermark, on a request's or Tick's thread (an index without the
    // evictor thread): every order's bytes in flight count as freed, orders
    // are batched, and busy tiers are treated as for kRoom.
    kWatermark,
    // The watermark, on the evictor thread: as kWatermark, but it may send
    // a tier with an order out another one, and wait for its answer.
    kEvictor,
  };
  // ObjectIndex::EvictTo; *exhausted (when given) says whether the pass
  // stopped above its target because no candidate was left, rather than
  // having reached it (perhaps with another pass's help). Takes evict_mu_
  // only to pick candidates: orders go out with no lock held.
  uint64_t EvictTo(uint64_t target_used, PassFor pass = PassFor::kRoom, bool* exhausted = nullptr)
      ABSL_LOCKS_EXCLUDED(evict_mu_);
  // Evicts `tenant`'s own candidates, least recently used first (soft-pinned
  // last), until their DRAM charge freed reaches `bytes` or none is left;
  // returns the charge freed. For a put over the tenant's quota.
  uint64_t EvictTenant(absl::string_view tenant, uint64_t bytes);
  // Evicts down to the low watermark when above the high one; false when
  // it had nothing to do, or found nothing it could evict.
  bool MaybeEvict(PassFor pass = PassFor::kWatermark);
  void RunEvictor();
  void StopEvictor();
  void Tick();
  uint64_t DropSegments(const std::vector<uint32_t>& ids, const absl::flat_hash_map<uint32_t, uint32_t>& keep_ssd);
  std::vector<bool> ConfirmSsd(uint32_t id, const std::vector<std::pair<std::string, uint64_t>>& records,
                               uint64_t* dropped);
  uint64_t DropSsd(uint32_t id, const std::vector<std::string>& keys);
  uint64_t DropSsdExcept(uint32_t id, const absl::flat_hash_set<std::string>& keep);
  // Per record: whether the object has an SSD replica on `id` of the
  // record's size; one of another size (every one, with drop_all) is
  // dropped, counted in *dropped.
  std::vector<bool> MatchSsd(uint32_t id, const std::vector<std::pair<std::string, uint64_t>>& records,
                             bool drop_all, uint64_t* dropped);
  // Drops the object's SSD replica on `id` and the copies staged from it;
  // false when it has none there. Erases an object left with no replica.
  bool DropSsdAt(Shard& s, uint32_t slot, uint32_t id, std::vector<Mutation>* mutations, FollowUp* follow)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // A complete object that lost some replicas and keeps others: off the
  // candidate lists once no DRAM copy is left, its record rewritten.
  void KeepSurvivor(Shard& s, uint32_t slot, std::vector<Mutation>* mutations) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Frees the extent of a dropped copy staged from SSD once no reader or
  // stage can reach it: stage_grace after the object's lease.
  void HoldStagedCopy(const Replica& r, const Object& o, int64_t now_ms);
  // True when `o` has a copy on a segment whose daemon checks grants: its
  // readers hold the master's extent grants (and, for a staged copy, its
  // leave to stage, auth::StageProof) until the lease's end, so giving the
  // lease back early must not free the extent for another put before then.
  bool UnderGrants(const Object& o) const;
  absl::StatusOr<uint64_t> Recover();
  absl::Status CheckInvariants();

 private:
  size_t ShardOf(absl::string_view key) const;
  int64_t NowMs() const;
  // Accesses are ordered in 1/kAccessTicksPerSecond s since the index
  // started: fine enough that the evictor's order across shards is LRU to
  // within 16 ms, not a second (at thousands of puts a second, most of a
  // pass's candidates would tie); 32 bits last 776 days of uptime, after
  // which the tick stays put.
  static constexpr uint32_t kAccessTicksPerSecond = 64;
  uint32_t AccessTick() const;

  // Shard-locked helpers.
  uint32_t Find(Shard& s, absl::string_view key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  uint32_t NewSlot(Shard& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void Unlist(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void ListAtHead(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void ListAtTail(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void Touch(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Inserts `slot` into the shard's set and updates the shard's footprint.
  void IndexSlot(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // A put over a complete object whose copies all wait on absent daemons
  // replaces it only once the put commits: Displace sets the object aside
  // (out of the set, off the lists; record, extents, charge and counts
  // kept), Undisplace puts it back as it was when the put fails, and PutEnd
  // erases it once the new record has replaced its record.
  void Displace(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void Undisplace(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // The slot of the object the pending put in `slot` set aside, or kNil
  // (none, or it left meanwhile: its segments went, or RemoveAll).
  uint32_t DisplacedBy(Shard& s, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void UpdateFootprint(Shard& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Moves a complete object's lease from `old_deadline_ms` to its
  // current deadline in the lease wheel.
  void MoveLease(const Object& o, int64_t old_deadline_ms, int64_t now_ms);
  bool Visible(const Object& o) const;
  // ALREADY_EXISTS ("put in progress", "exists") when a put of the
  // object's key must be refused: a put not yet timed out, or a complete
  // object with a copy on a live segment (or being moved). OK when a new
  // put replaces it.
  absl::Status KeyTaken(const Object& o, int64_t now_ms) const;
  // What the query stats learn of a found object; call before Touch.
  KeyHit HitOf(const Object& o) const {
    const uint32_t tick = AccessTick();
    return {true, o.size, tick > o.access ? (tick - o.access) / kAccessTicksPerSecond : 0};
  }
  bool Leased(const Object& o, int64_t now_ms) const;
  // What the object counts against its tenant's quota: its size per DRAM
  // replica (copies staged from SSD are not charged).
  static uint64_t DramCharge(const Object& o) {
    uint64_t n = 0;
    for (const Replica& r : o.replicas) n += (!r.ssd && !r.stage) ? 1 : 0;
    return n * o.size;
  }
  // Charges a put of `bytes` to `tenant`, first evicting the tenant's own
  // objects when the put would pass its quota; RESOURCE_EXHAUSTED (counted)
  // when that cannot make room, or ALREADY_EXISTS (nothing evicted) when
  // `key` is taken. Call with no shard lock held.
  absl::Status ChargeQuota(absl::string_view tenant, uint64_t bytes, const std::string& key);
  // True while some replica is a DRAM extent (only those are evicted).
  static bool InDram(const Object& o) {
    for (const Replica& r : o.replicas) {
      if (!r.ssd) return true;
    }
    return false;
  }
  // An offload order out for the object in `slot` (EvictTo).
  struct Move {
    size_t shard;
    uint32_t slot;
    uint32_t gen;
    uint64_t bytes;  // its extent's, counted in moving_bytes_ until answered
    std::string tier_http;
    TierOrder order;
  };
  // One EvictTo's progress, kept across the releases of evict_mu_ while
  // its orders are out.
  struct EvictPass {
    uint64_t target_used = 0;
    PassFor pass = PassFor::kRoom;
    int list = 0;             // 0: unpinned leaves, 1: soft-pinned leaves
    bool list_open = false;   // `list` was entered (its counts below are set)
    bool ran_out = false;     // of candidates in the list
    int idle_rounds = 0;
    size_t listed = 0, requeued = 0;
    uint64_t freed = 0;
    std::vector<Move> batch;  // picked, not yet sent
    uint64_t batch_bytes = 0;
    std::string wait_tier;    // a busy tier to wait on, with no lock held
    bool waited = false;      // it waited once: busy tiers are sent to now
  };
  // Runs rounds of `pass` until its batch of moves is due (false: send it,
  // then call again) or the pass is over (true; moves may be left to send).
  bool EvictRounds(EvictPass* pass) ABSL_EXCLUSIVE_LOCKS_REQUIRED(evict_mu_);
  // Used bytes less those the pass counts as already leaving.
  uint64_t UsedFor(const EvictPass& pass) const;
  // The SSD tier an eviction of `o` moves it to (docs/eviction.md, the
  // admission rule), or nullopt when it is dropped instead: the tier is
  // paused, or (unless `busy_ok`) has had an order out for
  // kTierStalledAfter. A tier with a younger order out is returned, unless
  // `wait_for` is given: then nullopt, with the tier's name in *wait_for
  // (the caller waits for that order, AwaitTier, and asks again).
  std::optional<std::string> OffloadTier(const Object& o, bool busy_ok, std::string* wait_for = nullptr) const;
  // Returns once `tier` has no order out, or its oldest has been out for
  // kTierStalledAfter. Call with no lock held.
  void AwaitTier(const std::string& tier);
  // Marks the object in `slot` moving to `tier`: off the lists, its extent
  // held and counted in moving_bytes_ until FinishMoves.
  Move StartMove(Shard& s, size_t shard, uint32_t slot, std::string tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Sends the orders, one per daemon (each bounded by offload_timeout), and
  // applies the answers: a confirmed object keeps an SSD replica in place of
  // its extent, the others are evicted. Blocks for the answers, so it runs
  // with no index lock held.
  void FinishMoves(std::vector<Move> moves) ABSL_LOCKS_EXCLUDED(evict_mu_);

  // Removes the object in `slot`: frees its live extents, deletes its
  // record (into *mutations), and records parent/group follow-ups. Extents
  // of a leased object wait for the lease; those of a pending one wait
  // revoke_grace, unless `never_written` (no writer was ever given them).
  void Erase(Shard& s, uint32_t slot, std::vector<Mutation>* mutations, FollowUp* follow,
             bool never_written = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Commits and clears `mutations`; then frees `follow`'s extents if the
  // write succeeded, or keeps them allocated if it failed (the record, still
  // in the store, owns them again after a restart). Returns the store's
  // replication ticket (0: nothing written). It does not wait for the
  // standbys: a caller that acknowledges the change to a user awaits the
  // ticket once its shard locks are released. Freed space may be reused
  // before a standby has the deletion: the standbys apply batches in order,
  // so any put acknowledged on that space reaches them after it, and a
  // value read at a stale extent fails its key-bound trailer.
  uint64_t Persist(std::vector<Mutation>* mutations, FollowUp* follow = nullptr);
  // Runs follow-ups with no shard lock held.
  void RunFollowUps(FollowUp follow);
  void DecrementParent(const FollowUp::ParentRef& ref);
  // Removes the remaining members of a dead group (skipping leased ones,
  // which Tick retries). Consumes one pin on `group`.
  void KillGroup(Group* group);
  void ReleaseGroupPin(Group* group);
  std::string EncodeRecord(const Object& o, const std::string& parent_key) const;
  // Replicas on LIVE segments (those in `names`); names copied if asked.
  std::vector<ExtentOut> VisibleExtents(const Object& o, const LiveSegments& names,
                                        bool resolve_names = true) const;
  LiveSegments LiveNames() const;
  // Links a freshly completed child to its complete parent (if any).
  void LinkParent(size_t child_shard, absl::string_view child_key, const std::string& parent_key);
  void EraseByKey(const std::string& key, Group* only_group, bool force, FollowUp* follow,
                  bool never_written = false);

  const IndexOptions options_;
  SegmentRegistry* const registry_;
  IndexStore* const store_;
  Clock* const clock_;
  const absl::Time start_;
  std::vector<std::unique_ptr<Shard>> shards_;

  // Extents of objects removed while a reader held a lease: invisible at
  // once, but not handed out again until the lease ends (Tick frees them).
  struct DeferredFree {
    ReplicaList replicas;
    uint64_t size = 0;
    int64_t until_ms = 0;
  };
  void FreeDeferred(int64_t now_ms);
  // Puts in flight per client (its TenantKey) and per tenant, kept with
  // the pending objects themselves.
  void CountPending(const std::string& client, int delta);
  Mutex clients_mu_;  // a leaf: taken under shard locks
  absl::flat_hash_map<std::string, uint64_t> pending_by_client_ ABSL_GUARDED_BY(clients_mu_);
  absl::flat_hash_map<std::string, uint64_t> pending_by_tenant_ ABSL_GUARDED_BY(clients_mu_);
  Mutex deferred_mu_;  // a leaf: taken under shard locks
  std::vector<DeferredFree> deferred_ ABSL_GUARDED_BY(deferred_mu_);
  // Space of removed objects whose record deletion failed to persist: held
  // until a restart, when the surviving record owns it again.
  std::vector<FollowUp::Extents> stranded_ ABSL_GUARDED_BY(deferred_mu_);

  Mutex groups_mu_;
  // Groups by id, plus pins: a group is deleted when it has neither members
  // nor pins (a pin is held across a follow-up that touches it).
  absl::flat_hash_map<std::string, Group*> groups_ ABSL_GUARDED_BY(groups_mu_);
  absl::flat_hash_map<Group*, int> pins_ ABSL_GUARDED_BY(groups_mu_);
  uint64_t next_group_serial_ ABSL_GUARDED_BY(groups_mu_) = 1;
  // Dead groups with members that were leased when the group died; each
  // holds a pin. Tick retries them.
  std::vector<Group*> dead_groups_ ABSL_GUARDED_BY(groups_mu_);

  // The background evictor (RunEvictor): PutStart wakes it instead of
  // evicting inline whenever it runs.
  bool AboveHighWatermark() const;
  void WakeEvictor();
  Mutex evictor_mu_;
  CondVar evictor_cv_;
  bool evictor_wanted_ ABSL_GUARDED_BY(evictor_mu_) = false;
  bool evictor_stopped_ ABSL_GUARDED_BY(evictor_mu_) = false;
  std::atomic<bool> evictor_running_{false};

  // One pass picks candidates at a time; no pass holds it while its
  // offload orders are out.
  Mutex evict_mu_;
  size_t evict_cursor_ ABSL_GUARDED_BY(evict_mu_) = 0;
  // DRAM bytes of objects picked to move to SSD whose orders are not
  // answered yet: they leave DRAM either way (moved, or evicted), so a
  // watermark pass counts them as freed.
  std::atomic<uint64_t> moving_bytes_{0};
  // SSD tiers whose last order went unanswered, and until when (ms) no
  // order goes to them. A stalled daemon holds the pass that sent an order
  // for offload_timeout; paused, it costs that once per kTierPause, and its
  // objects are evicted as plain evictions meanwhile.
  static constexpr absl::Duration kTierPause = absl::Seconds(10);
  bool TierPaused(const std::string& tier, int64_t now_ms) const;
  // A healthy daemon answers an order in milliseconds; one out this long
  // (real time) is taken for stalled by passes for requests, which then
  // drop that tier's candidates rather than wait up to offload_timeout.
  static constexpr std::chrono::milliseconds kTierStalledAfter{250};
  enum class TierLoad { kIdle, kBusy, kStalled };
  TierLoad LoadOf(const std::string& tier) const;
  mutable Mutex tier_pause_mu_;  // a leaf: taken under shard locks
  CondVar tier_answered_;        // signalled (under tier_pause_mu_) at each answer
  absl::flat_hash_map<std::string, int64_t> tier_paused_until_ms_ ABSL_GUARDED_BY(tier_pause_mu_);
  // When each order out was sent, per tier; orders_out_total_ lets LoadOf
  // skip the lock when none is.
  absl::flat_hash_map<std::string, std::vector<std::chrono::steady_clock::time_point>> orders_out_
      ABSL_GUARDED_BY(tier_pause_mu_);
  std::atomic<int> orders_out_total_{0};
  // The latest pause's end: until then some tier may be paused. Every
  // candidate of a pass asks, so past it none takes the lock.
  std::atomic<int64_t> pauses_end_ms_{0};
  std::atomic<uint64_t> objects_{0}, pending_{0}, evictions_{0}, evicted_bytes_{0};
  std::atomic<uint64_t> evictor_passes_{0};
  TenantTable tenants_;
  std::atomic<uint64_t> pinned_{0}, key_bytes_{0};
  std::atomic<uint64_t> offloaded_{0}, offload_failed_{0}, staged_{0}, stage_no_room_{0};
  std::atomic<uint64_t> leases_released_{0};
  // Put ids count up from a number drawn at each start, so a restarted or
  // newly promoted master does not hand out the ids its predecessor did.
  std::atomic<uint64_t> next_put_id_{(uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()};
  // Until then (ms), every read is leased for pressure_lease (IndexOptions::pressure_window).
  std::atomic<int64_t> pressure_until_ms_{0};
  void NotePressure() {
    pressure_until_ms_.store(NowMs() + absl::ToInt64Milliseconds(options_.pressure_window), std::memory_order_relaxed);
  }
  LeaseWheel leases_;

  friend class ObjectIndex;
};

}  // namespace tierkv::master
