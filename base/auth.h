// Who may call a tierkv server, and as what.
//
// With `--auth token` a server accepts a call only with a bearer token
// listed in its token file (`--token-file`, re-read on SIGHUP). Each line
// of that file names one caller:
//
//   # token                            name       roles          [expiry]
//   3f9c0e7d8a1b4c2e9f7a6b5c4d3e2f10   decode-3   daemon
//   a81d6c5e4f3b2a1908f7e6d5c4b3a291   sglang-0   client
//   0c1d2e3f4a5b6c7d8e9fa0b1c2d3e4f5   ops        admin,client   expires=2027-06-01T00:00:00Z
//   5e4d3c2b1a0918f7e6d5c4b3a2918f7e   vllm-a     client         tenant=team-a
//
// Roles: `daemon` (mount, heartbeat, unmount, its SSD listings, segment
// descriptors), `client` (puts, gets, removes, stats, descriptor reads)
// and `admin` (everything, remove-all included). A token is at least 16
// characters; the file holds a hash of each, so the lookup takes the same
// time whatever a guess shares with a real token.
//
// A caller with `tenant=` works in that tenant's namespace at the master
// (master/tenants.h): its keys are its own, and its puts count against
// the tenant's quota. A caller without one is in the default tenant, as
// every caller is under `--auth none`; an admin without one sees all.
//
// With `--auth none` every caller is admitted as "anonymous" with every
// role; a server refuses to start that way on an address other than
// loopback unless `--insecure-allow-remote` is given (CheckBind).
//
// Callers present their token, read from a file of their own whose first
// word is the token (ReadTokenFile): over gRPC as "authorization: Bearer
// <token>" metadata, over HTTP as the same header, over the master's
// direct lane in the connection's first frame.
//
// With `--auth mtls` a caller is its TLS client certificate instead: the
// server verifies it against its --tls-ca, and the file's lines whose
// first word is `cert:<name>` say which certificates are whom, <name>
// matched against the certificate's DNS, URI and IP subject alternative
// names, then its common name:
//
//   cert:decode-3.tierkv.internal      decode-3   daemon
//   cert:spiffe://prod/sglang-0        sglang-0   client   tenant=team-a
//
// Tokens are not accepted under mtls, and certificate lines not under token.
//
// Thread-safe: Authorize may run on any thread while Reload swaps tables.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"

struct ssl_ctx_st;

namespace httplib {
class Client;
class Server;
struct Request;
}  // namespace httplib

namespace tierkv::auth {

enum Role : uint32_t {
  kDaemon = 1,
  kClient = 2,
  kAdmin = 4,
};
inline constexpr uint32_t kAnyRole = kDaemon | kClient | kAdmin;

// "daemon,client" -> kDaemon | kClient; INVALID_ARGUMENT naming an unknown
// role or for an empty list.
absl::StatusOr<uint32_t> ParseRoles(absl::string_view text);
// kDaemon | kClient -> "daemon,client".
std::string RoleNames(uint32_t roles);

// OK for a tenant name: 1 to kMaxTenantLength letters, digits, '-', '_'
// or '.'; INVALID_ARGUMENT saying why otherwise.
inline constexpr size_t kMaxTenantLength = 64;
absl::Status ValidateTenant(absl::string_view tenant);

struct Identity {
  std::string name;
  uint32_t roles = 0;
  std::string tenant;  // empty: the default tenant
  absl::Time expires = absl::InfiniteFuture();
};

// The accepted tokens and certificate names, parsed from a token file's text.
class TokenTable {
 public:
  // INVALID_ARGUMENT naming the line for a malformed one, a short token,
  // a duplicate token or certificate name, or an unknown role.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text);
  // UNAUTHENTICATED for an unknown token or one expired by `now`.
  absl::StatusOr<Identity> Find(absl::string_view token, absl::Time now) const;
  // The identity of the first of a certificate's `names` listed as
  // `cert:<name>`; UNAUTHENTICATED naming them when none is, or when it
  // expired by `now`.
  absl::StatusOr<Identity> FindCertificate(const std::vector<std::string>& names, absl::Time now) const;
  size_t size() const { return by_digest_.size(); }
  size_t certificates() const { return by_certificate_.size(); }

  static constexpr size_t kMinTokenLength = 16;

 private:
  absl::flat_hash_map<std::string, Identity> by_digest_;       // SHA-256 of the token
  absl::flat_hash_map<std::string, Identity> by_certificate_;  // the name after "cert:"
};

// What a caller presented: a bearer token, and the names of a TLS client
// certificate the server verified (empty without one).
struct Credentials {
  std::string token;
  std::vector<std::string> certificate;
};

// What a server checks each caller against.
class Authenticator {
 public:
  // `mode` is "none", "token" or "mtls"; the last two read `token_file`
  // (which must name a readable, valid file listing tokens, or certificate
  // names for mtls). INVALID_ARGUMENT otherwise.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(const std::string& mode,
                                                               const std::string& token_file);

  bool enabled() const { return enabled_; }
  // Callers are their client certificates (--auth mtls).
  bool certificates() const { return certificates_; }
  // Re-reads the token file; on an error the table in use stays and the
  // error comes back (a bad edit never locks every caller out).
  absl::Status Reload();
  // The caller holding `token` if it has one of `any_of`'s roles.
  // UNAUTHENTICATED without a token or with one not accepted,
  // PERMISSION_DENIED naming the caller, `what` and the roles it needs.
  // With auth off: "anonymous", every role.
  absl::StatusOr<Identity> Authorize(absl::string_view token, uint32_t any_of, absl::string_view what) const {
    return Authorize(Credentials{std::string(token), {}}, any_of, what);
  }
  // The same, for a token (--auth token) or a certificate (--auth mtls).
  absl::StatusOr<Identity> Authorize(const Credentials& caller, uint32_t any_of, absl::string_view what) const;

 private:
  Authenticator(bool enabled, bool certificates, std::string token_file)
      : enabled_(enabled), certificates_(certificates), token_file_(std::move(token_file)) {}

  const bool enabled_;
  const bool certificates_;
  const std::string token_file_;
  mutable Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
};

// The token of an "authorization" header value ("Bearer <token>", the
// scheme's case ignored); empty for anything else.
absl::string_view BearerToken(absl::string_view header);
inline constexpr char kAuthorizationHeader[] = "authorization";

// A caller's own token: the first word of the first line of `path` that is
// neither blank nor a comment. Empty path: no token (""). INVALID_ARGUMENT
// for an unreadable file or one without a token.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Whether `host` (a bind or dial address without port) is loopback:
// 127.0.0.0/8, ::1 or "localhost".
bool IsLoopback(absl::string_view host);
// A server bound to `listen` with auth `mode`: FAILED_PRECONDITION for
// "none" on a routable address unless `allow_remote`, which logs a warning.
absl::Status CheckBind(absl::string_view mode, absl::string_view listen, bool allow_remote,
                       absl::string_view binary);

// --- Data grants: who may move bytes to and from a daemon's segment.
//
// A daemon running --auth token gives each segment it serves a random
// 32-byte data key and registers it at the master when it mounts (over
// the authenticated RPC channel). A client asks the master for a grant on
// a segment; the master answers the grant (its expiry and 16 random
// bytes) and its session key, HMAC-SHA256(data key, grant). On each new
// connection the daemon sends a random nonce and the client answers the
// grant and a proof, HMAC-SHA256(session key, nonce | segment index | id):
// the daemon recomputes both from its key. So a client needs the master's
// word for each segment, a captured proof is worthless on another
// connection, and a session key is worthless on another segment.
inline constexpr size_t kDataKeyBytes = 32;
inline constexpr size_t kGrantBytes = 24;   // u64 LE expiry (Unix ms) | 16 random bytes
inline constexpr size_t kProofBytes = 32;
inline constexpr size_t kNonceBytes = 32;
// `n` bytes from OpenSSL's CSPRNG.
std::string RandomBytes(size_t n);
std::string HmacSha256(absl::string_view key, absl::string_view data);
// Compares in time independent of where the inputs differ.
bool SameSecret(absl::string_view a, absl::string_view b);
// A grant expiring at `expiry`, and the time a grant expires (InfinitePast
// for a malformed one).
std::string NewGrant(absl::Time expiry);
absl::Time GrantExpiry(absl::string_view grant);
std::string GrantSessionKey(absl::string_view data_key, absl::string_view grant);
// The session key of a grant that also lets its holder map the segment's
// memory (shm, rdma, cuda), which no extent grant can bound: the master
// hands it instead of GrantSessionKey's to a caller of the segment owner's
// tenant. Another label, so neither key can be made from the other.
std::string MapSessionKey(absl::string_view data_key, absl::string_view grant);
std::string GrantProof(absl::string_view session_key, absl::string_view nonce, uint32_t segment_index,
                       uint64_t segment_id);
// OK when `proof` shows the holder of a session key for `grant` under
// `data_key`, answering `nonce` for the segment, and the grant has not
// expired by `now`; UNAUTHENTICATED saying which part failed otherwise.
// `may_map`, when given, says whether the key was MapSessionKey's.
absl::Status CheckGrant(absl::string_view data_key, absl::string_view grant, absl::string_view proof,
                        absl::string_view nonce, uint32_t segment_index, uint64_t segment_id, absl::Time now,
                        bool* may_map = nullptr);

// A daemon's HTTP tier orders (/tier/offload from the master, /tier/stage
// from clients) have no connection to challenge, so each request carries
// its grant and a proof over itself, bound to a time:
//   X-Tierkv-Grant: hex(grant)
//   X-Tierkv-Time:  Unix ms when it was signed
//   X-Tierkv-Proof: hex(HMAC-SHA256(session key, path | time | body))
// A daemon refuses one signed more than kTierRequestSkew from its clock;
// within that window a captured request can be replayed as it was (the
// same records to the same extents), never changed.
inline constexpr absl::Duration kTierRequestSkew = absl::Seconds(30);
std::vector<std::pair<std::string, std::string>> SignTierRequest(absl::string_view grant,
                                                                 absl::string_view session_key,
                                                                 absl::string_view path, absl::string_view body,
                                                                 absl::Time now);
// Who may sign a tier request: any holder of a data grant for the
// segment (stages), or only the master (offloads, which erase and write
// SSD records by name). The master's session key for a grant comes from
// the data key by another label than a grant holder's, so no client can
// make it from the grants it is given.
enum class TierSigner { kGrantHolder, kMaster };
std::string OrderSessionKey(absl::string_view data_key, absl::string_view grant);
// OK for a request signed as above with a grant under `data_key`, by a
// holder of the session key `signer` needs; UNAUTHENTICATED saying what is
// missing or wrong otherwise.
absl::Status CheckTierRequest(absl::string_view data_key, const httplib::Request& req, absl::Time now,
                              TierSigner signer = TierSigner::kGrantHolder);
// The master's leave to stage one object: 16 bytes of HMAC-SHA256 under the
// segment's data key over the record's key (as the index holds it, tenant
// included), the extent it goes to and the reader's lease expiry. A
// GetReplicas answer carries one per staging extent, the client puts it in
// its stage order's item, and the daemon stages no item without one that
// matches, before its expiry: a grant for the segment alone stages nothing,
// so no tenant can copy another's record into memory it reads.
std::string StageProof(absl::string_view data_key, absl::string_view key, uint64_t offset, uint64_t length,
                       int64_t expiry_unix_ms);
// OK when `proof` is StageProof of these and `now` is before the expiry;
// PERMISSION_DENIED otherwise.
absl::Status CheckStageProof(absl::string_view data_key, absl::string_view key, uint64_t offset, uint64_t length,
                             int64_t expiry_unix_ms, absl::string_view proof, absl::Time now);

// --- TLS on the master's ports and the daemons' HTTP (docs/security.md, "TLS").
//
// PEM files: `cert` and `key` are one's own certificate chain and private
// key (a server always has them; a client only for mutual TLS), `ca` the
// certificates that sign the peer's (a client's verify the master; a
// master's, when given, are required of every client). Servers and clients
// re-read the files every kTlsRefreshSeconds, so a renewed certificate
// takes effect without a restart.
struct TlsFiles {
  std::string ca;
  std::string cert;
  std::string key;
  bool enabled() const { return !ca.empty() || !cert.empty() || !key.empty(); }
};
inline constexpr unsigned kTlsRefreshSeconds = 60;
// OK when the files given parse as PEM, `cert` and `key` come together and
// match, and a server has both; INVALID_ARGUMENT naming the file and the
// problem otherwise. `who` names the flags' owner in the message.
absl::Status CheckTlsFiles(const TlsFiles& files, bool server, absl::string_view who);

// A server's TLS context built from its files (`cert`, `key`; `ca` as the
// caller's `configure` uses it), rebuilt when they change, checked at most
// every kTlsRefreshSeconds, so renewed certificates take effect without a
// restart. A renewal that does not load is logged and the context in use
// stays. Every context is TLS 1.2 or later without renegotiation or
// compression; `configure` adds the server's own settings (false: it
// failed, with OpenSSL's error queue saying why). Thread-safe.
class ServerTlsContext {
 public:
  using Configure = std::function<bool(ssl_ctx_st* ctx, const TlsFiles& files)>;
  // INVALID_ARGUMENT naming the files (`who`: the flags' owner) when they
  // do not load.
  static absl::StatusOr<std::unique_ptr<ServerTlsContext>> Create(
      TlsFiles files, std::string who, Configure configure,
      absl::Duration refresh = absl::Seconds(kTlsRefreshSeconds));
  // The context for a new connection (SSL_new takes its own reference).
  std::shared_ptr<ssl_ctx_st> Current();
  // Makes every context re-check its files at its next connection, however
  // recently it checked (a SIGHUP after renewing certificates).
  static void RecheckAll();

 private:
  ServerTlsContext(TlsFiles files, std::string who, Configure configure, absl::Duration refresh)
      : files_(std::move(files)), who_(std::move(who)), configure_(std::move(configure)), refresh_(refresh) {}
  absl::StatusOr<std::shared_ptr<ssl_ctx_st>> Build() const;
  std::string Stamp() const;  // the files' sizes and modification times

  const TlsFiles files_;
  const std::string who_;
  const Configure configure_;
  const absl::Duration refresh_;
  Mutex mu_;
  std::shared_ptr<ssl_ctx_st> ctx_ ABSL_GUARDED_BY(mu_);
  std::string stamp_ ABSL_GUARDED_BY(mu_);
  absl::Time checked_ ABSL_GUARDED_BY(mu_);
  uint64_t recheck_seen_ ABSL_GUARDED_BY(mu_) = 0;  // RecheckAll calls seen
};

// The names a request's TLS client certificate carries (DNS, URI and IP
// subject alternative names, then the common name) when the server asked
// for one, the client sent it, and it verified; empty otherwise.
std::vector<std::string> VerifiedPeerNames(const httplib::Request& req);
// What an HTTP request presents: its bearer token, and its verified
// certificate's names when `certificate`.
Credentials CredentialsOf(const httplib::Request& req, bool certificate);

// A client of `endpoint`: "https://host:port" speaks TLS, verifying the
// server against `tls.ca` (the system's trust store without one) and
// presenting `tls.cert`/`tls.key` when given; "http://host:port" or a
// bare "host:port" is plain. Connect, read and write bounded by `timeout`.
// The first HTTPS client ignores SIGPIPE unless the program handles it
// (IgnoreSigpipeUnlessHandled). An endpoint HttpEndpointUrl refuses is
// INVALID_ARGUMENT (endpoints come from peers: a daemon's tier, etcd).
absl::StatusOr<std::unique_ptr<httplib::Client>> NewHttpClient(absl::string_view endpoint, const TlsFiles& tls,
                                                               absl::Duration timeout);
// `endpoint` ("host:port", "http://host:port" or "https://host:port", a
// trailing "/" allowed) as the URL NewHttpClient dials, with http:// when
// it has no scheme; INVALID_ARGUMENT naming what is wrong: another
// scheme, an empty host, a host other than a name, an IPv4 address or a
// bracketed IPv6 one, a port outside 1-65535, or over 512 bytes.
absl::StatusOr<std::string> HttpEndpointUrl(absl::string_view endpoint);
// "host:port" as a URL: https:// when `tls`, http:// otherwise; an
// endpoint that already has a scheme is returned as it is.
std::string HttpUrl(absl::string_view endpoint, bool tls);

// Makes `server` answer a request without accepted credentials (a token,
// or a certificate under mtls) 401 and one whose caller lacks the roles
// `required(request)` returns 403, each with the reason as a JSON body
// ({"error": "..."}); `required` returning 0 leaves the path open. With
// `require_certificate` (a TLS server with a client CA) a request to a
// path that is not open also needs a verified client certificate, as the
// gRPC port does. `auth` must outlive the server.
void RequireHttpAuth(httplib::Server* server, const Authenticator* auth,
                     std::function<uint32_t(const httplib::Request&)> required, bool require_certificate = false);

}  // namespace tierkv::auth
