// CheckInvariants: the object index checked against itself and the
// allocator under every shard lock (slots and set, eviction lists, child
// counts, counters, tenant charges, lease wheel, bytes per segment). For
// tests and debugging; it stops the index while it runs.
#include "absl/strings/str_cat.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {

absl::Status ObjectIndex::Impl::CheckInvariants() {
  // Lock every shard, in order, for one consistent view.
  std::vector<std::unique_ptr<MutexLock>> locks;
  for (auto& sp : shards_) locks.push_back(std::make_unique<MutexLock>(&sp->mu));
  absl::flat_hash_map<uint32_t, uint64_t> used_by_objects;
  absl::flat_hash_map<std::pair<size_t, uint32_t>, uint32_t> children;
  absl::flat_hash_map<uint32_t, uint64_t> lease_ticks;
  const int64_t now_ms = NowMs();
  uint64_t complete = 0, pending = 0;
  absl::flat_hash_map<std::string, uint64_t> charged;
  for (size_t si = 0; si < shards_.size(); ++si) {
    Shard& s = *shards_[si];
    size_t live = 0;
    for (uint32_t slot = 0; slot < s.objects.size(); ++slot) {
      const Object& o = s.objects[slot];
      if (o.state == ObjState::kFree) continue;
      // One set aside is out of the set; the pending put of its key names it.
      if (!o.displaced) ++live;
      (o.state == ObjState::kComplete ? complete : pending)++;
      if (const uint64_t c = DramCharge(o); c != 0) charged[TenantOf(o.key)] += c;
      if (o.state == ObjState::kComplete && o.deadline_ms > 0 && leases_.Counted(o.deadline_ms, now_ms)) {
        ++lease_ticks[leases_.TickOf(o.deadline_ms)];
      }
      if (o.displaced) {
        const uint32_t by = Find(s, o.key);
        if (o.state != ObjState::kComplete || by == kNil || DisplacedBy(s, by) != slot) {
          return absl::InternalError(absl::StrCat(o.key, ": set aside, but by no put of its key"));
        }
      } else if (Find(s, o.key) != slot) {
        return absl::InternalError(absl::StrCat("key ", o.key, " not indexed"));
      }
      if (o.replicas.empty()) return absl::InternalError(absl::StrCat(o.key, " has no replica"));
      for (const Replica& r : o.replicas) {
        if (!r.ssd) used_by_objects[r.segment_id] += registry_->Rounded(o.size);
      }
      bool should_list = o.state == ObjState::kComplete && o.children == 0 && !o.hard_pin && !o.moving &&
                         !o.displaced && InDram(o);
      if (should_list != (o.list != ListId::kNone)) {
        return absl::InternalError(absl::StrCat(o.key, ": eviction list membership is wrong"));
      }
      if (o.parent_slot != kNil) {
        const Shard& ps = *shards_[o.parent_shard];
        if (o.parent_slot < ps.objects.size() && ps.objects[o.parent_slot].gen == o.parent_gen) {
          ++children[{o.parent_shard, o.parent_slot}];
        }
      }
    }
    if (live != s.index.size()) return absl::InternalError("index size disagrees with slots");
    for (int l = 1; l <= 2; ++l) {
      size_t n = 0;
      uint32_t prev = kNil;
      for (uint32_t cur = s.lists[l].head; cur != kNil; cur = s.objects[cur].next) {
        if (s.objects[cur].prev != prev || static_cast<int>(s.objects[cur].list) != l) {
          return absl::InternalError("eviction list links are broken");
        }
        prev = cur;
        if (++n > s.objects.size()) return absl::InternalError("eviction list has a cycle");
      }
      if (n != s.lists[l].size || prev != s.lists[l].tail) {
        return absl::InternalError("eviction list size or tail is wrong");
      }
    }
  }
  for (size_t si = 0; si < shards_.size(); ++si) {
    Shard& s = *shards_[si];
    for (uint32_t slot = 0; slot < s.objects.size(); ++slot) {
      const Object& o = s.objects[slot];
      if (o.state == ObjState::kFree) continue;
      auto it = children.find({si, slot});
      uint32_t want = it == children.end() ? 0 : it->second;
      if (o.children != want) {
        return absl::InternalError(
            absl::StrCat(o.key, ": child count ", o.children, " but ", want, " children point at it"));
      }
    }
  }
  {
    MutexLock lock(&deferred_mu_);
    for (const DeferredFree& d : deferred_) {
      for (const Replica& r : d.replicas) {
        if (!r.ssd) used_by_objects[r.segment_id] += registry_->Rounded(d.size);
      }
    }
    for (const FollowUp::Extents& e : stranded_) {
      for (const Replica& r : e.replicas) used_by_objects[r.segment_id] += registry_->Rounded(e.size);
    }
  }
  if (complete != objects_.load() || pending != pending_.load()) {
    return absl::InternalError("object counters disagree with the index");
  }
  for (const TenantUsage& t : tenants_.Snapshot()) {
    const uint64_t want = charged.contains(t.tenant) ? charged[t.tenant] : 0;
    if (t.used_bytes != want) {
      return absl::InternalError(absl::StrCat("tenant ", TenantName(t.tenant), ": charged ", t.used_bytes,
                                              " bytes, its objects hold ", want));
    }
    charged.erase(t.tenant);
  }
  for (const auto& [tenant, bytes] : charged) {
    return absl::InternalError(absl::StrCat("tenant ", TenantName(tenant), ": its objects hold ", bytes,
                                            " bytes, none charged"));
  }
  if (lease_ticks != leases_.Buckets(now_ms)) {
    return absl::InternalError("the lease count disagrees with the leased objects");
  }
  for (const auto& [id, used] : registry_->UsedById()) {
    uint64_t want = used_by_objects.contains(id) ? used_by_objects[id] : 0;
    if (used != want) {
      return absl::InternalError(absl::StrCat("segment ", registry_->Name(id), ": allocator says ",
                                              used, " bytes used, objects hold ", want));
    }
  }
  return absl::OkStatus();
}

}  // namespace tierkv::master
