// The object index's read paths: GetReplicas (staging a value from SSD when
// no DRAM copy is left, and leasing what it names), the cached-read and
// existence checks, prefix match, Describe, and Stats.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "master/internal/index_impl.h"

namespace tierkv::master {

std::vector<LookupOut> ObjectIndex::Impl::GetReplicas(const std::vector<std::string>& keys,
                                                      bool resolve_names, bool counted) {
  std::vector<size_t> no_room;
  uint64_t need = 0;
  const uint64_t staged_before = staged_.load(std::memory_order_relaxed);
  std::vector<LookupOut> out = Lookup(keys, resolve_names, &no_room, &need, counted);
  if (!no_room.empty()) {
    // SSD hits found no room to stage: make it as a put would (outside
    // the shard locks), then look those keys up once more.
    const uint64_t used = registry_->used();
    EvictTo(used > need ? used - need : 0);
    FreeDeferred(NowMs());  // staged copies the eviction dropped whose grace is over
    std::vector<std::string> again;
    for (size_t i : no_room) again.push_back(keys[i]);
    std::vector<LookupOut> retried = Lookup(again, resolve_names, nullptr, nullptr, counted);
    for (size_t k = 0; k < no_room.size(); ++k) out[no_room[k]] = std::move(retried[k]);
  }
  if (!no_room.empty() || staged_.load(std::memory_order_relaxed) != staged_before) {
    // Staging extents take DRAM: keep the headroom puts expect.
    if (evictor_running_.load(std::memory_order_relaxed)) {
      if (AboveHighWatermark()) WakeEvictor();
    } else {
      MaybeEvict();
    }
  }
  return out;
}

std::vector<LookupOut> ObjectIndex::Impl::Lookup(const std::vector<std::string>& keys, bool resolve_names,
                                                 std::vector<size_t>* no_room, uint64_t* staged_bytes,
                                                 bool count_all) {
  std::vector<LookupOut> out(keys.size());
  auto names = LiveNames();
  absl::Time now = clock_->Now();
  const int64_t now_ms = absl::ToUnixMillis(now);
  const bool pressed = now_ms < pressure_until_ms_.load(std::memory_order_relaxed);
  const absl::Duration stage_lease = std::min(options_.lease_ttl, pressed ? options_.pressure_lease : options_.stage_lease);
  int64_t stage_until = absl::ToUnixMillis(now + stage_lease);
  int64_t lease_until = pressed ? stage_until : absl::ToUnixMillis(now + options_.lease_ttl);
  for (size_t i = 0; i < keys.size(); ++i) {
    Shard& s = *shards_[ShardOf(keys[i])];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, keys[i]);
    if (slot == kNil || !Visible(s.objects[slot])) {
      out[i].status = absl::NotFoundError(keys[i]);
      continue;
    }
    Object& o = s.objects[slot];
    out[i].replicas = VisibleExtents(o, names, resolve_names);
    std::vector<ExtentOut>& reps = out[i].replicas;
    if (std::any_of(reps.begin(), reps.end(), [](const ExtentOut& e) { return !e.ssd; })) {
      // DRAM first: an SSD replica is named only when none is left.
      reps.erase(std::remove_if(reps.begin(), reps.end(), [](const ExtentOut& e) { return e.ssd; }), reps.end());
    } else if (!reps.empty()) {
      // Stage the value into an extent of the daemon holding it. The
      // extent stays with the object as its DRAM copy (every reader fills
      // it from the record first), so it is evicted like any object, not
      // pinned per read.
      const ExtentOut on_ssd = reps.front();
      reps.clear();
      if (std::optional<Replica> staging = registry_->AllocateIn(on_ssd.segment_id, o.size)) {
        reps.push_back({on_ssd.segment, staging->offset, o.size, on_ssd.segment_id, false, true});
        o.replicas.push_back(*staging);
        o.unreturned = false;  // a new copy: no stage of an older one can reach it
        if (o.children == 0 && o.list == ListId::kNone && !o.moving) ListAtHead(s, slot);
        staged_.fetch_add(1, std::memory_order_relaxed);
      } else {
        out[i].status = absl::NotFoundError(absl::StrCat(keys[i], ": no room to stage it from SSD"));
        if (no_room != nullptr) {
          no_room->push_back(i);
          *staged_bytes += o.size;
        } else {
          stage_no_room_.fetch_add(1, std::memory_order_relaxed);
          NotePressure();
        }
        continue;
      }
    }
    if (reps.empty()) {
      // Copies on a daemon expected back (a master just restarted or
      // elected) are not lost: UNAVAILABLE, which a reader waits out,
      // rather than a miss that would send it to recompute or re-put.
      const bool awaited = std::any_of(o.replicas.begin(), o.replicas.end(),
                                       [&](const Replica& r) { return registry_->AwaitsRemount(r.segment_id); });
      out[i].status = awaited ? absl::UnavailableError(absl::StrCat(keys[i], ": its copies are ", kAwaitingRemount))
                              : absl::NotFoundError(absl::StrCat(keys[i], ": no live replica"));
      continue;
    }
    out[i].size = o.size;
    out[i].put_id = o.put_id;
    const int64_t old_deadline = o.deadline_ms;
    if (old_deadline <= now_ms) {
      // The last lease is over, and every count it had with it; one that
      // ran out with counted readers left may still see their stages land.
      if (o.readers > 0) o.unreturned = true;
      o.readers = 0;
      o.hard_lease = false;
    }
    // A read under pressure or from SSD is counted, so its reader can give
    // the DRAM back the moment it is done instead of at the deadline; so is
    // one whose reader asked (a read session, which holds it for a while).
    const bool counted = count_all || pressed || reps.front().stage;
    if (counted && o.readers < kStickyReaders) {
      // Issued below, once the lease's expiry is known (the token covers it).
      ++o.readers;
    } else if (!counted) {
      o.hard_lease = true;
    }
    o.released = false;
    o.deadline_ms = std::max(old_deadline, reps.front().stage ? stage_until : lease_until);
    if (o.deadline_ms != old_deadline) MoveLease(o, old_deadline, now_ms);
    out[i].lease_expiry = absl::FromUnixMillis(o.deadline_ms);
    if (counted && o.readers < kStickyReaders) out[i].lease_token = s.lease_tokens.Issue(slot, o.gen, o.deadline_ms);
    out[i].idle_s = HitOf(o).idle_s;
    Touch(s, slot);
  }
  return out;
}

std::vector<KeyHit> ObjectIndex::Impl::NoteCachedReads(const std::vector<std::string>& keys) {
  std::vector<KeyHit> hits(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    Shard& s = *shards_[ShardOf(keys[i])];
    MutexLock lock(&s.mu);
    const uint32_t slot = Find(s, keys[i]);
    if (slot == kNil || !Visible(s.objects[slot])) continue;
    hits[i] = HitOf(s.objects[slot]);
    Touch(s, slot);
  }
  return hits;
}

std::vector<bool> ObjectIndex::Impl::Exists(const std::vector<std::string>& keys,
                                            std::vector<KeyHit>* hits) {
  std::vector<bool> out(keys.size());
  auto names = LiveNames();
  for (size_t i = 0; i < keys.size(); ++i) {
    Shard& s = *shards_[ShardOf(keys[i])];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, keys[i]);
    out[i] = slot != kNil && Visible(s.objects[slot]) &&
             !VisibleExtents(s.objects[slot], names).empty();
    if (hits != nullptr) hits->push_back(out[i] ? HitOf(s.objects[slot]) : KeyHit{});
  }
  return out;
}

size_t ObjectIndex::Impl::PrefixMatch(const std::vector<std::string>& keys,
                                      std::vector<KeyHit>* hits) {
  auto names = LiveNames();
  size_t n = 0;
  for (; n < keys.size(); ++n) {
    Shard& s = *shards_[ShardOf(keys[n])];
    MutexLock lock(&s.mu);
    uint32_t slot = Find(s, keys[n]);
    if (slot == kNil || !Visible(s.objects[slot]) ||
        VisibleExtents(s.objects[slot], names).empty()) {
      break;
    }
    if (hits != nullptr) hits->push_back(HitOf(s.objects[slot]));
    Touch(s, slot);
  }
  return n;
}

absl::StatusOr<ObjectInfo> ObjectIndex::Impl::Describe(const std::string& key) {
  auto names = LiveNames();
  Shard& s = *shards_[ShardOf(key)];
  MutexLock lock(&s.mu);
  uint32_t slot = Find(s, key);
  if (slot == kNil) return absl::NotFoundError(key);
  const Object& o = s.objects[slot];
  ObjectInfo info;
  info.size = o.size;
  info.put_id = o.put_id;
  info.state = o.state == ObjState::kPending ? "pending" : "complete";
  info.replicas = VisibleExtents(o, names);
  if (o.state == ObjState::kComplete && o.deadline_ms > 0) {
    info.lease_expiry = absl::FromUnixMillis(o.deadline_ms);
  }
  info.soft_pin = o.soft_pin;
  info.hard_pin = o.hard_pin;
  info.group = o.group != nullptr ? o.group->id : "";
  info.visible = Visible(o) && !info.replicas.empty();
  info.children = o.children;
  return info;
}

IndexStats ObjectIndex::Impl::Stats() const {
  IndexStats st;
  st.objects = objects_.load();
  st.pending = pending_.load();
  st.evictions = evictions_.load();
  st.evictor_passes = evictor_passes_.load();
  st.evicted_bytes = evicted_bytes_.load();
  st.pinned = pinned_.load();
  st.offloaded = offloaded_.load();
  st.offload_failed = offload_failed_.load();
  st.staged = staged_.load();
  st.stage_no_room = stage_no_room_.load();
  st.leases_released = leases_released_.load();
  // No shard lock and no object visited: a scrape costs the same at any
  // object count and never stalls a request.
  st.leased = leases_.Count(NowMs());
  uint64_t footprint = 0;
  for (const auto& sp : shards_) footprint += sp->footprint.load(std::memory_order_relaxed);
  {
    MutexLock lock(&const_cast<Impl*>(this)->groups_mu_);
    st.groups = groups_.size();
  }
  st.memory_bytes = footprint + key_bytes_.load();
  return st;
}

}  // namespace tierkv::master
