#include "proto/channel_credentials.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "base/status.h"

namespace tierkv {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MasterChannelCredentials(const auth::TlsFiles& tls,
                                                                                   absl::string_view who) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  RETURN_IF_ERROR(auth::CheckTlsFiles(tls, /*server=*/false, who));
  auto provider = tls.cert.empty()
                      ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.ca,
                                                                                            auth::kTlsRefreshSeconds)
                      : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            tls.key, tls.cert, tls.ca, auth::kTlsRefreshSeconds);
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  if (!tls.cert.empty()) options.watch_identity_key_cert_pairs();
  return grpc::experimental::TlsCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MasterServerCredentials(const auth::TlsFiles& tls) {
  RETURN_IF_ERROR(auth::CheckTlsFiles(tls, /*server=*/true, "tierkv-master"));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.key, tls.cert, tls.ca,
                                                                                      auth::kTlsRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions creds(provider);
  creds.watch_identity_key_cert_pairs();
  if (!tls.ca.empty()) {
    creds.watch_root_certs();
    creds.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(creds);
}

}  // namespace tierkv
