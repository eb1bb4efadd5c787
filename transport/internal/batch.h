// Private to transport/: a submitted batch and the queue of work the
// engine's workers run.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "transport/backend.h"
#include "transport/buffer_claim.h"
#include "transport/engine.h"

namespace tierkv::transport::internal {

// Completion is counted per slice and per request, so statuses() can tell
// a finished request from one still on the wire. A Wait that times out
// seals the batch: every unfinished request is DEADLINE_EXCEEDED from then
// on, and slices that finish later no longer change any status (the caller
// has already acted on them). It then revokes the batch's claim on its
// local buffers (buffer_claim.h) and returns once no copy into them is in
// progress: the caller may free them.
class BatchImpl final : public Batch {
 public:
  BatchImpl(size_t requests, absl::Time deadline)
      : deadline_(deadline), statuses_(requests), pending_(requests, 0) {}

  bool Done() const override { return done_.load(std::memory_order_acquire); }
  bool Wait(absl::Time deadline) override;
  std::vector<absl::Status> statuses() const override;
  // True once a Wait timed out: workers skip tasks not yet posted.
  bool sealed() const { return sealed_.load(std::memory_order_acquire); }
  // What the workers' backends hold around each copy into or out of the
  // requests' local buffers; revoked by a Wait that times out.
  BufferClaim* claim() { return &claim_; }

  // Before Start: record a request's final status without any slice.
  void SetStatus(size_t request, absl::Status s) {
    MutexLock lock(&mu_);
    statuses_[request] = std::move(s);
  }
  // Before Start: request `follower` moves inside `lead`'s slices (the
  // engine coalesced them) and reports `lead`'s status.
  void Follow(size_t follower, size_t lead) { followers_.emplace_back(follower, lead); }
  // Slices and the request each belongs to; stable once Start is called.
  std::vector<Slice> slices;
  std::vector<size_t> slice_request;
  // Arms completion: the batch is done when every slice reported.
  void Start();
  // Called by workers for finished slices.
  void Complete(absl::Span<Slice* const> done);

 private:
  void Finish();
  // Unfinished requests become DEADLINE_EXCEEDED; later completions are ignored.
  void Seal() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Time deadline_;
  mutable Mutex mu_;
  CondVar cv_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> pending_ ABSL_GUARDED_BY(mu_);  // unfinished slices per request
  std::vector<std::pair<size_t, size_t>> followers_;    // (follower, lead); fixed once started
  size_t remaining_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> sealed_{false};
  std::atomic<bool> done_{false};
  BufferClaim claim_;
};

struct Task {
  std::shared_ptr<BatchImpl> batch;
  std::shared_ptr<PeerChannel> channel;
  std::string segment;
  std::vector<Slice*> slices;
  absl::Time deadline;
};

// A FIFO of tasks served by a fixed set of threads. Each task runs with its
// batch's claim as the thread's CurrentTaskClaim().
class WorkQueue {
 public:
  using Runner = std::function<void(Task&)>;
  WorkQueue(int threads, Runner run);
  ~WorkQueue();
  void Push(Task task);

 private:
  void Loop();
  Runner run_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace tierkv::transport::internal
