#include "tests/support/wait.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tierkv::testing {

absl::Status WaitFor(absl::string_view what, absl::Duration timeout, const std::function<bool()>& condition) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  absl::Duration pause = absl::Milliseconds(1);
  while (true) {
    if (condition()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("waited ", absl::FormatDuration(now - start), " for ", what, "; it did not happen"));
    }
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, absl::Milliseconds(20));
  }
}

absl::Status StaysFalse(absl::string_view what, absl::Duration window, const std::function<bool()>& condition) {
  const absl::Time start = absl::Now();
  const absl::Time end = start + window;
  while (true) {
    if (condition()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " happened after ", absl::FormatDuration(absl::Now() - start)));
    }
    const absl::Time now = absl::Now();
    if (now >= end) return absl::OkStatus();
    absl::SleepFor(std::min(absl::Milliseconds(1), end - now));
  }
}

}  // namespace tierkv::testing
