// The object index's write path: PutStart places a new object's replicas
// (making room by eviction when it must) and declares its group, PutEnd makes
// it complete in one store write per call and links it to its parent,
// PutRevoke gives up a put in progress.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {
namespace {

// Eviction passes one PutStart item runs for room of its own before it is
// refused: enough to outlast other writers taking the room first, few
// enough that a store whose objects cannot go refuses at once.
constexpr int kRoomAttempts = 8;

}  // namespace

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
      absl::Status taken = slot != kNil ? KeyTaken(s.objects[slot], NowMs()) : absl::OkStatus();
      if (taken.ok() && slot != kNil && s.objects[slot].state == ObjState::kPending) {
        // A timed-out put: reclaim it now. An object it had set aside
        // comes back, and is looked at as any other.
        std::vector<Mutation> none;
        Erase(s, slot, &none, &follow);
        slot = Find(s, item.key);
        if (slot != kNil) taken = KeyTaken(s.objects[slot], NowMs());
      }
      if (!taken.ok()) {
        res.status = absl::Status(taken.code(), absl::StrCat(item.key, ": ", taken.message()));
        break;
      }
      // A complete object left here has its only copies on daemons that
      // are away (the SSD record of a dormant segment, a segment recovering
      // after a master restart): this put replaces it, but only once it
      // commits; until then it is set aside, untouched in the store, and
      // comes back if the put fails.
      const uint32_t replaced = slot;
      auto home = group != nullptr ? homes.find(group) : homes.end();
      absl::StatusOr<std::vector<Replica>> placed = registry_->Allocate(
          item.size, replicas, item.preferred_segment,
          home != homes.end() ? absl::Span<const uint32_t>(home->second) : absl::Span<const uint32_t>(), tenant);
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
          const uint64_t freed = EvictTo(used > need ? used - need : 0, PassFor::kRoom, &exhausted);
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
      if (replaced != kNil) Displace(s, replaced);
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
      s.pending[slot] = PendingInfo{item.parent_key, item.client, replaced,
                                    replaced != kNil ? s.objects[replaced].gen : 0};
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
  FollowUp follow;
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
      const uint32_t replaced = DisplacedBy(s, slot);
      CountPending(s.pending[slot].client, -1);
      s.pending.erase(slot);
      pending_.fetch_sub(1);
      if (replaced != kNil) {
        // The object this put set aside goes now: its record was replaced
        // by this one's in the write above, so its deletion is not
        // written, and its extents are free once that write is durable.
        std::vector<Mutation> superseded;
        Erase(s, replaced, &superseded, &follow);
      }
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
  RunFollowUps(std::move(follow));
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

}  // namespace tierkv::master
