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

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/mutex.h"

namespace tierkv::master {

struct Mutation {
  std::string key;
  std::string value;
  bool remove = false;
};

// Where a leader's committed batches go to reach its standby masters
// (master/replication.h). Append is called once per committed store batch,
// in commit order, before any writer in it returns; Await then holds each
// writer until its batch is as replicated as the mode asks.
class Replicator {
 public:
  virtual ~Replicator() = default;
  // The batch's sequence number. Called with the store's writes
  // serialized: two Appends never overlap and their order is the order
  // the mutations were applied in.
  virtual uint64_t Append(const std::vector<const std::vector<Mutation>*>& group) = 0;
  // OK once `seq` is replicated enough to acknowledge; UNAVAILABLE when it
  // never will be (this master is no longer the leader).
  virtual absl::Status Await(uint64_t seq) = 0;
  // The sequence of the latest Append (0: none yet).
  virtual uint64_t LastAppended() = 0;
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
  // With a replicator, returns once they are replicated as it asks.
  virtual absl::Status Write(const std::vector<Mutation>& batch) = 0;
  // Write without the wait for replication: the ticket to hand to
  // AwaitReplicated before acknowledging (0: nothing to wait for). A caller
  // commits under its own locks and waits for the standbys after releasing
  // them, so one replication round never holds up other calls. The default
  // is Write, which has waited already.
  virtual absl::StatusOr<uint64_t> Commit(const std::vector<Mutation>& batch) {
    if (absl::Status s = Write(batch); !s.ok()) return s;
    return 0;
  }
  // OK once the commit that returned `ticket` (and every one before it) is
  // replicated as the replicator's mode asks; UNAVAILABLE when it never
  // will be (this master was deposed).
  absl::Status AwaitReplicated(uint64_t ticket) {
    Replicator* r = replicator();
    return ticket == 0 || r == nullptr ? absl::OkStatus() : r->Await(ticket);
  }
  // A ticket covering every commit that has returned so far: for a caller
  // that finds a change made by another call, which may still be waiting.
  uint64_t LatestTicket() {
    Replicator* r = replicator();
    return r == nullptr ? 0 : r->LastAppended();
  }
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
  // Calls fn for every key after `after` ("" : from the first), in key
  // order, until fn returns false: a standby's snapshot reads in pages.
  // The default walks every key from the first.
  virtual absl::Status ScanAfter(const std::string& after,
                                 const std::function<bool(absl::string_view key, absl::string_view value)>& fn);
  // Every write from now on is handed to `r` (null: none) as above; set
  // before the store takes writes, `r` outliving them.
  void SetReplicator(Replicator* r) { replicator_.store(r, std::memory_order_release); }

 protected:
  Replicator* replicator() const { return replicator_.load(std::memory_order_acquire); }

 private:
  std::atomic<Replicator*> replicator_{nullptr};
};

// Opens (creating if needed) a RocksDB database in `dir`.
absl::StatusOr<std::unique_ptr<IndexStore>> OpenRocksDbStore(const std::string& dir);

// Volatile store for tests and for a master run without --data-dir.
std::unique_ptr<IndexStore> NewMemStore();

}  // namespace tierkv::master
