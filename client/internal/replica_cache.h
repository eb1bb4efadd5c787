// Private to client/: where recently read values sit, remembered for the
// life of the read lease the master granted with them.
//
// A lease keeps a value's extents from being freed or reused until it ends
// (DESIGN.md, docs/faults.md "Leases defer frees"), so while it runs the
// replicas GetReplicas named still hold exactly that value: a repeated get
// of the same key can read them without asking the master again. Each
// entry is used only before its lease's end (already less the client's
// margin), and the read itself stays bounded by that end, as any read is.
//
// A counted read (the master counts readers while DRAM is evicted, so an
// object can go the moment its last reader gives its lease back) is
// remembered for at most `hold`, and its lease is given back (through
// `release`) when the entry goes: the count it still holds is what keeps
// the extents intact meanwhile. The master's own bound is the counted
// lease's expiry, so a give-back that never comes costs no more than the
// lease the master granted.
//
// Entries serve only while the master has answered recently: within
// `fresh` of the last GetReplicas answer (Heard), so a client whose master
// is gone stops reading from memory nobody vouches for any more. Each
// answer names the master's epoch and membership (it changes whenever
// segments leave); one naming others than the last forgets every entry,
// since some may sit on a segment that has gone.
//
//   ReplicaCache cache(4096, absl::Milliseconds(100), release, absl::Milliseconds(100));
//   uint64_t since = cache.generation();
//   ... GetReplicas (asked at `asked`), read the value, verify its checksum ...
//   cache.Heard(asked, resp.epoch(), resp.membership());
//   cache.Insert(key, located, since);   // refused if an Invalidate or a new membership came between
//   std::optional<Located> hit = cache.Lookup(key, absl::Now());
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/time/time.h"
#include "base/extent_grant.h"
#include "base/mutex.h"

namespace tierkv::client::internal {

// Where one key's value sits, as GetReplicas described it.
struct Located {
  uint64_t stored_size = 0;  // value + trailer; 0: absent
  uint64_t put_id = 0;       // the put that wrote it (its trailer says so); 0: before put ids
  absl::Time lease_end;      // a read must finish before this
  absl::InlinedVector<std::pair<std::string, uint64_t>, 2> replicas;  // (segment, offset), in order
  // The replicas' extent grants from the master, 48 bytes each in replica
  // order (GetReplicasResponse.replica_grants; empty: no daemon checks
  // them), sent with each read of replica j; all zeros: none for it.
  std::string grants;
  absl::string_view grant(size_t j) const {
    constexpr size_t kBytes = auth::kExtentGrantBytes;
    if ((j + 1) * kBytes > grants.size()) return {};
    absl::string_view g = absl::string_view(grants).substr(j * kBytes, kBytes);
    return g.find_first_not_of('\0') == absl::string_view::npos ? absl::string_view() : g;
  }
  bool cached = false;       // came from the cache, not the master
  // A counted read (GetReplicasResponse.lease_tokens): its lease is given
  // back once the read is over, with the master's expiry; a cached entry
  // holds it until the entry goes (a hit returns it as 0: the hit holds
  // nothing of its own).
  uint64_t lease_token = 0;
  int64_t lease_expiry_ms = 0;
};

class ReplicaCache {
 public:
  // Gives a counted read's lease back: (key, token, expiry in unix ms).
  using Release = std::function<void(const std::string&, uint64_t, int64_t)>;
  // At most `capacity` entries; 0 disables the cache (every Lookup misses).
  // Counted reads are kept for at most `hold` (0: never). Entries serve
  // within `fresh` of the master's last answer (infinite: Heard is not
  // needed).
  explicit ReplicaCache(size_t capacity, absl::Duration hold = absl::ZeroDuration(), Release release = nullptr,
                        absl::Duration fresh = absl::InfiniteDuration())
      : capacity_(capacity), fresh_(fresh), hold_(hold), release_(std::move(release)) {}
  ~ReplicaCache();

  // The entry for `key` if its lease has not ended by `now` (an ended one
  // is dropped) and the master answered within `fresh` before `now`.
  std::optional<Located> Lookup(const std::string& key, absl::Time now);
  // A GetReplicas answer to a request sent at `asked`, from a master at
  // `epoch` whose membership was `membership`. Renews freshness from
  // `asked`; an answer naming another epoch or membership than the last
  // forgets every entry (as Clear) unless it was asked before the last
  // such change was heard (a late answer from before it).
  void Heard(absl::Time asked, uint64_t epoch, uint64_t membership);
  // The current generation; pass it to Insert.
  uint64_t generation() const;
  // Remembers `where` for `key` unless an Invalidate or Clear happened
  // since generation() returned `since` (the value may have been removed
  // while it was being read). When full, ended leases go first, then all
  // unless that left at most half.
  // A counted read's lease (where.lease_token) is the cache's from here
  // on: held while the entry lasts (at most `hold` from `now`), given back
  // at once when it is not remembered.
  void Insert(const std::string& key, Located where, uint64_t since, absl::Time now = absl::Now());
  // Drops the counted entries whose hold has ended by `now`, giving their
  // leases back: call before asking the master, so the give-backs go with
  // that call.
  void ReleaseEnded(absl::Time now);
  // Forgets `key`; use when a read through the entry failed, or the key
  // was put anew. Without `give_back` a lease it holds is kept to its
  // expiry: for a read that may still be moving bytes.
  void Erase(const std::string& key, bool give_back = true);
  // Forgets `key` and refuses every insert begun before now: for a key
  // this client removed, which must never be served again.
  void Invalidate(const std::string& key);
  void Clear();
  size_t size() const;

 private:
  // Gives back the lease `where` holds, if any.
  void Drop(const std::string& key, const Located& where) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets every entry, giving their leases back, and refuses inserts
  // begun before.
  void ForgetAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases entries_[it], giving its lease back.
  void EraseEntry(absl::flat_hash_map<std::string, Located>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t capacity_;
  const absl::Duration fresh_;
  const absl::Duration hold_;
  const Release release_;
  mutable Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  // The last answer heard: when it was asked (InfinitePast: none yet),
  // and the view it named.
  absl::Time heard_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t membership_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time view_changed_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::flat_hash_map<std::string, Located> entries_ ABSL_GUARDED_BY(mu_);
  // Counted entries in the order their holds end: (end, key, token). One
  // whose key now has another entry (or none) is skipped when it comes up.
  struct Held {
    absl::Time end;
    std::string key;
    uint64_t token;
  };
  std::deque<Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::client::internal
