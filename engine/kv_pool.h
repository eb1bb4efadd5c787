// KvPool: a fixed number of page-sized slots in one allocation (L1: the
// device pool, host memory standing in when there is no GPU; L2: the host
// pool, whose memory the transfer engine reads into directly).
//
// Not thread-safe: the cache serialises access.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "transport/memory.h"

namespace tierkv::engine {

class KvPool {
 public:
  // Memory is reserved, not touched, until pages are used.
  KvPool(size_t slots, size_t page_bytes);
  // A free slot, or -1 when full.
  int Allocate();
  void Free(int slot);
  char* Page(int slot) const { return base_ + static_cast<size_t>(slot) * page_bytes_; }
  size_t slots() const { return slots_; }
  size_t used() const { return slots_ - free_.size(); }
  size_t page_bytes() const { return page_bytes_; }
  char* base() const { return base_; }
  size_t bytes() const { return slots_ * page_bytes_; }

 private:
  size_t slots_;
  size_t page_bytes_;
  std::unique_ptr<transport::SharedRegion> region_;
  char* base_;
  std::vector<int> free_;
};

}  // namespace tierkv::engine
