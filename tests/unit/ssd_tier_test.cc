// SsdTier against the in-memory FileIo (record format, torn records, the
// restart scan, batching, reclaim, faults), and once against a real file
// through io_uring, with O_DIRECT and with the buffered fallback.
#include "store/ssd_tier.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "tests/support/status_matchers.h"

namespace tierkv::store {
namespace {

using ::testing::UnorderedElementsAre;
using ::tierkv::testing::StatusIs;
using io::AlignedBuffer;
using io::FakeFileIo;
using io::IoOp;
using io::kIoAlign;
using io::OpenUringFile;
using io::UringAvailable;

constexpr uint64_t kRegion = 64 << 10;

std::string Value(const std::string& key, size_t n) {
  std::string v(n, '\0');
  uint32_t x = Crc32c(key.data(), key.size()) | 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    v[i] = static_cast<char>(x);
  }
  return v;
}

class SsdTierTest : public ::testing::Test {
 protected:
  // Opens a tier over the shared storage, as a (re)started daemon would.
  std::unique_ptr<SsdTier> Open(SsdTierOptions o = {}) {
    o.region_size = kRegion;
    auto file = std::make_unique<FakeFileIo>(storage_, depth_);
    file_ = file.get();
    auto tier = SsdTier::Open(std::move(file), std::move(o));
    EXPECT_OK(tier.status());
    return tier.ok() ? std::move(*tier) : nullptr;
  }

  // A tier that reclaims above 75 % of its regions down to 50 %, telling
  // `dropped` (when given) of every record it drops.
  std::unique_ptr<SsdTier> OpenReclaiming(std::vector<std::string>* dropped) {
    SsdTierOptions o;
    o.high_watermark = 0.75;
    o.low_watermark = 0.5;
    if (dropped != nullptr) o.on_drop = [dropped](const std::string& key) { dropped->push_back(key); };
    return Open(std::move(o));
  }

  absl::Status Put(SsdTier& tier, const std::string& key, const std::string& value) {
    SsdWrite w{key, value.data(), value.size()};
    return tier.WriteBatch(absl::MakeConstSpan(&w, 1))[0];
  }

  absl::StatusOr<std::string> Get(SsdTier& tier, const std::string& key, size_t cap = 1 << 20) {
    std::string out(cap, '\0');
    SsdRead r{key, out.data(), cap};
    absl::StatusOr<uint64_t> n = tier.ReadBatch(absl::MakeConstSpan(&r, 1))[0];
    if (!n.ok()) return n.status();
    out.resize(*n);
    return out;
  }

  std::string Raw(uint64_t offset, size_t n) {
    MutexLock lock(&storage_->mu);
    return storage_->bytes.substr(offset, n);
  }

  unsigned depth_ = 256;
  std::shared_ptr<FakeFileIo::Storage> storage_ = FakeFileIo::NewStorage(16 * kRegion);
  FakeFileIo* file_ = nullptr;  // the last opened tier's
};

TEST_F(SsdTierTest, RoundTripsValuesOfManySizes) {
  auto tier = Open();
  std::vector<std::string> keys = {"a", "page/1", std::string(kSsdMaxKey, 'k'), "binary\x01\xff"};
  std::vector<size_t> sizes = {1, 4032, 4097, 60000};
  for (size_t i = 0; i < keys.size(); ++i) ASSERT_OK(Put(*tier, keys[i], Value(keys[i], sizes[i])));
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(Get(*tier, keys[i]).value(), Value(keys[i], sizes[i]));
  EXPECT_THAT(Get(*tier, "absent").status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(tier->SizeOf("page/1"), 4032u);
  SsdStats s = tier->Stats();
  EXPECT_EQ(s.records, 4u);
  EXPECT_EQ(s.used, 1u + 4032 + 4097 + 60000);
  EXPECT_EQ(s.capacity, 16 * kRegion);
}

TEST_F(SsdTierTest, AGroupBlockNamesEveryRecordOfABatchAndValuesArePacked) {
  auto tier = Open();
  std::string v = Value("k1", 5000);
  std::vector<SsdWrite> w = {{"k1", v.data(), v.size()}, {"k2", "x", 1}};
  for (const absl::Status& s : tier->WriteBatch(w)) ASSERT_OK(s);
  ASSERT_OK(Put(*tier, "k3", "y"));
  std::string block = Raw(0, 4096);
  uint32_t magic, used;
  uint16_t count;
  uint64_t group_len;
  std::memcpy(&magic, block.data(), 4);
  std::memcpy(&count, block.data() + 6, 2);
  std::memcpy(&group_len, block.data() + 24, 8);
  std::memcpy(&used, block.data() + 32, 4);
  EXPECT_EQ(magic, 0x47564b54u);
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(group_len, 8192u);  // 128 B of block, 5000 + 1 of values, rounded up to 4 KiB
  EXPECT_EQ(used, 64u + 32 + 32);  // header, then two entries of 24 B + key, padded to 8
  // Entry: value offset, value length, CRC32C of key and value, key length, flags; then the key.
  uint64_t offset, len;
  uint32_t crc;
  uint16_t key_len;
  std::memcpy(&offset, block.data() + 64, 8);
  std::memcpy(&len, block.data() + 72, 8);
  std::memcpy(&crc, block.data() + 80, 4);
  std::memcpy(&key_len, block.data() + 84, 2);
  EXPECT_EQ(offset, 128u);  // right after the entries
  EXPECT_EQ(len, 5000u);
  EXPECT_EQ(crc, Crc32cExtend(Crc32c("k1", 2), v.data(), v.size()));
  EXPECT_EQ(key_len, 2u);
  EXPECT_EQ(block.substr(88, 2), "k1");
  std::memcpy(&offset, block.data() + 96, 8);
  EXPECT_EQ(offset, 128u + 5000);  // packed right after k1's value
  EXPECT_EQ(block.substr(120, 2), "k2");
  EXPECT_EQ(Raw(128, 5000), v);
  EXPECT_EQ(Raw(5128, 1), "x");
  std::memcpy(&magic, Raw(8192, 4).data(), 4);  // the next batch's group starts on the next 4 KiB
  EXPECT_EQ(magic, 0x47564b54u);
  EXPECT_EQ(Raw(8192 + 88, 2), "k3");
}

// A KV page with its 8-byte trailer takes a little over 4 KiB, not two blocks.
TEST_F(SsdTierTest, PagesWithTrailersArePackedNotPadded) {
  auto tier = Open();
  std::vector<std::string> values;
  std::vector<SsdWrite> w;
  for (int i = 0; i < 8; ++i) values.push_back(Value(absl::StrCat("page/", i), 4104));
  for (int i = 0; i < 8; ++i) w.push_back({absl::StrCat("page/", i), values[i].data(), values[i].size()});
  for (const absl::Status& s : tier->WriteBatch(w)) ASSERT_OK(s);
  ASSERT_OK(Put(*tier, "next", "z"));
  // 64 + 8 * 32 bytes of block, then 8 * 4104 of values: 33152 bytes,
  // rounded up: the next group at 36864.
  EXPECT_EQ(Raw(36864 + 88, 4), "next");
  // A page alone takes two blocks: block and value share the first. ("next"
  // took one, at 36864.)
  std::string page = Value("page/alone", 4104);
  ASSERT_OK(Put(*tier, "page/alone", page));
  ASSERT_OK(Put(*tier, "after", "w"));
  EXPECT_EQ(Raw(40960 + 88, 10), "page/alone");
  EXPECT_EQ(Raw(40960 + 8192 + 88, 5), "after");
  EXPECT_EQ(Get(*tier, "page/alone").value(), page);

  for (int i = 0; i < 8; ++i) EXPECT_EQ(Get(*tier, absl::StrCat("page/", i)).value(), values[i]) << i;
}

// A large value in 4 KiB-aligned memory goes to disk from that memory:
// the block and the partial last block are copied, the body is not.
TEST_F(SsdTierTest, AnAlignedLargeValueIsWrittenFromItsOwnMemory) {
  auto tier = Open();
  std::string v = Value("big", 40000);
  AlignedBuffer src(v.size());
  std::memcpy(src.data(), v.data(), v.size());
  uint64_t before = file_->writes();
  SsdWrite w{"big", src.data(), v.size()};
  ASSERT_OK(tier->WriteBatch(absl::MakeConstSpan(&w, 1))[0]);
  EXPECT_EQ(file_->writes() - before, 3u);  // block, body (36864 B), last 3136 B
  EXPECT_EQ(Raw(4096, v.size()), v);
  EXPECT_EQ(Get(*tier, "big").value(), v);
  // A small value after it in the same batch packs after its end.
  std::string small = Value("small", 100);
  std::vector<SsdWrite> ws = {{"big2", src.data(), v.size()}, {"small", small.data(), small.size()}};
  for (const absl::Status& s : tier->WriteBatch(ws)) ASSERT_OK(s);
  EXPECT_EQ(Get(*tier, "big2").value(), v);
  EXPECT_EQ(Get(*tier, "small").value(), small);
}

TEST_F(SsdTierTest, ABatchIsOneSubmission) {
  auto tier = Open();
  std::vector<std::string> values;
  std::vector<SsdWrite> writes;
  for (int i = 0; i < 100; ++i) values.push_back(Value(absl::StrCat("k", i), 3000));
  for (int i = 0; i < 100; ++i) writes.push_back({absl::StrCat("k", i), values[i].data(), values[i].size()});
  uint64_t before = file_->submissions();
  for (const absl::Status& s : tier->WriteBatch(writes)) ASSERT_OK(s);
  EXPECT_EQ(file_->submissions() - before, 1u);
  std::vector<std::string> out(100, std::string(4096, '\0'));
  std::vector<SsdRead> reads;
  for (int i = 0; i < 100; ++i) reads.push_back({absl::StrCat("k", i), out[i].data(), out[i].size()});
  before = file_->submissions();
  std::vector<absl::StatusOr<uint64_t>> got = tier->ReadBatch(reads);
  EXPECT_EQ(file_->submissions() - before, 1u);
  for (int i = 0; i < 100; ++i) {
    ASSERT_OK(got[i].status());
    EXPECT_EQ(out[i].substr(0, *got[i]), values[i]);
  }
}

TEST_F(SsdTierTest, ABatchLargerThanTheQueueTakesSeveralSubmissions) {
  depth_ = 16;
  auto tier = Open();
  std::vector<SsdWrite> writes;
  std::string v = "value";
  // Keys of 2000 bytes: one entry per group block, so 40 groups, 40 writes.
  for (int i = 0; i < 40; ++i) writes.push_back({absl::StrCat(std::string(2000, 'k'), i), v.data(), v.size()});
  uint64_t before = file_->submissions();
  for (const absl::Status& s : tier->WriteBatch(writes)) ASSERT_OK(s);
  EXPECT_EQ(file_->submissions() - before, 3u);
}

TEST_F(SsdTierTest, RefusesWhatDoesNotFitAndDuplicates) {
  auto tier = Open();
  std::string big(kRegion, 'x');
  EXPECT_THAT(Put(*tier, "big", big), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Put(*tier, std::string(kSsdMaxKey + 1, 'k'), "v"), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(Put(*tier, "k", "v1"));
  EXPECT_THAT(Put(*tier, "k", "v2"), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(Get(*tier, "k").value(), "v1");
  EXPECT_THAT(Get(*tier, "k", 1).status(), StatusIs(absl::StatusCode::kOutOfRange));
}

TEST_F(SsdTierTest, RestartScansHeadersOnlyAndFindsEveryRecord) {
  {
    auto tier = Open();
    for (int i = 0; i < 40; ++i) ASSERT_OK(Put(*tier, absl::StrCat("k", i), Value(absl::StrCat("k", i), 9000)));
    ASSERT_OK(tier->Erase("k7"));
  }
  auto tier = Open();
  SsdStats s = tier->Stats();
  EXPECT_EQ(s.recovered, 39u);
  EXPECT_EQ(s.torn, 0u);
  EXPECT_EQ(s.used, 39u * 9000);
  // One 4 KiB read per group block (each Put is a group) plus one per
  // region to find its end; no value was read.
  EXPECT_LE(file_->reads(), 40u + 16u);
  // Regions are scanned side by side: one submission per step down the
  // longest chain (5 groups of 12 KiB per 64 KiB region, plus its end).
  EXPECT_LE(file_->submissions(), 6u);
  EXPECT_THAT(Get(*tier, "k7").status(), StatusIs(absl::StatusCode::kNotFound));
  for (int i = 0; i < 40; ++i) {
    if (i == 7) continue;
    EXPECT_EQ(Get(*tier, absl::StrCat("k", i)).value(), Value(absl::StrCat("k", i), 9000)) << i;
  }
}

TEST_F(SsdTierTest, WritesAfterARestartSurviveTheNextOneAndErasedStaysErased) {
  {
    auto tier = Open();
    ASSERT_OK(Put(*tier, "old", "1"));
    ASSERT_OK(Put(*tier, "gone", "2"));
    ASSERT_OK(tier->Erase("gone"));
  }
  {
    auto tier = Open();
    ASSERT_OK(Put(*tier, "new", "3"));
  }
  auto tier = Open();
  std::vector<std::string> keys;
  for (auto& [k, n] : tier->Records()) keys.push_back(k);
  EXPECT_THAT(keys, UnorderedElementsAre("old", "new"));
  EXPECT_EQ(Get(*tier, "new").value(), "3");
}

TEST_F(SsdTierTest, TornHeaderIsSkippedAndCountedAtRestart) {
  {
    auto tier = Open();
    ASSERT_OK(Put(*tier, "whole", "1"));
    file_->TearNextWrite(10);  // the crash lands inside the second group's block
    ASSERT_OK(Put(*tier, "torn", "2"));
  }
  auto tier = Open();
  EXPECT_EQ(tier->Stats().torn, 1u);
  EXPECT_EQ(tier->Stats().recovered, 1u);
  EXPECT_EQ(Get(*tier, "whole").value(), "1");
  EXPECT_THAT(Get(*tier, "torn").status(), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(SsdTierTest, TornValueIsNeverServed) {
  std::vector<std::string> dropped;
  {
    auto tier = Open();
    file_->TearNextWrite(4096);  // the group block landed, the value did not
    ASSERT_OK(Put(*tier, "torn", Value("torn", 20000)));
  }
  SsdTierOptions o;
  o.on_drop = [&dropped](const std::string& key) { dropped.push_back(key); };
  auto tier = Open(std::move(o));
  EXPECT_EQ(tier->Stats().recovered, 1u);  // the block is sound: found, not yet checked
  EXPECT_THAT(Get(*tier, "torn").status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(tier->Stats().corrupt, 1u);
  EXPECT_THAT(dropped, UnorderedElementsAre("torn"));
  EXPECT_THAT(Get(*tier, "torn").status(), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(SsdTierTest, AnotherKeysBytesReadAsLossNotAsAValue) {
  auto tier = Open();
  ASSERT_OK(Put(*tier, "ka", Value("ka", 1000)));
  ASSERT_OK(Put(*tier, "kb", Value("kb", 1000)));
  {
    // Swap the two groups on disk (each one 4 KiB block, value included):
    // each key's entry now points at the other key's value.
    MutexLock lock(&storage_->mu);
    std::string a = storage_->bytes.substr(0, 4096);
    storage_->bytes.replace(0, 4096, storage_->bytes.substr(4096, 4096));
    storage_->bytes.replace(4096, 4096, a);
  }
  EXPECT_THAT(Get(*tier, "ka").status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(Get(*tier, "kb").status(), StatusIs(absl::StatusCode::kDataLoss));
}

TEST_F(SsdTierTest, ReclaimsTheOldestRegionsPastTheHighWatermark) {
  std::vector<std::string> dropped;
  auto tier = OpenReclaiming(&dropped);
  // 60 000-byte values: one per 64 KiB region; 40 of them into 16 regions.
  for (int i = 0; i < 40; ++i) ASSERT_OK(Put(*tier, absl::StrCat("k", i), Value(absl::StrCat("k", i), 60000)));
  SsdStats s = tier->Stats();
  EXPECT_LE(s.regions_in_use, 12u);
  EXPECT_EQ(s.records + s.reclaimed, 40u);
  EXPECT_EQ(dropped.size(), s.reclaimed);
  EXPECT_THAT(Get(*tier, "k0").status(), StatusIs(absl::StatusCode::kNotFound));  // oldest first
  EXPECT_EQ(Get(*tier, "k39").value(), Value("k39", 60000));
  // A restart finds at least what was live (a reclaimed region not yet
  // reused still holds sound records, which may come back), and every
  // record it finds reads back as written.
  tier.reset();
  tier = Open();
  EXPECT_GE(tier->Stats().recovered, s.records);
  for (auto& [key, size] : tier->Records()) EXPECT_EQ(Get(*tier, key).value(), Value(key, 60000)) << key;
}

// A record read from the older half of the regions is re-appended by the
// next write, so reclaim takes the unread records and keeps the read one.
TEST_F(SsdTierTest, AReadRecordOutlivesTheReclaimOfItsRegion) {
  std::vector<std::string> dropped;
  auto tier = OpenReclaiming(&dropped);
  auto key = [](int i) { return absl::StrCat("k", i); };
  // One 60 000-byte value fills a 64 KiB region: ten regions of sixteen.
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(*tier, key(i), Value(key(i), 60000)));
  EXPECT_EQ(Get(*tier, "k0").value(), Value("k0", 60000));  // the oldest region: kept for re-append
  EXPECT_EQ(Get(*tier, "k0").value(), Value("k0", 60000));  // read again: still kept once
  EXPECT_EQ(Get(*tier, "k9").value(), Value("k9", 60000));  // the open region: not
  // k0 is re-appended with k10; k11 passes the high watermark (13 > 12)
  // and the five oldest regions go, down to eight: k0's old one and k1 .. k4's.
  for (int i = 10; i < 12; ++i) ASSERT_OK(Put(*tier, key(i), Value(key(i), 60000)));
  SsdStats s = tier->Stats();
  EXPECT_EQ(s.refreshed, 1u);
  EXPECT_EQ(s.regions_in_use, 8u);
  EXPECT_THAT(dropped, UnorderedElementsAre("k1", "k2", "k3", "k4"));
  EXPECT_EQ(Get(*tier, "k0").value(), Value("k0", 60000));
  EXPECT_THAT(Get(*tier, "k1").status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(s.used, 8u * 60000);  // k0, k5 .. k11: the re-append counts once
  // A restart finds the re-appended copy (the newer one).
  tier.reset();
  tier = Open();
  EXPECT_EQ(Get(*tier, "k0").value(), Value("k0", 60000));
  // An erased record is not re-appended, nor found by the next restart.
  EXPECT_EQ(Get(*tier, "k5").value(), Value("k5", 60000));
  ASSERT_OK(tier->Erase("k5"));
  ASSERT_OK(Put(*tier, key(12), Value(key(12), 60000)));
  EXPECT_EQ(tier->Stats().refreshed, 0u);
  EXPECT_THAT(Get(*tier, "k5").status(), StatusIs(absl::StatusCode::kNotFound));
  tier.reset();
  tier = Open();
  EXPECT_THAT(Get(*tier, "k5").status(), StatusIs(absl::StatusCode::kNotFound));
}

// Writers, readers and an eraser at once, with regions reclaimed and read
// records re-appended under them: every value read is the one its key was
// written with, and every call answers one of the statuses it documents.
TEST_F(SsdTierTest, ConcurrentCallsUnderReclaimNeverReturnAnotherValue) {
  auto tier = OpenReclaiming(nullptr);
  constexpr int kKeys = 400;
  auto key = [](int i) { return absl::StrCat("page/", i); };
  std::vector<std::string> values;
  for (int i = 0; i < kKeys; ++i) values.push_back(Value(key(i), 3000 + i * 7 % 5000));
  std::atomic<int> wrong{0}, unexpected{0}, hits{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (int round = 0; round < 3; ++round) {
        for (int i = w; i < kKeys; i += 16) {
          std::vector<SsdWrite> batch;
          for (int j = i; j < std::min(kKeys, i + 8); ++j) batch.push_back({key(j), values[j].data(), values[j].size()});
          for (const absl::Status& st : tier->WriteBatch(batch)) {
            if (!st.ok() && !absl::IsAlreadyExists(st)) ++unexpected;
          }
        }
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::string> out(4, std::string(8192, '\0'));
      for (int n = 0; n < 600; ++n) {
        std::vector<SsdRead> reads;
        std::vector<int> which;
        for (int j = 0; j < 4; ++j) {
          which.push_back((n * 13 + j * 101 + r) % kKeys);
          reads.push_back({key(which.back()), out[j].data(), out[j].size()});
        }
        std::vector<absl::StatusOr<uint64_t>> got = tier->ReadBatch(reads);
        for (int j = 0; j < 4; ++j) {
          if (got[j].ok()) {
            ++hits;
            if (out[j].substr(0, *got[j]) != values[which[j]]) ++wrong;
          } else if (!absl::IsNotFound(got[j].status())) {
            ++unexpected;
          }
        }
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < kKeys; i += 9) {
      absl::Status st = tier->Erase(key(i));
      if (!st.ok() && !absl::IsNotFound(st)) ++unexpected;
    }
  });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_GT(hits.load(), 0);
  SsdStats s = tier->Stats();
  EXPECT_GT(s.reclaimed, 0u);
  EXPECT_EQ(s.corrupt, 0u);
  // What is indexed reads back whole, and again after a restart.
  for (auto& [k, size] : tier->Records()) {
    int i = std::stoi(k.substr(5));
    EXPECT_EQ(Get(*tier, k).value(), values[i]) << k;
  }
  size_t before = tier->Records().size();
  tier.reset();
  tier = Open();
  EXPECT_GE(tier->Records().size(), before);
  for (auto& [k, size] : tier->Records()) EXPECT_EQ(Get(*tier, k).value(), values[std::stoi(k.substr(5))]) << k;
}

TEST_F(SsdTierTest, WriteErrorFailsTheTier) {
  auto tier = Open();
  ASSERT_OK(Put(*tier, "before", "1"));
  file_->FailOps(IoOp::kWrite, ENOSPC);
  EXPECT_THAT(Put(*tier, "k", "v"), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_TRUE(tier->failed());
  EXPECT_THAT(tier->Stats().failure, ::testing::HasSubstr(strerror(ENOSPC)));
  EXPECT_THAT(Get(*tier, "before").status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(Get(*tier, "k").status(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(SsdTierTest, ReadErrorFailsTheTierAndReturnsNoBytes) {
  auto tier = Open();
  ASSERT_OK(Put(*tier, "k", "value"));
  file_->FailOps(IoOp::kRead, EIO);
  std::string out(16, '#');
  SsdRead r{"k", out.data(), out.size()};
  EXPECT_THAT(tier->ReadBatch(absl::MakeConstSpan(&r, 1))[0].status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(out, std::string(16, '#'));
  EXPECT_TRUE(tier->failed());
}

// A read that completes after its reader's deadline writes nothing: the
// reader's staging extent may already belong to another object.
TEST_F(SsdTierTest, AReadPastItsDeadlineLeavesTheBufferAlone) {
  auto tier = Open();
  ASSERT_OK(Put(*tier, "k", "value"));
  std::string out(16, '#');
  SsdRead late{"k", out.data(), out.size(), std::chrono::steady_clock::now() - std::chrono::milliseconds(1)};
  EXPECT_THAT(tier->ReadBatch(absl::MakeConstSpan(&late, 1))[0].status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(out, std::string(16, '#'));
  EXPECT_FALSE(tier->failed());
  SsdRead in_time{"k", out.data(), out.size(), std::chrono::steady_clock::now() + std::chrono::seconds(10)};
  ASSERT_OK_AND_ASSIGN(uint64_t n, tier->ReadBatch(absl::MakeConstSpan(&in_time, 1))[0]);
  EXPECT_EQ(out.substr(0, n), "value");
}

TEST_F(SsdTierTest, ASlowDiskFailsTheTier) {
  SsdTierOptions o;
  o.slow_io = absl::Milliseconds(20);
  auto tier = Open(std::move(o));
  ASSERT_OK(Put(*tier, "k", "v"));
  file_->Delay(absl::Milliseconds(50));
  EXPECT_THAT(Get(*tier, "k").status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(tier->Stats().failure, ::testing::HasSubstr("took"));
}

TEST_F(SsdTierTest, ScanErrorRefusesToOpen) {
  auto file = std::make_unique<FakeFileIo>(storage_);
  file->FailOps(IoOp::kRead, EIO);
  SsdTierOptions o;
  o.region_size = kRegion;
  EXPECT_THAT(SsdTier::Open(std::move(file), o).status(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(SsdTierTest, RefusesUnusableOptions) {
  SsdTierOptions o;
  o.region_size = 5000;
  EXPECT_THAT(SsdTier::Open(std::make_unique<FakeFileIo>(storage_), o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.region_size = 16 * kRegion;  // one region only
  EXPECT_THAT(SsdTier::Open(std::make_unique<FakeFileIo>(storage_), o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The real file seam: io_uring on a file, written, reopened and read.
// `expect_direct` empty: either (tmpfs takes O_DIRECT from Linux 6.6 on).
void RealFileRoundTrip(const std::string& dir, std::optional<bool> expect_direct, bool direct = true) {
  std::string path = dir + "/tierkv-ssd.dat";
  for (int pass = 0; pass < 2; ++pass) {
    auto file = OpenUringFile({.path = path, .size = 8 << 20, .direct = direct});
    ASSERT_OK(file.status());
    if (expect_direct.has_value()) {
      EXPECT_EQ((*file)->direct(), *expect_direct);
    }
    SsdTierOptions o;
    o.region_size = 1 << 20;
    auto tier = SsdTier::Open(std::move(*file), o);
    ASSERT_OK(tier.status());
    std::vector<std::string> values;
    for (int i = 0; i < 8; ++i) values.push_back(Value(absl::StrCat("k", i), 70000 + i));
    if (pass == 0) {
      std::vector<SsdWrite> w;
      for (int i = 0; i < 8; ++i) w.push_back({absl::StrCat("k", i), values[i].data(), values[i].size()});
      for (const absl::Status& s : (*tier)->WriteBatch(w)) ASSERT_OK(s);
    } else {
      EXPECT_EQ((*tier)->Stats().recovered, 8u);
    }
    std::vector<std::string> out(8, std::string(1 << 17, '\0'));
    std::vector<SsdRead> r;
    for (int i = 0; i < 8; ++i) r.push_back({absl::StrCat("k", i), out[i].data(), out[i].size()});
    std::vector<absl::StatusOr<uint64_t>> got = (*tier)->ReadBatch(r);
    for (int i = 0; i < 8; ++i) {
      ASSERT_OK(got[i].status());
      EXPECT_EQ(out[i].substr(0, *got[i]), values[i]);
    }
  }
}

void RealFileRoundTripBuffered(const std::string& dir) { RealFileRoundTrip(dir, false, /*direct=*/false); }

#define SKIP_WITHOUT_URING()                                                \
  do {                                                                     \
    if (absl::Status u = UringAvailable(); !u.ok()) GTEST_SKIP() << u.message(); \
  } while (0)

// True when `dir`'s file system takes O_DIRECT (some overlay and FUSE file
// systems refuse it, and the tier then falls back, which another test covers).
bool TakesDirectIo(const std::string& dir) {
  std::string path = dir + "/probe";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644);
  if (fd < 0) return false;
  AlignedBuffer b(kIoAlign);
  bool ok = ftruncate(fd, kIoAlign) == 0 && pread(fd, b.data(), kIoAlign, 0) >= 0;
  close(fd);
  unlink(path.c_str());
  return ok;
}

std::string TempDir(const char* under) {
  std::string tmpl = std::string(under) + "/tierkv-ssd-XXXXXX";
  char* made = mkdtemp(tmpl.data());
  return made ? std::string(made) : std::string();
}

TEST(SsdTierFileTest, DirectIoOnADiskFileSystem) {
  const char* base = std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp";
  struct statfs fs {};
  if (statfs(base, &fs) != 0 || fs.f_type == TMPFS_MAGIC) GTEST_SKIP() << base << " is tmpfs";
  SKIP_WITHOUT_URING();
  std::string dir = TempDir(base);
  ASSERT_FALSE(dir.empty());
  if (!TakesDirectIo(dir)) {
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << base << " refuses O_DIRECT";
  }
  RealFileRoundTrip(dir, /*expect_direct=*/true);
  std::filesystem::remove_all(dir);
}

TEST(SsdTierFileTest, TmpfsWithOrWithoutDirectIo) {
  struct statfs fs {};
  if (statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC) GTEST_SKIP() << "no tmpfs at /dev/shm";
  SKIP_WITHOUT_URING();
  std::string dir = TempDir("/dev/shm");
  ASSERT_FALSE(dir.empty());
  RealFileRoundTrip(dir, std::nullopt);
  std::filesystem::remove_all(dir);
}

// The buffered path (what a file system refusing O_DIRECT gets; the
// fallback itself is tested on a daemon, by the store.ssd.direct failpoint).
TEST(SsdTierFileTest, BufferedIo) {
  SKIP_WITHOUT_URING();
  std::string dir = TempDir("/tmp");
  ASSERT_FALSE(dir.empty());
  auto file = OpenUringFile({.path = dir + "/f", .size = 1 << 20, .direct = false});
  ASSERT_OK(file.status());
  EXPECT_FALSE((*file)->direct());
  file->reset();
  RealFileRoundTripBuffered(dir);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tierkv::store
