// The serving side's place in a vectored frame's ranges (WRITEV, READV;
// wire.h): the frame's data moves a piece at a time, as bytes arrive or
// the socket takes them, and the cursor says which range a piece belongs
// to and how far into it.
//
// Every piece resolves its ranges again (a frame may wait parked while
// memory is unregistered): a run of ranges that lies in one registered
// buffer under one pin, otherwise a range at a time. A pin holds a shared
// lock, so the cursor never holds two at once.
//
//   cursor.Start(served, segment, segment_id, std::move(ranges));
//   RETURN_IF_ERROR(cursor.CheckAll());            // before any byte moves
//   n = recvmsg(fd, cursor.PinRun(...) iovecs);   // or Copy() via a buffer
//   cursor.Skip(n);
//
// Not thread-safe: it belongs to one connection's frame in progress.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "transport/backend.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {

class RangeCursor {
 public:
  // At most this many ranges are pinned (and iovecs filled) per run.
  static constexpr size_t kMaxRun = 64;

  // Takes a frame's ranges in segment (index, id) of `served`, the cursor
  // at the start of the first.
  void Start(ServedMemory* served, uint32_t segment, uint64_t segment_id, std::vector<WireRange> ranges) {
    served_ = served;
    segment_ = segment;
    segment_id_ = segment_id;
    ranges_ = std::move(ranges);
    at_ = 0;
    done_ = 0;
    Skip(0);
  }
  void Clear() { Start(nullptr, 0, 0, {}); }

  // OK when every range resolves, checked overflow-safe; otherwise the
  // first failing range's status, naming it. One lookup of the span of all
  // of them answers where they share a buffer (a P/D pool's entries do).
  absl::Status CheckAll() const {
    uint64_t lo = UINT64_MAX, hi = 0;
    bool spans = !ranges_.empty();
    for (const WireRange& r : ranges_) {
      if (r.length > UINT64_MAX - r.offset) {
        spans = false;
        break;
      }
      lo = std::min(lo, r.offset);
      hi = std::max(hi, r.offset + r.length);
    }
    if (spans && Resolve(lo, hi - lo).ok()) return absl::OkStatus();
    for (size_t i = 0; i < ranges_.size(); ++i) {
      absl::StatusOr<ServedMemory::Pin> pin = Resolve(ranges_[i].offset, ranges_[i].length);
      if (!pin.ok()) {
        return absl::Status(pin.status().code(),
                            absl::StrCat("range ", i, " of ", ranges_.size(), ": ", pin.status().message()));
      }
    }
    return absl::OkStatus();
  }

  // The rest of the next ranges (at most `max`, up to kMaxRun) as iovecs
  // into served memory, under one pin put in *pin; 0 when they do not lie
  // in one buffer (then nothing is pinned) or none are left. CheckAll
  // must have passed: the ranges do not overflow.
  size_t PinRun(size_t max, std::optional<ServedMemory::Pin>* pin, iovec* iov) const {
    max = std::min(max, kMaxRun);
    size_t count = 0;
    uint64_t lo = UINT64_MAX, hi = 0;
    for (size_t i = at_; i < ranges_.size() && count < max; ++i) {
      if (ranges_[i].length == 0) continue;
      ++count;
      lo = std::min(lo, ranges_[i].offset);
      hi = std::max(hi, ranges_[i].offset + ranges_[i].length);
    }
    if (count == 0) return 0;
    absl::StatusOr<ServedMemory::Pin> span = Resolve(lo, hi - lo);
    if (!span.ok()) return 0;
    size_t k = 0;
    for (size_t i = at_; k < count; ++i) {
      const WireRange& r = ranges_[i];
      const uint64_t from = i == at_ ? done_ : 0;
      if (r.length == 0) continue;
      iov[k++] = {span->addr + (r.offset + from - lo), r.length - from};
    }
    *pin = *std::move(span);
    return count;
  }

  // Moves the cursor `n` bytes on, and past any empty range after them.
  void Skip(uint64_t n) {
    while (at_ < ranges_.size()) {
      const uint64_t part = std::min(ranges_[at_].length - done_, n);
      n -= part;
      done_ += part;
      if (done_ < ranges_[at_].length) return;
      ++at_;
      done_ = 0;
    }
  }

  // Copies `n` bytes between `buf` and the ranges from the cursor on (into
  // served memory when `into_memory`) and moves past them; the status of
  // a range that no longer resolves (unregistered meanwhile), INTERNAL for
  // bytes beyond the last range.
  absl::Status Copy(char* buf, uint64_t n, bool into_memory) {
    while (n > 0) {
      if (at_ == ranges_.size()) return absl::InternalError("vectored frame: bytes beyond its ranges");
      std::optional<ServedMemory::Pin> pin;
      iovec iov[kMaxRun];
      size_t count = PinRun(kMaxRun, &pin, iov);
      if (count == 0) {
        // Ranges in different buffers: the current one alone.
        const uint64_t part = std::min(ranges_[at_].length - done_, n);
        absl::StatusOr<ServedMemory::Pin> one = Resolve(ranges_[at_].offset + done_, part);
        if (!one.ok()) return one.status();
        iov[0] = {one->addr, part};
        count = 1;
        pin = *std::move(one);
      }
      uint64_t moved = 0;
      for (size_t k = 0; k < count && moved < n; ++k) {
        const uint64_t part = std::min<uint64_t>(iov[k].iov_len, n - moved);
        if (into_memory) {
          std::memcpy(iov[k].iov_base, buf + moved, part);
        } else {
          std::memcpy(buf + moved, iov[k].iov_base, part);
        }
        moved += part;
      }
      pin.reset();
      Skip(moved);
      buf += moved;
      n -= moved;
    }
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<ServedMemory::Pin> Resolve(uint64_t offset, uint64_t length) const {
    return served_->Resolve(segment_, segment_id_, offset, length);
  }

  ServedMemory* served_ = nullptr;
  uint32_t segment_ = 0;
  uint64_t segment_id_ = 0;
  std::vector<WireRange> ranges_;
  size_t at_ = 0;      // the range the next byte belongs to
  uint64_t done_ = 0;  // bytes of it already moved
};

}  // namespace tierkv::transport::tcp
