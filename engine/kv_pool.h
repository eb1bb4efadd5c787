// KvPool: a fixed number of page-sized slots in one allocation. L1 is
// allocated by the engine's device (GPU memory, or host memory on cpu);
// L2 is host memory the transfer engine reads into directly, registered
// with the device so that copies between the tiers can use DMA.
//
// Not thread-safe: the cache serialises access.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/device.h"
#include "transport/memory.h"

namespace tierkv::engine {

class KvPool {
 public:
  enum class Tier { kDevice, kHost };
  // Memory is reserved, not touched, until pages are used. `device` must
  // outlive the pool. Throws std::bad_alloc when the memory cannot be had:
  // a pool is sized once, at start-up.
  KvPool(size_t slots, size_t page_bytes, Device* device, Tier tier);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  // A free slot, or -1 when full.
  int Allocate();
  void Free(int slot);
  char* Page(int slot) const { return base_ + static_cast<size_t>(slot) * page_bytes_; }
  size_t slots() const { return slots_; }
  size_t used() const { return slots_ - free_.size(); }
  size_t page_bytes() const { return page_bytes_; }
  char* base() const { return base_; }
  size_t bytes() const { return slots_ * page_bytes_; }
  // The memfd behind the pool, for registering it with a transfer engine
  // that serves same-host peers over shm; -1 when there is none.
  int memfd() const;

 private:
  size_t slots_;
  size_t page_bytes_;
  Device* device_;
  Tier tier_;
  bool registered_ = false;
  std::unique_ptr<transport::SharedRegion> region_;  // kHost
  char* base_ = nullptr;
  std::vector<int> free_;
};

}  // namespace tierkv::engine
