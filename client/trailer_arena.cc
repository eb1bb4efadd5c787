#include "client/internal/trailer_arena.h"

#include <algorithm>
#include <utility>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "base/log.h"

namespace tierkv::client::internal {

namespace {
constexpr uint32_t kMagicV1 = 0x3156'4b54;  // "TKV1"
constexpr uint32_t kMagicV2 = 0x3256'4b54;  // "TKV2"
}  // namespace

uint32_t KeyCrc(absl::string_view key) { return Crc32c(key.data(), key.size()); }

void EncodeTrailer(uint32_t crc, uint64_t put_id, char* t) {
  std::memcpy(t, &crc, 4);
  std::memcpy(t + 4, &kMagicV2, 4);
  std::memcpy(t + 8, &put_id, 8);
}

absl::Status CheckTrailer(const char* t, uint64_t put_id, const std::string& key,
                          absl::Span<const absl::Span<char>> value, bool verify, const transport::CopyCrc& copied) {
  uint32_t crc, magic;
  std::memcpy(&crc, t, 4);
  std::memcpy(&magic, t + 4, 4);
  if (put_id == 0) {
    if (magic != kMagicV1) return absl::DataLossError(absl::StrCat(key, ": value trailer is corrupt"));
  } else {
    uint64_t wrote = 0;
    std::memcpy(&wrote, t + 8, 8);
    if (magic != kMagicV2 || wrote != put_id) {
      return absl::NotFoundError(absl::StrCat(key, ": its extent holds the bytes of another put (",
                                              magic != kMagicV2 ? "no trailer of a put" : "put id does not match",
                                              "); read as a miss"));
    }
  }
  if (!verify) return absl::OkStatus();
  uint32_t got;
  if (copied.set && value.size() == 1) {
    got = copied.value;
  } else {
    got = put_id != 0 ? KeyCrc(key) : 0;
    for (absl::Span<char> p : value) got = Crc32cExtend(got, p.data(), p.size());
  }
  if (crc != got) return absl::DataLossError(absl::StrCat(key, ": checksum mismatch"));
  return absl::OkStatus();
}

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
