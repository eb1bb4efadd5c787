// ExtentAllocator: carves one segment's address range into extents.
//
// Best fit over a coalescing free list, indexed two ways: by offset (to
// merge a freed extent with its neighbours) and by (length, offset) (to find
// the smallest free extent that fits). Lengths are rounded up to
// `alignment`. When most objects share a few sizes (KV pages), a freed page
// is exactly the best fit for the next page of its size, so steady-state
// churn reuses holes without splitting them and fragmentation stays near
// zero; docs/allocator.md gives the argument and its bound for mixed sizes.
//
// Only free space is tracked: an allocated extent costs the allocator
// nothing, so master memory per object does not grow with it. The caller
// remembers (offset, length) and passes both back to Free.
//
// Not thread-safe: the segment registry serialises access.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "absl/status/status.h"

namespace tierkv::master {

class ExtentAllocator {
 public:
  // `alignment` must be a power of two.
  explicit ExtentAllocator(uint64_t capacity, uint64_t alignment = 64);

  // The offset of a new extent of at least `length` bytes, or nullopt when
  // no free extent is large enough. `length` 0 is treated as 1.
  std::optional<uint64_t> Allocate(uint64_t length);

  // Returns an extent obtained from Allocate (same `length`). Freeing space
  // that is not allocated is a caller bug: it is refused with
  // FAILED_PRECONDITION and nothing changes.
  absl::Status Free(uint64_t offset, uint64_t length);

  // Marks a specific extent allocated (rebuilding state from a persisted
  // index). FAILED_PRECONDITION if any part of it is not free.
  absl::Status Reserve(uint64_t offset, uint64_t length);

  uint64_t Rounded(uint64_t length) const;
  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return capacity_ - free_bytes_; }
  uint64_t largest_free() const;
  size_t free_extents() const { return by_offset_.size(); }

 private:
  void InsertFree(uint64_t offset, uint64_t length);
  void EraseFree(std::map<uint64_t, uint64_t>::iterator it);

  const uint64_t capacity_;
  const uint64_t alignment_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> by_offset_;            // offset -> length
  std::set<std::pair<uint64_t, uint64_t>> by_size_;   // (length, offset)
};

}  // namespace tierkv::master
