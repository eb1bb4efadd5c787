// Private to master/: what the leader's side of replication (replication.cc)
// and the standby's (replication_standby.cc) must agree on beyond the wire
// schema.
#pragma once

#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "master/replication.h"

namespace tierkv::master {

// How long a pull waits for a batch, and how often a stream with nothing to
// send sends a heartbeat: a standby that hears nothing for ten of these
// takes the stream for dead.
inline constexpr uint32_t kPullWaitMs = 200;

// Whether `key` is this master's own bookkeeping (kHaPrefix): never
// replicated, never in a snapshot.
inline bool IsHaKey(absl::string_view key) { return absl::StartsWith(key, kHaPrefix); }

}  // namespace tierkv::master
