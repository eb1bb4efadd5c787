// Replication of the leader master's store to its standbys (docs/ha.md).
//
// Leader: ReplicationLog is the Replicator its store hands every committed
// batch to. Batches are numbered from 1 in each epoch and the latest are
// kept in memory (at most max_log_bytes). Standbys follow them on a stream
// the leader pushes as batches commit (Stream, on the direct lane), or pull
// them over the MasterHa service from a leader that does not stream.
// Semi-synchronous (the default): a write returns once a standby has
// acknowledged its batch, so a promoted standby has every acknowledged put. When no standby acknowledges within sync_timeout the
// log turns degraded and stops waiting, until a standby has caught up
// again: one dead standby never stops the cluster's puts. After Close (the
// leader was deposed) every waiting and later write fails UNAVAILABLE.
//
// Standby: StandbyCopier follows the leader's stream (or pulls) and applies
// the batches to its own store, with its position ("h/pos": epoch and
// sequence) in the same write. A copy without a position in the leader's log (new, too far
// behind, or following an earlier epoch) first takes a snapshot: the whole
// store in pages, then the batches after the snapshot's sequence. While a
// snapshot is being installed "h/snap" marks the copy incomplete: such a
// master never campaigns.
//
// ServingGate: whether this master may answer as the leader now (its etcd
// lease is surely alive); every RPC checks it before and after it runs.
//
// Thread-safe.
#pragma once

#include <grpcpp/security/credentials.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "base/auth.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "base/status.h"
#include "master/persistence.h"
#include "proto/master.grpc.pb.h"

namespace tierkv::master {

// Keys under "h/" are this master's own bookkeeping: never replicated,
// never part of a snapshot, ignored by recovery.
inline constexpr char kHaPrefix[] = "h/";
inline constexpr char kHaPositionKey[] = "h/pos";
inline constexpr char kHaSnapshotKey[] = "h/snap";

// Where a store's copy stands: every batch of `epoch` up to `seq` applied.
struct ReplPosition {
  uint64_t epoch = 0;
  uint64_t seq = 0;
  bool valid = false;  // false: no position (a new store, or a snapshot cut short)
  friend bool operator<(const ReplPosition& a, const ReplPosition& b) {
    return a.epoch != b.epoch ? a.epoch < b.epoch : a.seq < b.seq;
  }
};
std::string EncodePosition(const ReplPosition& p);
// An absent or unreadable position is {valid = false}.
ReplPosition ParsePosition(absl::string_view s);
// The store's own position, from its "h/pos" and "h/snap" keys.
ReplPosition ReadPosition(IndexStore* store);

// The leader's serving gate: open while its etcd lease is surely alive.
// It closes by itself when that time passes (the lease unconfirmed), and
// for good on Close (the leader steps down); OpenUntil opens it again.
class ServingGate {
 public:
  // Open until `until` (steady clock), as the lease allows.
  void OpenUntil(std::chrono::steady_clock::time_point until) {
    until_ns_.store(until.time_since_epoch().count(), std::memory_order_release);
    MutexLock lock(&mu_);
    cv_.SignalAll();
  }
  // Closed for good: calls waiting in AwaitOpen are refused.
  void Close() {
    until_ns_.store(0, std::memory_order_release);
    MutexLock lock(&mu_);
    ++closes_;
    cv_.SignalAll();
  }
  bool open() const {
    return std::chrono::steady_clock::now().time_since_epoch().count() <
           until_ns_.load(std::memory_order_acquire);
  }
  // OK while open; UNAVAILABLE naming kNotLeader (base/status.h)
  // otherwise.
  absl::Status Check() const;
  // For an answer already decided: OK if the gate is open, or opens again
  // before `deadline` and within the grace after it closed, without having
  // been closed for good in between (the lease was confirmed, so the leader
  // never stopped being one); else as Check.
  absl::Status AwaitOpen(absl::Time deadline) const;
  // The grace: no successor can be elected sooner after the gate closes by
  // itself (the lease's margin), so a wait that long delays no failover.
  // Zero (the default): answers do not wait. Set before serving.
  void set_grace(absl::Duration grace) { grace_ = grace; }

 private:
  std::atomic<int64_t> until_ns_{0};
  absl::Duration grace_;
  mutable Mutex mu_;
  mutable CondVar cv_;
  uint64_t closes_ ABSL_GUARDED_BY(mu_) = 0;
};

struct ReplicationOptions {
  uint64_t epoch = 0;
  bool semi_sync = true;
  absl::Duration sync_timeout = absl::Seconds(1);
  size_t max_log_bytes = size_t{256} << 20;
  // Semi-sync: makes the "ahead" mark before a write no standby has is
  // acknowledged (while it stands no standby may take over), answering the
  // mark's etcd mod revision. A write whose mark fails is refused
  // UNAVAILABLE. Null (with unmark_ahead): nothing to mark.
  std::function<absl::StatusOr<int64_t>()> mark_ahead;
  // Removes the mark made at `revision` once a standby has caught up, only
  // while the mark is still that one: a removal etcd applies late never
  // takes away a later mark. An error means it may or may not have been
  // applied.
  std::function<absl::Status(int64_t revision)> unmark_ahead;
  // A mark of this master's already in etcd when the log starts (made in an
  // earlier term), at this mod revision; 0: none. Removed like the log's
  // own once a standby has caught up.
  int64_t ahead_revision = 0;
  // Called when a standby has caught up after the log was degraded, so the
  // mark can be cleared (UnmarkIfSynced) without waiting for a timer.
  std::function<void()> caught_up;
  // How long a stream's reader busy-polls for a standby's next
  // acknowledgement before sleeping (--direct-spin; zero: never).
  absl::Duration spin = absl::ZeroDuration();
};

struct StandbyInfo {
  std::string name;
  uint64_t acked = 0;       // batches of this epoch it has applied
  bool snapshotting = false;
  absl::Time last_seen;
};

struct ReplicationState {
  uint64_t epoch = 0;
  uint64_t last_seq = 0;
  // semi-sync | degraded | async | closed; degraded until the "ahead" mark
  // is cleared, since until then no standby may take over.
  std::string sync;
  uint64_t degraded_writes = 0;  // writes acknowledged without a standby
  std::vector<StandbyInfo> standbys;
};

class ReplicationLog final : public Replicator {
 public:
  ReplicationLog(ReplicationOptions options, IndexStore* store);
  ~ReplicationLog() override;

  uint64_t Append(const std::vector<const std::vector<Mutation>*>& group) override;
  absl::Status Await(uint64_t seq) override;
  uint64_t LastAppended() override;

  // The MasterHa calls (proto/master.proto).
  void Pull(const v1::PullRequest& req, v1::PullResponse* resp);
  // Serves a standby's replication stream on the direct-lane connection
  // `fd` (proto/direct_frame.h, kReplicate), whose first call was `first`:
  // frames of batches as they commit, a heartbeat frame every 200 ms with
  // none, the standby's acknowledgements read as they come. Returns when
  // the standby goes (or is silent for 2 s), after a frame saying it needs
  // a snapshot, or on Close; the caller then closes `fd`.
  void Stream(int fd, const v1::PullRequest& first);
  absl::Status Snapshot(const v1::SnapshotRequest& req, v1::SnapshotResponse* resp);

  // The leader was deposed: writers waiting and to come get UNAVAILABLE,
  // pullers are answered at once. Idempotent.
  void Close();
  // Clears the "ahead" mark once a standby has caught up (unmark_ahead);
  // when an earlier call left the mark's state unknown, first makes it
  // again so that its revision is known. The leader calls it now and then,
  // off the write path; it blocks for those etcd calls.
  void UnmarkIfSynced();
  ReplicationState State();

 private:
  struct Entry {
    uint64_t seq;
    size_t bytes;
    v1::ReplBatch batch;
  };
  // A writer in Await. Whoever wakes it first takes it out of waiters_
  // (claimed, under mu_), then wakes it after unlocking: a writer woken
  // under the log's lock would only wait for that lock again. (Not a
  // std::binary_semaphore: its timed wait spins on sched_yield, which
  // costs the other threads on a busy machine more than the wait saves;
  // nor absl::Notification, whose locking TSan cannot see here, as
  // base/mutex.h explains.)
  class Waiter {
   public:
    void Wake() {
      {
        MutexLock lock(&mu_);
        woken_ = true;
      }
      cv_.Signal();
    }
    // Whether it was woken before `deadline`.
    bool WaitUntil(std::chrono::steady_clock::time_point deadline) {
      MutexLock lock(&mu_);
      while (!woken_) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) return false;
        cv_.WaitFor(&mu_, deadline - now);
      }
      return true;
    }
    void Wait() {
      MutexLock lock(&mu_);
      while (!woken_) cv_.Wait(&mu_);
    }
    bool claimed = false;  // guarded by the log's mu_

   private:
    Mutex mu_;
    CondVar cv_;
    bool woken_ ABSL_GUARDED_BY(mu_) = false;
  };
  // Releases the claimed writers when it goes out of scope: declare it
  // before the MutexLock, so that happens after the unlock.
  class WakeList {
   public:
    WakeList() = default;
    WakeList(const WakeList&) = delete;
    WakeList& operator=(const WakeList&) = delete;
    ~WakeList() {
      for (const std::shared_ptr<Waiter>& w : claimed_) w->Wake();
    }
    void Add(std::shared_ptr<Waiter> w) { claimed_.push_back(std::move(w)); }

   private:
    std::vector<std::shared_ptr<Waiter>> claimed_;
  };
  // The standby `name`, created on first sight.
  StandbyInfo& Standby(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Claims every writer waiting on a batch up to `seq` into `wake`.
  void Claim(uint64_t seq, WakeList* wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the log can serve a standby asking for `req` (else it needs a
  // snapshot); marks the standby snapshotting or not.
  bool Positioned(const v1::PullRequest& req, StandbyInfo* standby) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The standby `name` has applied every batch before `next_seq`.
  // Writers it lets go are added to `wake`.
  void Acknowledge(const std::string& name, uint64_t next_seq, WakeList* wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds the batches from `next` (in the log) up to about max_bytes;
  // returns the sequence after the last added.
  uint64_t AddBatches(uint64_t next, size_t max_bytes, v1::PullResponse* resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ReplicationOptions options_;
  IndexStore* const store_;
  Mutex mu_;
  CondVar appended_cv_;  // a batch arrived, or Close
  // Writers waiting in Await, by the batch each waits for; each is
  // claimed and woken once its batch is acknowledged, or on Close or
  // degrading.
  std::multimap<uint64_t, std::shared_ptr<Waiter>> waiters_ ABSL_GUARDED_BY(mu_);
  std::deque<Entry> log_ ABSL_GUARDED_BY(mu_);
  size_t log_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t acked_ ABSL_GUARDED_BY(mu_) = 0;  // the most any standby has applied
  // A standby has caught up since the last time one failed to acknowledge
  // in time; false until the first one has.
  bool synced_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t degraded_writes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<StandbyInfo> standbys_ ABSL_GUARDED_BY(mu_);
  // Where the "ahead" mark stands in etcd, as far as this log can know.
  // etcd may apply a call that failed or timed out, so after one the state
  // is unknown: a degraded write then makes the mark again before it is
  // acknowledged, and UnmarkIfSynced makes it again before removing it.
  enum class Mark { kNone, kMade, kUnknown };
  // Records `state` (and the revision of a mark made); under mark_mu_.
  void SetMark(Mark state, int64_t revision = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mark_mu_);
  // Held across mark_ahead and unmark_ahead calls, which may take an etcd
  // round trip; never taken under mu_.
  Mutex mark_mu_;
  Mark mark_ ABSL_GUARDED_BY(mark_mu_) = Mark::kNone;
  int64_t mark_revision_ ABSL_GUARDED_BY(mark_mu_) = 0;  // while kMade
  // A mark that failed, answered to the writers behind it until then
  // (sync_timeout on), rather than each asking etcd again in turn.
  absl::Status mark_failure_ ABSL_GUARDED_BY(mark_mu_);
  absl::Time mark_failed_until_ ABSL_GUARDED_BY(mark_mu_) = absl::InfinitePast();
  std::atomic<bool> marked_now_{false};  // mark_ != kNone, readable without waiting on mark_mu_
};

// The MasterHa gRPC service over `log` (a synchronous service: a Pull
// waits for batches on a thread of gRPC's pool). With `auth` enabled,
// Pull and Snapshot need a caller with the admin role: they read every
// tenant's index, and a puller counts as a standby for semi-sync.
std::unique_ptr<v1::MasterHa::Service> NewMasterHaService(ReplicationLog* log,
                                                          const auth::Authenticator* auth = nullptr);

class StandbyCopier {
 public:
  // `self`: this master's advertised address, its name to the leader.
  // `page_bytes`: how much one pull or snapshot page carries at most.
  // `spin`: how long the stream's reader busy-polls for the leader's next
  // frame before sleeping (--direct-spin; zero: never).
  // `token`: presented to a leader running --auth token (--ha-token-file;
  // its caller needs the admin role there); empty: none.
  // `creds`: for the leader's gRPC port; null: insecure. A leader serving
  // TLS has no direct lane, so with TLS credentials the copy is pulled over
  // gRPC, never streamed.
  static constexpr uint32_t kDefaultPageBytes = 4 << 20;
  StandbyCopier(IndexStore* store, std::string self, uint32_t page_bytes = kDefaultPageBytes,
                absl::Duration spin = absl::ZeroDuration(), std::string token = "",
                std::shared_ptr<grpc::ChannelCredentials> creds = nullptr, bool tls = false);
  ~StandbyCopier();  // Stop()

  // Copies from the leader at `address` (host:port) from now on; "" pauses.
  void Follow(const std::string& address);
  // Stops the thread; the store is left at a consistent position.
  void Stop();
  ReplPosition position();
  // The leader followed and the sequence it last reported (for lag).
  std::string leader();
  uint64_t leader_seq();
  // Snapshots taken (completed) since it started.
  uint64_t snapshots();
  // Batches applied from replication streams (the rest were pulled).
  uint64_t streamed();

 private:
  void Loop();
  // One snapshot when needed; else a replication stream from the leader at
  // `address` (its direct lane) while *stream, which a leader refusing
  // streams turns off; else one pull from `stub`.
  absl::Status Step(v1::MasterHa::Stub* stub, const std::string& address, bool* stream);
  // Applies a pull's or a stream frame's batches after *pos, advancing it.
  absl::Status Apply(const v1::PullResponse& resp, ReplPosition* pos);
  // Follows the stream until it ends, the leader changes, a snapshot is
  // needed or Stop; *refused when the leader answered it with an error.
  absl::Status StreamFrom(const std::string& address, ReplPosition pos, bool* refused);
  absl::Status TakeSnapshot(v1::MasterHa::Stub* stub);
  // Adds the token, if any, to a call to the leader.
  void Present(grpc::ClientContext* ctx) const;

  IndexStore* const store_;
  const std::string self_;
  const uint32_t page_bytes_;
  const absl::Duration spin_;
  const std::string token_;
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  const bool tls_;
  Mutex mu_;
  CondVar cv_;
  uint64_t snapshots_ ABSL_GUARDED_BY(mu_) = 0;
  std::string leader_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped by Follow
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  ReplPosition pos_ ABSL_GUARDED_BY(mu_);
  bool need_snapshot_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t leader_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int stream_fd_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t streamed_ ABSL_GUARDED_BY(mu_) = 0;  // the stream's connection, while one is open
  std::thread thread_;
};

}  // namespace tierkv::master
