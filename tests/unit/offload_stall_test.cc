// An SSD tier that stops answering its offload orders (a stopped daemon):
// the order holds only the pass that sent it. Puts waiting for room, reads
// of SSD-resident keys and other passes go on meanwhile, and a concurrent
// pass counts the bytes the order is freeing rather than evicting them
// again.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "tests/support/wait.h"
#include "tests/unit/object_index_fixture.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::WaitFor;

class OffloadStallTest : public IndexTest {
 protected:
  void SetUp() override {
    IndexOptions o;
    // A daemon that takes the order and, while stalled, answers only once
    // released (or after a minute, so a broken test ends).
    o.offload = [this](const std::string&, const std::vector<TierOrder>& orders, absl::Duration) {
      std::unique_lock<std::mutex> lock(mu_);
      ++orders_in_;
      moved_ += orders.size();
      cv_.notify_all();
      if (stalled_) cv_.wait_for(lock, std::chrono::minutes(1), [this] { return released_; });
      ++answered_;
      return std::vector<absl::Status>(orders.size(), absl::OkStatus());
    };
    Build(o);
    bool restored;
    std::optional<uint32_t> replaced;
    ASSERT_OK(registry_->Mount({"seg-a", "seg-a", 100 * 1024, "inc", "", "127.0.0.1:9", 1 << 20, 0}, clock_.Now(),
                               &restored, &replaced)
                  .status());
  }

  void Stall() {
    std::lock_guard<std::mutex> lock(mu_);
    stalled_ = true;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  size_t orders_in() {
    std::lock_guard<std::mutex> lock(mu_);
    return orders_in_;
  }
  size_t moved() {
    std::lock_guard<std::mutex> lock(mu_);
    return moved_;
  }
  size_t answered() {
    std::lock_guard<std::mutex> lock(mu_);
    return answered_;
  }

  // `n` pages of 1 KiB named prefix0.., each read once (so the tier admits
  // it), a second apart; then their leases run out.
  void PutRead(const std::string& prefix, int n) {
    for (int i = 0; i < n; ++i) {
      ASSERT_OK(Put(absl::StrCat(prefix, i), 1024));
      ASSERT_OK(index_->GetReplicas({absl::StrCat(prefix, i)})[0].status);
      clock_.Advance(absl::Seconds(1));
    }
    clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool stalled_ = false;
  bool released_ = false;
  size_t orders_in_ = 0;
  size_t answered_ = 0;
  size_t moved_ = 0;  // objects ordered
};

// The evictor's order to a stalled tier is out: a put that finds no room
// and a read of a page on SSD that needs a staging extent both make room
// by plain evictions and answer while that order is still unanswered.
TEST_F(OffloadStallTest, APutNeedingRoomAndAnSsdReadDoNotWaitForAStalledOrder) {
  PutRead("k", 95);
  ASSERT_OK(Put("trigger", 1024));  // 96 %: k0..k5 move to SSD (inline, no evictor yet)
  ASSERT_EQ(index_->Stats().offloaded, 6u);
  ASSERT_EQ(registry_->used(), 90u * 1024);
  const size_t orders_before = orders_in(), answered_before = answered();

  Stall();
  std::thread evictor = StartEvictor();
  ASSERT_TRUE(index_->EvictorRunning());
  absl::Cleanup stop = [&] {
    Release();
    index_->StopEvictor();
    evictor.join();
  };
  PutRead("r", 6);  // 96 %: the evictor's pass orders k6.. to SSD
  ASSERT_OK(WaitFor("the evictor's order to reach the tier", absl::Seconds(10), [&] { return orders_in() == orders_before + 1; }));
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(absl::StrCat("u", i), 1024));  // full, with the order out
  ASSERT_EQ(registry_->used(), 100u * 1024);

  std::atomic<bool> done{false};
  absl::Status put;
  LookupOut read;
  std::thread request([&] {
    put = Put("room", 1024);
    read = index_->GetReplicas({"k0"})[0];
    done = true;
  });
  absl::Cleanup join = [&] {
    Release();
    request.join();
  };
  EXPECT_OK(WaitFor("a put needing room and a read of an SSD page to answer", absl::Seconds(10),
                    [&] { return done.load(); }));
  EXPECT_EQ(answered(), answered_before) << "they answered only once the stalled order did";
  std::move(join).Invoke();
  EXPECT_OK(put);
  ASSERT_OK(read.status);
  ASSERT_EQ(read.replicas.size(), 1u);
  EXPECT_TRUE(read.replicas[0].stage);
  // Neither sent the stalled tier a second order: their room came from
  // plain evictions.
  EXPECT_EQ(orders_in(), orders_before + 1);

  // The evictor's moves land once the tier answers.
  std::move(stop).Invoke();
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, index_->Describe("k6"));
  ASSERT_EQ(info.replicas.size(), 1u);
  EXPECT_TRUE(info.replicas[0].ssd);
  EXPECT_OK(index_->CheckInvariants());
}

// Two watermark passes at once: the second counts the first's bytes in
// flight as freed, so it neither waits for that order nor evicts more; and
// the first counts its own moves once, so it evicts exactly to the low
// watermark.
TEST_F(OffloadStallTest, ConcurrentPassesCountBytesInFlightOnce) {
  PutRead("k", 95);
  Stall();
  std::thread first([&] { EXPECT_OK(Put("trigger", 1024)); });  // 96 %: evicts inline, orders k0..k5
  absl::Cleanup join_first = [&] {
    Release();
    first.join();
  };
  ASSERT_OK(WaitFor("the first pass's order to reach the tier", absl::Seconds(10), [&] { return orders_in() == 1; }));
  EXPECT_EQ(moved(), 6u);
  ASSERT_EQ(registry_->used(), 96u * 1024);  // the moving extents are held until the answer

  std::atomic<bool> done{false};
  std::thread second([&] {
    index_->MaybeEvict();
    done = true;
  });
  absl::Cleanup join_second = [&] {
    Release();
    second.join();
  };
  EXPECT_OK(WaitFor("a second pass to return while the first's order is out", absl::Seconds(10),
                    [&] { return done.load(); }));
  EXPECT_EQ(answered(), 0u);
  EXPECT_EQ(registry_->used(), 96u * 1024) << "the second pass evicted what the first is moving away";
  EXPECT_EQ(index_->Stats().evictions, 0u);

  std::move(join_second).Invoke();
  std::move(join_first).Invoke();
  EXPECT_EQ(registry_->used(), 90u * 1024);
  EXPECT_EQ(index_->Stats().offloaded, 6u);
  EXPECT_EQ(index_->Stats().evictions, 6u);
  EXPECT_EQ(orders_in(), 1u);
  EXPECT_OK(index_->CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master
