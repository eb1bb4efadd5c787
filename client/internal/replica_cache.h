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
//   ReplicaCache cache(4096);
//   uint64_t since = cache.generation();
//   ... GetReplicas, read the value, verify its checksum ...
//   cache.Insert(key, located, since);   // refused if an Invalidate came between
//   std::optional<Located> hit = cache.Lookup(key, absl::Now());
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/time/time.h"
#include "config/base/mutex.h"

namespace tierkv::client::internal {

// Where one key's value sits, as GetReplicas described it.
struct Located {
  uint64_t stored_size = 0;  // value + trailer; 0: absent
  absl::Time lease_end;      // a read must finish before this
  absl::InlinedVector<std::pair<std::string, uint64_t>, 2> replicas;  // (segment, offset), in order
  bool cached = false;       // came from the cache, not the master
  // A counted read (GetReplicasResponse.lease_tokens): never cached, its
  // lease given back once the read is over, with the master's expiry.
  uint64_t lease_token = 0;
  int64_t lease_expiry_ms = 0;
};

class ReplicaCache {
 public:
  // At most `capacity` entries; 0 disables the cache (every Lookup misses).
  explicit ReplicaCache(size_t capacity) : capacity_(capacity) {}

  // The entry for `key` if its lease has not ended by `now` (an ended one
  // is dropped).
  std::optional<Located> Lookup(const std::string& key, absl::Time now);
  // The current generation; pass it to Insert.
  uint64_t generation() const;
  // Remembers `where` for `key` unless an Invalidate or Clear happened
  // since generation() returned `since` (the value may have been removed
  // while it was being read). When full, ended leases go first, then all.
  void Insert(const std::string& key, Located where, uint64_t since);
  // Forgets `key`; use when a read through the entry failed, or the key
  // was put anew.
  void Erase(const std::string& key);
  // Forgets `key` and refuses every insert begun before now: for a key
  // this client removed, which must never be served again.
  void Invalidate(const std::string& key);
  void Clear();
  size_t size() const;

 private:
  const size_t capacity_;
  mutable Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Located> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::client::internal
