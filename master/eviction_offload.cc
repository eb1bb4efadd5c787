// Offload on eviction: which SSD tier, if any, an evicted object moves to
// (the admission rule), the orders sent to tier daemons and what their answers
// do (an SSD replica in place of the DRAM extent, or a plain eviction), and
// the pause on a tier whose daemon stops answering.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {

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

}  // namespace tierkv::master
