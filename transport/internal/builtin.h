// Private to transport/: factories of the backends built into every build.
#pragma once

#include "transport/registry.h"

namespace tierkv::transport::internal {

absl::StatusOr<std::unique_ptr<Backend>> NewTcpBackend(const BackendOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> NewShmBackend(const BackendOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> NewLoopbackBackend(const BackendOptions& options);

// The tcp control channel, used by every backend's handshake: sends
// `request` for backend `transport` to `control` ("host:port", or
// "tls://host:port" for a daemon running --data-tls, verified against
// `tls_ca`). With a `grant` the connection first authenticates for
// segment (index, id), as a daemon running --auth token requires.
absl::StatusOr<std::string> TcpHandshake(const std::string& control, const std::string& transport,
                                         const std::string& request, absl::Time deadline,
                                         const GrantFn& grant = nullptr, uint32_t segment = 0,
                                         uint64_t segment_id = 0, const std::string& tls_ca = "");

}  // namespace tierkv::transport::internal
