// Private to transport/: a submitted batch and the queue of work the
// engine's workers run.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "config/base/mutex.h"
#include "transport/backend.h"
#include "transport/engine.h"

namespace tierkv::transport::internal {

class BatchImpl final : public Batch {
 public:
  explicit BatchImpl(size_t requests) : statuses_(requests) {}

  bool Done() const override { return done_.load(std::memory_order_acquire); }
  bool Wait(absl::Time deadline) override;
  const std::vector<absl::Status>& statuses() const override { return statuses_; }

  // Before Start: record a request's final status without any slice.
  void SetStatus(size_t request, absl::Status s) { statuses_[request] = std::move(s); }
  // Slices and the request each belongs to; stable once Start is called.
  std::vector<Slice> slices;
  std::vector<size_t> slice_request;
  // Arms completion: the batch is done when `pending` slices reported.
  void Start(size_t pending);
  // Called by workers for finished slices.
  void Complete(absl::Span<Slice* const> done);

 private:
  void Finish();
  std::vector<absl::Status> statuses_;
  std::atomic<size_t> remaining_{0};
  std::atomic<bool> done_{false};
  Mutex mu_;
  CondVar cv_;
};

struct Task {
  std::shared_ptr<BatchImpl> batch;
  std::shared_ptr<PeerChannel> channel;
  std::string segment;
  std::vector<Slice*> slices;
  absl::Time deadline;
};

// A FIFO of tasks served by a fixed set of threads.
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
