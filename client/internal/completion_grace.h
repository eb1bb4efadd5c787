// Private to client/: the one constant the put and get paths
// (client/client_put.cc, client/client_get.cc) share.
#pragma once

#include "absl/time/time.h"

namespace tierkv::client::internal {

// Past a transfer's deadline, how long a Wait allows for its last
// completions (the engine ends every task by its deadline).
inline constexpr absl::Duration kCompletionGrace = absl::Seconds(5);

}  // namespace tierkv::client::internal
