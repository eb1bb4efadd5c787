// A std::mutex that carries Clang's thread-safety capability annotations.
//
// Debian's Abseil is not built with ThreadSanitizer, so TSan cannot see
// absl::Mutex synchronise and reports false races. tierkv locks with
// std::mutex (which TSan intercepts) through this wrapper, so
// ABSL_GUARDED_BY / -Wthread-safety still check the locking discipline.
#pragma once

#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "absl/base/thread_annotations.h"

namespace tierkv {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

// Waits on a condition with a Mutex held; a thin std::condition_variable.
class CondVar {
 public:
  // Blocks until notified or `deadline_ms` milliseconds pass. `mu` must be
  // held; it is released while waiting and re-acquired before returning.
  template <class Rep, class Period>
  void WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> d) {
    std::unique_lock<std::mutex> lock(mu->native(), std::adopt_lock);
    cv_.wait_for(lock, d);
    lock.release();
  }
  // Blocks until notified (or a spurious wake-up); `mu` as for WaitFor.
  void Wait(Mutex* mu) {
    std::unique_lock<std::mutex> lock(mu->native(), std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace tierkv
