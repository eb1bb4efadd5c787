#include "master/allocator.h"

#include <map>
#include <random>

#include "tests/support/status_matchers.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StatusIs;

// The model: allocated extents by offset. Checks the allocator never hands
// out overlapping or out-of-range space and accounts bytes exactly.
class Model {
 public:
  explicit Model(uint64_t capacity) : capacity_(capacity) {}
  void Add(uint64_t off, uint64_t len) {
    ASSERT_LE(off + len, capacity_);
    auto next = live_.lower_bound(off);
    if (next != live_.end()) {
      ASSERT_GE(next->first, off + len) << "overlaps the next extent";
    }
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      ASSERT_LE(prev->first + prev->second, off) << "overlaps the previous extent";
    }
    live_[off] = len;
    used_ += len;
  }
  void Remove(uint64_t off) {
    used_ -= live_.at(off);
    live_.erase(off);
  }
  uint64_t used() const { return used_; }
  const std::map<uint64_t, uint64_t>& live() const { return live_; }

 private:
  uint64_t capacity_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> live_;
};

TEST(AllocatorTest, RandomMixedSizesAgreeWithModel) {
  constexpr uint64_t kCap = 64 << 20;
  ExtentAllocator alloc(kCap, 64);
  Model model(kCap);
  std::mt19937_64 rng(42);
  std::vector<std::pair<uint64_t, uint64_t>> held;  // (offset, requested length)
  for (int step = 0; step < 200'000; ++step) {
    bool do_alloc = held.empty() || rng() % 100 < 55;
    if (do_alloc) {
      // Mostly small, sometimes large, sometimes 0 or odd sizes.
      uint64_t len = rng() % 10 == 0 ? rng() % (4 << 20) : rng() % 70'000;
      std::optional<uint64_t> off = alloc.Allocate(len);
      if (!off) {
        ASSERT_LT(alloc.largest_free(), alloc.Rounded(len));
        continue;
      }
      ASSERT_EQ(*off % 64, 0u);
      model.Add(*off, alloc.Rounded(len));
      if (HasFatalFailure()) return;
      held.emplace_back(*off, len);
    } else {
      size_t i = rng() % held.size();
      ASSERT_OK(alloc.Free(held[i].first, held[i].second));
      model.Remove(held[i].first);
      held[i] = held.back();
      held.pop_back();
    }
    ASSERT_EQ(alloc.used(), model.used());
  }
  for (auto& [off, len] : held) ASSERT_OK(alloc.Free(off, len));
  EXPECT_EQ(alloc.used(), 0u);
  EXPECT_EQ(alloc.free_extents(), 1u);  // everything coalesced back
  EXPECT_EQ(alloc.largest_free(), kCap);
}

TEST(AllocatorTest, UniformPagesNeverFragment) {
  // KV pages of one size churned at 95 % fill: any free page-sized space is
  // always allocatable, i.e. no byte is lost to fragmentation.
  constexpr uint64_t kPage = 256 << 10;
  constexpr uint64_t kCap = 1000 * kPage;
  ExtentAllocator alloc(kCap, 64);
  std::mt19937_64 rng(7);
  std::vector<uint64_t> held;
  for (int i = 0; i < 950; ++i) held.push_back(*alloc.Allocate(kPage));
  for (int step = 0; step < 100'000; ++step) {
    size_t i = rng() % held.size();
    ASSERT_OK(alloc.Free(held[i], kPage));
    held[i] = held.back();
    held.pop_back();
    int refill = 1 + static_cast<int>(rng() % 2);
    for (int r = 0; r < refill && held.size() < 1000; ++r) {
      std::optional<uint64_t> off = alloc.Allocate(kPage);
      ASSERT_TRUE(off.has_value()) << "fragmented at step " << step << " with "
                                   << alloc.capacity() - alloc.used() << " bytes free";
      held.push_back(*off);
    }
  }
  while (held.size() < 1000) ASSERT_TRUE(alloc.Allocate(kPage).has_value());
  EXPECT_EQ(alloc.used(), kCap);
  EXPECT_FALSE(alloc.Allocate(1).has_value());
}

TEST(AllocatorTest, BadFreesAreRefusedAndChangeNothing) {
  ExtentAllocator alloc(1 << 20, 64);
  uint64_t a = *alloc.Allocate(4096);
  uint64_t b = *alloc.Allocate(4096);
  ASSERT_OK(alloc.Free(a, 4096));
  EXPECT_THAT(alloc.Free(a, 4096), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(alloc.Free(a + 64, 64), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(alloc.Free(1 << 20, 64), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(alloc.Free(UINT64_MAX - 63, 128), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(alloc.Free(3, 64), StatusIs(absl::StatusCode::kFailedPrecondition));
  uint64_t used = alloc.used();
  EXPECT_THAT(alloc.Free(b + 4096, 64), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(alloc.used(), used);
}

TEST(AllocatorTest, ReserveRebuildsState) {
  ExtentAllocator alloc(1 << 20, 64);
  ASSERT_OK(alloc.Reserve(4096, 1000));
  ASSERT_OK(alloc.Reserve(0, 64));
  EXPECT_THAT(alloc.Reserve(4096 + 512, 64), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(alloc.Reserve(1 << 20, 64), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(alloc.used(), 64u + 1024u);
  ASSERT_OK(alloc.Free(4096, 1000));
  ASSERT_OK(alloc.Free(0, 64));
  EXPECT_EQ(alloc.free_extents(), 1u);
}

TEST(AllocatorTest, HugeRequestsFailCleanly) {
  ExtentAllocator alloc(1 << 20, 64);
  EXPECT_FALSE(alloc.Allocate(UINT64_MAX).has_value());
  EXPECT_FALSE(alloc.Allocate((1 << 20) + 1).has_value());
  EXPECT_TRUE(alloc.Allocate(1 << 20).has_value());
}

}  // namespace
}  // namespace tierkv::master
