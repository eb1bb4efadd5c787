#include "master/allocator.h"

#include "absl/strings/str_cat.h"

namespace tierkv::master {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity & ~(alignment - 1)), alignment_(alignment), free_bytes_(0) {
  if (capacity_ > 0) InsertFree(0, capacity_);
}

uint64_t ExtentAllocator::Rounded(uint64_t length) const {
  if (length == 0) length = 1;
  if (length > UINT64_MAX - alignment_) return UINT64_MAX;
  return (length + alignment_ - 1) & ~(alignment_ - 1);
}

void ExtentAllocator::InsertFree(uint64_t offset, uint64_t length) {
  by_offset_.emplace(offset, length);
  by_size_.emplace(length, offset);
  free_bytes_ += length;
}

void ExtentAllocator::EraseFree(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

std::optional<uint64_t> ExtentAllocator::Allocate(uint64_t length) {
  uint64_t need = Rounded(length);
  if (need > free_bytes_) return std::nullopt;
  auto fit = by_size_.lower_bound({need, 0});
  if (fit == by_size_.end()) return std::nullopt;
  auto [hole, offset] = *fit;
  EraseFree(by_offset_.find(offset));
  // Allocate from the hole's start so the remainder stays one extent.
  if (hole > need) InsertFree(offset + need, hole - need);
  return offset;
}

absl::Status ExtentAllocator::Free(uint64_t offset, uint64_t length) {
  uint64_t len = Rounded(length);
  if (offset % alignment_ != 0 || offset > capacity_ || len > capacity_ - offset) {
    return absl::FailedPreconditionError(
        absl::StrCat("free of [", offset, ", +", len, ") outside the segment"));
  }
  // Refuse a free that overlaps free space: it would corrupt the lists.
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first < offset + len) {
    return absl::FailedPreconditionError(absl::StrCat("double free at ", offset));
  }
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > offset) {
      return absl::FailedPreconditionError(absl::StrCat("double free at ", offset));
    }
  }
  uint64_t start = offset, end = offset + len;
  if (next != by_offset_.end() && next->first == end) {
    end += next->second;
    EraseFree(next);
  }
  auto after = by_offset_.lower_bound(start);
  if (after != by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == start) {
      start = prev->first;
      EraseFree(prev);
    }
  }
  InsertFree(start, end - start);
  return absl::OkStatus();
}

absl::Status ExtentAllocator::Reserve(uint64_t offset, uint64_t length) {
  uint64_t len = Rounded(length);
  if (offset % alignment_ != 0 || offset > capacity_ || len > capacity_ - offset) {
    return absl::FailedPreconditionError(
        absl::StrCat("extent [", offset, ", +", len, ") outside the segment"));
  }
  auto it = by_offset_.upper_bound(offset);
  if (it == by_offset_.begin()) {
    return absl::FailedPreconditionError(absl::StrCat("extent at ", offset, " overlaps another"));
  }
  --it;
  auto [hole_start, hole_len] = *it;
  if (hole_start + hole_len < offset + len) {
    return absl::FailedPreconditionError(absl::StrCat("extent at ", offset, " overlaps another"));
  }
  EraseFree(it);
  if (offset > hole_start) InsertFree(hole_start, offset - hole_start);
  uint64_t tail = hole_start + hole_len - (offset + len);
  if (tail > 0) InsertFree(offset + len, tail);
  return absl::OkStatus();
}

uint64_t ExtentAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

}  // namespace tierkv::master
