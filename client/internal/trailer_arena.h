// Private to client/: registered memory for the checksum trailers.
//
// Every value travels with an 8-byte trailer, and its local copy must sit
// in memory the transfer engine registered, or transports that move only
// registered memory (rdma) would refuse it. The arena keeps a few
// registered blocks and lends one per put or get:
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
#include "config/base/mutex.h"
#include "transport/engine.h"

namespace tierkv::client::internal {

inline constexpr size_t kTrailerBytes = 8;

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
