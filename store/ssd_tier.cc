#include "store/ssd_tier.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "config/base/crc32c.h"
#include "config/base/failpoint.h"
#include "config/base/log.h"
#include "config/base/status.h"

namespace tierkv::store {
namespace {

constexpr uint32_t kMagic = 0x52564b54;  // "TKVR"
constexpr uint16_t kVersion = 1;
constexpr uint16_t kLive = 1;
constexpr uint16_t kDead = 2;
// Regions scanned at once: bounds the scan's buffers (4 KiB each) and
// its submission size.
constexpr size_t kScanWave = 256;

struct RecordHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t flags;
  uint64_t seq;
  uint64_t nonce;
  uint64_t record_len;
  uint64_t value_len;
  uint32_t key_len;
  uint32_t value_crc;
  uint32_t header_crc;  // CRC32C of this header (header_crc = 0), then the key
  uint8_t reserved[12];
};
static_assert(sizeof(RecordHeader) == 64);

uint32_t HeaderCrc(RecordHeader h, const char* key) {
  h.header_crc = 0;
  return Crc32cExtend(Crc32c(&h, sizeof h), key, h.key_len);
}

// Writes header and key at `block` (at least kIoAlign bytes).
void EncodeHeader(char* block, uint16_t flags, uint64_t seq, uint64_t nonce, uint64_t record_len,
                  const std::string& key, uint64_t value_len, uint32_t value_crc) {
  RecordHeader h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.flags = flags;
  h.seq = seq;
  h.nonce = nonce;
  h.record_len = record_len;
  h.value_len = value_len;
  h.key_len = static_cast<uint32_t>(key.size());
  h.value_crc = value_crc;
  std::memcpy(block + sizeof h, key.data(), key.size());
  h.header_crc = HeaderCrc(h, key.data());
  std::memcpy(block, &h, sizeof h);
}

enum class HeaderCheck { kOk, kNoRecord, kTorn };

// Checks the header at `block` (kIoAlign bytes) for a record that must fit
// in `room` bytes.
HeaderCheck DecodeHeader(const char* block, uint64_t room, RecordHeader* h) {
  std::memcpy(h, block, sizeof *h);
  if (h->magic != kMagic) return HeaderCheck::kNoRecord;
  if (h->version != kVersion || h->key_len > kSsdMaxKey || (h->flags != kLive && h->flags != kDead) ||
      h->record_len % kIoAlign != 0 || h->record_len < AlignUp(sizeof *h + h->key_len + h->value_len) ||
      h->record_len > room || HeaderCrc(*h, block + sizeof *h) != h->header_crc) {
    return HeaderCheck::kTorn;
  }
  return HeaderCheck::kOk;
}

std::string ErrnoName(int64_t result) {
  return result < 0 ? std::string(strerror(static_cast<int>(-result))) : absl::StrCat("short transfer (", result, " bytes)");
}

}  // namespace

SsdTier::SsdTier(std::unique_ptr<FileIo> file, SsdTierOptions options)
    : file_(std::move(file)),
      options_(std::move(options)),
      num_regions_(static_cast<uint32_t>(file_->size() / options_.region_size)) {}

SsdTier::~SsdTier() = default;

absl::StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(std::unique_ptr<FileIo> file, SsdTierOptions options) {
  if (file == nullptr) return absl::InvalidArgumentError("no file");
  if (options.region_size < kIoAlign || options.region_size % kIoAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat("region size ", options.region_size, " is not a multiple of 4 KiB"));
  }
  if (file->size() / options.region_size < 2) {
    return absl::InvalidArgumentError(absl::StrCat("SSD size ", file->size(), " holds fewer than 2 regions of ",
                                                   options.region_size, " bytes"));
  }
  if (!(options.low_watermark > 0 && options.low_watermark <= options.high_watermark && options.high_watermark <= 1)) {
    return absl::InvalidArgumentError("SSD watermarks must satisfy 0 < low <= high <= 1");
  }
  std::unique_ptr<SsdTier> tier(new SsdTier(std::move(file), std::move(options)));
  RETURN_IF_ERROR(tier->Scan());
  return tier;
}

absl::Status SsdTier::Scan() {
  struct Cursor {
    uint32_t region = 0;
    uint64_t pos = 0;
    bool started = false;
  };
  std::vector<Region> regions(num_regions_);
  absl::flat_hash_map<std::string, Record> index;
  uint64_t torn = 0;
  uint64_t max_seq = 0;
  uint32_t next_region = 0;
  std::vector<Cursor> active;
  std::vector<AlignedBuffer> bufs;
  while (next_region < num_regions_ || !active.empty()) {
    while (active.size() < kScanWave && next_region < num_regions_) active.push_back({next_region++, 0, false});
    std::vector<IoOp> ops(active.size());
    if (bufs.size() < active.size()) bufs.resize(active.size());
    for (size_t i = 0; i < active.size(); ++i) {
      if (bufs[i].data() == nullptr) bufs[i] = AlignedBuffer(kIoAlign);
      ops[i] = {IoOp::kRead, uint64_t{active[i].region} * options_.region_size + active[i].pos, bufs[i].data(), kIoAlign};
    }
    RETURN_IF_ERROR(RunBatch(absl::MakeSpan(ops), "store.ssd.scan", EIO, "scan"));
    if (failed()) {
      MutexLock lock(&mu_);
      return FailedStatus();
    }
    std::vector<Cursor> next;
    for (size_t i = 0; i < active.size(); ++i) {
      Cursor c = active[i];
      Region& r = regions[c.region];
      RecordHeader h;
      HeaderCheck check = DecodeHeader(bufs[i].data(), options_.region_size - c.pos, &h);
      bool more = false;
      if (check == HeaderCheck::kTorn) {
        ++torn;
      } else if (check == HeaderCheck::kOk && (!c.started || h.nonce == r.nonce)) {
        if (!c.started) {
          r.seq = h.seq;
          r.nonce = h.nonce;
          c.started = true;
        }
        max_seq = std::max(max_seq, h.seq);
        if (h.flags == kLive) {
          std::string key(bufs[i].data() + sizeof h, h.key_len);
          Record rec{c.region, uint64_t{c.region} * options_.region_size + c.pos, h.record_len, h.value_len};
          auto [it, inserted] = index.try_emplace(key, rec);
          // The same key in two regions: the newer record wins.
          if (!inserted && regions[it->second.region].seq < r.seq) it->second = rec;
          r.keys.push_back(std::move(key));
        }
        c.pos += h.record_len;
        more = c.pos + kIoAlign <= options_.region_size;
      }
      if (more) {
        next.push_back(c);
      } else {
        r.write_ptr = c.pos;
      }
    }
    active = std::move(next);
  }
  MutexLock lock(&mu_);
  regions_ = std::move(regions);
  index_ = std::move(index);
  for (uint32_t i = 0; i < num_regions_; ++i) {
    if (regions_[i].seq == 0) {
      free_.push_back(i);
    } else {
      ++in_use_;
    }
  }
  for (const auto& [key, rec] : index_) stats_.used += rec.value_len;
  next_seq_ = max_seq + 1;
  stats_.recovered = index_.size();
  stats_.torn = torn;
  if (torn > 0) TKV_LOG(WARNING) << "SSD tier: skipped " << torn << " torn record(s)";
  return absl::OkStatus();
}

absl::Status SsdTier::RunBatch(absl::Span<IoOp> ops, const char* failpoint, int fail_errno, const char* what) {
  if (ops.empty()) return absl::OkStatus();
  absl::Time start = absl::Now();
  int inject = 0;
  if (TIERKV_FAILPOINT(failpoint)) inject = fail_errno;
  if (inject == 0 && std::strcmp(failpoint, "store.ssd.write") == 0 && TIERKV_FAILPOINT("store.ssd.write_full")) {
    inject = ENOSPC;
  }
  if (inject != 0) {
    for (IoOp& op : ops) op.result = -inject;
  } else if (absl::Status s = file_->Run(ops); !s.ok()) {
    Fail(absl::StrCat(what, ": ", s.message()));
    return absl::OkStatus();
  }
  absl::Duration took = absl::Now() - start;
  for (const IoOp& op : ops) {
    if (op.result != static_cast<int64_t>(op.len)) {
      Fail(absl::StrCat(what, " at offset ", op.offset, ": ", ErrnoName(op.result)));
      return absl::OkStatus();
    }
  }
  if (took > options_.slow_io) {
    Fail(absl::StrCat(what, ": a batch of ", ops.size(), " took ", absl::FormatDuration(took), " (over ",
                      absl::FormatDuration(options_.slow_io), ")"));
  }
  return absl::OkStatus();
}

void SsdTier::Fail(const std::string& why) {
  MutexLock lock(&mu_);
  if (stats_.failed) return;
  stats_.failed = true;
  stats_.failure = why;
  TKV_LOG(ERROR) << "SSD tier failed: " << why << "; serving DRAM only";
}

absl::Status SsdTier::FailedStatus() const {
  return absl::UnavailableError(absl::StrCat("SSD tier failed: ", stats_.failure));
}

bool SsdTier::failed() const {
  MutexLock lock(&mu_);
  return stats_.failed;
}

bool SsdTier::ReclaimOldest(std::vector<std::string>* dropped) {
  int64_t oldest = -1;
  for (uint32_t i = 0; i < num_regions_; ++i) {
    const Region& r = regions_[i];
    if (r.seq == 0 || r.pins > 0 || i == open_region_) continue;
    if (oldest < 0 || r.seq < regions_[oldest].seq) oldest = i;
  }
  if (oldest < 0) return false;
  Region& r = regions_[oldest];
  for (std::string& key : r.keys) {
    auto it = index_.find(key);
    if (it == index_.end() || it->second.region != static_cast<uint32_t>(oldest)) continue;
    stats_.used -= it->second.value_len;
    index_.erase(it);
    ++stats_.reclaimed;
    dropped->push_back(std::move(key));
  }
  r = Region{};
  free_.push_back(static_cast<uint32_t>(oldest));
  --in_use_;
  return true;
}

void SsdTier::MaybeReclaim(std::vector<std::string>* dropped) {
  if (static_cast<double>(in_use_) <= options_.high_watermark * num_regions_) return;
  while (static_cast<double>(in_use_) > options_.low_watermark * num_regions_ && ReclaimOldest(dropped)) {
  }
}

absl::StatusOr<std::pair<uint32_t, uint64_t>> SsdTier::Allocate(uint64_t len, std::vector<std::string>* dropped) {
  if (open_region_ >= 0) {
    Region& r = regions_[open_region_];
    if (r.write_ptr + len <= options_.region_size) {
      uint64_t at = r.write_ptr;
      r.write_ptr += len;
      ++r.pins;
      return std::make_pair(static_cast<uint32_t>(open_region_), at);
    }
    open_region_ = -1;
  }
  if (free_.empty() && !ReclaimOldest(dropped)) {
    return absl::ResourceExhaustedError("SSD tier: every region has I/O in flight");
  }
  uint32_t id = free_.front();
  free_.pop_front();
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  Region& r = regions_[id];
  r = Region{};
  r.seq = next_seq_++;
  r.nonce = rng() | 1;
  r.write_ptr = len;
  r.pins = 1;
  ++in_use_;
  open_region_ = id;
  return std::make_pair(id, uint64_t{0});
}

void SsdTier::DropLocked(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  stats_.used -= it->second.value_len;
  index_.erase(it);
}

void SsdTier::Notify(const std::vector<std::string>& dropped) {
  if (!options_.on_drop) return;
  for (const std::string& key : dropped) options_.on_drop(key);
}

std::vector<absl::Status> SsdTier::WriteBatch(absl::Span<const SsdWrite> items) {
  std::vector<absl::Status> out(items.size());
  struct Pending {
    size_t item;
    uint32_t region;
    uint64_t offset;
    uint64_t record_len;
    AlignedBuffer buf;
  };
  std::vector<Pending> pending;
  std::vector<std::string> dropped;
  {
    MutexLock lock(&mu_);
    if (stats_.failed) return std::vector<absl::Status>(items.size(), FailedStatus());
    for (size_t i = 0; i < items.size(); ++i) {
      const SsdWrite& w = items[i];
      uint64_t len = AlignUp(sizeof(RecordHeader) + w.key.size() + w.size);
      if (w.key.empty() || w.key.size() > kSsdMaxKey || len > options_.region_size) {
        out[i] = absl::InvalidArgumentError(absl::StrCat("SSD tier: key of ", w.key.size(), " bytes and value of ",
                                                         w.size, " bytes do not fit a record"));
        continue;
      }
      if (index_.contains(w.key) || !writing_.insert(w.key).second) {
        out[i] = absl::AlreadyExistsError("on SSD already");
        continue;
      }
      absl::StatusOr<std::pair<uint32_t, uint64_t>> at = Allocate(len, &dropped);
      if (!at.ok()) {
        writing_.erase(w.key);
        out[i] = at.status();
        continue;
      }
      const Region& r = regions_[at->first];
      AlignedBuffer buf(len, /*zero=*/false);
      size_t body = sizeof(RecordHeader) + w.key.size() + w.size;
      std::memcpy(buf.data() + sizeof(RecordHeader) + w.key.size(), w.data, w.size);
      std::memset(buf.data() + body, 0, len - body);
      EncodeHeader(buf.data(), kLive, r.seq, r.nonce, len, w.key, w.size, Crc32c(w.data, w.size));
      pending.push_back({i, at->first, uint64_t{at->first} * options_.region_size + at->second, len, std::move(buf)});
    }
  }
  Notify(dropped);
  dropped.clear();
  std::vector<IoOp> ops(pending.size());
  for (size_t i = 0; i < pending.size(); ++i) {
    ops[i] = {IoOp::kWrite, pending[i].offset, pending[i].buf.data(), pending[i].record_len};
  }
  absl::Status run = RunBatch(absl::MakeSpan(ops), "store.ssd.write", EIO, "write");
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      --regions_[p.region].pins;
      writing_.erase(items[p.item].key);
      if (!run.ok() || stats_.failed) {
        out[p.item] = run.ok() ? FailedStatus() : run;
        continue;
      }
      const SsdWrite& w = items[p.item];
      index_.try_emplace(w.key, Record{p.region, p.offset, p.record_len, w.size});
      regions_[p.region].keys.push_back(w.key);
      stats_.used += w.size;
      stats_.bytes_written += w.size;
    }
    MaybeReclaim(&dropped);
  }
  Notify(dropped);
  return out;
}

std::vector<absl::StatusOr<uint64_t>> SsdTier::ReadBatch(absl::Span<const SsdRead> items) {
  std::vector<absl::StatusOr<uint64_t>> out(items.size(), absl::NotFoundError("not on SSD"));
  struct Pending {
    size_t item;
    Record rec;
    uint64_t nonce;
    AlignedBuffer buf;
  };
  std::vector<Pending> pending;
  {
    MutexLock lock(&mu_);
    if (stats_.failed) return std::vector<absl::StatusOr<uint64_t>>(items.size(), FailedStatus());
    for (size_t i = 0; i < items.size(); ++i) {
      auto it = index_.find(items[i].key);
      if (it == index_.end()) continue;
      if (it->second.value_len > items[i].capacity) {
        out[i] = absl::OutOfRangeError(absl::StrCat("value of ", it->second.value_len, " bytes; room for ",
                                                    items[i].capacity));
        continue;
      }
      Region& r = regions_[it->second.region];
      ++r.pins;
      pending.push_back({i, it->second, r.nonce, AlignedBuffer(it->second.record_len, /*zero=*/false)});
    }
  }
  std::vector<IoOp> ops(pending.size());
  for (size_t i = 0; i < pending.size(); ++i) {
    ops[i] = {IoOp::kRead, pending[i].rec.offset, pending[i].buf.data(), pending[i].rec.record_len};
  }
  absl::Status run = RunBatch(absl::MakeSpan(ops), "store.ssd.read", EIO, "read");
  std::vector<std::string> dropped;
  {
  MutexLock lock(&mu_);
  for (Pending& p : pending) {
    --regions_[p.rec.region].pins;
    const SsdRead& rd = items[p.item];
    if (!run.ok() || stats_.failed) {
      out[p.item] = run.ok() ? FailedStatus() : run;
      continue;
    }
    RecordHeader h;
    const char* block = p.buf.data();
    HeaderCheck check = DecodeHeader(block, p.rec.record_len, &h);
    bool good = check == HeaderCheck::kOk && h.nonce == p.nonce && h.record_len == p.rec.record_len &&
                h.value_len == p.rec.value_len && h.key_len == rd.key.size() &&
                std::memcmp(block + sizeof h, rd.key.data(), rd.key.size()) == 0;
    if (good && h.flags == kDead) {
      out[p.item] = absl::NotFoundError("erased while being read");
      continue;
    }
    const char* value = block + sizeof h + h.key_len;
    if (!good || Crc32c(value, h.value_len) != h.value_crc) {
      ++stats_.corrupt;
      auto it = index_.find(rd.key);
      if (it != index_.end() && it->second.offset == p.rec.offset) {
        DropLocked(rd.key);
        dropped.push_back(rd.key);
      }
      out[p.item] = absl::DataLossError("SSD record failed its checksum; dropped");
      continue;
    }
    if (std::chrono::steady_clock::now() > rd.deadline) {
      out[p.item] = absl::DeadlineExceededError("SSD read finished after its reader's deadline");
      continue;
    }
    std::memcpy(rd.dst, value, h.value_len);
    stats_.bytes_read += h.value_len;
    out[p.item] = h.value_len;
  }
  }
  Notify(dropped);
  return out;
}

absl::Status SsdTier::Erase(const std::string& key) {
  Record rec;
  uint64_t seq, nonce;
  {
    MutexLock lock(&mu_);
    if (stats_.failed) return FailedStatus();
    auto it = index_.find(key);
    if (it == index_.end()) return absl::NotFoundError("not on SSD");
    rec = it->second;
    DropLocked(key);
    Region& r = regions_[rec.region];
    seq = r.seq;
    nonce = r.nonce;
    ++r.pins;
  }
  // The dead header keeps the record's length, so a scan still steps over it.
  AlignedBuffer block(kIoAlign);
  EncodeHeader(block.data(), kDead, seq, nonce, rec.record_len, key, rec.value_len, 0);
  IoOp op{IoOp::kWrite, rec.offset, block.data(), kIoAlign};
  absl::Status run = RunBatch(absl::MakeSpan(&op, 1), "store.ssd.write", EIO, "erase");
  MutexLock lock(&mu_);
  --regions_[rec.region].pins;
  if (!run.ok()) return run;
  if (stats_.failed) return FailedStatus();
  return absl::OkStatus();
}

std::optional<uint64_t> SsdTier::SizeOf(const std::string& key) const {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  return it->second.value_len;
}

std::vector<std::pair<std::string, uint64_t>> SsdTier::Records() const {
  MutexLock lock(&mu_);
  std::vector<std::pair<std::string, uint64_t>> out;
  out.reserve(index_.size());
  for (const auto& [key, rec] : index_) out.emplace_back(key, rec.value_len);
  return out;
}

SsdStats SsdTier::Stats() const {
  MutexLock lock(&mu_);
  SsdStats s = stats_;
  s.capacity = uint64_t{num_regions_} * options_.region_size;
  s.regions = num_regions_;
  s.regions_in_use = in_use_;
  s.records = index_.size();
  s.submissions = file_->submissions();
  s.direct = file_->direct();
  return s;
}

}  // namespace tierkv::store
