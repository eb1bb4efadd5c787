// SsdTier: a daemon's disk tier. Values live as records in one file
// (through a io::FileIo: io_uring and O_DIRECT in production, an in-memory
// fake in tests), each record bound to its key and checked by CRC32C, so a
// read returns the bytes that key was written with or an error, never
// another key's bytes or a torn value.
//
// Layout. The file is cut into regions (--ssd-region-size, 16 MiB by
// default). Each WriteBatch appends groups of records to the open region; a
// group is
//   [block: header 64 B, then per record an entry of 24 B + key][values]
// padded to 4 KiB, and its block names every record in it: its key, the
// value's place in the group, its length and flags, and CRC32C of key and
// value (so bytes read for one key can only pass as that key's). Values are
// packed back to back, so a 4 KiB page with its 16-byte trailer takes a
// little over 4 KiB, not two blocks. A value of 32 KiB or more whose memory
// is 4 KiB-aligned starts on a 4 KiB boundary and is written straight from
// that memory (no copy); its last partial block is copied. The group block
// carries the region's sequence number and nonce and its own CRC32C. A group
// holds as many records as its block has room for and lies in one region.
// Space is reclaimed a whole region at a time, oldest first (FIFO), once the
// regions in use pass the high watermark, down to the low one; the records
// of a reclaimed region are dropped (Stats::reclaimed, and the drop listener
// is told), except those read since they were written into one of the
// older half of the regions: a read re-appends such a record (its bytes are
// in hand), so a cache that is read keeps what it reads (Stats::refreshed).
//
// Restart. Open reads only group blocks: per region, the first 4 KiB of
// each group, following group lengths while blocks carry the region's nonce
// (one read per region per step, all regions' reads in one submission).
// A block with the magic but a bad CRC is a group torn by a crash: its
// records are skipped, it is counted (Stats::torn), and the region's chain
// stops there. A region with records is sealed (never appended to again) so
// a new group cannot meet a stale block at its end. Values are verified
// lazily, when read: a value whose CRC fails (its write torn after the block
// landed) answers DATA_LOSS, is dropped and counted (Stats::corrupt). Erase
// rewrites the record's entry in its group block as dead.
//
// Faults. An I/O error (EIO, ENOSPC, a short transfer) or a batch slower
// than Options::slow_io marks the tier failed: every later call answers
// UNAVAILABLE naming the first failure, and the daemon serves DRAM only.
// Failpoints (base/failpoint.h): store.ssd.scan, store.ssd.write
// (EIO), store.ssd.write_full (ENOSPC), store.ssd.read (EIO); `sleep:<ms>`
// at any of them is a slow disk.
//
// Thread-safe. A batch's I/O runs outside the index lock; a region with
// I/O in flight is never reclaimed under it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "base/io/file_io.h"

namespace tierkv::store {

// Keys longer than this are not kept on disk (a group block must hold the
// key, so a scan reads one block per group).
inline constexpr size_t kSsdMaxKey = io::kIoAlign - 64 - 24;

struct SsdTierOptions {
  uint64_t region_size = 16ull << 20;  // multiple of 4 KiB; the largest record
  double high_watermark = 0.95;        // of regions in use: reclaim above ...
  double low_watermark = 0.90;         // ... down to this
  absl::Duration slow_io = absl::Seconds(5);
  // Told of every record the tier drops on its own (region reclaim, a
  // corrupt value), after the drop. Called without the tier's lock.
  std::function<void(const std::string& key)> on_drop;
};

struct SsdWrite {
  std::string key;
  const void* data = nullptr;
  uint64_t size = 0;
};

struct SsdRead {
  std::string key;
  void* dst = nullptr;   // receives the value
  uint64_t capacity = 0; // bytes at dst
  // Past this (monotonic clock) dst is left untouched: DEADLINE_EXCEEDED.
  // A reader's staging extent is its only while its lease lasts.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

struct SsdStats {
  uint64_t capacity = 0;    // file bytes usable for records
  uint64_t used = 0;        // bytes of live records (values)
  uint64_t regions_in_use = 0;
  uint64_t regions = 0;
  uint64_t records = 0;
  uint64_t recovered = 0;   // records found by the scan at Open
  uint64_t torn = 0;        // torn group blocks skipped by the scan
  uint64_t corrupt = 0;     // values that failed their CRC on read
  uint64_t reclaimed = 0;   // records dropped by region reclaim
  uint64_t refreshed = 0;   // records re-appended after a read (see Layout)
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t submissions = 0;
  bool direct = false;
  bool failed = false;
  std::string failure;      // the first failure, when failed
};

class SsdTier {
 public:
  // Scans the file's headers and indexes the records found.
  // INVALID_ARGUMENT for unusable options; UNAVAILABLE when the scan's I/O
  // fails.
  static absl::StatusOr<std::unique_ptr<SsdTier>> Open(std::unique_ptr<io::FileIo> file, SsdTierOptions options);
  ~SsdTier();

  // Writes each value as a record (one submission for the batch, which
  // also re-appends the records ReadBatch kept); per item: OK, ALREADY_EXISTS (the key is on disk; the old record stays),
  // INVALID_ARGUMENT (key too long, value larger than a region),
  // RESOURCE_EXHAUSTED (no region can be reclaimed: all have I/O in
  // flight), UNAVAILABLE (the tier failed).
  std::vector<absl::Status> WriteBatch(absl::Span<const SsdWrite> items);
  // Reads each key's value into its dst (one submission for the batch);
  // per item the value's size, or NOT_FOUND, OUT_OF_RANGE (capacity below
  // the value's size), DATA_LOSS (the record failed its checks and was
  // dropped), DEADLINE_EXCEEDED (read after the item's deadline; dst not
  // written), UNAVAILABLE (the tier failed). Each value is checked, then
  // copied into its dst in one memcpy after its I/O, outside the tier's
  // lock. A value read from the older half of the regions is kept (up to
  // four regions' worth) and re-appended by the next WriteBatch, which is
  // the only call that reclaims.
  std::vector<absl::StatusOr<uint64_t>> ReadBatch(absl::Span<const SsdRead> items);
  // Forgets the key and marks its record dead on disk, so a restart does
  // not bring it back. NOT_FOUND when absent.
  absl::Status Erase(const std::string& key);

  // The value's size, or nullopt when the key is not on disk.
  std::optional<uint64_t> SizeOf(const std::string& key) const;
  // Every key on disk with its value's size (for re-registering).
  std::vector<std::pair<std::string, uint64_t>> Records() const;
  SsdStats Stats() const;
  bool failed() const;

 private:
  struct Record {
    uint32_t region = 0;
    uint64_t offset = 0;      // the value's, in the file
    uint64_t value_len = 0;
    uint32_t crc = 0;         // CRC32C of key then value
    uint64_t group = 0;       // the group block's offset in the file
    uint32_t entry = 0;       // the entry's offset in that block
    bool refresh_queued = false;  // in refresh_ (so a record read often is kept once)
  };
  // A record read from an aging region, to re-append (see Layout).
  struct Refresh {
    std::string key;
    Record old;
    io::AlignedBuffer buf;
    uint64_t skip = 0;  // the value's offset in buf
  };
  struct Region {
    uint64_t seq = 0;     // 0: free
    uint64_t nonce = 0;
    uint64_t write_ptr = 0;
    int pins = 0;         // I/O in flight
    std::vector<std::string> keys;
  };

  SsdTier(std::unique_ptr<io::FileIo> file, SsdTierOptions options);
  absl::Status Scan();
  // Runs a batch, applying `failpoint`'s error as `fail_errno`; marks the
  // tier failed when it is slow. Non-OK when the batch could not run.
  absl::Status RunBatch(absl::Span<io::IoOp> ops, const char* failpoint, int fail_errno, const char* what);
  void Fail(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FailedStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finds room for `len` bytes, reclaiming old regions if needed; pins the
  // region. Appends dropped keys to `dropped`.
  absl::StatusOr<std::pair<uint32_t, uint64_t>> Allocate(uint64_t len, std::vector<std::string>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReclaimOldest(std::vector<std::string>* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FindOldest() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReclaim(std::vector<std::string>* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when `region` is in the older half of the regions in use, is not
  // the open one, and the tier is more than half full: its records are the
  // next to be reclaimed.
  bool Aging(uint32_t region) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rewrites the record's entry in its group block as dead.
  absl::Status MarkDead(const Record& rec, const std::string& key, uint64_t nonce) ABSL_LOCKS_EXCLUDED(mu_);
  void Notify(const std::vector<std::string>& dropped);

  const std::unique_ptr<io::FileIo> file_;
  const SsdTierOptions options_;
  const uint32_t num_regions_;
  Mutex erase_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one group block rewrite at a time
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, Record> index_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> writing_ ABSL_GUARDED_BY(mu_);  // keys with a write in flight
  std::vector<Region> regions_ ABSL_GUARDED_BY(mu_);
  std::deque<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  int64_t open_region_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t oldest_seq_ ABSL_GUARDED_BY(mu_) = 0;  // of the regions in use
  std::vector<Refresh> refresh_ ABSL_GUARDED_BY(mu_);
  uint64_t refresh_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  SsdStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::store
