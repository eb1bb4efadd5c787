#include "transport/internal/batch.h"

namespace tierkv::transport::internal {

bool BatchImpl::Wait(absl::Time deadline) {
  {
    MutexLock lock(&mu_);
    for (;;) {
      if (done_.load(std::memory_order_acquire)) return true;
      absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      cv_.WaitFor(&mu_, absl::ToChronoMicroseconds(left) + std::chrono::microseconds(100));
    }
    Seal();
  }
  // Outside mu_: a holder finishing its copy never needs it, and Complete does.
  claim_.Revoke();
  return false;
}

std::vector<absl::Status> BatchImpl::statuses() const {
  MutexLock lock(&mu_);
  std::vector<absl::Status> out = statuses_;
  if (!done_.load(std::memory_order_acquire) && !sealed_.load(std::memory_order_acquire)) {
    // Asked before the end: a request still on the wire is not OK.
    const bool late = absl::Now() >= deadline_;
    for (size_t i = 0; i < out.size(); ++i) {
      if (pending_[i] == 0 || !out[i].ok()) continue;
      out[i] = late ? absl::DeadlineExceededError("the request did not finish by its deadline")
                    : absl::UnavailableError("the request is still in flight");
    }
  }
  for (const auto& [follower, lead] : followers_) out[follower] = out[lead];
  return out;
}

void BatchImpl::Seal() {
  if (sealed_.exchange(true, std::memory_order_acq_rel)) return;
  for (size_t i = 0; i < statuses_.size(); ++i) {
    if (pending_[i] > 0 && statuses_[i].ok()) {
      statuses_[i] = absl::DeadlineExceededError("the request did not finish by its deadline");
    }
  }
}

void BatchImpl::Start() {
  {
    MutexLock lock(&mu_);
    for (size_t req : slice_request) ++pending_[req];
    remaining_ = slices.size();
    if (remaining_ > 0) return;
  }
  Finish();
}

void BatchImpl::Complete(absl::Span<Slice* const> done) {
  bool finished;
  {
    MutexLock lock(&mu_);
    const bool sealed = sealed_.load(std::memory_order_acquire);
    for (Slice* s : done) {
      size_t req = slice_request[s - slices.data()];
      --pending_[req];
      if (!sealed && !s->status.ok() && statuses_[req].ok()) statuses_[req] = s->status;
    }
    remaining_ -= done.size();
    finished = remaining_ == 0;
  }
  if (finished) Finish();
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
    TaskClaimScope scope(task.batch != nullptr ? task.batch->claim() : nullptr);
    run_(task);
  }
}

}  // namespace tierkv::transport::internal
