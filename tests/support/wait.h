// Waiting on conditions, not on time. A test that needs something to happen
// polls for it with a deadline and, when the deadline passes, says what it
// waited for; a fixed sleep is too long on a quiet machine and too short on
// a loaded one.
//
//   ASSERT_OK(WaitFor("the standby to catch up", absl::Seconds(10),
//                     [&] { return copier.position().seq == log.last_seq(); }));
//   // Something must NOT happen: the window is the claim being tested.
//   EXPECT_OK(StaysFalse("a write returned before a standby had it",
//                        absl::Milliseconds(50), [&] { return done.load() > 0; }));
#pragma once

#include <functional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tierkv::testing {

// Polls `condition` (first at once, then every 1 ms growing to 20 ms) until
// it returns true or `timeout` passes. OK when it held; DEADLINE_EXCEEDED
// naming `what` and the time waited otherwise. `condition` runs on the
// calling thread.
absl::Status WaitFor(absl::string_view what, absl::Duration timeout, const std::function<bool()>& condition);

// The opposite claim: polls `condition` for the whole `window` and returns
// FAILED_PRECONDITION naming `what` as soon as it holds, OK if it never did.
// For tests whose point is that something does not happen within a time.
absl::Status StaysFalse(absl::string_view what, absl::Duration window, const std::function<bool()>& condition);

}  // namespace tierkv::testing
