#include "master/segment_registry.h"

#include <algorithm>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tierkv::master {
namespace {

absl::Status NotOwner(const std::string& name, const std::string& owner, const SegmentActor& actor) {
  return absl::PermissionDeniedError(absl::StrCat("segment ", name, " belongs to '", owner, "', not to '",
                                                  actor.identity, "' (only its owner or an admin may change it)"));
}

}  // namespace

const std::string* LiveSegments::Find(uint32_t id) const {
  if (table_ == nullptr) return nullptr;
  const size_t chunk = id >> kChunkBits;
  if (chunk >= table_->size() || (*table_)[chunk] == nullptr) return nullptr;
  const std::string& name = (*(*table_)[chunk])[id & ((1u << kChunkBits) - 1)];
  return name.empty() ? nullptr : &name;
}

void SegmentRegistry::PublishLive(uint32_t id, const std::string& name) {
  using Table = LiveSegments::Table;
  using Chunk = LiveSegments::Chunk;
  std::shared_ptr<const Table> current;
  {
    std::shared_lock<std::shared_mutex> lock(live_mu_);
    current = live_;
  }
  auto next = current != nullptr ? std::make_shared<Table>(*current) : std::make_shared<Table>();
  const size_t at = id >> LiveSegments::kChunkBits;
  if (next->size() <= at) next->resize(at + 1);
  auto chunk = (*next)[at] != nullptr ? std::make_shared<Chunk>(*(*next)[at]) : std::make_shared<Chunk>();
  (*chunk)[id & ((1u << LiveSegments::kChunkBits) - 1)] = name;
  const bool empty = std::all_of(chunk->begin(), chunk->end(), [](const std::string& n) { return n.empty(); });
  (*next)[at] = empty ? nullptr : std::shared_ptr<const Chunk>(std::move(chunk));
  std::unique_lock<std::shared_mutex> lock(live_mu_);
  live_ = std::move(next);
}

void SegmentRegistry::File(Segment& seg) {
  if (seg.recovering || seg.filed) return;
  const Key key{seg.allocator->capacity() - seg.allocator->used(), seg.id};
  order_.insert(key);
  Order& host = by_host_[seg.spec.host];
  const bool first = host.empty() || MostFree()(key, *host.begin());
  if (first && !host.empty()) host_firsts_.erase(*host.begin());
  host.insert(key);
  if (first) host_firsts_.insert(key);
  seg.filed = true;
  seg.filed_free = key.first;
}

void SegmentRegistry::Unfile(Segment& seg) {
  if (!seg.filed) return;
  const Key key{seg.filed_free, seg.id};
  order_.erase(key);
  auto it = by_host_.find(seg.spec.host);
  Order& host = it->second;
  const bool first = *host.begin() == key;
  host.erase(key);
  if (first) {
    host_firsts_.erase(key);
    if (!host.empty()) host_firsts_.insert(*host.begin());
  }
  if (host.empty()) by_host_.erase(it);
  seg.filed = false;
}

void SegmentRegistry::Recount(Segment& seg) {
  // Unsigned wrap-around makes a decrease an addition of its negation.
  const uint64_t used = seg.allocator->used();
  used_.fetch_add(used - seg.counted_used, std::memory_order_relaxed);
  seg.counted_used = used;
  const uint64_t capacity = seg.dormant ? 0 : seg.allocator->capacity();
  capacity_.fetch_add(capacity - seg.counted_capacity, std::memory_order_relaxed);
  seg.counted_capacity = capacity;
}

uint32_t SegmentRegistry::AddLocked(const SegmentSpec& spec, absl::Time now, bool recovering) {
  uint32_t id = next_id_++;
  auto [it, fresh] = by_id_.emplace(id, Segment{id, spec, std::make_unique<ExtentAllocator>(spec.capacity, alignment_),
                                                now, recovering, false, spec.ssd_id.empty()});
  by_name_[spec.name] = id;
  Segment& seg = it->second;
  capacities_.insert(seg.allocator->capacity());
  largest_.store(*capacities_.rbegin(), std::memory_order_relaxed);
  Recount(seg);
  File(seg);
  if (!recovering) PublishLive(id, spec.name);
  return id;
}

void SegmentRegistry::EraseLocked(uint32_t id) {
  auto it = by_id_.find(id);
  Segment& seg = it->second;
  Unfile(seg);
  used_.fetch_sub(seg.counted_used, std::memory_order_relaxed);
  capacity_.fetch_sub(seg.counted_capacity, std::memory_order_relaxed);
  capacities_.erase(capacities_.find(seg.allocator->capacity()));
  largest_.store(capacities_.empty() ? 0 : *capacities_.rbegin(), std::memory_order_relaxed);
  if (!seg.recovering) PublishLive(id, "");
  if (auto n = by_name_.find(seg.spec.name); n != by_name_.end() && n->second == id) by_name_.erase(n);
  by_id_.erase(it);
}

absl::StatusOr<uint32_t> SegmentRegistry::Mount(const SegmentSpec& spec, absl::Time now,
                                                bool* restored,
                                                std::optional<uint32_t>* replaced_id,
                                                absl::Duration live_within, bool* same_ssd,
                                                const SegmentActor& actor, std::string* owner,
                                                std::string* owner_tenant) {
  if (spec.name.empty()) return absl::InvalidArgumentError("segment name is empty");
  if (spec.capacity < alignment_) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment ", spec.name, ": capacity ", spec.capacity, " is too small"));
  }
  *restored = false;
  replaced_id->reset();
  if (same_ssd != nullptr) *same_ssd = false;
  SegmentSpec owned = spec;
  owned.owner = actor.admin ? std::string() : actor.identity;
  owned.owner_tenant = actor.admin ? std::string() : actor.tenant;
  MutexLock lock(&mu_);
  if (!spec.tier_http.empty() && TierTakenLocked(spec.tier_http, spec.name)) {
    return absl::PermissionDeniedError(absl::StrCat("segment ", spec.name, ": another segment serves the SSD tier at ",
                                                    spec.tier_http));
  }
  if (owner != nullptr) *owner = owned.owner;
  if (owner_tenant != nullptr) *owner_tenant = owned.owner_tenant;
  if (auto it = by_name_.find(spec.name); it != by_name_.end()) {
    Segment& seg = by_id_.at(it->second);
    // Checked under the lock that the mount takes, so no other mount can
    // slip in between.
    const bool same_daemon = (!spec.data_key.empty() && spec.data_key == seg.spec.data_key) ||
                             (!spec.ssd_id.empty() && spec.ssd_id == seg.spec.ssd_id);
    if (!actor.MayChange(seg.spec.owner) && !(seg.spec.owner.empty() && same_daemon)) {
      return NotOwner(spec.name, seg.spec.owner, actor);
    }
    if (actor.admin) {
      owned.owner = seg.spec.owner;
      owned.owner_tenant = seg.spec.owner_tenant;
    }
    // An admin's mount keeps the owner, and says so (it is persisted).
    if (owner != nullptr) *owner = owned.owner;
    if (owner_tenant != nullptr) *owner_tenant = owned.owner_tenant;
    if (seg.spec.incarnation == spec.incarnation && seg.spec.capacity == spec.capacity && !seg.dormant) {
      Unfile(seg);  // the host may be another
      const bool was_recovering = seg.recovering;
      seg.recovering = false;
      seg.last_heartbeat = now;
      seg.spec = owned;
      seg.ssd_synced = spec.ssd_id.empty();
      File(seg);
      if (was_recovering) PublishLive(seg.id, spec.name);
      *restored = true;
      return seg.id;
    }
    if (!seg.recovering && seg.spec.host != spec.host && now - seg.last_heartbeat < live_within) {
      return absl::AlreadyExistsError(absl::StrCat(
          "segment ", spec.name, " is held by a live daemon on host ", seg.spec.host,
          "; each daemon needs its own name (set --host or --name)"));
    }
    *replaced_id = seg.id;
    if (same_ssd != nullptr) *same_ssd = !spec.ssd_id.empty() && seg.spec.ssd_id == spec.ssd_id;
    EraseLocked(seg.id);
  }
  return AddLocked(owned, now, /*recovering=*/false);
}

uint32_t SegmentRegistry::Recover(const SegmentSpec& spec, absl::Time now) {
  MutexLock lock(&mu_);
  return AddLocked(spec, now, /*recovering=*/true);
}

absl::StatusOr<uint32_t> SegmentRegistry::Unmount(const std::string& name, const SegmentActor& actor) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return absl::NotFoundError(absl::StrCat("no segment ", name));
  uint32_t id = it->second;
  const std::string& owner = by_id_.at(id).spec.owner;
  if (!actor.MayChange(owner)) return NotOwner(name, owner, actor);
  EraseLocked(id);
  return id;
}

absl::Status SegmentRegistry::MayChange(const std::string& name, const SegmentActor& actor) const {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return absl::OkStatus();
  const std::string& owner = by_id_.at(it->second).spec.owner;
  return actor.MayChange(owner) ? absl::OkStatus() : NotOwner(name, owner, actor);
}

bool SegmentRegistry::Heartbeat(const std::string& name, const std::string& incarnation,
                                absl::Time now, const SegmentActor& actor) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return false;
  Segment& seg = by_id_.at(it->second);
  if (seg.recovering || seg.spec.incarnation != incarnation || !actor.MayChange(seg.spec.owner)) return false;
  seg.last_heartbeat = now;
  return true;
}

void SegmentRegistry::UpdateTier(const SegmentSpec& spec) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(spec.name);
  if (it == by_name_.end()) return;
  Segment& seg = by_id_.at(it->second);
  if (seg.spec.incarnation != spec.incarnation) return;
  // A move to an address another segment's tier serves is not taken:
  // offloads to that address are signed with that segment's key.
  if (spec.tier_http == seg.spec.tier_http || spec.tier_http.empty() || !TierTakenLocked(spec.tier_http, spec.name)) {
    seg.spec.tier_http = spec.tier_http;
  }
  seg.spec.ssd_capacity = spec.ssd_capacity;
  seg.spec.ssd_used = spec.ssd_used;
}

std::optional<std::string> SegmentRegistry::TierFor(uint32_t id, uint64_t size) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.recovering || !it->second.ssd_synced) return std::nullopt;
  const SegmentSpec& spec = it->second.spec;
  if (spec.tier_http.empty() || spec.ssd_capacity < size) return std::nullopt;
  return spec.tier_http;
}

void SegmentRegistry::DormantLocked(Segment& seg) {
  Unfile(seg);
  if (!seg.recovering) PublishLive(seg.id, "");
  seg.recovering = true;
  seg.dormant = true;
  seg.ssd_synced = false;
  // Its DRAM is gone with the process: the extents of the dropped
  // objects go with the old allocator.
  seg.allocator = std::make_unique<ExtentAllocator>(seg.spec.capacity, alignment_);
  Recount(seg);
}

std::vector<uint32_t> SegmentRegistry::Expire(absl::Time now, absl::Duration ttl, absl::Duration ssd_grace,
                                              std::vector<uint32_t>* dormant) {
  std::vector<uint32_t> gone;
  MutexLock lock(&mu_);
  for (auto& [id, seg] : by_id_) {
    const bool keeps_ssd = !seg.spec.ssd_id.empty() && ssd_grace > absl::ZeroDuration() && dormant != nullptr;
    if (now - seg.last_heartbeat <= ttl) continue;
    if (!keeps_ssd || (seg.dormant && now - seg.last_heartbeat > std::max(ttl, ssd_grace))) {
      gone.push_back(id);
    } else if (!seg.dormant) {
      DormantLocked(seg);
      dormant->push_back(id);
    }
  }
  for (uint32_t id : gone) EraseLocked(id);
  return gone;
}

absl::StatusOr<std::vector<Replica>> SegmentRegistry::Allocate(uint64_t size, int count,
                                                               const std::string& preferred,
                                                               absl::Span<const uint32_t> with,
                                                               absl::string_view tenant) {
  MutexLock lock(&mu_);
  if (order_.empty()) {
    // Not a matter of space: evicting would only throw cached data away.
    const size_t recovering = by_id_.size();
    return absl::UnavailableError(
        recovering > 0 ? absl::StrCat("no live segment: ", recovering, " ", kAwaitingRemount, " after a master restart")
                       : std::string("no segment is mounted"));
  }
  // The order every pass walks: `with` (in its order), then the preferred
  // segment, then the rest by free space (order_). Only segments with room
  // count; the walk stops as soon as `count` are picked, and what it skips
  // is what is picked already or lacks room.
  auto room = [size, tenant](const Segment& seg) {
    return (seg.spec.owner_tenant.empty() || seg.spec.owner_tenant == tenant) &&
           seg.allocator->largest_free() >= seg.allocator->Rounded(size);
  };
  absl::InlinedVector<Segment*, 8> front;
  auto in_front = [&front](uint32_t id) {
    return std::any_of(front.begin(), front.end(), [id](const Segment* s) { return s->id == id; });
  };
  auto add_front = [&](uint32_t id) {
    auto it = by_id_.find(id);
    if (it == by_id_.end() || it->second.recovering || !room(it->second) || in_front(id)) return;
    front.push_back(&it->second);
  };
  for (uint32_t id : with) add_front(id);
  if (auto it = by_name_.find(preferred); it != by_name_.end()) add_front(it->second);

  const size_t want = count > 0 ? static_cast<size_t>(count) : 0;
  absl::InlinedVector<Segment*, 8> picks;
  auto picked = [&picks](uint32_t id) {
    return std::any_of(picks.begin(), picks.end(), [id](const Segment* s) { return s->id == id; });
  };
  auto host_used = [&picks](const std::string& host) {
    return std::any_of(picks.begin(), picks.end(), [&host](const Segment* s) { return s->spec.host == host; });
  };
  // Pass one: one replica per host. After the front, the next pick is the
  // first segment in order on a host not yet used: each host's own order
  // is walked from its first, hosts in the order of their firsts, until
  // no host's first can beat the best found.
  for (Segment* seg : front) {
    if (picks.size() >= want) break;
    if (!host_used(seg->spec.host)) picks.push_back(seg);
  }
  while (picks.size() < want) {
    const Key* best = nullptr;
    Segment* best_seg = nullptr;
    for (const Key& first : host_firsts_) {
      if (best != nullptr && !MostFree()(first, *best)) break;
      const std::string& host = by_id_.at(first.second).spec.host;
      if (host_used(host)) continue;
      for (const Key& key : by_host_.at(host)) {
        if (best != nullptr && !MostFree()(key, *best)) break;
        Segment& seg = by_id_.at(key.second);
        if (in_front(seg.id) || !room(seg)) continue;
        best = &key;
        best_seg = &seg;
        break;
      }
    }
    if (best_seg == nullptr) break;
    picks.push_back(best_seg);
  }
  // Pass two: any segment not yet picked.
  for (Segment* seg : front) {
    if (picks.size() >= want) break;
    if (!picked(seg->id)) picks.push_back(seg);
  }
  for (auto it = order_.begin(); it != order_.end() && picks.size() < want; ++it) {
    Segment& seg = by_id_.at(it->second);
    if (!picked(seg.id) && !in_front(seg.id) && room(seg)) picks.push_back(&seg);
  }

  std::vector<Replica> out;
  for (Segment* seg : picks) {
    Unfile(*seg);
    std::optional<uint64_t> off = seg->allocator->Allocate(size);
    Recount(*seg);
    File(*seg);
    if (off) out.push_back({seg->id, false, false, *off});
  }
  if (out.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("no segment has room for ", size, " bytes"));
  }
  return out;
}

std::optional<Replica> SegmentRegistry::AllocateIn(uint32_t id, uint64_t size) {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.recovering) return std::nullopt;
  Segment& seg = it->second;
  if (seg.allocator->largest_free() < seg.allocator->Rounded(size)) return std::nullopt;
  Unfile(seg);
  std::optional<uint64_t> off = seg.allocator->Allocate(size);
  Recount(seg);
  File(seg);
  if (!off) return std::nullopt;
  return Replica{id, false, true, *off};
}

void SegmentRegistry::Free(const Replica& r, uint64_t size) {
  if (r.ssd) return;
  MutexLock lock(&mu_);
  auto it = by_id_.find(r.segment_id);
  if (it == by_id_.end()) return;
  // A refused free means the index and allocator disagree; the extent is
  // leaked rather than handed out twice.
  Segment& seg = it->second;
  Unfile(seg);
  (void)seg.allocator->Free(r.offset, size);
  Recount(seg);
  File(seg);
}

absl::Status SegmentRegistry::Reserve(const Replica& r, uint64_t size) {
  if (r.ssd) return absl::OkStatus();
  MutexLock lock(&mu_);
  auto it = by_id_.find(r.segment_id);
  if (it == by_id_.end()) return absl::NotFoundError("segment left");
  Segment& seg = it->second;
  Unfile(seg);
  absl::Status st = seg.allocator->Reserve(r.offset, size);
  Recount(seg);
  File(seg);
  return st;
}

bool SegmentRegistry::MakeDormant(const std::string& name, absl::Time now, const SegmentActor& actor) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return false;
  Segment& seg = by_id_.at(it->second);
  if (seg.spec.ssd_id.empty() || !actor.MayChange(seg.spec.owner)) return false;
  DormantLocked(seg);
  seg.last_heartbeat = now;  // the grace counts from the stop
  return true;
}

std::optional<uint32_t> SegmentRegistry::LiveId(const std::string& name, const std::string& incarnation) const {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  const Segment& seg = by_id_.at(it->second);
  if (seg.recovering || seg.spec.incarnation != incarnation) return std::nullopt;
  return seg.id;
}

void SegmentRegistry::MarkSsdSynced(uint32_t id, const std::string& tier_http, uint64_t ssd_capacity,
                                    uint64_t ssd_used) {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.recovering) return;
  it->second.ssd_synced = true;
  if (tier_http.empty() || TierTakenLocked(tier_http, it->second.spec.name)) return;
  it->second.spec.tier_http = tier_http;
  // A daemon that lists before it has heartbeated its tier's size.
  if (ssd_capacity > 0) {
    it->second.spec.ssd_capacity = ssd_capacity;
    it->second.spec.ssd_used = ssd_used;
  }
}

bool SegmentRegistry::IsLive(uint32_t id) const { return LiveNames().Contains(id); }

bool SegmentRegistry::AwaitsRemount(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it != by_id_.end() && it->second.recovering && !it->second.dormant;
}

std::string SegmentRegistry::Name(uint32_t id) const {
  {
    const LiveSegments live = LiveNames();
    if (const std::string* name = live.Find(id)) return *name;
  }
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? std::string() : it->second.spec.name;
}

std::string SegmentRegistry::OwnerOf(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? std::string() : it->second.spec.owner;
}

std::optional<uint32_t> SegmentRegistry::IdOf(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> SegmentRegistry::DataKeyOf(const std::string& name, std::string* owner_tenant) const {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  const Segment& seg = by_id_.at(it->second);
  if (seg.dormant) return std::nullopt;
  if (owner_tenant != nullptr) *owner_tenant = seg.spec.owner_tenant;
  return seg.spec.data_key;
}

bool SegmentRegistry::TierTakenLocked(const std::string& tier_http, const std::string& name) const {
  for (const auto& [id, seg] : by_id_) {
    // Dormant ones too: their daemon comes back to the same address.
    if (seg.spec.name != name && seg.spec.tier_http == tier_http) return true;
  }
  return false;
}

std::optional<std::string> SegmentRegistry::DataKeyOfId(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.dormant) return std::nullopt;
  return it->second.spec.data_key;
}

bool SegmentRegistry::ChecksGrants(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it != by_id_.end() && !it->second.spec.data_key.empty();
}

std::string SegmentRegistry::DataKeyOfTier(const std::string& tier_http) const {
  MutexLock lock(&mu_);
  for (const auto& [id, seg] : by_id_) {
    if (!seg.dormant && seg.spec.tier_http == tier_http) return seg.spec.data_key;
  }
  return "";
}

LiveSegments SegmentRegistry::LiveNames() const {
  std::shared_lock<std::shared_mutex> lock(live_mu_);
  return LiveSegments(live_);
}

uint64_t SegmentRegistry::Rounded(uint64_t size) const {
  if (size == 0) size = 1;
  return (size + alignment_ - 1) & ~(alignment_ - 1);
}

absl::flat_hash_map<uint32_t, uint64_t> SegmentRegistry::UsedById() const {
  MutexLock lock(&mu_);
  absl::flat_hash_map<uint32_t, uint64_t> out;
  for (const auto& [id, seg] : by_id_) out[id] = seg.allocator->used();
  return out;
}

std::vector<SegmentSnapshot> SegmentRegistry::Snapshot() const {
  MutexLock lock(&mu_);
  std::vector<SegmentSnapshot> out;
  for (const auto& [id, seg] : by_id_) {
    out.push_back({id, seg.spec, seg.allocator->used(), seg.recovering, seg.last_heartbeat, seg.dormant});
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentSnapshot& a, const SegmentSnapshot& b) { return a.spec.name < b.spec.name; });
  return out;
}

}  // namespace tierkv::master
