#include "master/segment_registry.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tierkv::master {

uint32_t SegmentRegistry::AddLocked(const SegmentSpec& spec, absl::Time now, bool recovering) {
  uint32_t id = next_id_++;
  by_id_.emplace(id, Segment{id, spec, std::make_unique<ExtentAllocator>(spec.capacity, alignment_),
                             now, recovering, false, spec.ssd_id.empty()});
  by_name_[spec.name] = id;
  return id;
}

absl::StatusOr<uint32_t> SegmentRegistry::Mount(const SegmentSpec& spec, absl::Time now,
                                                bool* restored,
                                                std::optional<uint32_t>* replaced_id,
                                                absl::Duration live_within, bool* same_ssd) {
  if (spec.name.empty()) return absl::InvalidArgumentError("segment name is empty");
  if (spec.capacity < alignment_) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment ", spec.name, ": capacity ", spec.capacity, " is too small"));
  }
  *restored = false;
  replaced_id->reset();
  if (same_ssd != nullptr) *same_ssd = false;
  MutexLock lock(&mu_);
  if (auto it = by_name_.find(spec.name); it != by_name_.end()) {
    Segment& seg = by_id_.at(it->second);
    if (seg.spec.incarnation == spec.incarnation && seg.spec.capacity == spec.capacity && !seg.dormant) {
      seg.recovering = false;
      seg.last_heartbeat = now;
      seg.spec = spec;
      seg.ssd_synced = spec.ssd_id.empty();
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
    by_id_.erase(seg.id);
    by_name_.erase(it);
  }
  return AddLocked(spec, now, /*recovering=*/false);
}

uint32_t SegmentRegistry::Recover(const SegmentSpec& spec, absl::Time now) {
  MutexLock lock(&mu_);
  return AddLocked(spec, now, /*recovering=*/true);
}

absl::StatusOr<uint32_t> SegmentRegistry::Unmount(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return absl::NotFoundError(absl::StrCat("no segment ", name));
  uint32_t id = it->second;
  by_id_.erase(id);
  by_name_.erase(it);
  return id;
}

bool SegmentRegistry::Heartbeat(const std::string& name, const std::string& incarnation,
                                absl::Time now) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return false;
  Segment& seg = by_id_.at(it->second);
  if (seg.recovering || seg.spec.incarnation != incarnation) return false;
  seg.last_heartbeat = now;
  return true;
}

void SegmentRegistry::UpdateTier(const SegmentSpec& spec) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(spec.name);
  if (it == by_name_.end()) return;
  Segment& seg = by_id_.at(it->second);
  if (seg.spec.incarnation != spec.incarnation) return;
  seg.spec.tier_http = spec.tier_http;
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
  seg.recovering = true;
  seg.dormant = true;
  seg.ssd_synced = false;
  // Its DRAM is gone with the process: the extents of the dropped
  // objects go with the old allocator.
  seg.allocator = std::make_unique<ExtentAllocator>(seg.spec.capacity, alignment_);
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
  for (uint32_t id : gone) {
    by_name_.erase(by_id_.at(id).spec.name);
    by_id_.erase(id);
  }
  return gone;
}

absl::StatusOr<std::vector<Replica>> SegmentRegistry::Allocate(uint64_t size, int count,
                                                               const std::string& preferred,
                                                               absl::Span<const uint32_t> with) {
  MutexLock lock(&mu_);
  struct Candidate {
    Segment* seg;
    uint64_t free;
  };
  std::vector<Candidate> candidates;
  candidates.reserve(by_id_.size());
  size_t live = 0, recovering = 0;
  for (auto& [id, seg] : by_id_) {
    (seg.recovering ? recovering : live)++;
    if (seg.recovering || seg.allocator->largest_free() < seg.allocator->Rounded(size)) continue;
    candidates.push_back({&seg, seg.allocator->capacity() - seg.allocator->used()});
  }
  if (live == 0) {
    // Not a matter of space: evicting would only throw cached data away.
    return absl::UnavailableError(
        recovering > 0 ? absl::StrCat("no live segment: ", recovering, " ", kAwaitingRemount, " after a master restart")
                       : std::string("no segment is mounted"));
  }
  if (candidates.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("no segment has room for ", size, " bytes"));
  }
  auto rank = [&](const Segment* seg) {
    auto it = std::find(with.begin(), with.end(), seg->id);
    return static_cast<size_t>(it - with.begin());  // with.size() when not in `with`
  };
  std::sort(candidates.begin(), candidates.end(), [&](const Candidate& a, const Candidate& b) {
    size_t ra = rank(a.seg), rb = rank(b.seg);
    if (ra != rb) return ra < rb;
    bool pa = a.seg->spec.name == preferred, pb = b.seg->spec.name == preferred;
    if (pa != pb) return pa;
    if (a.free != b.free) return a.free > b.free;
    return a.seg->id < b.seg->id;
  });
  // Two passes: first one replica per host, then any remaining segment.
  std::vector<Replica> out;
  absl::flat_hash_set<std::string> hosts;
  absl::flat_hash_set<uint32_t> used;
  for (int pass = 0; pass < 2 && static_cast<int>(out.size()) < count; ++pass) {
    for (Candidate& c : candidates) {
      if (static_cast<int>(out.size()) >= count) break;
      if (used.contains(c.seg->id)) continue;
      if (pass == 0 && hosts.contains(c.seg->spec.host)) continue;
      std::optional<uint64_t> off = c.seg->allocator->Allocate(size);
      if (!off) continue;
      out.push_back({c.seg->id, false, false, *off});
      hosts.insert(c.seg->spec.host);
      used.insert(c.seg->id);
    }
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
  std::optional<uint64_t> off = it->second.allocator->Allocate(size);
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
  (void)it->second.allocator->Free(r.offset, size);
}

absl::Status SegmentRegistry::Reserve(const Replica& r, uint64_t size) {
  if (r.ssd) return absl::OkStatus();
  MutexLock lock(&mu_);
  auto it = by_id_.find(r.segment_id);
  if (it == by_id_.end()) return absl::NotFoundError("segment left");
  return it->second.allocator->Reserve(r.offset, size);
}

bool SegmentRegistry::MakeDormant(const std::string& name, absl::Time now) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return false;
  Segment& seg = by_id_.at(it->second);
  if (seg.spec.ssd_id.empty()) return false;
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
  if (tier_http.empty()) return;
  it->second.spec.tier_http = tier_http;
  // A daemon that lists before it has heartbeated its tier's size.
  if (ssd_capacity > 0) {
    it->second.spec.ssd_capacity = ssd_capacity;
    it->second.spec.ssd_used = ssd_used;
  }
}

bool SegmentRegistry::IsLive(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it != by_id_.end() && !it->second.recovering;
}

std::string SegmentRegistry::Name(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? std::string() : it->second.spec.name;
}

std::optional<uint32_t> SegmentRegistry::IdOf(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> SegmentRegistry::DataKeyOf(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  const Segment& seg = by_id_.at(it->second);
  if (seg.dormant) return std::nullopt;
  return seg.spec.data_key;
}

std::string SegmentRegistry::DataKeyOfTier(const std::string& tier_http) const {
  MutexLock lock(&mu_);
  for (const auto& [id, seg] : by_id_) {
    if (!seg.dormant && seg.spec.tier_http == tier_http) return seg.spec.data_key;
  }
  return "";
}

absl::flat_hash_map<uint32_t, std::string> SegmentRegistry::LiveNames() const {
  MutexLock lock(&mu_);
  absl::flat_hash_map<uint32_t, std::string> out;
  out.reserve(by_id_.size());
  for (const auto& [id, seg] : by_id_) {
    if (!seg.recovering) out.emplace(id, seg.spec.name);
  }
  return out;
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

uint64_t SegmentRegistry::used() const {
  MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [id, seg] : by_id_) n += seg.allocator->used();
  return n;
}

uint64_t SegmentRegistry::capacity() const {
  MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [id, seg] : by_id_) {
    if (!seg.dormant) n += seg.allocator->capacity();
  }
  return n;
}

uint64_t SegmentRegistry::largest_segment() const {
  MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [id, seg] : by_id_) n = std::max(n, seg.allocator->capacity());
  return n;
}

}  // namespace tierkv::master
