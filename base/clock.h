// Clock: the one seam through which tierkv reads time.
//
// Leases, heartbeat TTLs and put timeouts all ask a Clock, so tests drive
// them with ManualClock::Advance() instead of sleeping.
//
//   ManualClock clock;
//   Master master(options, &clock);
//   clock.Advance(absl::Seconds(11));
//   master.Tick();  // the segment's TTL has now passed
#pragma once

#include <atomic>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tierkv {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;

  // The process-wide real clock; never destroyed.
  static Clock* Real();
};

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

// A clock that moves only when told. Thread-safe.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000))
      : nanos_(absl::ToUnixNanos(start)) {}
  absl::Time Now() const override { return absl::FromUnixNanos(nanos_.load()); }
  void Advance(absl::Duration d) { nanos_.fetch_add(absl::ToInt64Nanoseconds(d)); }

 private:
  std::atomic<int64_t> nanos_;
};

}  // namespace tierkv
