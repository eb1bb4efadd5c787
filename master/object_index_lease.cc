// Read leases in the object index: the lease wheel that counts leased
// objects without visiting them, moving an object's lease when a read extends
// it, readers giving counted leases back, and the extents held past a lease
// (DeferredFree, staged copies) until no reader can still reach them.
#include <algorithm>
#include <cstring>

#include "base/log.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {

LeaseTokens::LeaseTokens() {
  // Without tokens counted reads cannot be given back early: their leases
  // then last to their expiry, which is safe, only slower to free memory.
  if (!mac_.ok()) TKV_LOG(ERROR) << "cannot set up lease tokens (AES-128 key); counted leases will run to their expiry";
}

std::optional<uint64_t> LeaseTokens::Tag(uint32_t slot, uint32_t gen, uint32_t seq, int64_t expiry_ms) {
  // Two blocks of fixed layout: (slot, generation, expiry), then the read
  // number. Every field has its own bits, so no change to one can be made
  // up by a change to another.
  uint8_t msg[32] = {}, tag[16];
  std::memcpy(msg, &slot, 4);
  std::memcpy(msg + 4, &gen, 4);
  std::memcpy(msg + 8, &expiry_ms, 8);
  std::memcpy(msg + 16, &seq, 4);
  if (!mac_.Mac(msg, tag)) return std::nullopt;
  uint64_t t;
  std::memcpy(&t, tag, 8);
  return t & ((uint64_t{1} << kTagBits) - 1);
}

uint64_t LeaseTokens::Issue(uint32_t slot, uint32_t gen, int64_t expiry_ms) {
  seq_ = (seq_ + 1) & ((1u << (64 - kTagBits)) - 1);
  if (seq_ == 0) seq_ = 1;  // so no token is 0
  std::optional<uint64_t> tag = Tag(slot, gen, seq_, expiry_ms);
  return tag ? uint64_t{seq_} << kTagBits | *tag : 0;
}

bool LeaseTokens::Redeem(uint64_t token, uint32_t slot, uint32_t gen, int64_t expiry_ms, int64_t now_ms) {
  const uint32_t seq = static_cast<uint32_t>(token >> kTagBits);
  if (token == 0 || expiry_ms <= now_ms || seq == 0) return false;
  std::optional<uint64_t> tag = Tag(slot, gen, seq, expiry_ms);
  if (!tag || *tag != (token & ((uint64_t{1} << kTagBits) - 1))) return false;
  if (!redeemed_.emplace(token, expiry_ms).second) return false;
  if (redeemed_.size() >= prune_at_) {
    absl::erase_if(redeemed_, [now_ms](const auto& e) { return e.second <= now_ms; });
    prune_at_ = std::max<size_t>(1024, 2 * redeemed_.size());
  }
  return true;
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
    if (o.state != ObjState::kComplete || o.deadline_ms <= now_ms || o.readers == 0 || o.readers == kStickyReaders ||
        !s.lease_tokens.Redeem(r.token, slot, o.gen, r.expiry_ms, now_ms)) {
      continue;
    }
    ++applied;
    if (--o.readers > 0 || o.hard_lease || UnderGrants(o)) continue;
    if (leases_.Counted(o.deadline_ms, now_ms)) leases_.Remove(leases_.TickOf(o.deadline_ms));
    o.deadline_ms = 0;
    o.released = true;
  }
  leases_released_.fetch_add(applied, std::memory_order_relaxed);
  return applied;
}

bool ObjectIndex::Impl::UnderGrants(const Object& o) const {
  for (const Replica& r : o.replicas) {
    if (!r.ssd && registry_->ChecksGrants(r.segment_id)) return true;
  }
  return false;
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

}  // namespace tierkv::master
