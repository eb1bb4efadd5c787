#include "transport/internal/batch.h"

namespace tierkv::transport::internal {

bool BatchImpl::Wait(absl::Time deadline) {
  MutexLock lock(&mu_);
  while (!done_.load(std::memory_order_acquire)) {
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    cv_.WaitFor(&mu_, absl::ToChronoMicroseconds(left) + std::chrono::microseconds(100));
  }
  return true;
}

void BatchImpl::Start(size_t pending) {
  if (pending == 0) {
    Finish();
    return;
  }
  remaining_.store(pending, std::memory_order_release);
}

void BatchImpl::Complete(absl::Span<Slice* const> done) {
  {
    MutexLock lock(&mu_);
    for (Slice* s : done) {
      size_t req = slice_request[s - slices.data()];
      if (!s->status.ok() && statuses_[req].ok()) statuses_[req] = s->status;
    }
  }
  if (remaining_.fetch_sub(done.size(), std::memory_order_acq_rel) == done.size()) Finish();
}

void BatchImpl::Finish() {
  MutexLock lock(&mu_);
  done_.store(true, std::memory_order_release);
  cv_.SignalAll();
}

WorkQueue::WorkQueue(int threads, Runner run) : run_(std::move(run)) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

WorkQueue::~WorkQueue() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  for (auto& t : threads_) t.join();
}

void WorkQueue::Push(Task task) {
  {
    MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.Signal();  // one task, one worker: no thundering herd
}

void WorkQueue::Loop() {
  for (;;) {
    Task task;
    {
      MutexLock lock(&mu_);
      while (tasks_.empty() && !stopping_) cv_.WaitFor(&mu_, std::chrono::seconds(1));
      if (tasks_.empty()) return;  // stopping, and nothing left to finish
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    run_(task);
  }
}

}  // namespace tierkv::transport::internal
