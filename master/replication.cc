// The leader's side of replication: the serving gate, store positions, and
// ReplicationLog, which keeps the latest committed batches, sends them to
// standbys (pushed on a stream, or pulled over the MasterHa service), serves
// snapshots, and holds each semi-synchronous write until a standby has it.
// The standby's side is in replication_standby.cc.
#include "master/replication.h"

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/log.h"
#include "base/net/socket.h"
#include "base/status.h"
#include "master/grpc_service.h"
#include "master/internal/replication_common.h"
#include "proto/direct_frame.h"

namespace tierkv::master {

namespace {

constexpr uint32_t kPageBytes = 4 << 20;

// The page a standby asked for (0: the default), within what one message carries.
size_t PageBytes(uint32_t asked) { return asked == 0 ? kPageBytes : std::min<size_t>(asked, 32 << 20); }

// A write the log was closed under (a step-down) while it waited.
absl::Status SteppedDown() {
  return absl::UnavailableError(
      absl::StrCat("tierkv master: ", kNotLeader, " any more; the write may not have reached a standby"));
}

}  // namespace

namespace {
absl::Status NotServing() {
  return absl::UnavailableError(absl::StrCat("tierkv master: ", kNotLeader, "; try another master"));
}
}  // namespace

absl::Status ServingGate::Check() const { return open() ? absl::OkStatus() : NotServing(); }

absl::Status ServingGate::AwaitOpen(absl::Time deadline) const {
  if (open()) return absl::OkStatus();
  const int64_t until = until_ns_.load(std::memory_order_acquire);
  if (until == 0) return NotServing();  // closed for good, or never opened
  const std::chrono::steady_clock::duration left =
      std::chrono::steady_clock::duration(until) + absl::ToChronoNanoseconds(grace_) -
      std::chrono::steady_clock::now().time_since_epoch();
  deadline = std::min(deadline, absl::Now() + absl::FromChrono(left));
  MutexLock lock(&mu_);
  const uint64_t closes = closes_;
  while (!open() && closes_ == closes) {
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    cv_.WaitFor(&mu_, absl::ToChronoNanoseconds(deadline - now));
  }
  return open() && closes_ == closes ? absl::OkStatus() : NotServing();
}

std::string EncodePosition(const ReplPosition& p) { return absl::StrCat(p.epoch, " ", p.seq); }

ReplPosition ParsePosition(absl::string_view s) {
  std::vector<absl::string_view> parts = absl::StrSplit(s, ' ');
  ReplPosition p;
  if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &p.epoch) && absl::SimpleAtoi(parts[1], &p.seq)) p.valid = true;
  return p;
}

ReplPosition ReadPosition(IndexStore* store) {
  if (store->Get(kHaSnapshotKey).ok()) return {};  // a snapshot was cut short
  absl::StatusOr<std::string> pos = store->Get(kHaPositionKey);
  return pos.ok() ? ParsePosition(*pos) : ReplPosition{};
}

// ---------------------------------------------------------------- leader

ReplicationLog::ReplicationLog(ReplicationOptions options, IndexStore* store)
    : options_(options), store_(store) {
  MutexLock mark(&mark_mu_);
  if (options_.ahead_revision > 0) SetMark(Mark::kMade, options_.ahead_revision);
}

void ReplicationLog::SetMark(Mark state, int64_t revision) {
  mark_ = state;
  mark_revision_ = state == Mark::kMade ? revision : 0;
  marked_now_ = state != Mark::kNone;
}

ReplicationLog::~ReplicationLog() { Close(); }

uint64_t ReplicationLog::Append(const std::vector<const std::vector<Mutation>*>& group) {
  Entry e;
  for (const std::vector<Mutation>* batch : group) {
    for (const Mutation& m : *batch) {
      if (IsHaKey(m.key)) continue;
      v1::StoreMutation* out = e.batch.add_mutations();
      out->set_key(m.key);
      if (m.remove) {
        out->set_remove(true);
      } else {
        out->set_value(m.value);
      }
    }
  }
  e.bytes = e.batch.ByteSizeLong() + 64;
  uint64_t seq;
  {
    MutexLock lock(&mu_);
    seq = e.seq = ++last_seq_;
    e.batch.set_seq(e.seq);
    log_bytes_ += e.bytes;
    log_.push_back(std::move(e));
    // The oldest go first; a standby that still needed them takes a snapshot.
    while (log_bytes_ > options_.max_log_bytes && log_.size() > 1) {
      log_bytes_ -= log_.front().bytes;
      log_.pop_front();
    }
  }
  // After the unlock: a sender woken under it would only wait for it again.
  appended_cv_.SignalAll();
  return seq;
}

uint64_t ReplicationLog::LastAppended() {
  MutexLock lock(&mu_);
  return last_seq_;
}

void ReplicationLog::Claim(uint64_t seq, WakeList* wake) {
  for (auto it = waiters_.begin(); it != waiters_.end() && it->first <= seq; it = waiters_.erase(it)) {
    it->second->claimed = true;
    wake->Add(std::move(it->second));
  }
}

absl::Status ReplicationLog::Await(uint64_t seq) {
  if (!options_.semi_sync) return absl::OkStatus();
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.sync_timeout);
  {
    // Woken only when its own batch is acknowledged (or the mode changes),
    // not on every acknowledgement: a round that acknowledges a few batches
    // must not wake every writer waiting on later ones.
    std::shared_ptr<Waiter> mine;
    std::multimap<uint64_t, std::shared_ptr<Waiter>>::iterator at;
    {
      MutexLock lock(&mu_);
      if (!closed_ && synced_ && acked_ < seq) {
        mine = std::make_shared<Waiter>();
        at = waiters_.emplace(seq, mine);
      }
    }
    if (mine != nullptr && !mine->WaitUntil(deadline)) {
      bool claimed;
      {
        MutexLock lock(&mu_);
        claimed = mine->claimed;
        if (!claimed) waiters_.erase(at);
      }
      if (claimed) mine->Wait();  // woken just after its claimer unlocks
    }
    WakeList wake;
    MutexLock lock(&mu_);
    if (closed_) return SteppedDown();
    if (acked_ >= seq) return absl::OkStatus();
    if (synced_) {
      synced_ = false;
      Claim(UINT64_MAX, &wake);  // every writer waiting goes on unreplicated too
      TKV_LOG(WARNING) << "replication: no standby acknowledged batch " << seq << " within "
                       << options_.sync_timeout << "; writes go on unreplicated until one catches up";
    }
  }
  // Acknowledged without a standby: first say so where candidates look.
  if (options_.mark_ahead) {
    MutexLock mark(&mark_mu_);
    // Only a mark this log saw etcd take stands for certain; an unknown one
    // (a failed mark, or a failed removal etcd may have applied) is made again.
    if (mark_ != Mark::kMade) {
      {
        // A writer that waited here through a step-down asks etcd nothing.
        MutexLock lock(&mu_);
        if (closed_) return SteppedDown();
      }
      if (absl::Now() < mark_failed_until_) return mark_failure_;
      absl::StatusOr<int64_t> made = options_.mark_ahead();
      if (!made.ok()) {
        SetMark(Mark::kUnknown);
        mark_failure_ = absl::UnavailableError(
            absl::StrCat("the write reached no standby, and marking the leader ahead of its standbys failed: ",
                         made.status().message()));
        mark_failed_until_ = absl::Now() + options_.sync_timeout;
        return mark_failure_;
      }
      SetMark(Mark::kMade, *made);
    }
  }
  MutexLock lock(&mu_);
  ++degraded_writes_;
  return absl::OkStatus();
}

void ReplicationLog::UnmarkIfSynced() {
  if (!options_.mark_ahead || !options_.unmark_ahead) return;
  MutexLock mark(&mark_mu_);
  if (mark_ == Mark::kNone) return;
  {
    MutexLock lock(&mu_);
    if (!synced_ || closed_) return;
  }
  // A write that times out from here waits on mark_mu_ and marks again.
  if (mark_ == Mark::kUnknown) {
    // Whatever an earlier call left in etcd is replaced by a mark whose
    // revision is known, which the removal below is then fenced on.
    absl::StatusOr<int64_t> made = options_.mark_ahead();
    if (!made.ok()) return;
    SetMark(Mark::kMade, *made);
  }
  SetMark(options_.unmark_ahead(mark_revision_).ok() ? Mark::kNone : Mark::kUnknown);
}

StandbyInfo& ReplicationLog::Standby(const std::string& name) {
  for (StandbyInfo& s : standbys_) {
    if (s.name == name) return s;
  }
  standbys_.push_back({name});
  return standbys_.back();
}

bool ReplicationLog::Positioned(const v1::PullRequest& req, StandbyInfo* standby) {
  const uint64_t first = log_.empty() ? last_seq_ + 1 : log_.front().seq;
  standby->snapshotting = req.epoch() != options_.epoch || req.next_seq() == 0 || req.next_seq() > last_seq_ + 1 ||
                          req.next_seq() < first;
  return !standby->snapshotting;
}

void ReplicationLog::Acknowledge(const std::string& name, uint64_t next_seq, WakeList* wake) {
  StandbyInfo& standby = Standby(name);
  standby.last_seen = absl::Now();
  // Everything before next_seq is applied there.
  standby.acked = std::max(standby.acked, next_seq - 1);
  if (standby.acked > acked_) {
    acked_ = standby.acked;
    Claim(acked_, wake);
  }
  if (!synced_ && standby.acked >= last_seq_) {
    synced_ = true;
    TKV_LOG(INFO) << "replication: standby " << name << " has caught up at batch " << standby.acked
                  << "; writes wait for a standby's acknowledgement";
    if (options_.caught_up) options_.caught_up();
  }
}

uint64_t ReplicationLog::AddBatches(uint64_t next, size_t max_bytes, v1::PullResponse* resp) {
  size_t bytes = 0;
  for (size_t i = next - log_.front().seq; i < log_.size(); ++i) {
    if (bytes > 0 && bytes + log_[i].bytes > max_bytes) break;
    *resp->add_batches() = log_[i].batch;
    bytes += log_[i].bytes;
    next = log_[i].seq + 1;
  }
  return next;
}

void ReplicationLog::Pull(const v1::PullRequest& req, v1::PullResponse* resp) {
  resp->set_epoch(options_.epoch);
  {
    // The writers this lets go are woken before the wait below: one of them
    // may be what it waits for.
    WakeList wake;
    MutexLock lock(&mu_);
    StandbyInfo& standby = Standby(req.standby());
    standby.last_seen = absl::Now();
    if (!Positioned(req, &standby)) {
      resp->set_snapshot_needed(true);
      return;
    }
    Acknowledge(req.standby(), req.next_seq(), &wake);
  }
  MutexLock lock(&mu_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::min(req.wait_ms(), 1000u));
  while (!closed_ && last_seq_ < req.next_seq() && std::chrono::steady_clock::now() < deadline) {
    appended_cv_.WaitFor(&mu_, std::chrono::duration_cast<std::chrono::milliseconds>(
                                deadline - std::chrono::steady_clock::now()) + std::chrono::milliseconds(1));
  }
  if (closed_ || log_.empty() || last_seq_ < req.next_seq()) return;
  if (req.next_seq() < log_.front().seq) {  // trimmed while it waited
    resp->set_snapshot_needed(true);
    return;
  }
  AddBatches(req.next_seq(), PageBytes(req.max_bytes()), resp);
}

namespace {

// One reply frame of a replication stream (proto/direct_frame.h).
bool SendFrame(int fd, const v1::PullResponse& resp, std::string* buf) {
  direct::ReplyHeader h;
  h.length = static_cast<uint32_t>(resp.ByteSizeLong());
  buf->resize(direct::kHeaderSize + h.length);
  direct::EncodeReply(h, buf->data());
  resp.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(buf->data() + direct::kHeaderSize));
  iovec iov{buf->data(), buf->size()};
  return net::SendVecAll(fd, &iov, 1).ok();
}

// One call frame (a PullRequest) off a replication stream; false at its end
// or on anything that is not one.
bool RecvCall(int fd, v1::PullRequest* req, std::string* buf) {
  char h[direct::kHeaderSize];
  if (!net::RecvAll(fd, h, sizeof h).ok()) return false;
  absl::StatusOr<direct::CallHeader> call = direct::DecodeCall(h, 1 << 20);
  if (!call.ok() || call->method != direct::DirectMethod::kReplicate) return false;
  buf->resize(call->length);
  return net::RecvAll(fd, buf->data(), buf->size()).ok() && req->ParseFromString(*buf);
}

}  // namespace

void ReplicationLog::Stream(int fd, const v1::PullRequest& first) {
  const std::string name = first.standby();
  const size_t max_bytes = PageBytes(first.max_bytes());
  v1::PullResponse resp;
  std::string buf;
  uint64_t next = first.next_seq();
  bool positioned;
  {
    WakeList wake;
    MutexLock lock(&mu_);
    StandbyInfo& standby = Standby(name);
    standby.last_seen = absl::Now();
    if (closed_) return;
    positioned = Positioned(first, &standby);
    if (positioned) Acknowledge(name, next, &wake);
  }
  if (!positioned) {
    resp.set_epoch(options_.epoch);
    resp.set_snapshot_needed(true);
    (void)SendFrame(fd, resp, &buf);
    return;
  }
  // A standby acknowledges every frame, heartbeats included, so one silent
  // for this long is gone; one that stops reading is dropped as fast.
  net::SetTimeouts(fd, absl::Seconds(2));
  bool ended = false;  // guarded by mu_: the acknowledgements stopped
  uint64_t acked_next = next;  // guarded by mu_: the standby has every batch before this
  std::thread acks([&] {
    v1::PullRequest ack;
    std::string in;
    for (;;) {
      // Under semi-sync, writers wait for this acknowledgement: a reader
      // asleep in recv adds its wake-up to every round.
      net::SpinUntilReadable(fd, options_.spin);
      if (!RecvCall(fd, &ack, &in)) break;
      WakeList wake;
      bool more;
      {
        MutexLock lock(&mu_);
        if (ack.next_seq() == 0 || ack.next_seq() > last_seq_ + 1) break;  // acknowledges what was never sent
        Acknowledge(name, ack.next_seq(), &wake);
        more = ack.next_seq() > acked_next;
        if (more) acked_next = ack.next_seq();
      }
      if (more && !options_.semi_sync) appended_cv_.SignalAll();  // the async sender may go on
    }
    ::shutdown(fd, SHUT_RDWR);
    MutexLock lock(&mu_);
    ended = true;
    appended_cv_.SignalAll();
  });
  // Batches go out as they commit, while the standby applies the last
  // ones: no round waits for the standby to ask again. An async sender
  // that has caught up keeps one frame in flight, so the next carries
  // every batch committed meanwhile; one with a backlog (a standby
  // catching up) sends page after page without waiting.
  bool backlog = false;
  for (bool last = false; !last;) {
    resp.Clear();
    resp.set_epoch(options_.epoch);
    {
      MutexLock lock(&mu_);
      const auto heartbeat = std::chrono::steady_clock::now() + std::chrono::milliseconds(kPullWaitMs);
      while (!closed_ && !ended && (last_seq_ < next || (!options_.semi_sync && !backlog && acked_next < next)) &&
             std::chrono::steady_clock::now() < heartbeat) {
        appended_cv_.WaitFor(&mu_, std::chrono::duration_cast<std::chrono::milliseconds>(
                                       heartbeat - std::chrono::steady_clock::now()) + std::chrono::milliseconds(1));
      }
      if (closed_ || ended) break;
      if (last_seq_ >= next) {
        if (log_.empty() || next < log_.front().seq) {  // trimmed: it fell too far behind
          resp.set_snapshot_needed(true);
          last = true;
        } else {
          next = AddBatches(next, max_bytes, &resp);
          backlog = last_seq_ >= next;  // the page was full
        }
      }
    }
    if (!SendFrame(fd, resp, &buf)) break;
  }
  ::shutdown(fd, SHUT_RDWR);
  acks.join();
}

absl::Status ReplicationLog::Snapshot(const v1::SnapshotRequest& req, v1::SnapshotResponse* resp) {
  resp->set_epoch(options_.epoch);
  uint64_t seq;
  {
    MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError(absl::StrCat("tierkv master: ", kNotLeader));
    StandbyInfo& standby = Standby(req.standby());
    standby.last_seen = absl::Now();
    standby.snapshotting = true;
    if (req.after_key().empty()) {
      // Every batch up to here is in the store already (Append follows the
      // commit); later ones may or may not show in the pages, and the
      // standby applies them again after its last page, which leaves each
      // key as the leader has it.
      seq = last_seq_;
    } else {
      seq = req.seq();
      const uint64_t first = log_.empty() ? last_seq_ + 1 : log_.front().seq;
      if (seq + 1 < first || seq > last_seq_) {
        return absl::FailedPreconditionError("snapshot: the log moved past its sequence; start it again");
      }
    }
  }
  resp->set_seq(seq);
  const size_t max_bytes = PageBytes(req.max_bytes());
  size_t bytes = 0;
  bool more = false;
  RETURN_IF_ERROR(store_->ScanAfter(req.after_key(), [&](absl::string_view k, absl::string_view v) {
    if (IsHaKey(k)) return true;
    if (bytes >= max_bytes) {
      more = true;
      return false;
    }
    v1::StoreMutation* r = resp->add_records();
    r->set_key(std::string(k));
    r->set_value(std::string(v));
    bytes += k.size() + v.size() + 8;
    return true;
  }));
  resp->set_done(!more);
  return absl::OkStatus();
}

void ReplicationLog::Close() {
  WakeList wake;
  MutexLock lock(&mu_);
  closed_ = true;
  appended_cv_.SignalAll();
  Claim(UINT64_MAX, &wake);
}

ReplicationState ReplicationLog::State() {
  MutexLock lock(&mu_);
  ReplicationState s;
  s.epoch = options_.epoch;
  s.last_seq = last_seq_;
  s.sync = closed_                ? "closed"
           : !options_.semi_sync   ? "async"
           : synced_ && !marked_now_ ? "semi-sync"
                                     : "degraded";
  s.degraded_writes = degraded_writes_;
  s.standbys = standbys_;
  return s;
}

namespace {

class HaService final : public v1::MasterHa::Service {
 public:
  HaService(ReplicationLog* log, const auth::Authenticator* auth) : log_(log), auth_(auth) {}
  grpc::Status Pull(grpc::ServerContext* ctx, const v1::PullRequest* req, v1::PullResponse* resp) override {
    if (absl::Status s = Admit(*ctx, "replication pull"); !s.ok()) return ToGrpcStatus(s);
    log_->Pull(*req, resp);
    return grpc::Status::OK;
  }
  grpc::Status Snapshot(grpc::ServerContext* ctx, const v1::SnapshotRequest* req,
                        v1::SnapshotResponse* resp) override {
    if (absl::Status s = Admit(*ctx, "replication snapshot"); !s.ok()) return ToGrpcStatus(s);
    return ToGrpcStatus(log_->Snapshot(*req, resp));
  }

 private:
  absl::Status Admit(const grpc::ServerContext& ctx, absl::string_view what) const {
    if (auth_ == nullptr || !auth_->enabled()) return absl::OkStatus();
    return AuthorizeGrpcCall(*auth_, ctx, auth::kAdmin, what).status();
  }

  ReplicationLog* const log_;
  const auth::Authenticator* const auth_;
};

}  // namespace

std::unique_ptr<v1::MasterHa::Service> NewMasterHaService(ReplicationLog* log, const auth::Authenticator* auth) {
  return std::make_unique<HaService>(log, auth);
}

}  // namespace tierkv::master
