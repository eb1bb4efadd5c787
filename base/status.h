// Status helpers shared by every part.
//
// tierkv has one error model: fallible calls return absl::Status or
// absl::StatusOr<T>. Debian's Abseil (20220623) ships neither the
// propagation macros nor errno conversion, so they live here.
//
//   absl::StatusOr<int> ParsePort(absl::string_view s);
//   absl::Status Start() {
//     ASSIGN_OR_RETURN(int port, ParsePort(flag));
//     RETURN_IF_ERROR(Bind(port));
//     return absl::OkStatus();
//   }
#pragma once

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TIERKV_CONCAT_INNER(a, b) a##b
#define TIERKV_CONCAT(a, b) TIERKV_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` yields a non-OK status.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status tierkv_status_ = (expr);    \
    if (!tierkv_status_.ok()) return tierkv_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr); on error returns its status, else
// moves the value into `lhs` (which may be a declaration).
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  TIERKV_ASSIGN_OR_RETURN_IMPL(TIERKV_CONCAT(tierkv_statusor_, __LINE__), lhs, rexpr)
#define TIERKV_ASSIGN_OR_RETURN_IMPL(var, lhs, rexpr) \
  auto var = (rexpr);                                 \
  if (!var.ok()) return std::move(var).status();      \
  lhs = std::move(var).value()

namespace tierkv {

// In an UNAVAILABLE status from a master that is not (or no longer) the
// leader of its group (master/ha.h): it did not run the call, and a client
// given several masters tries the next.
inline constexpr char kNotLeader[] = "not the leader";
// A standby's refusal ends with this and the leader's host:port, which
// master clients read to call the leader next (master/ha.h).
inline constexpr char kLeaderIs[] = "the leader is ";
// In an UNAVAILABLE put refusal from a master whose segments all await
// their daemons' re-mount (just restarted, or just elected): it lasts a
// heartbeat, so a client tries the put again within its call timeout.
inline constexpr char kAwaitingRemount[] = "awaiting re-mount";

// Converts an errno value into a status whose code says what the caller
// should do (EAGAIN/ECONNREFUSED -> UNAVAILABLE, ENOENT -> NOT_FOUND, ...),
// with `what` (the operation being attempted) prefixed to the message.
absl::Status ErrnoToStatus(int err, absl::string_view what);

// Prefixes `context` to a non-OK status's message, keeping its code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace tierkv
