// TLS for the tcp transport's connections (a daemon's --data-tls).
//
// A daemon serving its transfer port over TLS advertises its endpoint as
// "tls://host:port"; clients dialling such an endpoint run a TLS handshake
// before anything else (the data grant's CHALLENGE and AUTH included) and
// verify the daemon's certificate against their CA (the system's trust
// store without one) and the endpoint's host. The frames inside are the
// same as on a plain connection (wire.h).
//
// Client sockets are non-blocking, and each call waits with poll() up to
// its deadline. The tcp server's sockets are non-blocking too, driven by
// its event loop one step at a time (TlsAcceptSome, TlsRecvSome,
// TlsSendSome), so a slow peer never holds a thread.
// Session tickets are off: an idle client connection must have nothing to
// read, or the pool would take it for stale (Connection::Stale).
#pragma once

#include <sys/uio.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/auth.h"
#include "base/net/socket.h"

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace tierkv::net {

struct SslFree {
  void operator()(SSL* ssl) const;
};
using SslPtr = std::unique_ptr<SSL, SslFree>;

inline constexpr char kTlsScheme[] = "tls://";
// "tls://host:port" -> true and "host:port" in *address; a plain
// "host:port" -> false and itself.
bool SplitTlsEndpoint(absl::string_view endpoint, std::string* address);

// A server's context from its certificate and key (files.cert, files.key),
// renewed when they change (auth::ServerTlsContext); INVALID_ARGUMENT
// naming the file that does not load.
absl::StatusOr<std::unique_ptr<auth::ServerTlsContext>> NewServerContext(const auth::TlsFiles& files);
// A client's context verifying servers against `ca` (the system's trust
// store when empty); one per CA file per process.
absl::StatusOr<std::shared_ptr<SSL_CTX>> ClientContext(const std::string& ca);

// The client's handshake. `fd` is a connected, non-blocking socket.
// UNAVAILABLE saying why on a failed handshake (a certificate not trusted,
// not for `host`, a peer that is not TLS).
absl::StatusOr<SslPtr> TlsConnect(int fd, SSL_CTX* ctx, const std::string& host, absl::Time deadline);

// The server's non-blocking steps (socket.h's IoStep). TlsServerSession
// makes the session of an accepted socket without any I/O; TlsAcceptSome
// moves its handshake on: 0 once done, else POLLIN or POLLOUT to wait
// for. TlsRecvSome reads what is there; TlsSendSome sends what it can of
// `len` bytes (whole records), and after n == 0 must be called again with
// the same bytes and length (the buffer may move). UNAVAILABLE
// saying why on a failed handshake, EOF or error.
absl::StatusOr<SslPtr> TlsServerSession(int fd, SSL_CTX* ctx);
absl::StatusOr<short> TlsAcceptSome(SSL* ssl);
absl::StatusOr<IoStep> TlsRecvSome(SSL* ssl, void* buf, size_t len);
absl::StatusOr<IoStep> TlsSendSome(SSL* ssl, const void* buf, size_t len);

// Non-blocking sockets (the client): as ReadFull and WriteVecFull.
absl::Status TlsReadFull(SSL* ssl, void* buf, size_t len, absl::Time deadline);
absl::Status TlsWriteVecFull(SSL* ssl, const struct iovec* iov, int count, absl::Time deadline);
// Bytes read from the socket and waiting in `ssl`, decrypted or not (a
// frame a poll of the socket would miss).
bool TlsPending(SSL* ssl);

}  // namespace tierkv::net
