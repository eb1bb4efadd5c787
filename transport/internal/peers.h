// Private to transport/: what the engine caches per remote segment, and
// how its backends' handshakes to one are made.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "transport/backend.h"
#include "transport/engine.h"
#include "transport/internal/builtin.h"

namespace tierkv::transport::internal {

// What the engine knows of one remote segment. `mu` is only ever held
// for moments, never across a network wait (a descriptor lookup, a
// handshake): workers take it to drop a dead channel, so a lock held
// while a dead peer's lookup stalls would take them all with it.
struct PeerEntry {
  Mutex mu;
  // One thread at a time looks the segment up (fetches the descriptor,
  // prepares channels), outside `mu`; others wanting it meanwhile wait on
  // `looked_up`, each no longer than its own deadline.
  bool looking_up ABSL_GUARDED_BY(mu) = false;
  CondVar looked_up;
  // Counts descriptor changes, so a channel prepared outside `mu` for an
  // older descriptor is not cached beside the newer one.
  uint64_t generation ABSL_GUARDED_BY(mu) = 0;
  std::optional<SegmentDescriptor> desc ABSL_GUARDED_BY(mu);
  std::shared_ptr<PeerChannel> channel ABSL_GUARDED_BY(mu);
  Backend* backend ABSL_GUARDED_BY(mu) = nullptr;  // the channel's; its capabilities decide refusals
  std::string transport ABSL_GUARDED_BY(mu);
  std::vector<std::string> fallbacks ABSL_GUARDED_BY(mu);
  // Channels of other transports, for requests the chosen one refuses
  // (by backend name); they share `desc` and are dropped with it.
  absl::flat_hash_map<std::string, std::shared_ptr<PeerChannel>> alternates ABSL_GUARDED_BY(mu);
  // "<to>: <refusal>" fallbacks already logged for this peer.
  absl::flat_hash_set<std::string> logged ABSL_GUARDED_BY(mu);
};

// How backends prepare a channel to `desc`: its handshakes (and, for a
// peer that needs data grants, its connections) authenticate with a
// grant for `segment`.
inline PrepareContext PeerContext(const EngineOptions& options, const std::string& segment,
                                  const SegmentDescriptor& desc, absl::Time deadline) {
  PrepareContext ctx;
  ctx.local_host_id = options.host_id;
  ctx.deadline = deadline;
  const std::string ca = options.backend.tls.ca;
  if (!desc.auth) {
    ctx.handshake = [ca](const std::string& control, const std::string& transport, const std::string& request,
                         absl::Time dl) {
      return TcpHandshake(control, transport, request, dl, nullptr, 0, 0, ca);
    };
    return ctx;
  }
  auto grants = options.grants;
  ctx.grant = [grants, segment](bool renew, absl::Time deadline) -> absl::StatusOr<DataGrant> {
    if (!grants) {
      return absl::UnauthenticatedError(absl::StrCat("segment ", segment,
                                                     " needs a data grant and this client has no master to ask"));
    }
    return grants(segment, renew, deadline);
  };
  ctx.handshake = [grant = ctx.grant, index = desc.segment_index, id = desc.segment_id, ca](
                      const std::string& control, const std::string& transport, const std::string& request,
                      absl::Time dl) {
    return TcpHandshake(control, transport, request, dl, grant, index, id, ca);
  };
  return ctx;
}

}  // namespace tierkv::transport::internal
