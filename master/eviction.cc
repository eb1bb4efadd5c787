// Eviction in the object index: the pass that frees DRAM in prefix-aware LRU
// order across shards (EvictTo), a tenant's eviction of its own objects to
// stay within its quota, and the background evictor that keeps usage between
// the watermarks. A pass holds the evict lock only while it picks; the
// offload orders it picked go out with no lock held (eviction_offload.cc),
// so a daemon that does not answer holds only that pass. docs/eviction.md
// has the policy.
#include <algorithm>
#include <chrono>

#include "base/status.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {

uint64_t ObjectIndex::Impl::EvictTo(uint64_t target_used, PassFor pass, bool* exhausted) {
  EvictPass p;
  p.target_used = target_used;
  p.pass = pass;
  for (;;) {
    bool over;
    {
      MutexLock evicting(&evict_mu_);
      over = EvictRounds(&p);
    }
    // The orders go out with evict_mu_ released: a daemon that does not
    // answer holds this pass, not the passes and the requests behind it.
    // Their objects are off the lists and their bytes counted in
    // moving_bytes_, so another pass meanwhile neither picks them again
    // nor evicts others in their stead.
    if (!p.batch.empty()) {
      std::vector<Move> moves;
      moves.swap(p.batch);
      p.batch_bytes = 0;
      FinishMoves(std::move(moves));
    }
    if (!p.wait_tier.empty()) {
      // A request's pass met a tier with an order out: most likely it is
      // answered in a moment, and the candidate moves as it would have.
      AwaitTier(p.wait_tier);
      p.wait_tier.clear();
      p.waited = true;
      continue;
    }
    if (over) break;
  }
  if (UsedFor(p) > target_used) NotePressure();  // what is left is leased, filling or pinned
  if (exhausted != nullptr) *exhausted = p.ran_out;
  return p.freed;
}

uint64_t ObjectIndex::Impl::UsedFor(const EvictPass& p) const {
  const uint64_t used = registry_->used();
  // A request needs room now: bytes another pass's order will free in a
  // while (up to offload_timeout, for a stalled daemon) are no room yet.
  // A pass for the watermark counts them as gone, as it does its own.
  const uint64_t leaving = p.pass == PassFor::kRoom ? p.batch_bytes : moving_bytes_.load(std::memory_order_acquire);
  return used > leaving ? used - leaving : 0;
}

bool ObjectIndex::Impl::EvictRounds(EvictPass* pass) {
  EvictPass& p = *pass;
  // A watermark pass's offload orders wait for up to kMoveBatch objects
  // (or the pass's end), so a daemon gets one order, and its SSD tier one
  // group of records, for many objects rather than one per round: a 4 KiB
  // page then takes a little over 4 KiB on SSD, not 8. Their DRAM counts
  // as freed meanwhile, so the pass does not evict more for them. A pass
  // making room for a request sends each round's orders at once, since the
  // request waits for that room.
  constexpr size_t kMoveBatch = 64;
  const size_t flush_at = p.pass == PassFor::kRoom ? 1 : kMoveBatch;
  // Only the evictor thread's pass may send a tier that has an order out
  // another whatever its age; any other pass waits on that order once,
  // briefly (AwaitTier), and drops the candidates of a tier whose order
  // is overdue (PassFor).
  const bool busy_ok = p.pass == PassFor::kEvictor;
  const int64_t now = NowMs();
  static constexpr ListId kLists[] = {ListId::kLeaf, ListId::kPinnedLeaf};
  // Unpinned leaves first; soft-pinned leaves only when those run out.
  for (; p.list < 2; ++p.list, p.list_open = false) {
    const ListId list = kLists[p.list];
    if (!p.list_open) {
      // Once at the target the pass is done: used bytes that rose again
      // meanwhile (other puts) are no reason to evict pinned objects.
      if (list != ListId::kLeaf && !p.ran_out) return true;
      p.list_open = true;
      p.idle_rounds = 0;
      p.ran_out = false;
      // Requeuing an object that cannot go (leased, filling, guaranteed)
      // counts as progress until as many have been requeued as the list
      // held: however many of them sit at the tails, every object of the
      // list is looked at before a pinned one is evicted.
      p.listed = 0;
      for (auto& shard : shards_) {
        MutexLock lock(&shard->mu);
        p.listed += shard->lists[static_cast<int>(list)].size;
      }
      p.requeued = 0;
    }
    for (;;) {
      // Orders due, or a busy tier to wait on: the caller does either.
      if (p.batch.size() >= flush_at || !p.wait_tier.empty()) return false;
      uint64_t used = UsedFor(p);
      if (used <= p.target_used) break;
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
        p.ran_out = true;
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
        for (size_t k = 0; k < budget && l.tail != kNil && used > p.target_used; ++k) {
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
            if (++p.requeued <= p.listed) progressed = true;
            continue;
          }
          const bool tie = o.access == runner_up;
          const size_t in_dram = static_cast<size_t>(
              std::count_if(o.replicas.begin(), o.replicas.end(), [](const Replica& r) { return !r.ssd; }));
          std::optional<std::string> tier;
          if (in_dram == o.replicas.size()) {
            tier = OffloadTier(o, busy_ok, p.waited ? nullptr : &p.wait_tier);
            if (!p.wait_tier.empty()) break;  // left in place: asked again after the wait
          }
          uint64_t bytes = registry_->Rounded(o.size) * in_dram;
          p.freed += bytes;
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
          if (tier) {
            moves.push_back(StartMove(s, best, slot, std::move(*tier)));
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
        p.batch_bytes += m.bytes;
        p.batch.push_back(std::move(m));
      }
      if (progressed) {
        p.idle_rounds = 0;
      } else if (++p.idle_rounds > static_cast<int>(shards_.size()) * 2) {
        p.ran_out = true;  // everything left is leased or still filling
        break;
      }
    }
  }
  return true;
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
      // charge is released when the daemon confirms), the rest are dropped;
      // so is a page whose tier's order out is overdue (kTierStalledAfter),
      // which the put would otherwise wait on.
      if (std::optional<std::string> tier = OffloadTier(o, /*busy_ok=*/false)) {
        moves.push_back(StartMove(s, c.shard, c.slot, std::move(*tier)));
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

bool ObjectIndex::Impl::AboveHighWatermark() const {
  uint64_t capacity = registry_->capacity();
  return capacity > 0 && registry_->used() > static_cast<uint64_t>(options_.high_watermark * capacity);
}

bool ObjectIndex::Impl::MaybeEvict(PassFor pass) {
  if (!AboveHighWatermark()) return false;
  // Evicting at all means DRAM is contended: long leases now would keep
  // what eviction wants (and, with the window, flip back and forth).
  NotePressure();
  return EvictTo(static_cast<uint64_t>(options_.low_watermark * registry_->capacity()), pass) > 0;
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
    const bool freed = above && MaybeEvict(PassFor::kEvictor);
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

}  // namespace tierkv::master
