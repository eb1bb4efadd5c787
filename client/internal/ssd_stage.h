// Private to client/. StageSsdHits: the get path's step that fills, from
// their daemons' SSD tier, the replicas a GetReplicas answer marks as
// staging extents, before anyone reads them.
//
// One POST /tier/stage per daemon, signed with the segment's data grant
// where the daemon runs --auth token. A staged replica is then read like
// any other, trailer and checksum included.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/auth.h"
#include "client/internal/grant_cache.h"
#include "proto/master.pb.h"

namespace tierkv::client::internal {

// Stages the SSD hits in `resp`, the answer to GetReplicas for `keys`.
// Per asked key: OK (nothing to stage, or staged), or NOT_FOUND saying why
// its value could not be staged (the record was dropped, the tier is
// down): a miss, as an eviction would have been. Blocks for the HTTP
// requests, each bounded by `timeout` and by the read leases in `resp`
// (a stage must end inside its lease). `grants` is not owned.
std::vector<absl::Status> StageSsdHits(const v1::GetReplicasResponse& resp, const std::vector<std::string>& keys,
                                       absl::Duration timeout, GrantCache* grants, const auth::TlsFiles& tls);

}  // namespace tierkv::client::internal
