// The object index and its store: recovery, concurrent clients, one store
// write per batch, a PutEnd or Remove waiting for a standby (semi-sync),
// and what a failed store write leaves.
#include "tests/unit/object_index_fixture.h"

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "master/replication.h"
#include "tests/support/wait.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StatusIs;
using ::tierkv::testing::StaysFalse;
using ::tierkv::testing::WaitFor;

TEST_F(IndexTest, RecoverRebuildsIndexGroupsAndParents) {
  Mount("seg-a", 1 << 20);
  ASSERT_OK(Put("p", 100));
  ASSERT_OK(Put("c", 200, {.parent_key = "p"}));
  ASSERT_OK(index_->PutStart({{"g1", 10, 1, "", "g"}, {"g2", 10, 1, "", "g"}})[0].status);
  ASSERT_OK(index_->PutEnd({"g1", "g2"})[0]);
  ASSERT_OK(index_->PutStart({{"pending", 10}})[0].status);
  uint64_t used_before = registry_->used();

  // A new registry and index over the same store: the segment comes back
  // recovering and its objects are held but not served until it re-mounts.
  std::unique_ptr<ObjectIndex> old_index = std::move(index_);
  std::unique_ptr<SegmentRegistry> old_registry = std::move(registry_);
  registry_ = std::make_unique<SegmentRegistry>();
  registry_->Recover({"seg-a", "seg-a", 1 << 20, "inc", ""}, clock_.Now());
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  ASSERT_OK_AND_ASSIGN(uint64_t restored, index_->Recover());
  EXPECT_EQ(restored, 4u);
  EXPECT_FALSE(Present("p"));
  Mount("seg-a", 1 << 20);  // same incarnation
  EXPECT_TRUE(Present("p") && Present("c") && Present("g1") && Present("g2"));
  EXPECT_FALSE(Present("pending"));
  EXPECT_EQ(index_->Describe("p")->children, 1u);
  EXPECT_LT(registry_->used(), used_before);  // the pending put's space is free again
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, ConcurrentClientsKeepInvariants) {
  IndexOptions o;
  o.lease_ttl = absl::ZeroDuration();
  Build(o);
  Mount("a", 4 << 20, "h1");
  Mount("b", 4 << 20, "h2");
  constexpr int kThreads = 6;
  constexpr int kOps = 4000;
  std::vector<std::thread> threads;
  std::atomic<int> unexpected{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        // A small shared key space so threads collide on keys and shards.
        std::string key = absl::StrCat("k", (i * 7 + t) % 300);
        std::string parent = absl::StrCat("k", (i * 7 + t) % 300 - 1);
        switch (i % 6) {
          case 0:
          case 1: {
            auto s = index_->PutStart({{key, 1000u + (i % 5) * 4096u, 1 + i % 2, "", "", i % 3 == 0, parent}});
            if (s[0].status.ok()) {
              if (i % 4 == 0) {
                index_->PutRevoke({key});
              } else {
                index_->PutEnd({key});
              }
            } else if (!absl::IsAlreadyExists(s[0].status) && !absl::IsResourceExhausted(s[0].status)) {
              ++unexpected;
            }
            break;
          }
          case 2:
            index_->GetReplicas({key, parent});
            break;
          case 3:
            index_->PrefixMatch({parent, key});
            break;
          case 4:
            index_->Remove({key}, i % 8 == 0);
            break;
          case 5:
            if (t == 0 && i % 60 == 5) index_->EvictTo(registry_->used() / 2);
            if (t == 1 && i % 50 == 5) index_->Tick();
            index_->Exists({key});
            break;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_OK(index_->CheckInvariants());
  index_->RemoveAll(true);
  clock_.Advance(options_.put_timeout + absl::Seconds(1));
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_OK(index_->CheckInvariants());
}

// Counts the store writes the index makes, over a MemStore.
class CountingStore final : public IndexStore {
 public:
  absl::Status Write(const std::vector<Mutation>& b) override {
    ++writes;
    return base_->Write(b);
  }
  absl::StatusOr<std::string> Get(const std::string& k) override { return base_->Get(k); }
  absl::Status Scan(const std::string& p,
                    const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
    return base_->Scan(p, fn);
  }
  absl::Status Flush() override { return base_->Flush(); }
  std::atomic<int> writes{0};

 private:
  std::unique_ptr<IndexStore> base_ = NewMemStore();
};

// A PutEnd or Remove of many keys is one store write (one RocksDB
// WriteBatch), not one per key, and what it wrote is what Recover reads.
TEST_F(IndexTest, PutEndAndRemoveOfManyKeysAreOneStoreWrite) {
  auto counting = std::make_unique<CountingStore>();
  CountingStore* store = counting.get();
  index_.reset();
  store_ = std::move(counting);
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  Mount("seg-a", 1 << 20);
  std::vector<PutItem> items;
  std::vector<std::string> keys;
  for (int i = 0; i < 40; ++i) {
    keys.push_back(absl::StrCat("k", i));
    items.push_back({keys.back(), 1024});
  }
  for (const PutStartOut& r : index_->PutStart(items)) ASSERT_OK(r.status);
  keys.push_back("k0");  // the same key twice in one call answers OK twice
  keys.push_back("never-started");
  std::vector<absl::Status> done = index_->PutEnd(keys);
  EXPECT_EQ(store->writes.load(), 1);
  for (int i = 0; i < 41; ++i) EXPECT_OK(done[i]) << i;
  EXPECT_THAT(done[41], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(index_->Stats().objects, 40u);
  std::vector<absl::Status> removed = index_->Remove({"k1", "k2", "k3", "missing"}, /*force=*/false);
  EXPECT_EQ(store->writes.load(), 2);
  for (int i = 0; i < 3; ++i) EXPECT_OK(removed[i]);
  EXPECT_THAT(removed[3], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_OK(index_->CheckInvariants());
  // A second index over the same records: the batch wrote every object.
  index_.reset();
  registry_ = std::make_unique<SegmentRegistry>();
  registry_->Recover({"seg-a", "seg-a", 1 << 20, "inc", ""}, clock_.Now());
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  absl::StatusOr<uint64_t> restored = index_->Recover();
  ASSERT_OK(restored.status());
  EXPECT_EQ(*restored, 37u);
  EXPECT_OK(index_->CheckInvariants());
}

// A PutEnd waiting for a standby's acknowledgement (semi-sync) holds no
// shard lock: calls on its shard go on meanwhile. A retried PutEnd of the
// same key, and a Remove, are answered only once the standby has them too.
TEST_F(IndexTest, APutEndWaitingForAStandbyHoldsUpNoOtherCall) {
  IndexOptions one_shard;
  one_shard.shards = 1;  // every key on the shard the waiting PutEnd locked
  Build(one_shard);
  ReplicationOptions ro;
  ro.epoch = 1;
  ro.sync_timeout = absl::Seconds(60);  // never degrades within the test
  ReplicationLog log(ro, store_.get());
  store_->SetReplicator(&log);
  Mount("seg-a", 1 << 20);
  // A standby that has everything: from here each write waits for it.
  auto acknowledge = [&] {
    v1::PullRequest req;
    req.set_standby("standby-1");
    req.set_epoch(1);
    req.set_next_seq(log.LastAppended() + 1);
    v1::PullResponse resp;
    log.Pull(req, &resp);
  };
  ASSERT_OK(Put("x", 100));  // not waited for: no standby has caught up yet
  acknowledge();
  ASSERT_EQ(log.State().sync, "semi-sync");
  for (const char* k : {"a", "b"}) ASSERT_OK(index_->PutStart({{k, 100}})[0].status);
  const uint64_t before = log.LastAppended();
  std::atomic<int> answered{0};
  absl::Status first, retried;
  std::thread putter([&] {
    first = index_->PutEnd({"a"})[0];
    ++answered;
  });
  ASSERT_OK(WaitFor("a's record to be committed", absl::Seconds(5), [&] { return log.LastAppended() != before; }));
  ASSERT_EQ(log.LastAppended(), before + 1) << "a's record was not committed";
  std::thread retrier([&] {
    retried = index_->PutEnd({"a"})[0];
    ++answered;
  });
  // The shard's other calls, while both wait: none blocks on them.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(Present("x"));
  EXPECT_OK(index_->PutStart({{"c", 100}})[0].status);
  EXPECT_OK(index_->PutRevoke({"c"})[0]);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_OK(StaysFalse("a PutEnd was answered before a standby had its record", absl::Milliseconds(100),
                       [&] { return answered.load() > 0; }));
  acknowledge();
  putter.join();
  retrier.join();
  EXPECT_OK(first);
  EXPECT_OK(retried);
  // A Remove waits the same way, and is answered once acknowledged.
  std::atomic<bool> removed{false};
  std::thread remover([&] {
    EXPECT_OK(index_->Remove({"a"}, /*force=*/false)[0]);
    removed = true;
  });
  ASSERT_OK(WaitFor("the Remove's record to be committed", absl::Seconds(5),
                    [&] { return log.LastAppended() != before + 1; }));
  EXPECT_OK(StaysFalse("a Remove was answered before a standby had its record", absl::Milliseconds(50),
                       [&] { return removed.load(); }));
  acknowledge();
  remover.join();
  EXPECT_TRUE(removed.load());
  EXPECT_FALSE(Present("a"));
  log.Close();
  store_->SetReplicator(nullptr);
  EXPECT_OK(index_->CheckInvariants());
}

// A failed batch write fails every key it carried, and none is committed.
TEST_F(IndexTest, AFailedBatchWriteCommitsNothing) {
  class FailingStore final : public IndexStore {
   public:
    absl::Status Write(const std::vector<Mutation>&) override { return absl::UnavailableError("disk gone"); }
    absl::StatusOr<std::string> Get(const std::string& k) override { return absl::NotFoundError(k); }
    absl::Status Scan(const std::string&,
                      const std::function<bool(absl::string_view, absl::string_view)>&) override {
      return absl::OkStatus();
    }
    absl::Status Flush() override { return absl::OkStatus(); }
  };
  index_.reset();
  store_ = std::make_unique<FailingStore>();
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  Mount("seg-a", 1 << 20);
  ASSERT_OK(index_->PutStart({{"a", 100}})[0].status);
  ASSERT_OK(index_->PutStart({{"b", 100}})[0].status);
  for (const absl::Status& s : index_->PutEnd({"a", "b"})) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  }
  EXPECT_FALSE(Present("a"));
  EXPECT_EQ(index_->Stats().pending, 2u);  // still the writer's to retry or revoke
  EXPECT_OK(index_->CheckInvariants());
}

// A removed object's space is reused only once the deletion of its record
// is durable. When that write fails the record survives in the store, so
// the space must stay allocated: a put reusing it would be overwritten by
// nothing, but after a restart the surviving record would read the new
// put's bytes as its own.
TEST_F(IndexTest, ARemovedObjectsSpaceIsNotReusedUntilItsDeletionIsDurable) {
  class FlakyStore final : public IndexStore {
   public:
    absl::Status Write(const std::vector<Mutation>& m) override {
      if (fail.load()) return absl::UnavailableError("disk gone");
      return base_->Write(m);
    }
    absl::StatusOr<std::string> Get(const std::string& k) override { return base_->Get(k); }
    absl::Status Scan(const std::string& p,
                      const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
      return base_->Scan(p, fn);
    }
    absl::Status Flush() override { return base_->Flush(); }
    std::atomic<bool> fail{false};

   private:
    std::unique_ptr<IndexStore> base_ = NewMemStore();
  };
  auto flaky = std::make_unique<FlakyStore>();
  FlakyStore* store = flaky.get();
  index_.reset();
  store_ = std::move(flaky);
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  Mount("seg-a", 4096);  // room for exactly one object
  ASSERT_OK(Put("a", 4096));
  store->fail.store(true);
  (void)index_->Remove({"a"}, false);
  store->fail.store(false);
  EXPECT_FALSE(Present("a"));
  EXPECT_THAT(index_->PutStart({{"b", 4096}})[0].status, StatusIs(absl::StatusCode::kResourceExhausted))
      << "the space of a whose record is still in the store was handed out again";
  EXPECT_OK(index_->CheckInvariants());
  // With the store writable a removal frees the space for the next put.
  Mount("seg-b", 4096);
  ASSERT_OK(Put("c", 4096));
  EXPECT_OK(index_->Remove({"c"}, false)[0]);
  EXPECT_OK(index_->PutStart({{"d", 4096}})[0].status);
  EXPECT_OK(index_->CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master
