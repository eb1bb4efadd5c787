// A batch's claim on its local buffers: what a transport holds while it
// copies bytes into (or out of) a caller's memory, and what the batch
// revokes when its caller stops waiting (a Batch::Wait that times out), so
// that nothing touches a caller's buffer after the call that lent it has
// returned (from Python, the buffer may be freed the next moment).
//
// A holder copies only what is there already (a non-blocking receive or
// send, a memcpy of one slice) and never waits on the network while it
// holds the claim, so Revoke returns within one such copy. A transfer that
// finds the claim revoked must not touch the buffer: it drops the bytes, or
// the connection they were on.
//
//   BufferClaim* claim = CurrentTaskClaim();  // null: the caller's own thread
//   ClaimHold hold(claim);
//   if (!hold.held()) return Abandon();        // the caller has gone
//   n = ::recv(fd, local, len, MSG_DONTWAIT);
//
// Thread-safe. Acquire and Release are one atomic operation each; only a
// revocation with a copy in progress sleeps (on the atomic, C++20 wait).
#pragma once

#include <atomic>
#include <cstdint>

namespace tierkv::transport {

class BufferClaim {
 public:
  // True: the buffers may be touched until the matching Release(). False
  // once revoked, and then nothing is held.
  bool Acquire() {
    if ((state_.fetch_add(1, std::memory_order_acquire) & kRevoked) == 0) return true;
    Release();
    return false;
  }
  void Release() {
    // The last holder after a revocation wakes the revoker.
    if (state_.fetch_sub(1, std::memory_order_release) == (kRevoked | 1)) state_.notify_all();
  }
  // From now on Acquire fails. Returns once every holder has released:
  // blocks only for copies in progress. Idempotent; any thread.
  void Revoke() {
    uint32_t s = state_.fetch_or(kRevoked, std::memory_order_acq_rel) | kRevoked;
    while (s != kRevoked) {
      state_.wait(s, std::memory_order_acquire);
      s = state_.load(std::memory_order_acquire);
    }
  }
  bool revoked() const { return (state_.load(std::memory_order_acquire) & kRevoked) != 0; }

 private:
  static constexpr uint32_t kRevoked = 1u << 31;
  std::atomic<uint32_t> state_{0};  // kRevoked | the number of holders
};

// Holds a claim for a scope. A null claim has nothing to revoke and counts
// as held.
class ClaimHold {
 public:
  explicit ClaimHold(BufferClaim* claim)
      : claim_(claim != nullptr && claim->Acquire() ? claim : nullptr), held_(claim == nullptr || claim_ != nullptr) {}
  ~ClaimHold() {
    if (claim_ != nullptr) claim_->Release();
  }
  ClaimHold(const ClaimHold&) = delete;
  ClaimHold& operator=(const ClaimHold&) = delete;
  bool held() const { return held_; }

 private:
  BufferClaim* const claim_;
  const bool held_;
};

namespace internal {
inline thread_local BufferClaim* task_claim = nullptr;
}  // namespace internal

// The claim of the batch whose task the calling thread runs for the
// engine's workers (set there by TaskClaimScope), which a backend's Post
// must hold around each copy into or out of a local buffer. Null on a
// thread that moves its own share of a batch (SubmitHere): that call cannot
// return while the copy runs, so there is nothing to revoke.
inline BufferClaim* CurrentTaskClaim() { return internal::task_claim; }

// Makes `claim` the calling thread's CurrentTaskClaim() for a scope.
class TaskClaimScope {
 public:
  explicit TaskClaimScope(BufferClaim* claim) : previous_(internal::task_claim) { internal::task_claim = claim; }
  ~TaskClaimScope() { internal::task_claim = previous_; }
  TaskClaimScope(const TaskClaimScope&) = delete;
  TaskClaimScope& operator=(const TaskClaimScope&) = delete;

 private:
  BufferClaim* const previous_;
};

}  // namespace tierkv::transport
