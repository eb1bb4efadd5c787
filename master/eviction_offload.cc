// Offload on eviction: which SSD tier, if any, an evicted object moves to
// (the admission rule), the orders sent to tier daemons and what their answers
// do (an SSD replica in place of the DRAM extent, or a plain eviction), and
// the pause on a tier whose daemon stops answering. Orders go out with no
// index lock held (evict_mu_ included): a daemon that does not answer holds
// only the pass that sent its order.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {

std::optional<std::string> ObjectIndex::Impl::OffloadTier(const Object& o, bool busy_ok,
                                                          std::string* wait_for) const {
  if (!options_.offload || !(o.read || options_.offload_unread) || o.group != nullptr || o.replicas.size() != 1 ||
      o.replicas[0].ssd) {
    return std::nullopt;
  }
  std::optional<std::string> tier = registry_->TierFor(o.replicas[0].segment_id, o.size);
  if (!tier || TierPaused(*tier, NowMs())) return std::nullopt;
  if (busy_ok) return tier;
  switch (LoadOf(*tier)) {
    case TierLoad::kIdle:
      return tier;
    case TierLoad::kStalled:
      return std::nullopt;
    case TierLoad::kBusy:
      if (wait_for == nullptr) return tier;
      *wait_for = std::move(*tier);
      return std::nullopt;
  }
  return std::nullopt;
}

ObjectIndex::Impl::TierLoad ObjectIndex::Impl::LoadOf(const std::string& tier) const {
  if (orders_out_total_.load(std::memory_order_acquire) == 0) return TierLoad::kIdle;
  MutexLock lock(&tier_pause_mu_);
  auto it = orders_out_.find(tier);
  if (it == orders_out_.end() || it->second.empty()) return TierLoad::kIdle;
  const auto oldest = *std::min_element(it->second.begin(), it->second.end());
  return std::chrono::steady_clock::now() - oldest >= kTierStalledAfter ? TierLoad::kStalled : TierLoad::kBusy;
}

void ObjectIndex::Impl::AwaitTier(const std::string& tier) {
  MutexLock lock(&tier_pause_mu_);
  for (;;) {
    auto it = orders_out_.find(tier);
    if (it == orders_out_.end() || it->second.empty()) return;
    const auto until = *std::min_element(it->second.begin(), it->second.end()) + kTierStalledAfter;
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return;
    tier_answered_.WaitFor(&tier_pause_mu_, until - now);
  }
}

ObjectIndex::Impl::Move ObjectIndex::Impl::StartMove(Shard& s, size_t shard, uint32_t slot, std::string tier) {
  Object& o = s.objects[slot];
  // The extent stays the object's until the daemon has copied it; a
  // remove meanwhile defers its free (Erase).
  o.moving = true;
  Unlist(s, slot);
  Move m{shard, slot, o.gen, registry_->Rounded(o.size), std::move(tier), {o.key, o.replicas[0].offset, o.size}};
  moving_bytes_.fetch_add(m.bytes, std::memory_order_acq_rel);
  return m;
}

bool ObjectIndex::Impl::TierPaused(const std::string& tier, int64_t now_ms) const {
  if (now_ms >= pauses_end_ms_.load(std::memory_order_acquire)) return false;
  MutexLock lock(&tier_pause_mu_);
  auto it = tier_paused_until_ms_.find(tier);
  return it != tier_paused_until_ms_.end() && now_ms < it->second;
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
    // Busy while the order is out: a pass for a request waits on it a
    // little (AwaitTier), then drops that tier's candidates.
    const auto sent = std::chrono::steady_clock::now();
    {
      MutexLock lock(&tier_pause_mu_);
      orders_out_[tier].push_back(sent);
      orders_out_total_.fetch_add(1, std::memory_order_acq_rel);
    }
    std::vector<absl::Status> answer = options_.offload(tier, orders, options_.offload_timeout);
    for (size_t k = 0; k < which.size() && k < answer.size(); ++k) got[which[k]] = answer[k];
    const bool unanswered =
        answer.size() < which.size() || std::all_of(answer.begin(), answer.end(), [](const absl::Status& s) {
          return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
        });
    {
      MutexLock lock(&tier_pause_mu_);
      if (auto it = orders_out_.find(tier); it != orders_out_.end()) {
        std::vector<std::chrono::steady_clock::time_point>& out = it->second;
        if (auto at = std::find(out.begin(), out.end(), sent); at != out.end()) out.erase(at);
        if (out.empty()) orders_out_.erase(it);
      }
      orders_out_total_.fetch_sub(1, std::memory_order_acq_rel);
      tier_answered_.SignalAll();
      if (unanswered) {
        // Paused before it stops being busy: no pass slips an order in.
        const int64_t until = NowMs() + absl::ToInt64Milliseconds(kTierPause);
        tier_paused_until_ms_[tier] = until;
        // Written under the lock, so no other pause lowers it meanwhile.
        if (until > pauses_end_ms_.load(std::memory_order_relaxed)) {
          pauses_end_ms_.store(until, std::memory_order_release);
        }
      }
    }
    if (unanswered) {
      TKV_LOG(WARNING) << "SSD tier " << tier << " did not take an order of " << which.size() << " ("
                       << (answer.empty() ? absl::UnavailableError("no answer") : answer[0])
                       << "); no order goes there for " << kTierPause;
    }
  }
  const int64_t now = NowMs();
  FollowUp follow;
  uint64_t moved_bytes = 0;
  for (const Move& m : moves) moved_bytes += m.bytes;
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
  // Last, once their extents are freed (or held for a reader): in the other
  // order a concurrent pass would, for a moment, count them neither as
  // leaving nor as gone, and evict more in their stead.
  moving_bytes_.fetch_sub(moved_bytes, std::memory_order_acq_rel);
}

}  // namespace tierkv::master
