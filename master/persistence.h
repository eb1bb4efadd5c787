// IndexStore: the seam between the master and durable storage.
//
// The master keeps three keyspaces: "s/<name>" segment records, "o/<key>"
// object records (proto/master.proto SegmentRecord / ObjectRecord), and
// "m/<key>" opaque metadata values served over HTTP. RocksDbStore is the
// real one; MemStore is the in-memory twin used by unit tests.
//
// Writes that arrive while another is in flight are group-committed: the
// next one to go applies them all as one RocksDB WriteBatch.
//
// Writes go to RocksDB's write-ahead log without fsync: a killed master
// process loses nothing that was acknowledged (the log is in the page
// cache); a power loss can lose the last moments. Flush() syncs, and is
// called at clean shutdown. docs/persistence.md has the details.
//
// Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "config/base/mutex.h"

namespace tierkv::master {

struct Mutation {
  std::string key;
  std::string value;
  bool remove = false;
};

struct WriteCounts {
  uint64_t writes = 0;   // Write calls that reached the store
  uint64_t batches = 0;  // store writes they were applied in
};

class IndexStore {
 public:
  virtual ~IndexStore() = default;
  // Applies the mutations atomically, in order. UNAVAILABLE/INTERNAL on an
  // I/O error (the caller must not acknowledge what it tried to persist).
  virtual absl::Status Write(const std::vector<Mutation>& batch) = 0;
  // NOT_FOUND when absent.
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  // Calls fn for every key starting with `prefix`, in key order; stops
  // early (OK) when fn returns false.
  virtual absl::Status Scan(const std::string& prefix,
                            const std::function<bool(absl::string_view key, absl::string_view value)>& fn) = 0;
  // Makes every prior write durable (fsync of the log).
  virtual absl::Status Flush() = 0;
  // How many writes were folded into how many batches (group commit);
  // zeros for a store that does not group.
  virtual WriteCounts Counts() { return {}; }
};

// Opens (creating if needed) a RocksDB database in `dir`.
absl::StatusOr<std::unique_ptr<IndexStore>> OpenRocksDbStore(const std::string& dir);

// Volatile store for tests and for a master run without --data-dir.
std::unique_ptr<IndexStore> NewMemStore();

}  // namespace tierkv::master
