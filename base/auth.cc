#include "base/auth.h"

#include <arpa/inet.h>
#include <sys/stat.h>
#include <openssl/crypto.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/log.h"
#include "base/signals.h"
#include "base/status.h"
#include "httplib.h"
#include "nlohmann/json.hpp"

namespace tierkv::auth {
namespace {

std::string Digest(absl::string_view token) {
  unsigned char out[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), out);
  return std::string(reinterpret_cast<const char*>(out), sizeof out);
}

struct RoleName {
  Role role;
  const char* name;
};
constexpr RoleName kRoles[] = {{kDaemon, "daemon"}, {kClient, "client"}, {kAdmin, "admin"}};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read token file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The words of each line that is neither blank nor a comment, with its
// 1-based number.
std::vector<std::pair<int, std::vector<absl::string_view>>> Lines(absl::string_view text) {
  std::vector<std::pair<int, std::vector<absl::string_view>>> out;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    out.emplace_back(number, absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty()));
  }
  return out;
}

}  // namespace

absl::Status ValidateTenant(absl::string_view tenant) {
  if (tenant.empty() || tenant.size() > kMaxTenantLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("a tenant name is 1 to ", kMaxTenantLength, " characters, not ", tenant.size()));
  }
  if (tenant == "default") {
    return absl::InvalidArgumentError("tenant 'default' is the name of callers without a tenant: leave tenant= out");
  }
  for (char c : tenant) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant '", absl::CHexEscape(tenant), "': only letters, digits, '-', '_' and '.' are allowed"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> ParseRoles(absl::string_view text) {
  uint32_t roles = 0;
  for (absl::string_view word : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    bool known = false;
    for (const RoleName& r : kRoles) {
      if (word == r.name) {
        roles |= r.role;
        known = true;
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("unknown role '", word, "' (roles: daemon, client, admin)"));
    }
  }
  if (roles == 0) return absl::InvalidArgumentError("no role given (roles: daemon, client, admin)");
  return roles;
}

std::string RoleNames(uint32_t roles) {
  std::vector<const char*> names;
  for (const RoleName& r : kRoles) {
    if (roles & r.role) names.push_back(r.name);
  }
  return absl::StrJoin(names, ",");
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text) {
  TokenTable table;
  for (const auto& [number, words] : Lines(text)) {
    auto bad = [&, n = number](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("token file line ", n, ": ", why));
    };
    if (words.size() < 3 || words.size() > 5) {
      return bad("expected: <token> <name> <roles> [expires=<RFC 3339 time>] [tenant=<name>]");
    }
    absl::string_view certificate = words[0];
    const bool by_certificate = absl::ConsumePrefix(&certificate, "cert:");
    if (by_certificate && certificate.empty()) return bad("'cert:' needs the certificate's name after it");
    if (!by_certificate && words[0].size() < kMinTokenLength) {
      return bad(absl::StrCat("a token must be at least ", kMinTokenLength, " characters"));
    }
    Identity id;
    id.name = std::string(words[1]);
    absl::StatusOr<uint32_t> roles = ParseRoles(words[2]);
    if (!roles.ok()) return bad(roles.status().message());
    id.roles = *roles;
    bool has_expiry = false, has_tenant = false;
    for (size_t w = 3; w < words.size(); ++w) {
      absl::string_view attr = words[w];
      if (absl::ConsumePrefix(&attr, "expires=") && !has_expiry) {
        std::string err;
        if (!absl::ParseTime(absl::RFC3339_full, attr, &id.expires, &err)) {
          return bad(absl::StrCat("'", words[w], "' is not expires=<RFC 3339 time> (2027-01-31T00:00:00Z)"));
        }
        has_expiry = true;
      } else if (absl::ConsumePrefix(&attr, "tenant=") && !has_tenant) {
        if (absl::Status st = ValidateTenant(attr); !st.ok()) return bad(st.message());
        id.tenant = std::string(attr);
        has_tenant = true;
      } else {
        return bad(absl::StrCat("'", words[w], "' is not expires=<RFC 3339 time> or tenant=<name>, or repeats one"));
      }
    }
    if (by_certificate) {
      if (!table.by_certificate_.emplace(certificate, std::move(id)).second) {
        return bad(absl::StrCat("certificate name '", certificate, "' is listed twice"));
      }
    } else if (!table.by_digest_.emplace(Digest(words[0]), std::move(id)).second) {
      return bad("the same token is listed twice");
    }
  }
  return table;
}

absl::StatusOr<Identity> TokenTable::Find(absl::string_view token, absl::Time now) const {
  auto it = by_digest_.find(Digest(token));
  if (it == by_digest_.end()) return absl::UnauthenticatedError("the token is not accepted");
  if (now >= it->second.expires) {
    return absl::UnauthenticatedError(
        absl::StrCat("the token of '", it->second.name, "' expired at ", absl::FormatTime(it->second.expires)));
  }
  return it->second;
}

absl::StatusOr<Identity> TokenTable::FindCertificate(const std::vector<std::string>& names, absl::Time now) const {
  for (const std::string& name : names) {
    auto it = by_certificate_.find(name);
    if (it == by_certificate_.end()) continue;
    if (now >= it->second.expires) {
      return absl::UnauthenticatedError(absl::StrCat("the certificate entry of '", it->second.name, "' expired at ",
                                                     absl::FormatTime(it->second.expires)));
    }
    return it->second;
  }
  return absl::UnauthenticatedError(
      absl::StrCat("no cert: line of the token file names the client certificate (", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(const std::string& mode,
                                                                     const std::string& token_file) {
  if (mode.empty() || mode == "none") return std::unique_ptr<Authenticator>(new Authenticator(false, false, ""));
  if (mode != "token" && mode != "mtls") {
    return absl::InvalidArgumentError(absl::StrCat("--auth '", mode, "': expected none, token or mtls"));
  }
  if (token_file.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth ", mode, " needs --token-file"));
  std::unique_ptr<Authenticator> a(new Authenticator(true, mode == "mtls", token_file));
  if (absl::Status s = a->Reload(); !s.ok()) return s;
  return a;
}

absl::Status Authenticator::Reload() {
  if (!enabled_) return absl::OkStatus();
  absl::StatusOr<std::string> text = ReadFile(token_file_);
  if (!text.ok()) return text.status();
  absl::StatusOr<TokenTable> table = TokenTable::Parse(*text);
  if (!table.ok()) return absl::InvalidArgumentError(absl::StrCat(token_file_, ": ", table.status().message()));
  if ((certificates_ ? table->certificates() : table->size()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(token_file_, certificates_ ? ": no cert: line (--auth mtls)" : ": no token listed"));
  }
  auto fresh = std::make_shared<const TokenTable>(*std::move(table));
  MutexLock lock(&mu_);
  table_ = std::move(fresh);
  return absl::OkStatus();
}

absl::StatusOr<Identity> Authenticator::Authorize(const Credentials& caller, uint32_t any_of,
                                                  absl::string_view what) const {
  if (!enabled_) return Identity{"anonymous", kAnyRole};
  if (certificates_ && caller.certificate.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat(what, ": no verified client certificate (the server runs --auth mtls)"));
  }
  if (!certificates_ && caller.token.empty()) {
    return absl::UnauthenticatedError(absl::StrCat(what, ": no token (the server runs --auth token)"));
  }
  std::shared_ptr<const TokenTable> table;
  {
    MutexLock lock(&mu_);
    table = table_;
  }
  absl::StatusOr<Identity> id =
      certificates_ ? table->FindCertificate(caller.certificate, absl::Now()) : table->Find(caller.token, absl::Now());
  if (!id.ok()) return absl::UnauthenticatedError(absl::StrCat(what, ": ", id.status().message()));
  if ((id->roles & (any_of | kAdmin)) == 0) {
    return absl::PermissionDeniedError(absl::StrCat(what, ": '", id->name, "' has role ", RoleNames(id->roles),
                                                    ", needs ", RoleNames(any_of | kAdmin)));
  }
  return id;
}

absl::string_view BearerToken(absl::string_view header) {
  header = absl::StripAsciiWhitespace(header);
  if (header.size() < 7 || !absl::EqualsIgnoreCase(header.substr(0, 7), "bearer ")) return {};
  return absl::StripAsciiWhitespace(header.substr(7));
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  if (path.empty()) return std::string();
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  auto lines = Lines(*text);
  if (lines.empty() || lines[0].second.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds no token"));
  }
  return std::string(lines[0].second[0]);
}

bool IsLoopback(absl::string_view host) {
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  const std::string h(host);
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

absl::Status CheckBind(absl::string_view mode, absl::string_view listen, bool allow_remote,
                       absl::string_view binary) {
  if ((!mode.empty() && mode != "none") || IsLoopback(listen)) return absl::OkStatus();
  const std::string where = listen.empty() ? "every address" : absl::StrCat("'", listen, "'");
  if (!allow_remote) {
    return absl::FailedPreconditionError(
        absl::StrCat(binary, " would serve anyone who reaches ", where,
                     " without authentication: give --auth token --token-file FILE, bind loopback, or pass "
                     "--insecure-allow-remote"));
  }
  TKV_LOG(WARNING) << binary << " serves " << where
                   << " without authentication (--insecure-allow-remote): anyone who reaches it may read, write "
                      "and remove every object";
  return absl::OkStatus();
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    // Never hand out predictable keys: a process without entropy cannot serve.
    TKV_LOG(ERROR) << "OpenSSL RAND_bytes failed";
    std::abort();
  }
  return out;
}

std::string HmacSha256(absl::string_view key, absl::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
       data.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool SameSecret(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string NewGrant(absl::Time expiry) {
  uint64_t ms = static_cast<uint64_t>(absl::ToUnixMillis(expiry));
  std::string g(8, '\0');
  for (int i = 0; i < 8; ++i) g[i] = static_cast<char>(ms >> (8 * i));
  return g + RandomBytes(kGrantBytes - 8);
}

absl::Time GrantExpiry(absl::string_view grant) {
  if (grant.size() != kGrantBytes) return absl::InfinitePast();
  uint64_t ms = 0;
  for (int i = 0; i < 8; ++i) ms |= static_cast<uint64_t>(static_cast<uint8_t>(grant[i])) << (8 * i);
  return absl::FromUnixMillis(static_cast<int64_t>(ms));
}

std::string GrantSessionKey(absl::string_view data_key, absl::string_view grant) {
  return HmacSha256(data_key, absl::StrCat("tierkv data grant v1|", grant));
}

std::string GrantProof(absl::string_view session_key, absl::string_view nonce, uint32_t segment_index,
                       uint64_t segment_id) {
  char target[12];
  for (int i = 0; i < 4; ++i) target[i] = static_cast<char>(segment_index >> (8 * i));
  for (int i = 0; i < 8; ++i) target[4 + i] = static_cast<char>(segment_id >> (8 * i));
  return HmacSha256(session_key, absl::StrCat(nonce, absl::string_view(target, sizeof target)));
}

std::string MapSessionKey(absl::string_view data_key, absl::string_view grant) {
  return HmacSha256(data_key, absl::StrCat("tierkv map grant v1|", grant));
}

absl::Status CheckGrant(absl::string_view data_key, absl::string_view grant, absl::string_view proof,
                        absl::string_view nonce, uint32_t segment_index, uint64_t segment_id, absl::Time now,
                        bool* may_map) {
  if (grant.size() != kGrantBytes || proof.size() != kProofBytes) {
    return absl::UnauthenticatedError("data grant: malformed");
  }
  if (nonce.size() != kNonceBytes) return absl::UnauthenticatedError("data grant: no challenge was asked first");
  const absl::Time expiry = GrantExpiry(grant);
  if (now >= expiry) {
    return absl::UnauthenticatedError(absl::StrCat("data grant expired at ", absl::FormatTime(expiry)));
  }
  const bool mapping = SameSecret(proof, GrantProof(MapSessionKey(data_key, grant), nonce, segment_index, segment_id));
  if (may_map != nullptr) *may_map = mapping;
  if (!mapping && !SameSecret(proof, GrantProof(GrantSessionKey(data_key, grant), nonce, segment_index, segment_id))) {
    return absl::UnauthenticatedError(
        "data grant refused: the proof does not match this segment's key (a grant for another segment, "
        "or one from another master)");
  }
  return absl::OkStatus();
}

namespace {
std::string Hex(absl::string_view bytes) { return absl::BytesToHexString(bytes); }
// False for anything but an even count of hex digits (the bytes come from the network).
bool FromHex(absl::string_view hex, std::string* out) {
  if (hex.size() % 2 != 0 || !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return false;
  }
  *out = absl::HexStringToBytes(hex);
  return true;
}
std::string TierMessage(absl::string_view path, absl::string_view time, absl::string_view body) {
  return absl::StrCat(path, "|", time, "|", body);
}
}  // namespace

std::vector<std::pair<std::string, std::string>> SignTierRequest(absl::string_view grant,
                                                                 absl::string_view session_key,
                                                                 absl::string_view path, absl::string_view body,
                                                                 absl::Time now) {
  const std::string time = absl::StrCat(absl::ToUnixMillis(now));
  return {{"X-Tierkv-Grant", Hex(grant)},
          {"X-Tierkv-Time", time},
          {"X-Tierkv-Proof", Hex(HmacSha256(session_key, TierMessage(path, time, body)))}};
}

std::string OrderSessionKey(absl::string_view data_key, absl::string_view grant) {
  return HmacSha256(data_key, absl::StrCat("tierkv tier order v1|", grant));
}

std::string StageProof(absl::string_view data_key, absl::string_view key, uint64_t offset, uint64_t length,
                       int64_t expiry_unix_ms) {
  // Fixed-width fields first, so no key can be read as other numbers.
  std::string msg = "tierkv stage v1|";
  for (uint64_t v : {offset, length, static_cast<uint64_t>(expiry_unix_ms)}) {
    for (int i = 0; i < 8; ++i) msg.push_back(static_cast<char>(v >> (8 * i)));
  }
  msg.append(key.data(), key.size());
  return HmacSha256(data_key, msg).substr(0, 16);
}

absl::Status CheckStageProof(absl::string_view data_key, absl::string_view key, uint64_t offset, uint64_t length,
                             int64_t expiry_unix_ms, absl::string_view proof, absl::Time now) {
  if (proof.empty()) return absl::PermissionDeniedError("stage order: no leave from the master for this object");
  // No allowance past the expiry: the master may hand the extent to
  // another put soon after the lease ends.
  if (now >= absl::FromUnixMillis(expiry_unix_ms)) {
    return absl::PermissionDeniedError(
        absl::StrCat("stage order: the master's leave expired at ", absl::FormatTime(absl::FromUnixMillis(expiry_unix_ms))));
  }
  if (!SameSecret(proof, StageProof(data_key, key, offset, length, expiry_unix_ms))) {
    return absl::PermissionDeniedError(
        "stage order: the master's leave does not match this object, extent and expiry");
  }
  return absl::OkStatus();
}

absl::Status CheckTierRequest(absl::string_view data_key, const httplib::Request& req, absl::Time now,
                              TierSigner signer) {
  const std::string grant_hex = req.get_header_value("X-Tierkv-Grant");
  const std::string time = req.get_header_value("X-Tierkv-Time");
  const std::string proof_hex = req.get_header_value("X-Tierkv-Proof");
  if (grant_hex.empty() || time.empty() || proof_hex.empty()) {
    return absl::UnauthenticatedError(
        "this daemon runs --auth token: a tier request needs X-Tierkv-Grant, X-Tierkv-Time and X-Tierkv-Proof");
  }
  std::string grant, proof;
  int64_t ms = 0;
  if (!FromHex(grant_hex, &grant) || !FromHex(proof_hex, &proof) ||
      !absl::SimpleAtoi(time, &ms)) {
    return absl::UnauthenticatedError("tier request: malformed grant headers");
  }
  if (absl::AbsDuration(now - absl::FromUnixMillis(ms)) > kTierRequestSkew) {
    return absl::UnauthenticatedError(absl::StrCat("tier request signed at ", time, " ms is more than ",
                                                   absl::FormatDuration(kTierRequestSkew), " from this daemon's clock"));
  }
  if (grant.size() != kGrantBytes || proof.size() != kProofBytes) {
    return absl::UnauthenticatedError("tier request: malformed grant");
  }
  if (now >= GrantExpiry(grant)) {
    return absl::UnauthenticatedError(absl::StrCat("tier request: grant expired at ", absl::FormatTime(GrantExpiry(grant))));
  }
  const std::string message = TierMessage(req.path, time, req.body);
  // A grant holder signs with the session key it was given, a plain or a
  // mapping one.
  const bool signed_ok =
      signer == TierSigner::kMaster
          ? SameSecret(proof, HmacSha256(OrderSessionKey(data_key, grant), message))
          : SameSecret(proof, HmacSha256(GrantSessionKey(data_key, grant), message)) ||
                SameSecret(proof, HmacSha256(MapSessionKey(data_key, grant), message));
  if (!signed_ok) {
    return absl::UnauthenticatedError(signer == TierSigner::kMaster
                                          ? "tier request: only the master may order this, and the proof is not its"
                                          : "tier request: the proof does not match this segment's key and the request");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ServerTlsContext>> ServerTlsContext::Create(TlsFiles files, std::string who,
                                                                           Configure configure,
                                                                           absl::Duration refresh) {
  std::unique_ptr<ServerTlsContext> t(
      new ServerTlsContext(std::move(files), std::move(who), std::move(configure), refresh));
  ASSIGN_OR_RETURN(std::shared_ptr<SSL_CTX> ctx, t->Build());
  MutexLock lock(&t->mu_);
  t->ctx_ = std::move(ctx);
  t->stamp_ = t->Stamp();
  t->checked_ = absl::Now();
  return t;
}

namespace {
std::atomic<uint64_t> tls_rechecks{0};
}  // namespace

void ServerTlsContext::RecheckAll() { tls_rechecks.fetch_add(1); }

std::shared_ptr<SSL_CTX> ServerTlsContext::Current() {
  MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  const uint64_t rechecks = tls_rechecks.load();
  if (now - checked_ >= refresh_ || rechecks != recheck_seen_) {
    recheck_seen_ = rechecks;
    checked_ = now;
    std::string stamp = Stamp();
    if (stamp != stamp_) {
      absl::StatusOr<std::shared_ptr<SSL_CTX>> ctx = Build();
      if (ctx.ok()) {
        ctx_ = *std::move(ctx);
        stamp_ = std::move(stamp);
        TKV_LOG(INFO) << who_ << ": reloaded " << files_.cert;
      } else {
        TKV_LOG(WARNING) << who_ << ": the renewed files do not load, the ones in use stay: " << ctx.status();
      }
    }
  }
  return ctx_;
}

std::string ServerTlsContext::Stamp() const {
  std::string out;
  for (const std::string* f : {&files_.cert, &files_.key, &files_.ca}) {
    struct stat st {};
    if (!f->empty() && ::stat(f->c_str(), &st) == 0) {
      absl::StrAppend(&out, st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ";");
    }
  }
  return out;
}

absl::StatusOr<std::shared_ptr<SSL_CTX>> ServerTlsContext::Build() const {
  RETURN_IF_ERROR(CheckTlsFiles(files_, /*server=*/true, who_));
  IgnoreSigpipeUnlessHandled();  // OpenSSL's writes to a peer that hung up
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(TLS_server_method()), SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError("SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
  ERR_clear_error();
  const bool ok = SSL_CTX_use_certificate_chain_file(ctx.get(), files_.cert.c_str()) == 1 &&
                  SSL_CTX_use_PrivateKey_file(ctx.get(), files_.key.c_str(), SSL_FILETYPE_PEM) == 1 &&
                  SSL_CTX_check_private_key(ctx.get()) == 1 && (!configure_ || configure_(ctx.get(), files_));
  if (!ok) {
    char why[256] = "rejected";
    if (unsigned long e = ERR_peek_last_error(); e != 0) ERR_error_string_n(e, why, sizeof(why));
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(who_, " TLS (", files_.cert, ", ", files_.key, "): ", why));
  }
  return ctx;
}

std::vector<std::string> VerifiedPeerNames(const httplib::Request& req) {
  std::vector<std::string> names;
  SSL* ssl = const_cast<SSL*>(req.ssl);
  // Only a server with a client CA asks for, and so verifies, certificates.
  if (ssl == nullptr || SSL_get_verify_mode(ssl) == SSL_VERIFY_NONE) return names;
  X509* cert = SSL_get0_peer_certificate(ssl);
  if (cert == nullptr || SSL_get_verify_result(ssl) != X509_V_OK) return names;
  if (auto* sans = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr))) {
    for (int i = 0; i < sk_GENERAL_NAME_num(sans); ++i) {
      const GENERAL_NAME* n = sk_GENERAL_NAME_value(sans, i);
      if (n->type == GEN_DNS || n->type == GEN_URI) {
        const ASN1_IA5STRING* v = n->type == GEN_DNS ? n->d.dNSName : n->d.uniformResourceIdentifier;
        names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(v)),
                           static_cast<size_t>(ASN1_STRING_length(v)));
      } else if (n->type == GEN_IPADD) {
        const ASN1_OCTET_STRING* ip = n->d.iPAddress;
        char text[INET6_ADDRSTRLEN] = {};
        const int family = ASN1_STRING_length(ip) == 4 ? AF_INET : ASN1_STRING_length(ip) == 16 ? AF_INET6 : 0;
        if (family != 0 && inet_ntop(family, ASN1_STRING_get0_data(ip), text, sizeof(text)) != nullptr) {
          names.emplace_back(text);
        }
      }
    }
    GENERAL_NAMES_free(sans);
  }
  X509_NAME* subject = X509_get_subject_name(cert);
  if (int at = X509_NAME_get_index_by_NID(subject, NID_commonName, -1); at >= 0) {
    const ASN1_STRING* cn = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, at));
    std::string text(reinterpret_cast<const char*>(ASN1_STRING_get0_data(cn)), static_cast<size_t>(ASN1_STRING_length(cn)));
    if (text.find('\0') == std::string::npos) names.push_back(std::move(text));  // "admin\0x" is no name
  }
  return names;
}

Credentials CredentialsOf(const httplib::Request& req, bool certificate) {
  Credentials c{std::string(BearerToken(req.get_header_value("Authorization"))), {}};
  if (certificate) c.certificate = VerifiedPeerNames(req);
  return c;
}

std::string HttpUrl(absl::string_view endpoint, bool tls) {
  if (absl::StartsWith(endpoint, "http://") || absl::StartsWith(endpoint, "https://")) return std::string(endpoint);
  return absl::StrCat(tls ? "https://" : "http://", endpoint);
}

absl::StatusOr<std::string> HttpEndpointUrl(absl::string_view endpoint) {
  // httplib parses a URL's port with std::stoi, which throws past INT_MAX:
  // what it is handed must already be sound.
  constexpr size_t kMaxEndpoint = 512;
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP endpoint '", absl::CHexEscape(endpoint.substr(0, 80)), endpoint.size() > 80 ? "..." : "",
                     "': ", why));
  };
  if (endpoint.size() > kMaxEndpoint) return refuse(absl::StrCat("over ", kMaxEndpoint, " bytes"));
  absl::string_view rest = endpoint;
  const bool https = absl::ConsumePrefix(&rest, "https://");
  if (!https && !absl::ConsumePrefix(&rest, "http://") && absl::StrContains(rest, "://")) {
    return refuse("the scheme must be http:// or https://");
  }
  while (absl::ConsumeSuffix(&rest, "/")) {
  }
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return refuse("needs host:port");
  absl::string_view host = rest.substr(0, colon), port_text = rest.substr(colon + 1);
  int port = 0;
  if (port_text.empty() || port_text.size() > 5 || !std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port_text, &port) || port < 1 || port > 65535) {
    return refuse("the port must be a number from 1 to 65535");
  }
  if (host.empty()) return refuse("the host is empty");
  if (absl::ConsumePrefix(&host, "[")) {
    if (!absl::ConsumeSuffix(&host, "]") || host.empty() ||
        !std::all_of(host.begin(), host.end(), [](char c) { return absl::ascii_isxdigit(c) || c == ':' || c == '.'; })) {
      return refuse("a bracketed host must be an IPv6 address");
    }
  } else if (!std::all_of(host.begin(), host.end(),
                          [](char c) { return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_'; })) {
    return refuse("the host must be a name or an address");
  }
  return absl::StrCat(https ? "https://" : "http://", rest);
}

absl::StatusOr<std::unique_ptr<httplib::Client>> NewHttpClient(absl::string_view endpoint, const TlsFiles& tls,
                                                               absl::Duration timeout) {
  ASSIGN_OR_RETURN(const std::string url, HttpEndpointUrl(endpoint));
  std::unique_ptr<httplib::Client> cli;
  if (absl::StartsWith(url, "https://")) {
    // A server that closes mid-request (one refusing our certificate).
    IgnoreSigpipeUnlessHandled();
    cli = std::make_unique<httplib::Client>(url, tls.cert, tls.key);
    if (!tls.ca.empty()) cli->set_ca_cert_path(tls.ca.c_str());
    cli->enable_server_certificate_verification(true);
  } else {
    cli = std::make_unique<httplib::Client>(url);
  }
  const auto us = absl::ToChronoMicroseconds(timeout);
  cli->set_connection_timeout(us);
  cli->set_read_timeout(us);
  cli->set_write_timeout(us);
  return cli;
}

void RequireHttpAuth(httplib::Server* server, const Authenticator* auth,
                     std::function<uint32_t(const httplib::Request&)> required, bool require_certificate) {
  if (!auth->enabled() && !require_certificate) return;
  server->set_pre_routing_handler([auth, required = std::move(required), require_certificate](
                                      const httplib::Request& req, httplib::Response& res) {
    const uint32_t roles = required(req);
    if (roles == 0) return httplib::Server::HandlerResponse::Unhandled;
    const std::string what = absl::StrCat(req.method, " ", req.path);
    const Credentials caller = CredentialsOf(req, require_certificate || auth->certificates());
    absl::StatusOr<Identity> id =
        require_certificate && caller.certificate.empty()
            ? absl::UnauthenticatedError(
                  absl::StrCat(what, ": no client certificate signed by the server's --tls-ca"))
            : auth->Authorize(caller, roles, what);
    if (id.ok()) return httplib::Server::HandlerResponse::Unhandled;
    const bool unknown = absl::IsUnauthenticated(id.status());
    res.status = unknown ? 401 : 403;
    if (unknown) res.set_header("WWW-Authenticate", "Bearer");
    // The message quotes the path, which may hold any bytes: invalid UTF-8
    // is replaced, not thrown on.
    res.set_content(nlohmann::json{{"error", std::string(id.status().message())}}.dump(
                        -1, ' ', false, nlohmann::json::error_handler_t::replace),
                    "application/json");
    return httplib::Server::HandlerResponse::Handled;
  });
}

absl::Status CheckTlsFiles(const TlsFiles& files, bool server, absl::string_view who) {
  auto bad = [&](absl::string_view why) { return absl::InvalidArgumentError(absl::StrCat(who, ": ", why)); };
  if (files.cert.empty() != files.key.empty()) return bad("--tls-cert and --tls-key go together");
  if (server && files.cert.empty()) return bad("TLS needs --tls-cert and --tls-key");
  if (!server && files.ca.empty()) return bad("TLS needs --tls-ca (the certificates that sign the master's)");
  // Each file read into a BIO, so a path that cannot be read says so apart
  // from one that holds no PEM.
  auto open = [&](const std::string& path) -> absl::StatusOr<std::unique_ptr<BIO, int (*)(BIO*)>> {
    std::unique_ptr<BIO, int (*)(BIO*)> bio(BIO_new_file(path.c_str(), "r"), BIO_free);
    if (bio == nullptr) return bad(absl::StrCat("cannot read ", path));
    return bio;
  };
  X509* cert = nullptr;
  if (!files.ca.empty()) {
    ASSIGN_OR_RETURN(auto bio, open(files.ca));
    X509* ca = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (ca == nullptr) return bad(absl::StrCat(files.ca, " holds no PEM certificate"));
    X509_free(ca);
  }
  if (!files.cert.empty()) {
    ASSIGN_OR_RETURN(auto cbio, open(files.cert));
    cert = PEM_read_bio_X509(cbio.get(), nullptr, nullptr, nullptr);
    if (cert == nullptr) return bad(absl::StrCat(files.cert, " holds no PEM certificate"));
    ASSIGN_OR_RETURN(auto kbio, open(files.key));
    EVP_PKEY* key = PEM_read_bio_PrivateKey(kbio.get(), nullptr, nullptr, nullptr);
    if (key == nullptr) {
      X509_free(cert);
      return bad(absl::StrCat(files.key, " holds no PEM private key (or one with a passphrase)"));
    }
    const bool match = X509_check_private_key(cert, key) == 1;
    EVP_PKEY_free(key);
    X509_free(cert);
    if (!match) return bad(absl::StrCat(files.key, " is not the key of ", files.cert));
  }
  return absl::OkStatus();
}

}  // namespace tierkv::auth
