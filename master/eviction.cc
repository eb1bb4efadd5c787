// The object index's background work: eviction in prefix-aware LRU order,
// reclaiming timed-out puts, finishing dead groups, dropping the objects of
// departed segments, rebuilding from the store, and invariant checks.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "master/internal/index_impl.h"
#include "proto/master.pb.h"

namespace tierkv::master {

uint64_t ObjectIndex::Impl::EvictTo(uint64_t target_used, bool batch_moves, bool* exhausted) {
  MutexLock evicting(&evict_mu_);
  uint64_t freed = 0;
  int64_t now = NowMs();
  // With batch_moves, offload orders wait for up to kMoveBatch objects (or
  // the pass's end), so a daemon gets one order, and its SSD tier one group
  // of records, for many objects rather than one per round: a 4 KiB page
  // then takes a little over 4 KiB on SSD, not 8. Their DRAM counts as
  // freed meanwhile, so the pass does not evict more for them. Only the
  // watermark passes batch; a pass making room for a request sends each
  // round's orders at once, since the request waits for that room.
  constexpr size_t kMoveBatch = 64;
  const size_t flush_at = batch_moves ? kMoveBatch : 1;
  std::vector<Move> batch;
  uint64_t batch_bytes = 0;
  bool ran_out = false;  // of candidates in every list
  // Unpinned leaves first; soft-pinned leaves only when those run out.
  for (ListId list : {ListId::kLeaf, ListId::kPinnedLeaf}) {
    // Once at the target the pass is done: used bytes that rose again
    // meanwhile (other puts) are no reason to evict pinned objects.
    if (list != ListId::kLeaf && !ran_out) break;
    int idle_rounds = 0;
    ran_out = false;
    // Requeuing an object that cannot go (leased, filling, guaranteed)
    // counts as progress until as many have been requeued as the list
    // held: however many of them sit at the tails, every object of the list
    // is looked at before a pinned one is evicted.
    size_t listed = 0;
    for (auto& shard : shards_) {
      MutexLock lock(&shard->mu);
      listed += shard->lists[static_cast<int>(list)].size;
    }
    size_t requeued = 0;
    for (;;) {
      uint64_t used = registry_->used();
      used = used > batch_bytes ? used - batch_bytes : 0;
      if (used <= target_used) break;
      // The shard whose least recent candidate is oldest goes next, and it
      // evicts only while its tail stays no newer than the runner-up's, so
      // the order across shards is LRU to within one clock tick.
      size_t best = shards_.size();
      uint32_t best_access = UINT32_MAX, runner_up = UINT32_MAX;
      // Ties (the same tick) go round-robin, starting at a moving shard.
      const size_t start = evict_cursor_++;
      for (size_t k = 0; k < shards_.size(); ++k) {
        size_t i = (start + k) % shards_.size();
        Shard& s = *shards_[i];
        MutexLock lock(&s.mu);
        uint32_t tail = s.lists[static_cast<int>(list)].tail;
        if (tail == kNil) continue;
        // A referenced tail is only requeued, which is cheap: go there first.
        uint32_t a = s.objects[tail].referenced ? 0 : s.objects[tail].access;
        if (a < best_access) {
          runner_up = best_access;
          best = i;
          best_access = a;
        } else if (a < runner_up) {
          runner_up = a;
        }
      }
      if (best == shards_.size()) {
        ran_out = true;
        break;
      }
      Shard& s = *shards_[best];
      FollowUp follow;
      std::vector<Move> moves;
      bool progressed = false;
      {
        MutexLock lock(&s.mu);
        std::vector<Mutation> mutations;
        LruList& l = s.lists[static_cast<int>(list)];
        size_t budget = std::min<size_t>(l.size, 32);
        for (size_t k = 0; k < budget && l.tail != kNil && used > target_used; ++k) {
          uint32_t slot = l.tail;
          Object& o = s.objects[slot];
          if (o.referenced) {
            // Used since it was queued: a second chance at the head.
            o.referenced = false;
            Unlist(s, slot);
            ListAtHead(s, slot);
            progressed = true;  // bounded: the bit is set again only by a use
            continue;
          }
          if (o.access > runner_up) break;
          bool filling = o.group != nullptr && !o.group->visible.load() && !o.group->dead;
          // A tenant within its guaranteed bytes keeps them whoever's put
          // needs room.
          if (Leased(o, now) || filling ||
              (tenants_.any_guarantee() && tenants_.Protected(TenantOf(o.key), DramCharge(o)))) {
            // In use (or its group is still being written): skip it by
            // making it most recent; it was just read anyway.
            Unlist(s, slot);
            ListAtHead(s, slot);
            s.objects[slot].access = AccessTick();
            if (++requeued <= listed) progressed = true;
            continue;
          }
          const bool tie = o.access == runner_up;
          const size_t in_dram = static_cast<size_t>(
              std::count_if(o.replicas.begin(), o.replicas.end(), [](const Replica& r) { return !r.ssd; }));
          uint64_t bytes = registry_->Rounded(o.size) * in_dram;
          freed += bytes;
          used = used > bytes ? used - bytes : 0;
          if (in_dram < o.replicas.size()) {
            // A copy staged from its SSD record: drop the copy, keep the
            // record.
            for (const Replica& r : o.replicas) {
              if (!r.ssd) HoldStagedCopy(r, o, now);
            }
            const uint64_t charged = DramCharge(o);
            o.replicas.erase(std::remove_if(o.replicas.begin(), o.replicas.end(), [](const Replica& r) { return !r.ssd; }),
                             o.replicas.end());
            tenants_.Release(TenantOf(o.key), charged);
            Unlist(s, slot);
            evicted_bytes_.fetch_add(o.size);
            evictions_.fetch_add(1);
            progressed = true;
            if (tie) break;
            continue;
          }
          std::optional<std::string> tier = OffloadTier(o);
          if (tier) {
            // The extent stays the object's until the daemon has copied
            // it; a remove meanwhile defers its free (Erase).
            o.moving = true;
            Unlist(s, slot);
            moves.push_back({best, slot, o.gen, std::move(*tier), {o.key, o.replicas[0].offset, o.size}});
          } else {
            evicted_bytes_.fetch_add(o.size);
            evictions_.fetch_add(1);
            Erase(s, slot, &mutations, &follow);
          }
          progressed = true;
          if (tie) break;  // as old as another shard's tail: take turns
          // A parent that just lost its last child competes from the next
          // round on; it may be older than this shard's next tail.
          if (!follow.parents.empty()) break;
        }
        Persist(&mutations, &follow);
      }
      RunFollowUps(std::move(follow));
      for (Move& m : moves) {
        batch_bytes += registry_->Rounded(m.order.length);
        batch.push_back(std::move(m));
      }
      if (batch.size() >= flush_at) {
        FinishMoves(std::move(batch));
        batch.clear();
        batch_bytes = 0;
      }
      if (progressed) {
        idle_rounds = 0;
      } else if (++idle_rounds > static_cast<int>(shards_.size()) * 2) {
        ran_out = true;  // everything left is leased or still filling
        break;
      }
    }
  }
  if (!batch.empty()) FinishMoves(std::move(batch));
  if (registry_->used() > target_used) NotePressure();  // what is left is leased, filling or pinned
  if (exhausted != nullptr) *exhausted = ran_out;
  return freed;
}

absl::Status ObjectIndex::Impl::ChargeQuota(absl::string_view tenant, uint64_t bytes, const std::string& key) {
  absl::Status st = tenants_.TryCharge(tenant, bytes);
  if (st.ok()) return st;
  {
    // A put PutStart would refuse ALREADY_EXISTS must not evict first.
    Shard& s = *shards_[ShardOf(key)];
    MutexLock lock(&s.mu);
    const uint32_t slot = Find(s, key);
    if (slot != kNil) RETURN_IF_ERROR(KeyTaken(s.objects[slot], NowMs()));
  }
  // Over its quota: the tenant's own least valuable objects make room,
  // unless the put alone is larger than the quota.
  const TenantLimits limits = tenants_.Limits(tenant);
  if (bytes <= limits.quota_bytes) {
    if (const uint64_t excess = tenants_.Excess(tenant, bytes); excess > 0) {
      tenants_.NoteEvictedForQuota(tenant, EvictTenant(tenant, excess));
    }
    st = tenants_.TryCharge(tenant, bytes);
  }
  if (!st.ok()) tenants_.NoteRejected(tenant);
  return st;
}

std::optional<std::string> ObjectIndex::Impl::OffloadTier(const Object& o) const {
  if (!options_.offload || !(o.read || options_.offload_unread) || o.group != nullptr || o.replicas.size() != 1 ||
      o.replicas[0].ssd) {
    return std::nullopt;
  }
  std::optional<std::string> tier = registry_->TierFor(o.replicas[0].segment_id, o.size);
  if (tier && TierPaused(*tier, NowMs())) return std::nullopt;
  return tier;
}

bool ObjectIndex::Impl::TierPaused(const std::string& tier, int64_t now_ms) const {
  if (now_ms >= pauses_end_ms_.load(std::memory_order_acquire)) return false;
  MutexLock lock(&tier_pause_mu_);
  auto it = tier_paused_until_ms_.find(tier);
  return it != tier_paused_until_ms_.end() && now_ms < it->second;
}

uint64_t ObjectIndex::Impl::EvictTenant(absl::string_view tenant, uint64_t bytes) {
  // Most candidates looked at per list and shard in one round: the walk
  // holds the shard lock, and a tenant with nothing near the lists' old
  // ends gets the put refused rather than stall the shard.
  constexpr size_t kScan = 1 << 16;
  uint64_t freed = 0;
  // A round frees leaves; parents they freed are candidates the next.
  for (int round = 0; round < 16 && freed < bytes; ++round) {
    struct Candidate {
      bool pinned;
      uint32_t access;
      size_t shard;
      uint32_t slot;
      uint32_t gen;
    };
    std::vector<Candidate> found;
    const int64_t now = NowMs();
    for (size_t i = 0; i < shards_.size(); ++i) {
      Shard& s = *shards_[i];
      MutexLock lock(&s.mu);
      for (ListId list : {ListId::kLeaf, ListId::kPinnedLeaf}) {
        size_t seen = 0;
        for (uint32_t slot = s.lists[static_cast<int>(list)].tail; slot != kNil && seen < kScan;
             slot = s.objects[slot].prev, ++seen) {
          const Object& o = s.objects[slot];
          if (TenantOf(o.key) != tenant || Leased(o, now) || DramCharge(o) == 0) continue;
          if (o.group != nullptr && !o.group->visible.load() && !o.group->dead) continue;
          found.push_back({list == ListId::kPinnedLeaf, o.access, i, slot, o.gen});
        }
      }
    }
    if (found.empty()) break;
    std::sort(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) {
      return a.pinned != b.pinned ? b.pinned : a.access < b.access;
    });
    FollowUp follow;
    std::vector<Move> moves;
    for (const Candidate& c : found) {
      if (freed >= bytes) break;
      Shard& s = *shards_[c.shard];
      MutexLock lock(&s.mu);
      Object& o = s.objects[c.slot];
      if (o.gen != c.gen || o.state != ObjState::kComplete || o.list == ListId::kNone || o.moving ||
          Leased(o, NowMs())) {
        continue;  // read, removed or moved since the walk
      }
      const uint64_t charge = DramCharge(o);
      freed += charge;
      // As the evictor would: a page its SSD tier admits moves there (its
      // charge is released when the daemon confirms), the rest are dropped.
      if (std::optional<std::string> tier = OffloadTier(o)) {
        o.moving = true;
        Unlist(s, c.slot);
        moves.push_back({c.shard, c.slot, o.gen, std::move(*tier), {o.key, o.replicas[0].offset, o.size}});
        continue;
      }
      std::vector<Mutation> mutations;
      evicted_bytes_.fetch_add(o.size);
      evictions_.fetch_add(1);
      Erase(s, c.slot, &mutations, &follow);
      Persist(&mutations, &follow);
    }
    RunFollowUps(std::move(follow));
    // The put waits for these orders, as a request-path eviction does.
    if (!moves.empty()) FinishMoves(std::move(moves));
  }
  return freed;
}

void ObjectIndex::Impl::FinishMoves(std::vector<Move> moves) {
  // One order per daemon, sent with no lock held.
  absl::flat_hash_map<std::string, std::vector<size_t>> by_tier;
  for (size_t i = 0; i < moves.size(); ++i) by_tier[moves[i].tier_http].push_back(i);
  std::vector<absl::Status> got(moves.size(), absl::UnavailableError("no answer to the offload order"));
  for (const auto& [tier, which] : by_tier) {
    // Moves picked before the tier was paused are not sent either.
    if (TierPaused(tier, NowMs())) {
      for (size_t i : which) {
        got[i] = absl::UnavailableError(absl::StrCat("offload to ", tier, ": paused, an order went unanswered"));
      }
      continue;
    }
    std::vector<TierOrder> orders;
    for (size_t i : which) orders.push_back(moves[i].order);
    std::vector<absl::Status> answer = options_.offload(tier, orders, options_.offload_timeout);
    for (size_t k = 0; k < which.size() && k < answer.size(); ++k) got[which[k]] = answer[k];
    const bool unanswered =
        answer.size() < which.size() || std::all_of(answer.begin(), answer.end(), [](const absl::Status& s) {
          return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
        });
    if (unanswered) {
      {
        MutexLock lock(&tier_pause_mu_);
        const int64_t until = NowMs() + absl::ToInt64Milliseconds(kTierPause);
        tier_paused_until_ms_[tier] = until;
        // Written under the lock, so no other pause lowers it meanwhile.
        if (until > pauses_end_ms_.load(std::memory_order_relaxed)) {
          pauses_end_ms_.store(until, std::memory_order_release);
        }
      }
      TKV_LOG(WARNING) << "SSD tier " << tier << " did not take an order of " << which.size() << " ("
                       << (answer.empty() ? absl::UnavailableError("no answer") : answer[0])
                       << "); no order goes there for " << kTierPause;
    }
  }
  const int64_t now = NowMs();
  FollowUp follow;
  size_t failed = 0;
  absl::Status first_failure;
  for (size_t i = 0; i < moves.size(); ++i) {
    const Move& m = moves[i];
    Shard& s = *shards_[m.shard];
    MutexLock lock(&s.mu);
    Object& o = s.objects[m.slot];
    // Removed (or dropped with its segment) meanwhile: its extent waits
    // out the hold in the deferred frees.
    if (o.gen != m.gen || o.state != ObjState::kComplete || !o.moving) continue;
    o.moving = false;
    std::vector<Mutation> mutations;
    evicted_bytes_.fetch_add(o.size);
    evictions_.fetch_add(1);
    if (!got[i].ok() || o.replicas.size() != 1 || o.replicas[0].ssd) {
      if (!got[i].ok() && ++failed == 1) first_failure = got[i];
      offload_failed_.fetch_add(1);
      Erase(s, m.slot, &mutations, &follow);
      Persist(&mutations);
      continue;
    }
    const Replica dram = o.replicas[0];
    tenants_.Release(TenantOf(o.key), DramCharge(o));
    o.replicas[0] = Replica{dram.segment_id, true, false, 0};
    if (Leased(o, now)) {
      // A reader given the extent while the order was out reads it still.
      MutexLock dlock(&deferred_mu_);
      deferred_.push_back({{dram}, o.size, o.deadline_ms});
    } else {
      registry_->Free(dram, o.size);
    }
    Unlist(s, m.slot);  // a child that left meanwhile may have listed it
    // Off DRAM, it no longer holds its parent there: the parent may be
    // evicted (and offloaded) in its turn. Its record drops the link too.
    if (o.parent_slot != kNil) {
      follow.parents.push_back({o.parent_shard, o.parent_slot, o.parent_gen, o.access});
      o.parent_slot = kNil;
    }
    mutations.push_back({absl::StrCat("o/", o.key), EncodeRecord(o, ""), false});
    Persist(&mutations);
    offloaded_.fetch_add(1);
  }
  if (failed > 0) {
    TKV_LOG(WARNING) << failed << " of " << moves.size() << " offloads to SSD failed (evicted instead): "
                     << first_failure;
  }
  RunFollowUps(std::move(follow));
}

bool ObjectIndex::Impl::AboveHighWatermark() const {
  uint64_t capacity = registry_->capacity();
  return capacity > 0 && registry_->used() > static_cast<uint64_t>(options_.high_watermark * capacity);
}

bool ObjectIndex::Impl::MaybeEvict() {
  if (!AboveHighWatermark()) return false;
  // Evicting at all means DRAM is contended: long leases now would keep
  // what eviction wants (and, with the window, flip back and forth).
  NotePressure();
  return EvictTo(static_cast<uint64_t>(options_.low_watermark * registry_->capacity()), /*batch_moves=*/true) > 0;
}

void ObjectIndex::Impl::WakeEvictor() {
  {
    MutexLock lock(&evictor_mu_);
    evictor_wanted_ = true;
  }
  evictor_cv_.Signal();
}

void ObjectIndex::Impl::RunEvictor() {
  MutexLock lock(&evictor_mu_);
  if (evictor_stopped_) return;
  evictor_running_.store(true);
  // After a pass above the high watermark that freed nothing (all leased,
  // or still being written), the next waits, doubling up to a second, and
  // wakes by PutStart are folded into it: otherwise every put would run a
  // whole fruitless pass, which burns CPU and requeues the leased tails.
  auto backoff = std::chrono::milliseconds(0);
  while (!evictor_stopped_) {
    // Woken by a PutStart past the high watermark; the timeout is a net
    // under a lost wake-up (frees by leases ending and Tick also pass here).
    if (backoff.count() > 0) {
      const auto until = std::chrono::steady_clock::now() + backoff;
      while (!evictor_stopped_ && std::chrono::steady_clock::now() < until) {
        evictor_cv_.WaitFor(&evictor_mu_, until - std::chrono::steady_clock::now());
      }
    } else if (!evictor_wanted_) {
      evictor_cv_.WaitFor(&evictor_mu_, std::chrono::milliseconds(100));
    }
    if (evictor_stopped_) break;
    evictor_wanted_ = false;
    evictor_mu_.Unlock();
    const bool above = AboveHighWatermark();
    const bool freed = above && MaybeEvict();
    if (above) evictor_passes_.fetch_add(1);
    evictor_mu_.Lock();
    if (!above || freed) {
      backoff = std::chrono::milliseconds(0);
    } else {
      backoff = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(1000),
                                                    std::max(std::chrono::milliseconds(50), backoff * 2));
    }
  }
  evictor_running_.store(false);
}

void ObjectIndex::Impl::StopEvictor() {
  {
    MutexLock lock(&evictor_mu_);
    evictor_stopped_ = true;
  }
  evictor_cv_.SignalAll();
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
  MaybeEvict();
}

void ObjectIndex::Impl::FreeDeferred(int64_t now_ms) {
  std::vector<DeferredFree> due;
  {
    MutexLock lock(&deferred_mu_);
    auto split = std::partition(deferred_.begin(), deferred_.end(),
                                [&](const DeferredFree& d) { return d.until_ms > now_ms; });
    due.assign(std::make_move_iterator(split), std::make_move_iterator(deferred_.end()));
    deferred_.erase(split, deferred_.end());
  }
  for (const DeferredFree& d : due) {
    for (const Replica& r : d.replicas) registry_->Free(r, d.size);
  }
}

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

void ObjectIndex::Impl::HoldStagedCopy(const Replica& r, const Object& o, int64_t now_ms) {
  // A reader may hold the copy until its lease ends, and a stage in transit
  // then may land a little after (daemons write none past the lease).
  // A copy whose readers all gave their leases back has neither.
  const absl::Duration hold = std::min(options_.revoke_grace, options_.stage_grace);
  if ((hold <= absl::ZeroDuration() || (o.released && !o.unreturned)) && !Leased(o, now_ms)) {
    registry_->Free(r, o.size);
    return;
  }
  MutexLock lock(&deferred_mu_);
  deferred_.push_back({{r}, o.size, std::max(now_ms, o.deadline_ms) + absl::ToInt64Milliseconds(hold)});
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
      ++live;
      (o.state == ObjState::kComplete ? complete : pending)++;
      if (const uint64_t c = DramCharge(o); c != 0) charged[TenantOf(o.key)] += c;
      if (o.state == ObjState::kComplete && o.deadline_ms > 0 && leases_.Counted(o.deadline_ms, now_ms)) {
        ++lease_ticks[leases_.TickOf(o.deadline_ms)];
      }
      if (Find(s, o.key) != slot) return absl::InternalError(absl::StrCat("key ", o.key, " not indexed"));
      if (o.replicas.empty()) return absl::InternalError(absl::StrCat(o.key, " has no replica"));
      for (const Replica& r : o.replicas) {
        if (!r.ssd) used_by_objects[r.segment_id] += registry_->Rounded(o.size);
      }
      bool should_list = o.state == ObjState::kComplete && o.children == 0 && !o.hard_pin && !o.moving && InDram(o);
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
