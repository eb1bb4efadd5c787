// Removal from the object index: Erase and Persist (an object's record is
// deleted before its extents are freed), the follow-ups run once the shard
// lock is released (parents that lost a child, groups that lost a member),
// Remove and RemoveAll, and Tick, which reclaims timed-out puts and retries
// dead groups.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {

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
  // A put that ends here without committing gives back what it set aside.
  const uint32_t restore = o.state == ObjState::kPending ? DisplacedBy(s, slot) : kNil;
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
  if (!o.displaced) s.index.erase(slot);  // one set aside is not in the set
  key_bytes_.fetch_sub(o.key.size());
  uint32_t gen = o.gen + 1;
  o = Object();
  o.gen = gen;
  s.free_slots.push_back(slot);
  if (restore != kNil) Undisplace(s, restore);  // after the put's slot left the set: the same key
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
    if (!p.moving && !p.displaced && InDram(p)) ListAtTail(s, ref.slot);
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

void ObjectIndex::Impl::KillGroup(Group* g) {
  std::vector<std::string> keys;
  {
    MutexLock lock(&groups_mu_);
    keys = g->keys;
  }
  FollowUp follow;
  for (const std::string& key : keys) EraseByKey(key, g, /*force=*/false, &follow);
  RunFollowUps(std::move(follow));
  bool keep = false;
  {
    MutexLock lock(&groups_mu_);
    if (g->alive > 0) {
      dead_groups_.push_back(g);  // a leased member: retry on a later tick
      keep = true;
    }
  }
  if (!keep) ReleaseGroupPin(g);
}

void ObjectIndex::Impl::Tick() {
  int64_t now = NowMs();
  FollowUp follow;
  uint64_t reclaimed = 0;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    MutexLock lock(&s.mu);
    std::vector<uint32_t> expired;
    for (const auto& [slot, info] : s.pending) {
      if (s.objects[slot].deadline_ms <= now) expired.push_back(slot);
    }
    std::vector<Mutation> none;
    for (uint32_t slot : expired) Erase(s, slot, &none, &follow);
    reclaimed += expired.size();
  }
  if (reclaimed > 0) TKV_LOG(INFO) << "reclaimed " << reclaimed << " puts whose writer timed out";
  RunFollowUps(std::move(follow));

  std::vector<Group*> dead;
  {
    MutexLock lock(&groups_mu_);
    dead.swap(dead_groups_);
  }
  for (Group* g : dead) KillGroup(g);
  FreeDeferred(now);
  // The evictor's pass, when it runs, may wait on an offload order: Tick
  // hands it the work rather than wait (or send orders) itself.
  if (evictor_running_.load(std::memory_order_relaxed)) {
    if (AboveHighWatermark()) WakeEvictor();
  } else {
    MaybeEvict();
  }
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
      const bool pending = o.state == ObjState::kPending;
      Erase(s, slot, &mutations, &follow);
      // A forced removal of a put in progress takes the key: the object
      // that put had set aside, back now, goes too.
      if (pending && (slot = Find(s, keys[i])) != kNil) Erase(s, slot, &mutations, &follow);
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

}  // namespace tierkv::master
