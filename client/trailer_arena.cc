#include "client/internal/trailer_arena.h"

#include <algorithm>
#include <utility>

#include "config/base/log.h"

namespace tierkv::client::internal {

TrailerBlock& TrailerBlock::operator=(TrailerBlock&& other) noexcept {
  if (this == &other) return *this;
  if (arena_ != nullptr) arena_->Release(block_, std::move(holds_));
  arena_ = std::exchange(other.arena_, nullptr);
  block_ = other.block_;
  data_ = std::exchange(other.data_, nullptr);
  crcs_ = std::exchange(other.crcs_, nullptr);
  holds_ = std::move(other.holds_);
  other.holds_.clear();
  return *this;
}

TrailerBlock::~TrailerBlock() {
  if (arena_ != nullptr) arena_->Release(block_, std::move(holds_));
}

bool TrailerArena::Idle(Block& b) {
  if (b.lent) return false;
  b.holds.erase(std::remove_if(b.holds.begin(), b.holds.end(),
                               [](const std::shared_ptr<transport::Batch>& h) { return h->Done(); }),
                b.holds.end());
  return b.holds.empty();
}

absl::StatusOr<TrailerBlock> TrailerArena::Acquire(size_t n) {
  const size_t need = std::max<size_t>(n, 1) * kTrailerBytes;
  MutexLock lock(&mu_);
  size_t pick = blocks_.size();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    Block& b = blocks_[i];
    if (b.bytes >= need && Idle(b) && (pick == blocks_.size() || b.bytes < blocks_[pick].bytes)) pick = i;
  }
  if (pick == blocks_.size()) {
    // Powers of two from 4 KiB, so blocks are reused by batches of similar size.
    size_t bytes = 4096;
    while (bytes < need) bytes *= 2;
    Block b;
    b.memory.reset(new char[bytes]());
    b.crcs.reset(new transport::CopyCrc[bytes / kTrailerBytes]());
    b.bytes = bytes;
    absl::Status st = engine_->RegisterMemory(b.memory.get(), bytes, "cpu:0");
    if (!st.ok()) return st;
    blocks_.push_back(std::move(b));
  }
  Block& b = blocks_[pick];
  b.lent = true;
  // Idle: no transfer can still write these.
  for (size_t i = 0; i < std::max<size_t>(n, 1); ++i) b.crcs[i] = {};
  TrailerBlock out;
  out.arena_ = this;
  out.block_ = pick;
  out.data_ = b.memory.get();
  out.crcs_ = b.crcs.get();
  return out;
}

void TrailerArena::Release(size_t block, std::vector<std::shared_ptr<transport::Batch>> holds) {
  MutexLock lock(&mu_);
  Block& b = blocks_[block];
  b.lent = false;
  for (auto& h : holds) {
    if (!h->Done()) b.holds.push_back(std::move(h));
  }
}

TrailerArena::~TrailerArena() {
  MutexLock lock(&mu_);
  const absl::Time grace = absl::Now() + absl::Seconds(10);
  for (Block& b : blocks_) {
    bool idle = true;
    for (auto& h : b.holds) idle = h->Wait(grace) && idle;
    if (!idle) {
      TKV_LOG(ERROR) << "a transfer into a trailer block did not finish; leaking the block";
      (void)b.memory.release();
      (void)b.crcs.release();
      continue;
    }
    (void)engine_->UnregisterMemory(b.memory.get());
  }
}

}  // namespace tierkv::client::internal
