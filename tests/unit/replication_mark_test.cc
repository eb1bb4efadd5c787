// The leader's "ahead" mark (master/replication.h) against what etcd holds,
// not what etcd answered: a mark or removal etcd applied but never answered
// leaves the mark's state unknown, so the next write no standby has makes
// the mark again before it is acknowledged, and a removal is fenced by the
// revision of the mark it removes, so one applied late never takes away a
// later mark. etcd is an in-memory twin of the one key, with etcd's
// revisions and its two ways to fail a call.
#include <cstdint>
#include <vector>

#include "base/mutex.h"
#include "gtest/gtest.h"
#include "master/replication.h"
#include "tests/support/status_matchers.h"

namespace tierkv::master {
namespace {

// The mark's key in etcd: every write takes the store's next revision, and
// a removal deletes the key only while its mod revision is the one named
// (EtcdClient::DeleteIfModifiedAt). A call fails as etcd's do: lost before
// etcd saw it, applied with its answer lost, or (removals) held in flight
// until ApplyHeld.
class FakeMarkKey {
 public:
  enum class Fault { kNone, kLost, kAppliedUnanswered, kHeld };

  void Install(ReplicationOptions* o) {
    o->mark_ahead = [this] { return Put(); };
    o->unmark_ahead = [this](int64_t revision) { return DeleteIfModifiedAt(revision); };
  }

  absl::StatusOr<int64_t> Put() {
    MutexLock lock(&mu_);
    ++puts_;
    if (put_fault_ == Fault::kLost) return absl::DeadlineExceededError("etcd put: lost");
    mod_revision_ = ++revision_;
    if (put_fault_ == Fault::kAppliedUnanswered) return absl::DeadlineExceededError("etcd put: answer lost");
    return mod_revision_;
  }

  absl::Status DeleteIfModifiedAt(int64_t revision) {
    MutexLock lock(&mu_);
    ++deletes_;
    if (delete_fault_ == Fault::kLost) return absl::DeadlineExceededError("etcd delete: lost");
    if (delete_fault_ == Fault::kHeld) {
      held_.push_back(revision);
      return absl::DeadlineExceededError("etcd delete: not answered yet");
    }
    Delete(revision);
    if (delete_fault_ == Fault::kAppliedUnanswered) return absl::DeadlineExceededError("etcd delete: answer lost");
    return absl::OkStatus();
  }

  // The removals held in flight reach etcd now.
  void ApplyHeld() {
    MutexLock lock(&mu_);
    for (int64_t revision : held_) Delete(revision);
    held_.clear();
  }

  void set_put_fault(Fault f) {
    MutexLock lock(&mu_);
    put_fault_ = f;
  }
  void set_delete_fault(Fault f) {
    MutexLock lock(&mu_);
    delete_fault_ = f;
  }
  bool present() {
    MutexLock lock(&mu_);
    return mod_revision_ != 0;
  }
  int64_t mod_revision() {
    MutexLock lock(&mu_);
    return mod_revision_;
  }
  int puts() {
    MutexLock lock(&mu_);
    return puts_;
  }
  std::vector<int64_t> held() {
    MutexLock lock(&mu_);
    return held_;
  }

 private:
  void Delete(int64_t revision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++revision_;  // a delete is a revision too, whether the compare held or not
    if (mod_revision_ == revision) mod_revision_ = 0;
  }

  Mutex mu_;
  int64_t revision_ ABSL_GUARDED_BY(mu_) = 100;
  int64_t mod_revision_ ABSL_GUARDED_BY(mu_) = 0;  // 0: no key
  Fault put_fault_ ABSL_GUARDED_BY(mu_) = Fault::kNone;
  Fault delete_fault_ ABSL_GUARDED_BY(mu_) = Fault::kNone;
  int puts_ ABSL_GUARDED_BY(mu_) = 0;
  int deletes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> held_ ABSL_GUARDED_BY(mu_);
};

constexpr uint64_t kEpoch = 3;

// A standby's pull asking for batch `next`: it has every batch before it.
void StandbyHasUpTo(ReplicationLog* log, uint64_t next) {
  v1::PullRequest req;
  req.set_standby("standby-1");
  req.set_epoch(kEpoch);
  req.set_next_seq(next);
  v1::PullResponse resp;
  log->Pull(req, &resp);
  ASSERT_FALSE(resp.snapshot_needed());
}

class ReplicationMarkTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(0); }
  void TearDown() override { store_->SetReplicator(nullptr); }

  // A log whose mark lives in etcd_; `ahead_revision`: a mark of an
  // earlier term already there.
  void Start(int64_t ahead_revision) {
    if (store_ != nullptr) store_->SetReplicator(nullptr);
    log_.reset();
    store_ = NewMemStore();
    ReplicationOptions o;
    o.epoch = kEpoch;
    // Short: each write no standby answers waits this long first.
    o.sync_timeout = absl::Milliseconds(100);
    o.ahead_revision = ahead_revision;
    etcd_.Install(&o);
    log_ = std::make_unique<ReplicationLog>(o, store_.get());
    store_->SetReplicator(log_.get());
  }

  absl::Status Write(const std::string& key) { return store_->Write({{key, "v", false}}); }

  FakeMarkKey etcd_;
  std::unique_ptr<IndexStore> store_;
  std::unique_ptr<ReplicationLog> log_;
};

TEST_F(ReplicationMarkTest, ARemovalEtcdAppliedButDidNotAnswerMakesTheNextDegradedWriteMarkAgain) {
  ASSERT_OK(Write("o/1"));  // no standby yet: acknowledged marked
  ASSERT_TRUE(etcd_.present());
  StandbyHasUpTo(log_.get(), 2);
  etcd_.set_delete_fault(FakeMarkKey::Fault::kAppliedUnanswered);
  log_->UnmarkIfSynced();
  ASSERT_FALSE(etcd_.present()) << "etcd applied the removal";
  EXPECT_EQ(log_->State().sync, "degraded") << "an unanswered removal leaves the mark unknown, not gone";
  etcd_.set_delete_fault(FakeMarkKey::Fault::kNone);

  // The standby says nothing more: this write waits out the timeout and is
  // acknowledged without it, which only a mark in etcd makes safe.
  ASSERT_OK(Write("o/2"));
  EXPECT_TRUE(etcd_.present()) << "a write no standby has was acknowledged with no mark in etcd";
  EXPECT_EQ(etcd_.puts(), 2);
  EXPECT_EQ(log_->State().degraded_writes, 2u);

  // Caught up again: the mark made for o/2 is the one removed.
  StandbyHasUpTo(log_.get(), 3);
  log_->UnmarkIfSynced();
  EXPECT_FALSE(etcd_.present());
  EXPECT_EQ(log_->State().sync, "semi-sync");
}

TEST_F(ReplicationMarkTest, ARemovalAppliedLateLeavesALaterMarkInPlace) {
  ASSERT_OK(Write("o/1"));
  const int64_t first = etcd_.mod_revision();
  StandbyHasUpTo(log_.get(), 2);
  etcd_.set_delete_fault(FakeMarkKey::Fault::kHeld);
  log_->UnmarkIfSynced();  // its removal is on the way, unanswered
  ASSERT_EQ(etcd_.held(), std::vector<int64_t>{first}) << "the removal names the revision of the mark it removes";
  etcd_.set_delete_fault(FakeMarkKey::Fault::kNone);

  ASSERT_OK(Write("o/2"));  // the standby went quiet: degraded, marked again
  const int64_t second = etcd_.mod_revision();
  ASSERT_NE(second, 0) << "a write no standby has was acknowledged with no mark in etcd";
  EXPECT_GT(second, first);
  etcd_.ApplyHeld();  // the first mark's removal reaches etcd only now
  EXPECT_TRUE(etcd_.present()) << "a late removal of the first mark took the mark o/2 was acknowledged under";
  EXPECT_EQ(etcd_.mod_revision(), second);
}

TEST_F(ReplicationMarkTest, AMarkEtcdAppliedButDidNotAnswerIsRemovedOnceAStandbyCatchesUp) {
  etcd_.set_put_fault(FakeMarkKey::Fault::kAppliedUnanswered);
  absl::Status refused = Write("o/1");
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  ASSERT_TRUE(etcd_.present()) << "etcd applied the mark";
  etcd_.set_put_fault(FakeMarkKey::Fault::kNone);
  EXPECT_EQ(log_->State().sync, "degraded");

  // A mark no one knows the revision of is made again, then removed by it:
  // left behind, it would keep every standby from ever taking over.
  StandbyHasUpTo(log_.get(), 2);
  log_->UnmarkIfSynced();
  EXPECT_FALSE(etcd_.present()) << "the mark etcd applied unanswered stayed behind";
  EXPECT_EQ(log_->State().sync, "semi-sync");
}

TEST_F(ReplicationMarkTest, AnEarlierTermsMarkIsRemovedOnceAStandbyCatchesUp) {
  // This master marked itself ahead, stopped, and was elected again on
  // that mark: its new term starts marked, at the mark's revision.
  ASSERT_OK_AND_ASSIGN(const int64_t earlier, etcd_.Put());
  Start(earlier);
  EXPECT_EQ(log_->State().sync, "degraded");
  StandbyHasUpTo(log_.get(), 1);
  log_->UnmarkIfSynced();
  EXPECT_FALSE(etcd_.present()) << "the earlier term's mark outlived the standby catching up";
  EXPECT_EQ(log_->State().sync, "semi-sync");
  EXPECT_EQ(etcd_.puts(), 1) << "a mark of known revision is removed without being made again";
}

TEST_F(ReplicationMarkTest, ARemovalLostBeforeEtcdSawItIsTriedAgain) {
  ASSERT_OK(Write("o/1"));
  StandbyHasUpTo(log_.get(), 2);
  etcd_.set_delete_fault(FakeMarkKey::Fault::kLost);
  log_->UnmarkIfSynced();
  ASSERT_TRUE(etcd_.present());
  EXPECT_EQ(log_->State().sync, "degraded");
  etcd_.set_delete_fault(FakeMarkKey::Fault::kNone);
  log_->UnmarkIfSynced();
  EXPECT_FALSE(etcd_.present());
  EXPECT_EQ(log_->State().sync, "semi-sync");
}

}  // namespace
}  // namespace tierkv::master
