#include "base/net/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <arpa/inet.h>
#include <poll.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/signals.h"
#include "base/status.h"

namespace tierkv::net {
namespace {

// Small iovecs (frame headers, small payloads) are gathered into one
// record rather than sent as a record each.
constexpr size_t kGather = 16 << 10;
constexpr size_t kReadBuffer = 256 << 10;

std::string SslError(const char* what) {
  char why[256] = "closed or timed out";
  if (unsigned long e = ERR_peek_last_error(); e != 0) ERR_error_string_n(e, why, sizeof(why));
  ERR_clear_error();
  return absl::StrCat(what, ": ", why);
}

// Waits for what OpenSSL asked for after a call on a non-blocking socket;
// false past the deadline.
bool WaitFor(SSL* ssl, int err, absl::Time deadline) {
  pollfd p{SSL_get_fd(ssl), static_cast<short>(err == SSL_ERROR_WANT_WRITE ? POLLOUT : POLLIN), 0};
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms < 0) return false;
    int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

// One OpenSSL call retried until it moves bytes (or completes): > 0, or
// the error. `deadline` null: a blocking socket, whose timeout ends the
// wait (WANT_* then means it fired).
template <typename Op>
absl::StatusOr<size_t> Retry(SSL* ssl, Op op, const absl::Time* deadline, const char* what) {
  for (;;) {
    ERR_clear_error();
    int n = op();
    if (n > 0) return static_cast<size_t>(n);
    const int err = SSL_get_error(ssl, n);
    if (err == SSL_ERROR_ZERO_RETURN) return absl::UnavailableError("connection closed by peer");
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      if (deadline == nullptr || !WaitFor(ssl, err, *deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(what, " timed out"));
      }
      continue;
    }
    if (err == SSL_ERROR_SYSCALL && errno == EINTR) continue;
    return absl::UnavailableError(SslError(what));
  }
}

absl::Status ReadAll(SSL* ssl, void* buf, size_t len, const absl::Time* deadline) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    const int want = static_cast<int>(std::min<size_t>(len, 1 << 30));
    ASSIGN_OR_RETURN(size_t n, Retry(ssl, [&] { return SSL_read(ssl, p, want); }, deadline, "read"));
    p += n;
    len -= n;
  }
  return absl::OkStatus();
}

absl::Status WriteOne(SSL* ssl, const char* p, size_t len, const absl::Time* deadline) {
  while (len > 0) {
    const int want = static_cast<int>(std::min<size_t>(len, 1 << 30));
    ASSIGN_OR_RETURN(size_t n, Retry(ssl, [&] { return SSL_write(ssl, p, want); }, deadline, "write"));
    p += n;
    len -= n;
  }
  return absl::OkStatus();
}

absl::Status WriteAll(SSL* ssl, const iovec* iov, int count, const absl::Time* deadline) {
  std::string gather;
  for (int i = 0; i < count; ++i) {
    const char* base = static_cast<const char*>(iov[i].iov_base);
    if (iov[i].iov_len <= kGather - std::min(gather.size(), kGather)) {
      gather.append(base, iov[i].iov_len);
      continue;
    }
    if (!gather.empty()) {
      RETURN_IF_ERROR(WriteOne(ssl, gather.data(), gather.size(), deadline));
      gather.clear();
    }
    RETURN_IF_ERROR(WriteOne(ssl, base, iov[i].iov_len, deadline));
  }
  return gather.empty() ? absl::OkStatus() : WriteOne(ssl, gather.data(), gather.size(), deadline);
}

// What both ends of a data connection set: bulk transfer.
void Tune(SSL_CTX* ctx) {
  // A write returns once all its records are out (no partial writes): one
  // call per payload, not one per 16 KiB record.
  SSL_CTX_set_mode(ctx, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Several records per receive, not a header and a body per record: a
  // MiB is 64 records.
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, kReadBuffer);
  // AES-128-GCM first: the cheapest cipher with AES instructions, and bulk
  // bytes are what these connections carry.
  SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256");
}

}  // namespace

void SslFree::operator()(SSL* ssl) const { SSL_free(ssl); }

bool SplitTlsEndpoint(absl::string_view endpoint, std::string* address) {
  const bool tls = absl::StartsWith(endpoint, kTlsScheme);
  if (tls) endpoint.remove_prefix(sizeof(kTlsScheme) - 1);
  *address = std::string(endpoint);
  return tls;
}

absl::StatusOr<std::unique_ptr<auth::ServerTlsContext>> NewServerContext(const auth::TlsFiles& files) {
  return auth::ServerTlsContext::Create({"", files.cert, files.key}, "--data-tls", [](SSL_CTX* ctx, const auth::TlsFiles&) {
    Tune(ctx);
    // No tickets: a client's idle pooled connection must stay silent.
    SSL_CTX_set_num_tickets(ctx, 0);
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    return true;
  });
}

absl::StatusOr<std::shared_ptr<SSL_CTX>> ClientContext(const std::string& ca) {
  IgnoreSigpipeUnlessHandled();  // a daemon that hangs up mid-request
  static Mutex mu;
  static auto* cache = new std::map<std::string, std::shared_ptr<SSL_CTX>>();
  MutexLock lock(&mu);
  auto it = cache->find(ca);
  if (it != cache->end()) return it->second;
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError("SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
  Tune(ctx.get());
  ERR_clear_error();
  const bool loaded = ca.empty() ? SSL_CTX_set_default_verify_paths(ctx.get()) == 1
                                 : SSL_CTX_load_verify_locations(ctx.get(), ca.c_str(), nullptr) == 1;
  if (!loaded) return absl::InvalidArgumentError(SslError(absl::StrCat("TLS CA ", ca).c_str()));
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  cache->emplace(ca, ctx);
  return ctx;
}

absl::StatusOr<SslPtr> TlsConnect(int fd, SSL_CTX* ctx, const std::string& host, absl::Time deadline) {
  SslPtr ssl(SSL_new(ctx));
  if (ssl == nullptr || SSL_set_fd(ssl.get(), fd) != 1) return absl::InternalError("SSL_new failed");
  // The certificate must name the host dialled (an IP or a DNS name).
  std::string name = host;
  if (name.size() > 2 && name.front() == '[' && name.back() == ']') name = name.substr(1, name.size() - 2);
  if (name.empty() || SSL_set1_host(ssl.get(), name.c_str()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("TLS: cannot check a certificate for host '", host, "'"));
  }
  in6_addr ip{};
  const bool literal = inet_pton(AF_INET, name.c_str(), &ip) == 1 || inet_pton(AF_INET6, name.c_str(), &ip) == 1;
  if (!literal) SSL_set_tlsext_host_name(ssl.get(), name.c_str());  // SNI names hosts, never addresses
  absl::StatusOr<size_t> done = Retry(ssl.get(), [&] { return SSL_connect(ssl.get()); }, &deadline, "TLS handshake");
  if (!done.ok()) {
    const long verify = SSL_get_verify_result(ssl.get());
    if (verify != X509_V_OK) {
      return absl::UnavailableError(absl::StrCat("TLS handshake with ", host, ": the certificate is not trusted (",
                                                 X509_verify_cert_error_string(verify),
                                                 "; give the CA that signs the daemon's: tls_ca / --tls-ca)"));
    }
    return absl::UnavailableError(absl::StrCat("TLS handshake with ", host, ": ", done.status().message()));
  }
  return ssl;
}

absl::StatusOr<SslPtr> TlsServerSession(int fd, SSL_CTX* ctx) {
  SslPtr ssl(SSL_new(ctx));
  if (ssl == nullptr || SSL_set_fd(ssl.get(), fd) != 1) return absl::InternalError("SSL_new failed");
  SSL_set_accept_state(ssl.get());
  // A large write returns as its records go out, so the server sees it
  // progress (and waits for a bulk reply rather than parking it).
  SSL_set_mode(ssl.get(), SSL_MODE_ENABLE_PARTIAL_WRITE);
  return ssl;
}

namespace {

// What a non-blocking OpenSSL call that returned `n` <= 0 means: a wait
// (POLLIN / POLLOUT), a retry (0, after EINTR), or the end.
absl::StatusOr<short> WantOf(SSL* ssl, int n, const char* what) {
  const int err = SSL_get_error(ssl, n);
  if (err == SSL_ERROR_WANT_READ) return static_cast<short>(POLLIN);
  if (err == SSL_ERROR_WANT_WRITE) return static_cast<short>(POLLOUT);
  if (err == SSL_ERROR_ZERO_RETURN) return absl::UnavailableError("connection closed by peer");
  if (err == SSL_ERROR_SYSCALL && errno == EINTR) return static_cast<short>(0);
  return absl::UnavailableError(SslError(what));
}

}  // namespace

absl::StatusOr<short> TlsAcceptSome(SSL* ssl) {
  for (;;) {
    ERR_clear_error();
    const int n = SSL_accept(ssl);
    if (n == 1) return static_cast<short>(0);
    ASSIGN_OR_RETURN(short want, WantOf(ssl, n, "TLS handshake"));
    if (want != 0) return want;
  }
}

absl::StatusOr<IoStep> TlsRecvSome(SSL* ssl, void* buf, size_t len) {
  for (;;) {
    ERR_clear_error();
    const int n = SSL_read(ssl, buf, static_cast<int>(std::min<size_t>(len, 1 << 30)));
    if (n > 0) return IoStep{static_cast<size_t>(n), 0};
    ASSIGN_OR_RETURN(short want, WantOf(ssl, n, "read"));
    if (want != 0) return IoStep{0, want};
  }
}

absl::StatusOr<IoStep> TlsSendSome(SSL* ssl, const void* buf, size_t len) {
  for (;;) {
    ERR_clear_error();
    const int n = SSL_write(ssl, buf, static_cast<int>(std::min<size_t>(len, 1 << 30)));
    if (n > 0) return IoStep{static_cast<size_t>(n), 0};
    ASSIGN_OR_RETURN(short want, WantOf(ssl, n, "write"));
    if (want != 0) return IoStep{0, want};
  }
}

absl::Status TlsReadFull(SSL* ssl, void* buf, size_t len, absl::Time deadline) {
  return ReadAll(ssl, buf, len, &deadline);
}

absl::Status TlsWriteVecFull(SSL* ssl, const iovec* iov, int count, absl::Time deadline) {
  return WriteAll(ssl, iov, count, &deadline);
}

bool TlsPending(SSL* ssl) { return SSL_has_pending(ssl) == 1; }

}  // namespace tierkv::net
