// gRPC channel credentials for calling a master, shared by clients,
// daemons, tools and standby masters.
#pragma once

#include <grpcpp/security/credentials.h>

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "config/base/auth.h"

namespace tierkv {

// Insecure without TLS files. With them: TLS, verifying the master against
// `tls.ca` (required) and presenting `tls.cert` when the master asks for a
// client certificate. The files are watched, so
// renewed certificates are taken up without a restart. INVALID_ARGUMENT
// (naming `who`'s files) when they do not load.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MasterChannelCredentials(const auth::TlsFiles& tls,
                                                                                   absl::string_view who);

}  // namespace tierkv
