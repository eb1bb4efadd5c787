// The request paths of the object index: put, get, exists, prefix match,
// remove. Eviction, liveness and recovery are in eviction.cc.
#include "master/object_index.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/log.h"
#include "base/status.h"
#include "master/internal/index_impl.h"
#include "proto/master.pb.h"

namespace tierkv::master {
namespace {

// Eviction passes one PutStart item runs for room of its own before it is
// refused: enough to outlast other writers taking the room first, few
// enough that a store whose objects cannot go refuses at once.
constexpr int kRoomAttempts = 8;

}  // namespace

absl::Status ValidateKey(absl::string_view key, size_t max_len) {
  if (key.empty()) return absl::InvalidArgumentError("empty key");
  if (key.size() > max_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("key of ", key.size(), " bytes exceeds the limit of ", max_len));
  }
  if (key.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("key contains a NUL byte");
  }
  return absl::OkStatus();
}

absl::Status ValidateIndexKey(absl::string_view key, size_t max_len) {
  const absl::string_view tenant = TenantOf(key);
  if (!tenant.empty() || (!key.empty() && key[0] == kTenantSeparator)) {
    if (absl::Status st = auth::ValidateTenant(tenant); !st.ok()) return st;
  }
  return ValidateKey(UserKey(key), max_len);
}

absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(absl::string_view name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "prefix") return EvictionPolicy::kPrefix;
  if (name == "chain") return EvictionPolicy::kChain;
  return absl::InvalidArgumentError(absl::StrCat("eviction policy '", name, "' is not lru, prefix or chain"));
}

absl::string_view EvictionPolicyName(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::kLru:
      return "lru";
    case EvictionPolicy::kPrefix:
      return "prefix";
    case EvictionPolicy::kChain:
      return "chain";
  }
  return "chain";
}

ObjectIndex::Impl::Impl(IndexOptions options, SegmentRegistry* registry, IndexStore* store,
                        Clock* clock)
    : options_(options),
      registry_(registry),
      store_(store),
      clock_(clock),
      start_(clock->Now()),
      leases_(options.lease_ttl, absl::ToUnixMillis(start_)) {
  int n = std::clamp(options_.shards, 1, 256);
  for (int i = 0; i < n; ++i) shards_.push_back(std::make_unique<Shard>());
}

ObjectIndex::Impl::~Impl() {
  // Groups are owned by the table or by their members; free every one once.
  absl::flat_hash_set<Group*> all;
  for (auto& s : shards_) {
    for (size_t i = 0; i < s->objects.size(); ++i) {
      if (s->objects[i].group != nullptr) all.insert(s->objects[i].group);
    }
  }
  for (auto& [id, g] : groups_) all.insert(g);
  for (auto& [g, n] : pins_) all.insert(g);
  for (Group* g : all) delete g;
}

size_t ObjectIndex::Impl::ShardOf(absl::string_view key) const {
  // Mix the hash again so shard choice is independent of the set's probing.
  uint64_t h = absl::HashOf(key, uint8_t{0x5b});
  return static_cast<size_t>(h % shards_.size());
}

int64_t ObjectIndex::Impl::NowMs() const { return absl::ToUnixMillis(clock_->Now()); }

uint32_t ObjectIndex::Impl::AccessTick() const {
  const int64_t ticks = absl::ToInt64Milliseconds(clock_->Now() - start_) * kAccessTicksPerSecond / 1000;
  // Past 776 days every access ties (round-robin across shards) rather than
  // wrapping, which would put the newest first; UINT32_MAX is the
  // evictor's "no candidate".
  return static_cast<uint32_t>(std::clamp<int64_t>(ticks, 0, UINT32_MAX - 1));
}

uint32_t ObjectIndex::Impl::Find(Shard& s, absl::string_view key) {
  auto it = s.index.find(key);
  return it == s.index.end() ? kNil : *it;
}

uint32_t ObjectIndex::Impl::NewSlot(Shard& s) {
  if (!s.free_slots.empty()) {
    uint32_t slot = s.free_slots.back();
    s.free_slots.pop_back();
    return slot;
  }
  s.objects.emplace_back();
  UpdateFootprint(s);
  return static_cast<uint32_t>(s.objects.size() - 1);
}

void ObjectIndex::Impl::IndexSlot(Shard& s, uint32_t slot) {
  s.index.insert(slot);
  UpdateFootprint(s);
}

void ObjectIndex::Impl::UpdateFootprint(Shard& s) {
  s.footprint.store(s.objects.size() * sizeof(Object) + s.index.capacity() * (sizeof(uint32_t) + 1),
                    std::memory_order_relaxed);
}

void ObjectIndex::Impl::MoveLease(const Object& o, int64_t old_deadline_ms, int64_t now_ms) {
  const uint32_t to = leases_.TickOf(o.deadline_ms);
  if (old_deadline_ms > 0 && leases_.Counted(old_deadline_ms, now_ms)) {
    const uint32_t from = leases_.TickOf(old_deadline_ms);
    if (from == to) return;  // most re-reads: the same tick, no atomic touched
    leases_.Remove(from);
  }
  leases_.Add(to);
}

LeaseWheel::LeaseWheel(absl::Duration lease_ttl, int64_t start_ms)
    : start_ms_(start_ms),
      // Two ticks of slack either side for readers of the clock racing.
      buckets_(static_cast<size_t>(absl::ToInt64Milliseconds(lease_ttl) / kTickMs + 5)) {}

uint32_t LeaseWheel::TickOf(int64_t deadline_ms) const {
  if (deadline_ms <= start_ms_) return 0;
  return static_cast<uint32_t>((deadline_ms - start_ms_ + kTickMs - 1) / kTickMs);
}

bool LeaseWheel::Counted(int64_t deadline_ms, int64_t now_ms) const {
  return start_ms_ + static_cast<int64_t>(TickOf(deadline_ms)) * kTickMs > now_ms;
}

void LeaseWheel::Add(uint32_t tick) {
  std::atomic<uint64_t>& b = buckets_[tick % buckets_.size()];
  uint64_t cur = b.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t held = static_cast<uint32_t>(cur >> 32);
    if (held > tick && cur != 0) return;  // a later tick owns it: cannot happen within lease_ttl
    const uint64_t next = held == tick ? cur + 1 : (uint64_t{tick} << 32 | 1);
    if (b.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return;
  }
}

void LeaseWheel::Remove(uint32_t tick) {
  std::atomic<uint64_t>& b = buckets_[tick % buckets_.size()];
  uint64_t cur = b.load(std::memory_order_relaxed);
  for (;;) {
    if (static_cast<uint32_t>(cur >> 32) != tick || (cur & 0xffffffffu) == 0) return;
    if (b.compare_exchange_weak(cur, cur - 1, std::memory_order_relaxed)) return;
  }
}

uint64_t LeaseWheel::Count(int64_t now_ms) const {
  uint64_t n = 0;
  for (const std::atomic<uint64_t>& b : buckets_) {
    const uint64_t v = b.load(std::memory_order_relaxed);
    const int64_t end = start_ms_ + static_cast<int64_t>(v >> 32) * kTickMs;
    if (end > now_ms) n += v & 0xffffffffu;
  }
  return n;
}

absl::flat_hash_map<uint32_t, uint64_t> LeaseWheel::Buckets(int64_t now_ms) const {
  absl::flat_hash_map<uint32_t, uint64_t> out;
  for (const std::atomic<uint64_t>& b : buckets_) {
    const uint64_t v = b.load(std::memory_order_relaxed);
    const uint32_t tick = static_cast<uint32_t>(v >> 32);
    if (start_ms_ + static_cast<int64_t>(tick) * kTickMs > now_ms && (v & 0xffffffffu) != 0) {
      out[tick] = v & 0xffffffffu;
    }
  }
  return out;
}

void ObjectIndex::Impl::Unlist(Shard& s, uint32_t slot) {
  Object& o = s.objects[slot];
  if (o.list == ListId::kNone) return;
  LruList& l = s.lists[static_cast<int>(o.list)];
  if (o.prev != kNil) {
    s.objects[o.prev].next = o.next;
  } else {
    l.head = o.next;
  }
  if (o.next != kNil) {
    s.objects[o.next].prev = o.prev;
  } else {
    l.tail = o.prev;
  }
  o.prev = o.next = kNil;
  o.list = ListId::kNone;
  --l.size;
}

void ObjectIndex::Impl::ListAtHead(Shard& s, uint32_t slot) {
  Object& o = s.objects[slot];
  if (o.hard_pin) return;  // the evictor never sees it
  o.list = o.soft_pin ? ListId::kPinnedLeaf : ListId::kLeaf;
  LruList& l = s.lists[static_cast<int>(o.list)];
  o.prev = kNil;
  o.next = l.head;
  if (l.head != kNil) s.objects[l.head].prev = slot;
  l.head = slot;
  if (l.tail == kNil) l.tail = slot;
  ++l.size;
}

void ObjectIndex::Impl::ListAtTail(Shard& s, uint32_t slot) {
  Object& o = s.objects[slot];
  if (o.hard_pin) return;
  o.list = o.soft_pin ? ListId::kPinnedLeaf : ListId::kLeaf;
  LruList& l = s.lists[static_cast<int>(o.list)];
  o.next = kNil;
  o.prev = l.tail;
  if (l.tail != kNil) s.objects[l.tail].next = slot;
  l.tail = slot;
  if (l.head == kNil) l.head = slot;
  ++l.size;
}

void ObjectIndex::Impl::Touch(Shard& s, uint32_t slot) {
  Object& o = s.objects[slot];
  o.access = AccessTick();
  o.referenced = true;
  o.read = true;
}

absl::Status ObjectIndex::Impl::KeyTaken(const Object& o, int64_t now_ms) const {
  if (o.state == ObjState::kPending && o.deadline_ms > now_ms) return absl::AlreadyExistsError("put in progress");
  if (o.state == ObjState::kComplete &&
      (o.moving || std::any_of(o.replicas.begin(), o.replicas.end(),
                               [this](const Replica& r) { return registry_->IsLive(r.segment_id); }))) {
    return absl::AlreadyExistsError("exists");
  }
  return absl::OkStatus();
}

bool ObjectIndex::Impl::Visible(const Object& o) const {
  return o.state == ObjState::kComplete &&
         (o.group == nullptr || o.group->visible.load(std::memory_order_acquire));
}

bool ObjectIndex::Impl::Leased(const Object& o, int64_t now_ms) const {
  return o.state == ObjState::kComplete && o.deadline_ms > now_ms;
}

absl::flat_hash_map<uint32_t, std::string> ObjectIndex::Impl::LiveNames() const {
  return registry_->LiveNames();
}

std::vector<ExtentOut> ObjectIndex::Impl::VisibleExtents(
    const Object& o, const absl::flat_hash_map<uint32_t, std::string>& names,
    bool resolve_names) const {
  std::vector<ExtentOut> out;
  for (const Replica& r : o.replicas) {
    auto it = names.find(r.segment_id);
    if (it == names.end()) continue;
    out.push_back({resolve_names ? it->second : std::string(), r.offset, o.size, r.segment_id, r.ssd, r.stage});
  }
  return out;
}

std::string ObjectIndex::Impl::EncodeRecord(const Object& o, const std::string& parent_key) const {
  v1::ObjectRecord rec;
  rec.set_size(o.size);
  rec.set_put_id(o.put_id);
  for (const Replica& r : o.replicas) {
    if (r.stage) continue;  // a read's copy of the SSD record, made again on demand
    v1::Extent* e = rec.add_replicas();
    e->set_segment(registry_->Name(r.segment_id));
    e->set_offset(r.offset);
    e->set_length(o.size);
    if (r.ssd) e->set_ssd(true);
  }
  rec.set_soft_pin(o.soft_pin);
  rec.set_hard_pin(o.hard_pin);
  if (o.group != nullptr) {
    rec.set_group(o.group->id);
    rec.set_group_size(o.group->members);
  }
  rec.set_parent_key(parent_key);
  return rec.SerializeAsString();
}

uint64_t ObjectIndex::Impl::Persist(std::vector<Mutation>* mutations, FollowUp* follow) {
  bool written = true;
  uint64_t ticket = 0;
  if (!mutations->empty()) {
    if (absl::StatusOr<uint64_t> s = store_->Commit(*mutations); s.ok()) {
      ticket = *s;
    } else {
      written = false;
      TKV_LOG(ERROR) << "persisting " << mutations->size() << " index changes failed: " << s.status()
                     << (follow != nullptr && !follow->freed.empty()
                             ? absl::StrCat("; ", follow->freed.size(), " removed objects' space stays allocated until a restart")
                             : std::string());
    }
    mutations->clear();
  }
  if (follow == nullptr) return ticket;
  if (written) {
    for (const FollowUp::Extents& e : follow->freed) {
      for (const Replica& r : e.replicas) registry_->Free(r, e.size);
    }
  } else {
    MutexLock lock(&deferred_mu_);
    for (FollowUp::Extents& e : follow->freed) stranded_.push_back(std::move(e));
  }
  follow->freed.clear();
  return ticket;
}

void ObjectIndex::Impl::Erase(Shard& s, uint32_t slot, std::vector<Mutation>* mutations,
                              FollowUp* follow, bool never_written) {
  Object& o = s.objects[slot];
  Unlist(s, slot);
  tenants_.Release(TenantOf(o.key), DramCharge(o));
  const int64_t now = NowMs();
  if (o.moving) {
    // An offload order is out: its daemon may be copying these bytes.
    MutexLock lock(&deferred_mu_);
    deferred_.push_back({o.replicas, o.size,
                         std::max(o.deadline_ms, now + 2 * absl::ToInt64Milliseconds(options_.offload_timeout))});
  } else if (o.state == ObjState::kComplete && Leased(o, now)) {
    // A reader may be copying these bytes right now: keep them until its lease ends.
    MutexLock lock(&deferred_mu_);
    deferred_.push_back({o.replicas, o.size, o.deadline_ms});
  } else if (o.state == ObjState::kPending && !never_written && options_.revoke_grace > absl::ZeroDuration()) {
    // A given-up writer may still have bytes on the way to these extents.
    MutexLock lock(&deferred_mu_);
    deferred_.push_back({o.replicas, o.size, now + absl::ToInt64Milliseconds(options_.revoke_grace)});
  } else if (o.state == ObjState::kComplete) {
    follow->freed.push_back({o.replicas, o.size});  // once its deletion is durable (Persist)
  } else {
    for (const Replica& r : o.replicas) registry_->Free(r, o.size);
  }
  if (o.state == ObjState::kComplete) {
    if (o.deadline_ms > 0 && leases_.Counted(o.deadline_ms, now)) leases_.Remove(leases_.TickOf(o.deadline_ms));
    if (options_.listener != nullptr) options_.listener->OnRemoved(o.key);
    mutations->push_back({absl::StrCat("o/", o.key), "", true});
    objects_.fetch_sub(1);
    if (o.soft_pin || o.hard_pin) pinned_.fetch_sub(1);
  } else if (o.state == ObjState::kPending) {
    CountPending(s.pending[slot].client, -1);
    s.pending.erase(slot);
    pending_.fetch_sub(1);
  }
  if (o.parent_slot != kNil) {
    follow->parents.push_back({o.parent_shard, o.parent_slot, o.parent_gen, o.access});
  }
  if (o.group != nullptr) {
    Group* g = o.group;
    MutexLock lock(&groups_mu_);
    --g->alive;
    g->visible.store(false, std::memory_order_release);
    if (!g->dead) {
      // First member to leave: the group dies and the rest must follow.
      g->dead = true;
      auto it = groups_.find(g->id);
      if (it != groups_.end() && it->second == g) groups_.erase(it);
      if (g->alive > 0) {
        ++pins_[g];
        follow->groups.push_back(g);
      }
    }
    if (g->alive == 0 && !pins_.contains(g)) delete g;
  }
  s.index.erase(slot);
  key_bytes_.fetch_sub(o.key.size());
  uint32_t gen = o.gen + 1;
  o = Object();
  o.gen = gen;
  s.free_slots.push_back(slot);
}

void ObjectIndex::Impl::ReleaseGroupPin(Group* g) {
  MutexLock lock(&groups_mu_);
  auto it = pins_.find(g);
  if (it != pins_.end() && --it->second == 0) pins_.erase(it);
  if (g->alive == 0 && !pins_.contains(g)) {
    auto t = groups_.find(g->id);
    if (t != groups_.end() && t->second == g) groups_.erase(t);
    delete g;
  }
}

void ObjectIndex::Impl::DecrementParent(const FollowUp::ParentRef& ref) {
  Shard& s = *shards_[ref.shard];
  MutexLock lock(&s.mu);
  if (ref.slot >= s.objects.size()) return;
  Object& p = s.objects[ref.slot];
  if (p.gen != ref.gen || p.state != ObjState::kComplete || p.children == 0) return;
  if (--p.children == 0) {
    // The parent's last cached child just left. A lookup that reached the
    // child passed the parent, so the parent is as old as the child unless
    // something touched it since: it is next in line, and a reference bit
    // from a touch the child's own has outlived must not send it round
    // again (kPrefix keeps that bit; docs/eviction.md has the cost).
    if (options_.eviction == EvictionPolicy::kChain && p.access <= ref.child_access) p.referenced = false;
    // An object on SSD (or being moved there) frees no DRAM: never a candidate.
    if (!p.moving && InDram(p)) ListAtTail(s, ref.slot);
  }
}

void ObjectIndex::Impl::RunFollowUps(FollowUp follow) {
  // Extents no Persist took (an erase with nothing to delete): their
  // records, if any, were written before this runs.
  for (const FollowUp::Extents& e : follow.freed) {
    for (const Replica& r : e.replicas) registry_->Free(r, e.size);
  }
  follow.freed.clear();
  // Parents first, then groups; a group kill may add more follow-ups.
  while (!follow.parents.empty() || !follow.groups.empty()) {
    std::vector<FollowUp::ParentRef> parents;
    parents.swap(follow.parents);
    for (const auto& ref : parents) DecrementParent(ref);
    std::vector<Group*> groups;
    groups.swap(follow.groups);
    for (Group* g : groups) KillGroup(g);
  }
}

void ObjectIndex::Impl::EraseByKey(const std::string& key, Group* only_group, bool force,
                                   FollowUp* follow, bool never_written) {
  Shard& s = *shards_[ShardOf(key)];
  std::vector<Mutation> mutations;
  {
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, key);
    if (slot == kNil) return;
    Object& o = s.objects[slot];
    if (only_group != nullptr && o.group != only_group) return;
    if (!force && Leased(o, NowMs())) return;
    Erase(s, slot, &mutations, follow, never_written);
    Persist(&mutations, follow);
  }
}

std::vector<PutStartOut> ObjectIndex::Impl::PutStart(const std::vector<PutItem>& items) {
  std::vector<PutStartOut> out(items.size());
  uint64_t largest = registry_->largest_segment();

  // Declare groups first: all items of this call with the same group id.
  absl::flat_hash_map<std::string, Group*> groups;
  {
    absl::flat_hash_map<std::string, std::vector<size_t>> members;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].group.empty()) members[items[i].group].push_back(i);
    }
    MutexLock lock(&groups_mu_);
    for (auto& [id, idx] : members) {
      if (groups_.contains(id)) {
        for (size_t i : idx) {
          out[i].status = absl::AlreadyExistsError(absl::StrCat("group ", id, " exists"));
        }
        continue;
      }
      Group* g = new Group();
      g->id = id;
      g->serial = next_group_serial_++;
      g->members = static_cast<uint32_t>(idx.size());
      g->completed = 0;
      g->alive = 0;
      for (size_t i : idx) g->keys.push_back(items[i].key);
      groups_[id] = g;
      pins_[g] = 1;  // held until this call ends
      groups[id] = g;
    }
  }

  FollowUp follow;
  // Where each group's first member went: the others follow it there, so
  // losing a segment loses whole groups rather than a half of many.
  absl::flat_hash_map<const Group*, std::vector<uint32_t>> homes;
  for (size_t i = 0; i < items.size(); ++i) {
    const PutItem& item = items[i];
    PutStartOut& res = out[i];
    if (!res.status.ok()) continue;
    if (absl::Status st = ValidateIndexKey(item.key, options_.max_key_bytes); !st.ok()) {
      res.status = st;
      continue;
    }
    if (item.size == 0) {
      res.status = absl::InvalidArgumentError(absl::StrCat(item.key, ": size is 0"));
      continue;
    }
    if (item.size > largest) {
      res.status = absl::InvalidArgumentError(absl::StrCat(
          item.key, ": size ", item.size, " exceeds the largest segment (", largest, " bytes)"));
      continue;
    }
    int replicas = item.replicas <= 0 ? 1 : item.replicas;
    if (replicas > options_.max_replicas) {
      res.status = absl::InvalidArgumentError(
          absl::StrCat(item.key, ": ", replicas, " replicas exceeds ", options_.max_replicas));
      continue;
    }
    Group* group = item.group.empty() ? nullptr : groups.at(item.group);
    const absl::string_view tenant = TenantOf(item.key);
    const uint64_t charge = item.size * static_cast<uint64_t>(replicas);
    if (absl::Status st = ChargeQuota(tenant, charge, item.key); !st.ok()) {
      res.status = absl::Status(st.code(), absl::StrCat(UserKey(item.key), ": ", st.message()));
      continue;
    }
    Shard& s = *shards_[ShardOf(item.key)];
    for (int attempt = 0;; ++attempt) {
      MutexLock lock(&s.mu);
      uint32_t slot = Find(s, item.key);
      if (slot != kNil) {
        Object& o = s.objects[slot];
        if (absl::Status taken = KeyTaken(o, NowMs()); !taken.ok()) {
          res.status = absl::Status(taken.code(), absl::StrCat(item.key, ": ", taken.message()));
          break;
        }
        if (o.state == ObjState::kPending) {
          std::vector<Mutation> none;
          Erase(s, slot, &none, &follow);  // a timed-out put: reclaim it now
        } else {
          // Its only copies wait on daemons that are away (the SSD record
          // of a dormant segment, a segment recovering after a master
          // restart): a new put of the key replaces them.
          std::vector<Mutation> gone;
          Erase(s, slot, &gone, &follow);
          Persist(&gone, &follow);
        }
      }
      auto home = group != nullptr ? homes.find(group) : homes.end();
      absl::StatusOr<std::vector<Replica>> placed = registry_->Allocate(
          item.size, replicas, item.preferred_segment,
          home != homes.end() ? absl::Span<const uint32_t>(home->second) : absl::Span<const uint32_t>());
      if (!placed.ok()) {
        if (attempt < kRoomAttempts && absl::IsResourceExhausted(placed.status())) {
          // Make room outside the shard lock, for the rest of this call at
          // once (one pass, not one per item), then try again.
          s.mu.Unlock();
          uint64_t need = 0;
          for (size_t j = i; j < items.size(); ++j) {
            if (out[j].status.ok()) need += items[j].size * static_cast<uint64_t>(std::max(1, items[j].replicas));
          }
          const uint64_t used = registry_->used();
          bool exhausted = false;
          const uint64_t freed = EvictTo(used > need ? used - need : 0, /*batch_moves=*/false, &exhausted);
          s.mu.Lock();
          // Another writer's PutStart may take that room first, and another
          // pass (the evictor's, a writer's) may have made it already: go on
          // unless this pass freed nothing for want of candidates (all that
          // is left is leased, pinned or being written).
          if (freed > 0 || !exhausted) continue;
        }
        res.status = placed.status();
        break;
      }
      if (group != nullptr && home == homes.end()) {
        std::vector<uint32_t>& ids = homes[group];
        for (const Replica& r : *placed) ids.push_back(r.segment_id);
      }
      slot = NewSlot(s);
      Object& o = s.objects[slot];
      o.key = item.key;
      o.size = item.size;
      if (item.put_id) {
        o.put_id = next_put_id_.fetch_add(1, std::memory_order_relaxed);
        if (o.put_id == 0) o.put_id = next_put_id_.fetch_add(1, std::memory_order_relaxed);  // 0 means "none"
      } else {
        o.put_id = 0;  // a slot is reused: no id left from its last object
      }
      res.put_id = o.put_id;
      o.replicas.assign(placed->begin(), placed->end());
      // The put was charged for the replicas it asked; fewer are placed
      // when fewer segments have room, and the object owes what it holds.
      tenants_.Release(tenant, charge - DramCharge(o));
      o.deadline_ms = NowMs() + absl::ToInt64Milliseconds(options_.put_timeout);
      o.state = ObjState::kPending;
      o.soft_pin = item.soft_pin;
      o.hard_pin = item.hard_pin;
      o.access = AccessTick();
      if (group != nullptr) {
        MutexLock glock(&groups_mu_);
        o.group = group;
        ++group->alive;
      }
      IndexSlot(s, slot);
      s.pending[slot] = PendingInfo{item.parent_key, item.client};
      CountPending(item.client, +1);
      pending_.fetch_add(1);
      key_bytes_.fetch_add(item.key.size());
      auto names = LiveNames();
      res.replicas = VisibleExtents(o, names);
      break;
    }
    if (!res.status.ok()) tenants_.Release(tenant, charge);
  }

  // A group with a failed member cannot complete: revoke the rest.
  for (auto& [id, g] : groups) {
    bool failed = false;
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].group == id && !out[i].status.ok()) failed = true;
    }
    if (failed) {
      for (size_t i = 0; i < items.size(); ++i) {
        if (items[i].group != id || !out[i].status.ok()) continue;
        EraseByKey(items[i].key, g, /*force=*/true, &follow, /*never_written=*/true);
        out[i].status = absl::AbortedError(
            absl::StrCat(items[i].key, ": another member of group ", id, " failed"));
        out[i].replicas.clear();
      }
    }
    ReleaseGroupPin(g);
  }
  RunFollowUps(std::move(follow));
  // Eviction runs off the request path: the evictor restores headroom
  // while this put's answer goes out.
  if (evictor_running_.load(std::memory_order_relaxed)) {
    if (AboveHighWatermark()) WakeEvictor();
  } else {
    MaybeEvict();
  }
  return out;
}

void ObjectIndex::Impl::LinkParent(size_t child_shard, absl::string_view child_key,
                                   const std::string& parent_key) {
  size_t ps = ShardOf(parent_key);
  Shard& a = *shards_[std::min(child_shard, ps)];
  Shard& b = *shards_[std::max(child_shard, ps)];
  MutexLock la(&a.mu);
  std::optional<MutexLock> lb;
  if (&a != &b) lb.emplace(&b.mu);
  Shard& cs = *shards_[child_shard];
  Shard& pshard = *shards_[ps];
  uint32_t c = Find(cs, child_key);
  uint32_t p = Find(pshard, parent_key);
  if (c == kNil || p == kNil || (c == p && &cs == &pshard)) return;
  Object& child = cs.objects[c];
  Object& parent = pshard.objects[p];
  if (child.state != ObjState::kComplete || child.parent_slot != kNil ||
      parent.state != ObjState::kComplete) {
    return;
  }
  child.parent_shard = static_cast<uint8_t>(ps);
  child.parent_slot = p;
  child.parent_gen = parent.gen;
  if (parent.children++ == 0) Unlist(pshard, p);
}

std::vector<absl::Status> ObjectIndex::Impl::PutEnd(const std::vector<std::string>& keys) {
  std::vector<absl::Status> out(keys.size());
  std::vector<size_t> shard_of(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) shard_of[i] = ShardOf(keys[i]);
  std::vector<std::string> parents(keys.size());
  std::vector<size_t> committing;
  uint64_t ticket = 0;
  {
    // Every record of the call goes in one store write, made under the
    // locks of the shards it touches, so each key's record and its turn
    // to COMPLETE stay one step (as a Remove or a timeout sees them), and
    // the store folds concurrent calls' writes into one batch. The wait
    // for a standby comes after the locks are released (below).
    ShardLocks locks(shards_, shard_of);
    const int64_t now = NowMs();
    std::vector<Mutation> records;
    for (size_t i = 0; i < keys.size(); ++i) {
      const std::string& key = keys[i];
      Shard& s = *shards_[shard_of[i]];
      uint32_t slot = Find(s, key);
      if (slot == kNil) {
        out[i] = absl::NotFoundError(absl::StrCat(key, ": no put in progress"));
        continue;
      }
      Object& o = s.objects[slot];
      if (o.state == ObjState::kComplete) {
        // A retried PutEnd: acknowledged like the first, once the batch
        // that made it complete (or a later one) is replicated.
        committing.push_back(i);
        ticket = std::max(ticket, store_->LatestTicket());
        continue;
      }
      if (o.deadline_ms <= now) {
        out[i] = absl::NotFoundError(absl::StrCat(key, ": put timed out"));
        continue;
      }
      records.push_back({absl::StrCat("o/", key), EncodeRecord(o, s.pending[slot].parent_key), false});
      committing.push_back(i);
    }
    absl::StatusOr<uint64_t> committed = store_->Commit(records);
    const absl::Status written = committed.status();
    if (committed.ok()) ticket = std::max(ticket, *committed);
    for (size_t i : committing) {
      const std::string& key = keys[i];
      Shard& s = *shards_[shard_of[i]];
      uint32_t slot = Find(s, key);
      Object& o = s.objects[slot];
      if (o.state == ObjState::kComplete) continue;  // the same key twice in this call
      if (!written.ok()) {
        out[i] = Annotate(written, absl::StrCat(key, ": persisting the object"));
        continue;
      }
      parents[i] = std::move(s.pending[slot].parent_key);
      CountPending(s.pending[slot].client, -1);
      s.pending.erase(slot);
      pending_.fetch_sub(1);
      objects_.fetch_add(1);
      if (o.soft_pin || o.hard_pin) pinned_.fetch_add(1);
      o.state = ObjState::kComplete;
      o.deadline_ms = 0;
      o.access = AccessTick();
      ListAtHead(s, slot);
      if (options_.listener != nullptr) options_.listener->OnStored(key, parents[i], o.size);
      if (o.group != nullptr) {
        MutexLock glock(&groups_mu_);
        Group* g = o.group;
        if (++g->completed == g->members && !g->dead) {
          g->visible.store(true, std::memory_order_release);
        }
      }
    }
  }
  // An object here but on no standby yet is readable, but no writer is
  // told it is stored until a standby has it (semi-synchronous).
  if (absl::Status replicated = store_->AwaitReplicated(ticket); !replicated.ok()) {
    for (size_t i : committing) {
      if (out[i].ok()) out[i] = Annotate(replicated, absl::StrCat(keys[i], ": replicating the object"));
    }
  }
  if (options_.eviction != EvictionPolicy::kLru) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!parents[i].empty()) LinkParent(shard_of[i], keys[i], parents[i]);
    }
  }
  return out;
}

std::vector<absl::Status> ObjectIndex::Impl::PutRevoke(const std::vector<std::string>& keys) {
  std::vector<absl::Status> out(keys.size());
  FollowUp follow;
  for (size_t i = 0; i < keys.size(); ++i) {
    Shard& s = *shards_[ShardOf(keys[i])];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, keys[i]);
    if (slot == kNil || s.objects[slot].state != ObjState::kPending) {
      out[i] = absl::NotFoundError(absl::StrCat(keys[i], ": no put in progress"));
      continue;
    }
    std::vector<Mutation> none;
    Erase(s, slot, &none, &follow);
  }
  RunFollowUps(std::move(follow));
  return out;
}

std::vector<LookupOut> ObjectIndex::Impl::GetReplicas(const std::vector<std::string>& keys,
                                                      bool resolve_names) {
  std::vector<size_t> no_room;
  uint64_t need = 0;
  const uint64_t staged_before = staged_.load(std::memory_order_relaxed);
  std::vector<LookupOut> out = Lookup(keys, resolve_names, &no_room, &need);
  if (!no_room.empty()) {
    // SSD hits found no room to stage: make it as a put would (outside
    // the shard locks), then look those keys up once more.
    const uint64_t used = registry_->used();
    EvictTo(used > need ? used - need : 0);
    FreeDeferred(NowMs());  // staged copies the eviction dropped whose grace is over
    std::vector<std::string> again;
    for (size_t i : no_room) again.push_back(keys[i]);
    std::vector<LookupOut> retried = Lookup(again, resolve_names, nullptr, nullptr);
    for (size_t k = 0; k < no_room.size(); ++k) out[no_room[k]] = std::move(retried[k]);
  }
  if (!no_room.empty() || staged_.load(std::memory_order_relaxed) != staged_before) {
    // Staging extents take DRAM: keep the headroom puts expect.
    if (evictor_running_.load(std::memory_order_relaxed)) {
      if (AboveHighWatermark()) WakeEvictor();
    } else {
      MaybeEvict();
    }
  }
  return out;
}

std::vector<LookupOut> ObjectIndex::Impl::Lookup(const std::vector<std::string>& keys, bool resolve_names,
                                                 std::vector<size_t>* no_room, uint64_t* staged_bytes) {
  std::vector<LookupOut> out(keys.size());
  auto names = LiveNames();
  absl::Time now = clock_->Now();
  const int64_t now_ms = absl::ToUnixMillis(now);
  const bool pressed = now_ms < pressure_until_ms_.load(std::memory_order_relaxed);
  const absl::Duration stage_lease = std::min(options_.lease_ttl, pressed ? options_.pressure_lease : options_.stage_lease);
  int64_t stage_until = absl::ToUnixMillis(now + stage_lease);
  int64_t lease_until = pressed ? stage_until : absl::ToUnixMillis(now + options_.lease_ttl);
  for (size_t i = 0; i < keys.size(); ++i) {
    Shard& s = *shards_[ShardOf(keys[i])];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, keys[i]);
    if (slot == kNil || !Visible(s.objects[slot])) {
      out[i].status = absl::NotFoundError(keys[i]);
      continue;
    }
    Object& o = s.objects[slot];
    out[i].replicas = VisibleExtents(o, names, resolve_names);
    std::vector<ExtentOut>& reps = out[i].replicas;
    if (std::any_of(reps.begin(), reps.end(), [](const ExtentOut& e) { return !e.ssd; })) {
      // DRAM first: an SSD replica is named only when none is left.
      reps.erase(std::remove_if(reps.begin(), reps.end(), [](const ExtentOut& e) { return e.ssd; }), reps.end());
    } else if (!reps.empty()) {
      // Stage the value into an extent of the daemon holding it. The
      // extent stays with the object as its DRAM copy (every reader fills
      // it from the record first), so it is evicted like any object, not
      // pinned per read.
      const ExtentOut on_ssd = reps.front();
      reps.clear();
      if (std::optional<Replica> staging = registry_->AllocateIn(on_ssd.segment_id, o.size)) {
        reps.push_back({on_ssd.segment, staging->offset, o.size, on_ssd.segment_id, false, true});
        o.replicas.push_back(*staging);
        o.unreturned = false;  // a new copy: no stage of an older one can reach it
        if (o.children == 0 && o.list == ListId::kNone && !o.moving) ListAtHead(s, slot);
        staged_.fetch_add(1, std::memory_order_relaxed);
      } else {
        out[i].status = absl::NotFoundError(absl::StrCat(keys[i], ": no room to stage it from SSD"));
        if (no_room != nullptr) {
          no_room->push_back(i);
          *staged_bytes += o.size;
        } else {
          stage_no_room_.fetch_add(1, std::memory_order_relaxed);
          NotePressure();
        }
        continue;
      }
    }
    if (reps.empty()) {
      out[i].status = absl::NotFoundError(absl::StrCat(keys[i], ": no live replica"));
      continue;
    }
    out[i].size = o.size;
    out[i].put_id = o.put_id;
    const int64_t old_deadline = o.deadline_ms;
    if (old_deadline <= now_ms) {
      // The last lease is over, and every count it had with it; one that
      // ran out with counted readers left may still see their stages land.
      if (o.readers > 0) o.unreturned = true;
      o.readers = 0;
      o.hard_lease = false;
    }
    // A read under pressure or from SSD is counted, so its reader can give
    // the DRAM back the moment it is done instead of at the deadline.
    const bool counted = pressed || reps.front().stage;
    if (counted && o.readers < kStickyReaders) {
      if (++o.readers < kStickyReaders) out[i].lease_token = LeaseToken(slot, o.gen, lease_boot_);
    } else if (!counted) {
      o.hard_lease = true;
    }
    o.released = false;
    o.deadline_ms = std::max(old_deadline, reps.front().stage ? stage_until : lease_until);
    if (o.deadline_ms != old_deadline) MoveLease(o, old_deadline, now_ms);
    out[i].lease_expiry = absl::FromUnixMillis(o.deadline_ms);
    out[i].idle_s = HitOf(o).idle_s;
    Touch(s, slot);
  }
  return out;
}

size_t ObjectIndex::Impl::ReleaseLeases(const std::vector<LeaseRelease>& releases) {
  size_t applied = 0;
  const int64_t now_ms = NowMs();
  for (const LeaseRelease& r : releases) {
    // At or past its expiry the lease ended by itself: a later reader's
    // count may have replaced it.
    if (r.token == 0 || r.expiry_ms <= now_ms) continue;
    Shard& s = *shards_[ShardOf(r.key)];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, r.key);
    if (slot == kNil) continue;
    Object& o = s.objects[slot];
    if (LeaseToken(slot, o.gen, lease_boot_) != r.token || o.state != ObjState::kComplete || o.deadline_ms <= now_ms ||
        o.readers == 0 || o.readers == kStickyReaders) {
      continue;
    }
    ++applied;
    if (--o.readers > 0 || o.hard_lease) continue;
    if (leases_.Counted(o.deadline_ms, now_ms)) leases_.Remove(leases_.TickOf(o.deadline_ms));
    o.deadline_ms = 0;
    o.released = true;
  }
  leases_released_.fetch_add(applied, std::memory_order_relaxed);
  return applied;
}

std::vector<KeyHit> ObjectIndex::Impl::NoteCachedReads(const std::vector<std::string>& keys) {
  std::vector<KeyHit> hits(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    Shard& s = *shards_[ShardOf(keys[i])];
    MutexLock lock(&s.mu);
    const uint32_t slot = Find(s, keys[i]);
    if (slot == kNil || !Visible(s.objects[slot])) continue;
    hits[i] = HitOf(s.objects[slot]);
    Touch(s, slot);
  }
  return hits;
}

std::vector<bool> ObjectIndex::Impl::Exists(const std::vector<std::string>& keys,
                                            std::vector<KeyHit>* hits) {
  std::vector<bool> out(keys.size());
  auto names = LiveNames();
  for (size_t i = 0; i < keys.size(); ++i) {
    Shard& s = *shards_[ShardOf(keys[i])];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, keys[i]);
    out[i] = slot != kNil && Visible(s.objects[slot]) &&
             !VisibleExtents(s.objects[slot], names).empty();
    if (hits != nullptr) hits->push_back(out[i] ? HitOf(s.objects[slot]) : KeyHit{});
  }
  return out;
}

size_t ObjectIndex::Impl::PrefixMatch(const std::vector<std::string>& keys,
                                      std::vector<KeyHit>* hits) {
  auto names = LiveNames();
  size_t n = 0;
  for (; n < keys.size(); ++n) {
    Shard& s = *shards_[ShardOf(keys[n])];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, keys[n]);
    if (slot == kNil || !Visible(s.objects[slot]) ||
        VisibleExtents(s.objects[slot], names).empty()) {
      break;
    }
    if (hits != nullptr) hits->push_back(HitOf(s.objects[slot]));
    Touch(s, slot);
  }
  return n;
}

std::vector<absl::Status> ObjectIndex::Impl::Remove(const std::vector<std::string>& keys,
                                                    bool force) {
  std::vector<absl::Status> out(keys.size());
  FollowUp follow;
  int64_t now = NowMs();
  std::vector<size_t> shard_of(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) shard_of[i] = ShardOf(keys[i]);
  uint64_t ticket = 0;
  {
    // One store write for the call's deletions, as in PutEnd.
    ShardLocks locks(shards_, shard_of);
    std::vector<Mutation> mutations;
    for (size_t i = 0; i < keys.size(); ++i) {
      Shard& s = *shards_[shard_of[i]];
      uint32_t slot = Find(s, keys[i]);
      if (slot == kNil) {
        out[i] = absl::NotFoundError(keys[i]);
        continue;
      }
      Object& o = s.objects[slot];
      if (!force && o.state == ObjState::kPending) {
        out[i] = absl::FailedPreconditionError(absl::StrCat(keys[i], ": put in progress"));
        continue;
      }
      if (!force && Leased(o, now)) {
        out[i] = absl::FailedPreconditionError(
            absl::StrCat(keys[i], ": leased for another ", o.deadline_ms - now, " ms"));
        continue;
      }
      Erase(s, slot, &mutations, &follow);
    }
    ticket = Persist(&mutations, &follow);
  }
  RunFollowUps(std::move(follow));
  // Answered once a standby has the deletions, outside the shard locks.
  if (absl::Status replicated = store_->AwaitReplicated(ticket); !replicated.ok()) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (out[i].ok()) out[i] = Annotate(replicated, absl::StrCat(keys[i], ": replicating the removal"));
    }
  }
  return out;
}

uint64_t ObjectIndex::Impl::RemoveAll(bool force, const std::string* tenant) {
  uint64_t removed = 0;
  uint64_t ticket = 0;
  int64_t now = NowMs();
  FollowUp follow;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    MutexLock lock(&s.mu);
    std::vector<Mutation> mutations;
    for (uint32_t slot = 0; slot < s.objects.size(); ++slot) {
      Object& o = s.objects[slot];
      if (o.state != ObjState::kComplete || (!force && Leased(o, now))) continue;
      if (tenant != nullptr && TenantOf(o.key) != *tenant) continue;
      Erase(s, slot, &mutations, &follow);
      ++removed;
    }
    ticket = std::max(ticket, Persist(&mutations, &follow));
  }
  RunFollowUps(std::move(follow));
  // A deposed master's answer never goes out (its serving gate), so only
  // the wait matters here, not its outcome.
  (void)store_->AwaitReplicated(ticket);
  return removed;
}

absl::StatusOr<ObjectInfo> ObjectIndex::Impl::Describe(const std::string& key) {
  auto names = LiveNames();
  Shard& s = *shards_[ShardOf(key)];
  MutexLock lock(&s.mu);
  uint32_t slot = Find(s, key);
  if (slot == kNil) return absl::NotFoundError(key);
  const Object& o = s.objects[slot];
  ObjectInfo info;
  info.size = o.size;
  info.put_id = o.put_id;
  info.state = o.state == ObjState::kPending ? "pending" : "complete";
  info.replicas = VisibleExtents(o, names);
  if (o.state == ObjState::kComplete && o.deadline_ms > 0) {
    info.lease_expiry = absl::FromUnixMillis(o.deadline_ms);
  }
  info.soft_pin = o.soft_pin;
  info.hard_pin = o.hard_pin;
  info.group = o.group != nullptr ? o.group->id : "";
  info.visible = Visible(o) && !info.replicas.empty();
  info.children = o.children;
  return info;
}

IndexStats ObjectIndex::Impl::Stats() const {
  IndexStats st;
  st.objects = objects_.load();
  st.pending = pending_.load();
  st.evictions = evictions_.load();
  st.evictor_passes = evictor_passes_.load();
  st.evicted_bytes = evicted_bytes_.load();
  st.pinned = pinned_.load();
  st.offloaded = offloaded_.load();
  st.offload_failed = offload_failed_.load();
  st.staged = staged_.load();
  st.stage_no_room = stage_no_room_.load();
  st.leases_released = leases_released_.load();
  // No shard lock and no object visited: a scrape costs the same at any
  // object count and never stalls a request.
  st.leased = leases_.Count(NowMs());
  uint64_t footprint = 0;
  for (const auto& sp : shards_) footprint += sp->footprint.load(std::memory_order_relaxed);
  {
    MutexLock lock(&const_cast<Impl*>(this)->groups_mu_);
    st.groups = groups_.size();
  }
  st.memory_bytes = footprint + key_bytes_.load();
  return st;
}

// --- The public face forwards to Impl.

ObjectIndex::ObjectIndex(IndexOptions options, SegmentRegistry* registry, IndexStore* store,
                         Clock* clock)
    : impl_(std::make_unique<Impl>(options, registry, store, clock)) {}
ObjectIndex::~ObjectIndex() = default;
std::vector<PutStartOut> ObjectIndex::PutStart(const std::vector<PutItem>& items) {
  return impl_->PutStart(items);
}
std::vector<absl::Status> ObjectIndex::PutEnd(const std::vector<std::string>& keys) {
  return impl_->PutEnd(keys);
}
std::vector<absl::Status> ObjectIndex::PutRevoke(const std::vector<std::string>& keys) {
  return impl_->PutRevoke(keys);
}
std::vector<LookupOut> ObjectIndex::GetReplicas(const std::vector<std::string>& keys,
                                                bool resolve_names) {
  return impl_->GetReplicas(keys, resolve_names);
}
size_t ObjectIndex::ReleaseLeases(const std::vector<LeaseRelease>& releases) {
  return impl_->ReleaseLeases(releases);
}
std::vector<KeyHit> ObjectIndex::NoteCachedReads(const std::vector<std::string>& keys) {
  return impl_->NoteCachedReads(keys);
}
std::vector<bool> ObjectIndex::Exists(const std::vector<std::string>& keys, std::vector<KeyHit>* hits) {
  return impl_->Exists(keys, hits);
}
size_t ObjectIndex::PrefixMatch(const std::vector<std::string>& keys, std::vector<KeyHit>* hits) {
  return impl_->PrefixMatch(keys, hits);
}
std::vector<absl::Status> ObjectIndex::Remove(const std::vector<std::string>& keys, bool force) {
  return impl_->Remove(keys, force);
}
uint64_t ObjectIndex::RemoveAll(bool force, const std::string* tenant) { return impl_->RemoveAll(force, tenant); }
TenantTable& ObjectIndex::tenants() { return impl_->tenants(); }
uint64_t ObjectIndex::EvictTo(uint64_t target_used) { return impl_->EvictTo(target_used); }
void ObjectIndex::MaybeEvict() { impl_->MaybeEvict(); }
void ObjectIndex::RunEvictor() { impl_->RunEvictor(); }
void ObjectIndex::StopEvictor() { impl_->StopEvictor(); }
bool ObjectIndex::EvictorRunning() const { return impl_->evictor_running_.load(); }
void ObjectIndex::Tick() { impl_->Tick(); }
uint64_t ObjectIndex::DropSegments(const std::vector<uint32_t>& ids,
                                   const absl::flat_hash_map<uint32_t, uint32_t>& keep_ssd) {
  return impl_->DropSegments(ids, keep_ssd);
}
std::vector<bool> ObjectIndex::ConfirmSsd(uint32_t id, const std::vector<std::pair<std::string, uint64_t>>& records,
                                          uint64_t* dropped) {
  return impl_->ConfirmSsd(id, records, dropped);
}
uint64_t ObjectIndex::DropSsd(uint32_t id, const std::vector<std::string>& keys) { return impl_->DropSsd(id, keys); }
uint64_t ObjectIndex::DropSsdExcept(uint32_t id, const absl::flat_hash_set<std::string>& keep) {
  return impl_->DropSsdExcept(id, keep);
}
absl::StatusOr<uint64_t> ObjectIndex::Recover() { return impl_->Recover(); }
absl::StatusOr<ObjectInfo> ObjectIndex::Describe(const std::string& key) {
  return impl_->Describe(key);
}
IndexStats ObjectIndex::Stats() const { return impl_->Stats(); }
uint64_t ObjectIndex::PendingOf(const std::string& client) { return impl_->PendingOf(client); }

void ObjectIndex::Impl::CountPending(const std::string& client, int delta) {
  MutexLock lock(&clients_mu_);
  uint64_t& n = pending_by_client_[client];
  n += delta;
  if (n == 0) pending_by_client_.erase(client);
}

uint64_t ObjectIndex::Impl::PendingOf(const std::string& client) {
  MutexLock lock(&clients_mu_);
  auto it = pending_by_client_.find(client);
  return it == pending_by_client_.end() ? 0 : it->second;
}
absl::Status ObjectIndex::CheckInvariants() { return impl_->CheckInvariants(); }

}  // namespace tierkv::master
