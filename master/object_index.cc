// The object index's core: key validation, construction, the shards and
// their slots, the per-shard eviction lists (each object's place on them),
// the small helpers every path shares (visibility, leases, records), and the
// public ObjectIndex, which forwards to Impl. The paths themselves live by
// name: puts in object_index_put.cc, reads in object_index_read.cc, leases in
// object_index_lease.cc, removal in object_index_remove.cc, liveness and
// recovery in object_index_recovery.cc, eviction in eviction.cc.
#include "master/object_index.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "master/internal/index_impl.h"
#include "proto/master.pb.h"

namespace tierkv::master {

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

void ObjectIndex::Impl::Displace(Shard& s, uint32_t slot) {
  Object& o = s.objects[slot];
  Unlist(s, slot);
  s.index.erase(slot);
  o.displaced = true;
}

void ObjectIndex::Impl::Undisplace(Shard& s, uint32_t slot) {
  Object& o = s.objects[slot];
  o.displaced = false;
  IndexSlot(s, slot);
  // Back on the list it left (at the old end: it sat idle meanwhile).
  if (o.children == 0 && !o.moving && InDram(o)) ListAtTail(s, slot);
}

uint32_t ObjectIndex::Impl::DisplacedBy(Shard& s, uint32_t slot) {
  auto it = s.pending.find(slot);
  if (it == s.pending.end() || it->second.displaced == kNil) return kNil;
  const Object& aside = s.objects[it->second.displaced];
  return aside.displaced && aside.gen == it->second.displaced_gen ? it->second.displaced : kNil;
}

void ObjectIndex::Impl::UpdateFootprint(Shard& s) {
  s.footprint.store(s.objects.size() * sizeof(Object) + s.index.capacity() * (sizeof(uint32_t) + 1),
                    std::memory_order_relaxed);
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

// A snapshot, not a copy: O(1) whatever the number of segments.
LiveSegments ObjectIndex::Impl::LiveNames() const { return registry_->LiveNames(); }

std::vector<ExtentOut> ObjectIndex::Impl::VisibleExtents(const Object& o, const LiveSegments& names,
                                                         bool resolve_names) const {
  std::vector<ExtentOut> out;
  for (const Replica& r : o.replicas) {
    const std::string* name = names.Find(r.segment_id);
    if (name == nullptr) continue;
    out.push_back({resolve_names ? *name : std::string(), r.offset, o.size, r.segment_id, r.ssd, r.stage});
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

void ObjectIndex::Impl::CountPending(const std::string& client, int delta) {
  MutexLock lock(&clients_mu_);
  uint64_t& n = pending_by_client_[client];
  n += delta;
  if (n == 0) pending_by_client_.erase(client);
  const std::string tenant(TenantOf(client));
  uint64_t& t = pending_by_tenant_[tenant];
  t += delta;
  if (t == 0) pending_by_tenant_.erase(tenant);
}

ObjectIndex::PendingCounts ObjectIndex::Impl::Pending(const std::string& client) {
  MutexLock lock(&clients_mu_);
  auto c = pending_by_client_.find(client);
  auto t = pending_by_tenant_.find(TenantOf(client));
  return {c == pending_by_client_.end() ? 0 : c->second, t == pending_by_tenant_.end() ? 0 : t->second};
}

uint64_t ObjectIndex::Impl::PendingOf(const std::string& client) { return Pending(client).client; }

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
                                                bool resolve_names, bool counted) {
  return impl_->GetReplicas(keys, resolve_names, counted);
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
ObjectIndex::PendingCounts ObjectIndex::Pending(const std::string& client) { return impl_->Pending(client); }
absl::Status ObjectIndex::CheckInvariants() { return impl_->CheckInvariants(); }

}  // namespace tierkv::master
