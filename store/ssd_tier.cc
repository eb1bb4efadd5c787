#include "store/ssd_tier.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "base/failpoint.h"
#include "base/log.h"
#include "base/status.h"

namespace tierkv::store {
namespace {

constexpr uint32_t kMagic = 0x47564b54;  // "TKVG": a group block
constexpr uint16_t kVersion = 2;
constexpr uint16_t kLive = 1;
constexpr uint16_t kDead = 2;
// Regions scanned at once: bounds the scan's buffers (4 KiB each) and
// its submission size.
constexpr size_t kScanWave = 256;
// A value this large from 4 KiB-aligned memory is written without a copy
// (it starts on a 4 KiB boundary, so up to 4 KiB of padding: under 1/8).
constexpr uint64_t kDirectMin = 32 << 10;

struct GroupHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t count;       // entries that follow
  uint64_t seq;
  uint64_t nonce;
  uint64_t group_len;   // the group's bytes on disk, this block included
  uint32_t used;        // bytes of the block in use: this header and the entries
  uint32_t header_crc;  // CRC32C of those bytes, header_crc = 0
  uint8_t reserved[24];
};
static_assert(sizeof(GroupHeader) == 64);

struct EntryHeader {
  uint64_t value_offset;  // from the group's start
  uint64_t value_len;
  uint32_t value_crc;     // CRC32C of key then value
  uint16_t key_len;
  uint16_t flags;
};
static_assert(sizeof(EntryHeader) == 24);
static_assert(sizeof(GroupHeader) + sizeof(EntryHeader) + kSsdMaxKey == io::kIoAlign);

// An entry and its key, padded to 8 bytes.
uint32_t EntrySize(size_t key_len) { return static_cast<uint32_t>((sizeof(EntryHeader) + key_len + 7) / 8 * 8); }

uint32_t ValueCrc(const std::string& key, const void* value, uint64_t len) {
  return Crc32cExtend(Crc32c(key.data(), key.size()), value, len);
}

uint32_t BlockCrc(const char* block, uint32_t used) {
  GroupHeader g;
  std::memcpy(&g, block, sizeof g);
  g.header_crc = 0;
  return Crc32cExtend(Crc32c(&g, sizeof g), block + sizeof g, used - sizeof g);
}

// Seals a group block whose entries are in place: writes its header.
void SealBlock(char* block, uint16_t count, uint64_t seq, uint64_t nonce, uint64_t group_len, uint32_t used) {
  GroupHeader g{};
  g.magic = kMagic;
  g.version = kVersion;
  g.count = count;
  g.seq = seq;
  g.nonce = nonce;
  g.group_len = group_len;
  g.used = used;
  std::memcpy(block, &g, sizeof g);
  g.header_crc = BlockCrc(block, used);
  std::memcpy(block, &g, sizeof g);
}

struct Entry {
  EntryHeader h;
  std::string_view key;
  uint32_t at;  // offset in the block
};

enum class HeaderCheck { kOk, kNoRecord, kTorn };

// Checks the group block at `block` (io::kIoAlign bytes) for a group that must
// fit in `room` bytes, and lists its entries.
HeaderCheck DecodeBlock(const char* block, uint64_t room, GroupHeader* g, std::vector<Entry>* entries) {
  std::memcpy(g, block, sizeof *g);
  if (g->magic != kMagic) return HeaderCheck::kNoRecord;
  if (g->version != kVersion || g->used < sizeof *g || g->used > io::kIoAlign || g->group_len < io::kIoAlign ||
      g->group_len % io::kIoAlign != 0 || g->group_len > room || BlockCrc(block, g->used) != g->header_crc) {
    return HeaderCheck::kTorn;
  }
  entries->clear();
  uint32_t at = sizeof *g;
  for (uint16_t i = 0; i < g->count; ++i) {
    Entry e;
    if (at + sizeof e.h > g->used) return HeaderCheck::kTorn;
    std::memcpy(&e.h, block + at, sizeof e.h);
    if (e.h.key_len == 0 || e.h.key_len > kSsdMaxKey || at + EntrySize(e.h.key_len) > g->used ||
        (e.h.flags != kLive && e.h.flags != kDead) || e.h.value_offset < g->used ||
        e.h.value_offset > g->group_len || e.h.value_len > g->group_len - e.h.value_offset) {
      return HeaderCheck::kTorn;
    }
    e.key = std::string_view(block + at + sizeof e.h, e.h.key_len);
    e.at = at;
    entries->push_back(e);
    at += EntrySize(e.h.key_len);
  }
  return HeaderCheck::kOk;
}

std::string ErrnoName(int64_t result) {
  return result < 0 ? std::string(strerror(static_cast<int>(-result))) : absl::StrCat("short transfer (", result, " bytes)");
}

}  // namespace

SsdTier::SsdTier(std::unique_ptr<io::FileIo> file, SsdTierOptions options)
    : file_(std::move(file)),
      options_(std::move(options)),
      num_regions_(static_cast<uint32_t>(file_->size() / options_.region_size)) {}

SsdTier::~SsdTier() = default;

absl::StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(std::unique_ptr<io::FileIo> file, SsdTierOptions options) {
  if (file == nullptr) return absl::InvalidArgumentError("no file");
  if (options.region_size < io::kIoAlign || options.region_size % io::kIoAlign != 0) {
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
  std::vector<io::AlignedBuffer> bufs;
  while (next_region < num_regions_ || !active.empty()) {
    while (active.size() < kScanWave && next_region < num_regions_) active.push_back({next_region++, 0, false});
    std::vector<io::IoOp> ops(active.size());
    if (bufs.size() < active.size()) bufs.resize(active.size());
    for (size_t i = 0; i < active.size(); ++i) {
      if (bufs[i].data() == nullptr) bufs[i] = io::AlignedBuffer(io::kIoAlign);
      ops[i] = {io::IoOp::kRead, uint64_t{active[i].region} * options_.region_size + active[i].pos, bufs[i].data(), io::kIoAlign};
    }
    RETURN_IF_ERROR(RunBatch(absl::MakeSpan(ops), "store.ssd.scan", EIO, "scan"));
    if (failed()) {
      MutexLock lock(&mu_);
      return FailedStatus();
    }
    std::vector<Cursor> next;
    std::vector<Entry> entries;
    for (size_t i = 0; i < active.size(); ++i) {
      Cursor c = active[i];
      Region& r = regions[c.region];
      GroupHeader g;
      HeaderCheck check = DecodeBlock(bufs[i].data(), options_.region_size - c.pos, &g, &entries);
      bool more = false;
      if (check == HeaderCheck::kTorn) {
        ++torn;
      } else if (check == HeaderCheck::kOk && (!c.started || g.nonce == r.nonce)) {
        if (!c.started) {
          r.seq = g.seq;
          r.nonce = g.nonce;
          c.started = true;
        }
        max_seq = std::max(max_seq, g.seq);
        uint64_t base = uint64_t{c.region} * options_.region_size + c.pos;
        for (const Entry& e : entries) {
          if (e.h.flags != kLive) continue;
          std::string key(e.key);
          Record rec{c.region, base + e.h.value_offset, e.h.value_len, e.h.value_crc, base, e.at};
          auto [it, inserted] = index.try_emplace(key, rec);
          // The same key in two regions: the newer record wins.
          if (!inserted && regions[it->second.region].seq < r.seq) it->second = rec;
          r.keys.push_back(std::move(key));
        }
        c.pos += g.group_len;
        more = c.pos + io::kIoAlign <= options_.region_size;
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
  FindOldest();
  stats_.recovered = index_.size();
  stats_.torn = torn;
  if (torn > 0) TKV_LOG(WARNING) << "SSD tier: skipped " << torn << " torn record(s)";
  return absl::OkStatus();
}

absl::Status SsdTier::RunBatch(absl::Span<io::IoOp> ops, const char* failpoint, int fail_errno, const char* what) {
  if (ops.empty()) return absl::OkStatus();
  absl::Time start = absl::Now();
  int inject = 0;
  if (TIERKV_FAILPOINT(failpoint)) inject = fail_errno;
  if (inject == 0 && std::strcmp(failpoint, "store.ssd.write") == 0 && TIERKV_FAILPOINT("store.ssd.write_full")) {
    inject = ENOSPC;
  }
  if (inject != 0) {
    for (io::IoOp& op : ops) op.result = -inject;
  } else if (absl::Status s = file_->Run(ops); !s.ok()) {
    Fail(absl::StrCat(what, ": ", s.message()));
    return absl::OkStatus();
  }
  absl::Duration took = absl::Now() - start;
  for (const io::IoOp& op : ops) {
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
  FindOldest();
  return true;
}

void SsdTier::FindOldest() {
  oldest_seq_ = 0;
  for (const Region& r : regions_) {
    if (r.seq != 0 && (oldest_seq_ == 0 || r.seq < oldest_seq_)) oldest_seq_ = r.seq;
  }
}

bool SsdTier::Aging(uint32_t region) const {
  const Region& r = regions_[region];
  return 2 * in_use_ > num_regions_ && static_cast<int64_t>(region) != open_region_ && r.seq != 0 &&
         r.seq - oldest_seq_ < (next_seq_ - oldest_seq_) / 2;
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
  if (in_use_++ == 0) oldest_seq_ = r.seq;
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
  // What one record of the batch writes: a caller's value or a kept read.
  struct Planned {
    const std::string* key;
    const char* data;
    uint64_t size;
    size_t item;          // in `items`; SIZE_MAX for a refresh
    size_t group;
    uint64_t at;          // the value's offset in its group
    bool direct;          // body written from `data`, not copied
    Record old;           // a refresh's record, to replace
  };
  struct Group {
    uint32_t region;
    uint64_t start;       // in the region
    uint64_t len;         // aligned
    uint32_t used;        // of its block
    uint64_t seq, nonce;
    uint16_t count;
    size_t first;         // its first record in `planned`
  };
  std::vector<Planned> planned;
  std::vector<Group> groups;
  std::vector<Refresh> refreshes;
  std::vector<std::string> dropped;
  {
    MutexLock lock(&mu_);
    if (stats_.failed) return std::vector<absl::Status>(items.size(), FailedStatus());
    // Values follow the block's entries (so they move as entries are
    // added): sets each record's offset from `g.first` to `end` and
    // returns the group's aligned length.
    auto layout = [&](const Group& g, uint32_t used, size_t end) {
      uint64_t pos = (used + 7) / 8 * 8;
      for (size_t p = g.first; p < end; ++p) {
        planned[p].at = planned[p].direct ? io::AlignUp(pos) : pos;
        pos = planned[p].at + planned[p].size;
      }
      return io::AlignUp(pos);
    };
    // Places a value in the open group, or opens a group for it.
    auto place = [&](const std::string& key, const char* data, uint64_t size) -> absl::Status {
      bool direct = size >= kDirectMin && reinterpret_cast<uintptr_t>(data) % io::kIoAlign == 0;
      planned.push_back({&key, data, size, 0, groups.size(), 0, direct, {}});
      if (!groups.empty()) {
        Group& g = groups.back();
        Region& r = regions_[g.region];
        uint32_t used = g.used + EntrySize(key.size());
        if (used <= io::kIoAlign && static_cast<int64_t>(g.region) == open_region_ && r.write_ptr == g.start + g.len) {
          uint64_t len = layout(g, used, planned.size());
          if (g.start + len <= options_.region_size) {
            planned.back().group = groups.size() - 1;
            r.write_ptr = g.start + len;
            g.len = len;
            g.used = used;
            ++g.count;
            return absl::OkStatus();
          }
          layout(g, g.used, planned.size() - 1);  // as it was
        }
      }
      Group g{0, 0, 0, static_cast<uint32_t>(sizeof(GroupHeader) + EntrySize(key.size())), 0, 0, 1, planned.size() - 1};
      uint64_t len = layout(g, g.used, planned.size());
      absl::StatusOr<std::pair<uint32_t, uint64_t>> where = Allocate(len, &dropped);
      if (!where.ok()) {
        planned.pop_back();
        return where.status();
      }
      const Region& r = regions_[where->first];
      g.region = where->first;
      g.start = where->second;
      g.len = len;
      g.seq = r.seq;
      g.nonce = r.nonce;
      groups.push_back(g);
      return absl::OkStatus();
    };
    // Kept reads first: their regions are pinned before anything is
    // reclaimed for this batch.
    refreshes = std::move(refresh_);
    refresh_.clear();
    refresh_bytes_ = 0;
    for (size_t i = 0; i < refreshes.size(); ++i) {
      Refresh& f = refreshes[i];
      auto it = index_.find(f.key);
      if (it == index_.end() || it->second.offset != f.old.offset) continue;
      it->second.refresh_queued = false;
      if (writing_.contains(f.key)) continue;
      ++regions_[f.old.region].pins;
      if (!place(f.key, f.buf.data() + f.skip, f.old.value_len).ok()) {
        --regions_[f.old.region].pins;
        continue;
      }
      writing_.insert(f.key);
      planned.back().item = SIZE_MAX;
      planned.back().old = f.old;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      const SsdWrite& w = items[i];
      if (w.key.empty() || w.key.size() > kSsdMaxKey || io::AlignUp(io::kIoAlign + w.size) > options_.region_size) {
        out[i] = absl::InvalidArgumentError(absl::StrCat("SSD tier: key of ", w.key.size(), " bytes and value of ",
                                                         w.size, " bytes do not fit a record"));
        continue;
      }
      if (index_.contains(w.key) || !writing_.insert(w.key).second) {
        out[i] = absl::AlreadyExistsError("on SSD already");
        continue;
      }
      if (absl::Status st = place(w.key, static_cast<const char*>(w.data), w.size); !st.ok()) {
        writing_.erase(w.key);
        out[i] = st;
        continue;
      }
      planned.back().item = i;
    }
  }
  Notify(dropped);
  dropped.clear();

  // Outside the lock: checksums, copies into each group's staging buffer
  // (the block, small values, the partial last block of direct values), and
  // the ops in disk order.
  std::vector<io::AlignedBuffer> stage(groups.size());
  std::vector<Record> records(planned.size());  // what the index learns of each, once written
  std::vector<io::IoOp> ops;
  for (size_t gi = 0, p = 0; gi < groups.size(); ++gi) {
    const Group& g = groups[gi];
    stage[gi] = io::AlignedBuffer(g.len, /*zero=*/false);
    char* buf = stage[gi].data();
    uint64_t file_at = uint64_t{g.region} * options_.region_size + g.start;
    std::memset(buf, 0, io::kIoAlign);
    uint32_t entry_at = sizeof(GroupHeader);
    uint64_t end = g.used;        // of the bytes placed so far
    uint64_t staged_from = 0;     // start of the staged run not yet in an op
    for (; p < planned.size() && planned[p].group == gi; ++p) {
      Planned& v = planned[p];
      const uint32_t crc = ValueCrc(*v.key, v.data, v.size);
      records[p] = Record{g.region, file_at + v.at, v.size, crc, file_at, entry_at};
      EntryHeader e{v.at, v.size, crc, static_cast<uint16_t>(v.key->size()), kLive};
      std::memcpy(buf + entry_at, &e, sizeof e);
      std::memcpy(buf + entry_at + sizeof e, v.key->data(), v.key->size());
      entry_at += EntrySize(v.key->size());
      std::memset(buf + end, 0, v.at - end);  // the entries' padding, or a direct value's
      uint64_t body = v.direct ? v.size / io::kIoAlign * io::kIoAlign : 0;
      if (body > 0) {
        if (v.at > staged_from) ops.push_back({io::IoOp::kWrite, file_at + staged_from, buf + staged_from, v.at - staged_from});
        ops.push_back({io::IoOp::kWrite, file_at + v.at, const_cast<char*>(v.data), body});
        staged_from = v.at + body;
      }
      std::memcpy(buf + v.at + body, v.data + body, v.size - body);
      end = v.at + v.size;
    }
    std::memset(buf + end, 0, g.len - end);
    if (g.len > staged_from) ops.push_back({io::IoOp::kWrite, file_at + staged_from, buf + staged_from, g.len - staged_from});
    SealBlock(buf, g.count, g.seq, g.nonce, g.len, g.used);
  }
  absl::Status run = RunBatch(absl::MakeSpan(ops), "store.ssd.write", EIO, "write");

  struct Orphan {
    Record rec;
    std::string key;
    uint64_t nonce;
  };
  std::vector<Orphan> orphans;  // refreshed while erased
  {
    MutexLock lock(&mu_);
    bool broken = !run.ok() || stats_.failed;
    for (const Group& g : groups) --regions_[g.region].pins;
    for (size_t p = 0; p < planned.size(); ++p) {
      const Planned& v = planned[p];
      const Group& g = groups[v.group];
      const Record& rec = records[p];
      writing_.erase(*v.key);
      if (v.item == SIZE_MAX) {
        --regions_[v.old.region].pins;
        if (broken) continue;
        auto it = index_.find(*v.key);
        if (it == index_.end() || it->second.offset != v.old.offset) {
          orphans.push_back({rec, *v.key, g.nonce});
          continue;
        }
        it->second = rec;
        regions_[g.region].keys.push_back(*v.key);
        ++stats_.refreshed;
        continue;
      }
      if (broken) {
        out[v.item] = run.ok() ? FailedStatus() : run;
        continue;
      }
      index_.try_emplace(*v.key, rec);
      regions_[g.region].keys.push_back(*v.key);
      stats_.used += v.size;
      stats_.bytes_written += v.size;
    }
    for (const Orphan& o : orphans) ++regions_[o.rec.region].pins;
    MaybeReclaim(&dropped);
  }
  // A record erased while its refresh was written: the new copy must not
  // come back at a restart either.
  for (const Orphan& o : orphans) {
    (void)MarkDead(o.rec, o.key, o.nonce);
    MutexLock lock(&mu_);
    --regions_[o.rec.region].pins;
  }
  Notify(dropped);
  return out;
}

std::vector<absl::StatusOr<uint64_t>> SsdTier::ReadBatch(absl::Span<const SsdRead> items) {
  std::vector<absl::StatusOr<uint64_t>> out(items.size(), absl::NotFoundError("not on SSD"));
  struct Pending {
    size_t item;
    Record rec;
    uint64_t begin;  // aligned start of the read
    bool aging;
    io::AlignedBuffer buf;
  };
  std::vector<Pending> pending;
  {
    MutexLock lock(&mu_);
    if (stats_.failed) return std::vector<absl::StatusOr<uint64_t>>(items.size(), FailedStatus());
    for (size_t i = 0; i < items.size(); ++i) {
      auto it = index_.find(items[i].key);
      if (it == index_.end()) continue;
      const Record& rec = it->second;
      if (rec.value_len > items[i].capacity) {
        out[i] = absl::OutOfRangeError(absl::StrCat("value of ", rec.value_len, " bytes; room for ", items[i].capacity));
        continue;
      }
      ++regions_[rec.region].pins;
      pending.push_back({i, rec, rec.offset / io::kIoAlign * io::kIoAlign, Aging(rec.region), {}});
    }
  }
  std::vector<io::IoOp> ops(pending.size());
  for (size_t i = 0; i < pending.size(); ++i) {
    Pending& p = pending[i];
    p.buf = io::AlignedBuffer(io::AlignUp(p.rec.offset + p.rec.value_len) - p.begin, /*zero=*/false);
    ops[i] = {io::IoOp::kRead, p.begin, p.buf.data(), p.buf.size()};
  }
  absl::Status run = RunBatch(absl::MakeSpan(ops), "store.ssd.read", EIO, "read");
  bool broken = !run.ok() || failed();
  // Checks and copies outside the lock: the buffers are this call's own.
  std::vector<bool> good(pending.size(), false);
  if (!broken) {
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      const SsdRead& rd = items[p.item];
      const char* value = p.buf.data() + (p.rec.offset - p.begin);
      good[i] = ValueCrc(rd.key, value, p.rec.value_len) == p.rec.crc;
      if (!good[i]) {
        out[p.item] = absl::DataLossError("SSD record failed its checksum; dropped");
      } else if (std::chrono::steady_clock::now() > rd.deadline) {
        out[p.item] = absl::DeadlineExceededError("SSD read finished after its reader's deadline");
      } else {
        std::memcpy(rd.dst, value, p.rec.value_len);
        out[p.item] = p.rec.value_len;
      }
    }
  }
  std::vector<std::string> dropped;
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      --regions_[p.rec.region].pins;
      const std::string& key = items[p.item].key;
      if (broken) {
        out[p.item] = run.ok() ? FailedStatus() : run;
        continue;
      }
      auto it = index_.find(key);
      bool current = it != index_.end() && it->second.offset == p.rec.offset;
      if (!good[i]) {
        ++stats_.corrupt;
        if (current) {
          DropLocked(key);
          dropped.push_back(key);
        }
        continue;
      }
      if (out[p.item].ok()) stats_.bytes_read += p.rec.value_len;
      if (p.aging && current && !it->second.refresh_queued &&
          refresh_bytes_ + p.buf.size() <= 4 * options_.region_size) {
        it->second.refresh_queued = true;  // a hot record read again before the next write is kept once
        refresh_bytes_ += p.buf.size();
        refresh_.push_back({key, p.rec, std::move(p.buf), p.rec.offset - p.begin});
      }
    }
  }
  Notify(dropped);
  return out;
}

absl::Status SsdTier::Erase(const std::string& key) {
  Record rec;
  uint64_t nonce;
  {
    MutexLock lock(&mu_);
    if (stats_.failed) return FailedStatus();
    auto it = index_.find(key);
    if (it == index_.end()) return absl::NotFoundError("not on SSD");
    rec = it->second;
    DropLocked(key);
    Region& r = regions_[rec.region];
    nonce = r.nonce;
    ++r.pins;
  }
  absl::Status st = MarkDead(rec, key, nonce);
  MutexLock lock(&mu_);
  --regions_[rec.region].pins;
  return st;
}

absl::Status SsdTier::MarkDead(const Record& rec, const std::string& key, uint64_t nonce) {
  // Read, change one entry's flags, write back: erases of one group must
  // not interleave.
  MutexLock erase_lock(&erase_mu_);
  io::AlignedBuffer block(io::kIoAlign);
  io::IoOp op{io::IoOp::kRead, rec.group, block.data(), io::kIoAlign};
  absl::Status run = RunBatch(absl::MakeSpan(&op, 1), "store.ssd.read", EIO, "erase");
  if (run.ok() && !failed()) {
    GroupHeader g;
    std::vector<Entry> entries;
    uint64_t room = options_.region_size - rec.group % options_.region_size;
    // A block that no longer decodes holds nothing a restart would find.
    if (DecodeBlock(block.data(), room, &g, &entries) != HeaderCheck::kOk || g.nonce != nonce) return absl::OkStatus();
    auto e = std::find_if(entries.begin(), entries.end(), [&](const Entry& e) { return e.at == rec.entry; });
    if (e == entries.end() || e->key != key) return absl::OkStatus();
    EntryHeader h = e->h;
    h.flags = kDead;
    std::memcpy(block.data() + e->at, &h, sizeof h);
    SealBlock(block.data(), g.count, g.seq, g.nonce, g.group_len, g.used);
    op = {io::IoOp::kWrite, rec.group, block.data(), io::kIoAlign};
    run = RunBatch(absl::MakeSpan(&op, 1), "store.ssd.write", EIO, "erase");
  }
  if (!run.ok()) return run;
  MutexLock lock(&mu_);
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
