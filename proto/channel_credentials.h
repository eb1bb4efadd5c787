// gRPC credentials for a master's port: the channel credentials that
// clients, daemons, tools and standby masters call it with, and the server
// credentials a master (leader or standby) serves it with.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/auth.h"

namespace tierkv {

// Insecure without TLS files. With them: TLS, verifying the master against
// `tls.ca` (required) and presenting `tls.cert` when the master asks for a
// client certificate. The files are watched, so
// renewed certificates are taken up without a restart. INVALID_ARGUMENT
// (naming `who`'s files) when they do not load.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MasterChannelCredentials(const auth::TlsFiles& tls,
                                                                                   absl::string_view who);

// A master's TLS port (`tls` enabled: cert and key, with a CA requiring
// and verifying client certificates). The files are watched as above.
// INVALID_ARGUMENT when they do not load.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MasterServerCredentials(const auth::TlsFiles& tls);

}  // namespace tierkv
