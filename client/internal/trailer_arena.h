// Private to client/: the trailer stored after every value, and the
// registered memory its local copies sit in.
//
// A trailer binds the bytes before it to their key and to the put that
// wrote them (docs/wire-formats.md), 16 bytes, little-endian:
//   CRC32C over the key then the value (u32) | "TKV2" | put id (u64)
// The put id is the master's (PutStartResult.put_id), and a reader checks
// it against the one the master's index holds (GetReplicasResponse
// .put_ids) whether or not it checksums the value. So whatever an extent
// holds that is not this put of this key (another key's value from a
// late grant of a deposed master, an older put's, a lost tail) reads as a
// miss, never as the value; a value whose bytes changed under its own
// trailer fails its checksum (DATA_LOSS). Objects put before put ids
// (put id 0 in the index) carry the older 8-byte trailer, CRC32C over the
// value | "TKV1", and stay readable.
//
// A trailer's local copy must sit in memory the transfer engine
// registered, or transports that move only registered memory (rdma) would
// refuse it. The arena keeps a few registered blocks and lends one per put
// or get:
//
//   ASSIGN_OR_RETURN(TrailerBlock block, arena.Acquire(n));
//   char* t = block.slot(i);            // kTrailerBytes bytes
//   transport::CopyCrc* c = block.crc(i);  // unset until a transport sets it
//   block.Hold(batch);                  // not lent again until batch is done
//
// A block comes back when the TrailerBlock is destroyed, but is lent again
// only once every batch it was held for is done: a transfer that outlived
// its caller's wait may still write into it. Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "transport/engine.h"

namespace tierkv::client::internal {

inline constexpr size_t kTrailerBytes = 16;       // a put's trailer, and a slot's size
inline constexpr size_t kLegacyTrailerBytes = 8;  // an object put before put ids
// The trailer after an object of put `put_id` (0: one put before put ids).
inline constexpr size_t TrailerSize(uint64_t put_id) { return put_id != 0 ? kTrailerBytes : kLegacyTrailerBytes; }

// Where a trailer's CRC starts: the CRC32C of the key, which the value's
// bytes then extend (a transport that checksums as it copies starts there).
uint32_t KeyCrc(absl::string_view key);
// Writes the trailer of put `put_id` (not 0) whose CRC over key and value
// is `crc`, into `t` (kTrailerBytes).
void EncodeTrailer(uint32_t crc, uint64_t put_id, char* t);
// Checks the trailer `t` read after `key`'s `value`, which the index says
// put `put_id` wrote: NOT_FOUND when the trailer is not that put's (a
// miss), DATA_LOSS when `verify` and the CRC does not match. `copied`:
// the CRC a transport worked out over a one-piece value as it copied it,
// started from KeyCrc(key) for a put id, 0 for none (unset: the bytes are
// checksummed here).
absl::Status CheckTrailer(const char* t, uint64_t put_id, const std::string& key,
                          absl::Span<const absl::Span<char>> value, bool verify, const transport::CopyCrc& copied);

class TrailerArena;

class TrailerBlock {
 public:
  TrailerBlock() = default;
  TrailerBlock(TrailerBlock&& other) noexcept { *this = std::move(other); }
  TrailerBlock& operator=(TrailerBlock&& other) noexcept;
  ~TrailerBlock();

  char* slot(size_t i) const { return data_ + i * kTrailerBytes; }
  // Where a transport may leave the CRC of value i as it copied it; the same
  // lifetime as the slots, since a late transfer may still write it.
  transport::CopyCrc* crc(size_t i) const { return crcs_ + i; }
  void Hold(std::shared_ptr<transport::Batch> batch) { holds_.push_back(std::move(batch)); }

 private:
  friend class TrailerArena;
  TrailerArena* arena_ = nullptr;
  size_t block_ = 0;
  char* data_ = nullptr;
  transport::CopyCrc* crcs_ = nullptr;
  std::vector<std::shared_ptr<transport::Batch>> holds_;
};

class TrailerArena {
 public:
  // `engine` must outlive the arena.
  explicit TrailerArena(transport::TransferEngine* engine) : engine_(engine) {}
  // Unregisters the blocks; a block whose batches do not finish within a
  // grace is leaked rather than freed under a transfer.
  ~TrailerArena();

  // Room for `n` trailers in registered memory; errors from RegisterMemory.
  absl::StatusOr<TrailerBlock> Acquire(size_t n);

 private:
  friend class TrailerBlock;
  struct Block {
    std::unique_ptr<char[]> memory;
    std::unique_ptr<transport::CopyCrc[]> crcs;  // one per slot
    size_t bytes = 0;
    bool lent = false;
    std::vector<std::shared_ptr<transport::Batch>> holds;  // until done
  };
  static bool Idle(Block& b);
  void Release(size_t block, std::vector<std::shared_ptr<transport::Batch>> holds);

  transport::TransferEngine* const engine_;
  Mutex mu_;
  std::vector<Block> blocks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::client::internal
