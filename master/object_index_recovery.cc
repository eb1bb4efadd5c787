// The object index against what segments and the store hold: dropping the
// replicas of departed segments, reconciling SSD replicas with the records a
// tier daemon reports (ConfirmSsd, DropSsd, DropSsdExcept), and Recover, which
// rebuilds the index from the store at start.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "master/internal/index_impl.h"
#include "proto/master.pb.h"

namespace tierkv::master {

uint64_t ObjectIndex::Impl::DropSegments(const std::vector<uint32_t>& ids,
                                         const absl::flat_hash_map<uint32_t, uint32_t>& keep_ssd) {
  if (ids.empty()) return 0;
  absl::flat_hash_set<uint32_t> gone(ids.begin(), ids.end());
  uint64_t dropped = 0;
  FollowUp follow;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    MutexLock lock(&s.mu);
    std::vector<Mutation> mutations;
    for (uint32_t slot = 0; slot < s.objects.size(); ++slot) {
      Object& o = s.objects[slot];
      if (o.state == ObjState::kFree) continue;
      const size_t before = o.replicas.size();
      const uint64_t charged = DramCharge(o);
      o.replicas.erase(std::remove_if(o.replicas.begin(), o.replicas.end(),
                                      [&](Replica& r) {
                                        if (!gone.contains(r.segment_id)) return false;
                                        auto to = r.ssd ? keep_ssd.find(r.segment_id) : keep_ssd.end();
                                        if (to == keep_ssd.end()) return true;
                                        r.segment_id = to->second;
                                        return false;
                                      }),
                       o.replicas.end());
      // A record names segments, not ids: a moved replica needs no write.
      if (o.replicas.size() == before) continue;
      tenants_.Release(TenantOf(o.key), charged - DramCharge(o));
      if (o.replicas.empty()) {
        Erase(s, slot, &mutations, &follow);
        ++dropped;
      } else if (o.state == ObjState::kComplete) {
        KeepSurvivor(s, slot, &mutations);
      }
    }
    Persist(&mutations, &follow);
  }
  RunFollowUps(std::move(follow));
  return dropped;
}

bool ObjectIndex::Impl::DropSsdAt(Shard& s, uint32_t slot, uint32_t id, std::vector<Mutation>* mutations,
                                  FollowUp* follow) {
  Object& o = s.objects[slot];
  if (o.state != ObjState::kComplete) return false;
  auto on_ssd = [id](const Replica& r) { return r.segment_id == id && r.ssd; };
  if (std::none_of(o.replicas.begin(), o.replicas.end(), on_ssd)) return false;
  const int64_t now = NowMs();
  for (const Replica& r : o.replicas) {
    if (r.segment_id == id && r.stage) HoldStagedCopy(r, o, now);
  }
  o.replicas.erase(std::remove_if(o.replicas.begin(), o.replicas.end(),
                                  [id](const Replica& r) { return r.segment_id == id && (r.ssd || r.stage); }),
                   o.replicas.end());
  if (o.replicas.empty()) {
    Erase(s, slot, mutations, follow);
  } else {
    KeepSurvivor(s, slot, mutations);
  }
  return true;
}

void ObjectIndex::Impl::KeepSurvivor(Shard& s, uint32_t slot, std::vector<Mutation>* mutations) {
  const Object& o = s.objects[slot];
  if (!InDram(o)) Unlist(s, slot);  // only its SSD record is left
  // The parent link is rebuilt only from records, so keep the record's
  // parent key as it was.
  absl::StatusOr<std::string> old = store_->Get(absl::StrCat("o/", o.key));
  v1::ObjectRecord rec;
  std::string parent = old.ok() && rec.ParseFromString(*old) ? rec.parent_key() : "";
  mutations->push_back({absl::StrCat("o/", o.key), EncodeRecord(o, parent), false});
}

std::vector<bool> ObjectIndex::Impl::ConfirmSsd(uint32_t id,
                                                const std::vector<std::pair<std::string, uint64_t>>& records,
                                                uint64_t* dropped) {
  return MatchSsd(id, records, /*drop_all=*/false, dropped);
}

uint64_t ObjectIndex::Impl::DropSsd(uint32_t id, const std::vector<std::string>& keys) {
  std::vector<std::pair<std::string, uint64_t>> records;
  records.reserve(keys.size());
  for (const std::string& k : keys) records.emplace_back(k, 0);
  uint64_t dropped = 0;
  MatchSsd(id, records, /*drop_all=*/true, &dropped);
  return dropped;
}

std::vector<bool> ObjectIndex::Impl::MatchSsd(uint32_t id,
                                              const std::vector<std::pair<std::string, uint64_t>>& records,
                                              bool drop_all, uint64_t* dropped) {
  std::vector<bool> out(records.size(), false);
  FollowUp follow;
  for (size_t i = 0; i < records.size(); ++i) {
    Shard& s = *shards_[ShardOf(records[i].first)];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, records[i].first);
    if (slot == kNil) continue;
    // A put of the key in progress over the object set aside: the record
    // is that object's, and it must survive for the object to come back.
    if (const uint32_t aside = DisplacedBy(s, slot); aside != kNil) slot = aside;
    if (!drop_all && s.objects[slot].size == records[i].second) {
      const Object& o = s.objects[slot];
      out[i] = o.state == ObjState::kComplete &&
               std::any_of(o.replicas.begin(), o.replicas.end(),
                           [id](const Replica& r) { return r.segment_id == id && r.ssd; });
      continue;
    }
    std::vector<Mutation> mutations;
    if (DropSsdAt(s, slot, id, &mutations, &follow)) ++*dropped;
    Persist(&mutations, &follow);
  }
  RunFollowUps(std::move(follow));
  return out;
}

uint64_t ObjectIndex::Impl::DropSsdExcept(uint32_t id, const absl::flat_hash_set<std::string>& keep) {
  uint64_t dropped = 0;
  FollowUp follow;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    MutexLock lock(&s.mu);
    std::vector<Mutation> mutations;
    for (uint32_t slot = 0; slot < s.objects.size(); ++slot) {
      if (s.objects[slot].state != ObjState::kComplete || keep.contains(s.objects[slot].key)) continue;
      if (DropSsdAt(s, slot, id, &mutations, &follow)) ++dropped;
    }
    Persist(&mutations, &follow);
  }
  RunFollowUps(std::move(follow));
  return dropped;
}

absl::StatusOr<uint64_t> ObjectIndex::Impl::Recover() {
  std::vector<std::pair<std::string, std::string>> links;  // child, parent
  absl::flat_hash_map<std::string, Group*> groups;
  std::vector<Mutation> stale;
  uint64_t restored = 0;
  absl::Status scan = store_->Scan("o/", [&](absl::string_view k, absl::string_view v) {
    std::string key(k.substr(2));
    v1::ObjectRecord rec;
    if (!ValidateIndexKey(key, options_.max_key_bytes).ok() ||
        !rec.ParseFromArray(v.data(), static_cast<int>(v.size())) || rec.size() == 0) {
      TKV_LOG(WARNING) << "dropping an unreadable object record (" << k.size() << " byte key)";
      stale.push_back({std::string(k), "", true});
      return true;
    }
    ReplicaList replicas;
    for (const v1::Extent& e : rec.replicas()) {
      std::optional<uint32_t> id = registry_->IdOf(e.segment());
      if (!id) continue;
      Replica r{*id, e.ssd(), false, e.ssd() ? 0 : e.offset()};
      if (absl::Status st = registry_->Reserve(r, rec.size()); !st.ok()) {
        TKV_LOG(WARNING) << "object " << key << ": dropping replica on " << e.segment() << ": " << st;
        continue;
      }
      replicas.push_back(r);
    }
    if (replicas.empty()) {
      stale.push_back({std::string(k), "", true});
      return true;
    }
    Shard& s = *shards_[ShardOf(key)];
    MutexLock lock(&s.mu);
    uint32_t slot = NewSlot(s);
    Object& o = s.objects[slot];
    o.key = key;
    o.size = rec.size();
    o.put_id = rec.put_id();
    o.replicas = replicas;
    o.state = ObjState::kComplete;
    tenants_.Charge(TenantOf(key), DramCharge(o));
    o.soft_pin = rec.soft_pin();
    o.hard_pin = rec.hard_pin();
    o.access = AccessTick();
    IndexSlot(s, slot);
    if (InDram(o)) ListAtHead(s, slot);
    objects_.fetch_add(1);
    if (o.soft_pin || o.hard_pin) pinned_.fetch_add(1);
    key_bytes_.fetch_add(key.size());
    if (!rec.group().empty()) {
      Group*& g = groups[rec.group()];
      if (g == nullptr) {
        g = new Group();
        g->id = rec.group();
        g->members = rec.group_size();
        g->completed = 0;
        g->alive = 0;
      }
      MutexLock glock(&groups_mu_);
      ++g->alive;
      ++g->completed;
      g->keys.push_back(key);
      o.group = g;
    }
    if (!rec.parent_key().empty()) links.emplace_back(key, rec.parent_key());
    if (options_.listener != nullptr) options_.listener->OnStored(key, rec.parent_key(), o.size);
    ++restored;
    return true;
  });
  if (!scan.ok()) return scan;

  for (auto& [id, g] : groups) {
    MutexLock lock(&groups_mu_);
    g->serial = next_group_serial_++;
    if (g->completed == g->members) {
      g->visible.store(true);
      groups_[id] = g;
    } else {
      pins_[g] = 1;  // a member is missing: the group is dropped below
    }
  }
  for (auto& [id, g] : groups) {
    if (g->visible.load()) continue;
    FollowUp follow;
    std::vector<std::string> keys;
    {
      MutexLock lock(&groups_mu_);
      keys = g->keys;
    }
    for (const std::string& key : keys) EraseByKey(key, g, /*force=*/true, &follow);
    RunFollowUps(std::move(follow));
    restored -= keys.size();
    ReleaseGroupPin(g);
  }
  if (options_.eviction != EvictionPolicy::kLru) {
    for (const auto& [child, parent] : links) LinkParent(ShardOf(child), child, parent);
  }
  if (!stale.empty()) RETURN_IF_ERROR(store_->Write(stale));
  return restored;
}

}  // namespace tierkv::master
