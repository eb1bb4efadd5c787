#include "base/extent_grant.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/auth.h"

namespace tierkv::auth {
namespace {

void Put64(uint8_t* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t Get64(const uint8_t* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

void EncodeFields(const ExtentGrantFields& f, uint8_t out[32]) {
  std::memset(out, 0, 32);
  Put64(out, f.offset);
  Put64(out + 8, f.length);
  Put64(out + 16, static_cast<uint64_t>(f.expiry_unix_ms));
  out[24] = f.ops;
}

// The extent key: its own label, so it is no session key of any grant.
std::string ExtentKey(absl::string_view data_key) {
  return HmacSha256(data_key, "tierkv extent grant v1").substr(0, 16);
}

}  // namespace

BlockMac::BlockMac(const uint8_t* key16) : ctx_(EVP_CIPHER_CTX_new()) {
  unsigned char key[16];
  bool keyed = true;
  if (key16 != nullptr) {
    std::memcpy(key, key16, sizeof key);
  } else {
    keyed = RAND_bytes(key, sizeof key) == 1;
  }
  ok_ = ctx_ != nullptr && keyed && EVP_EncryptInit_ex(ctx_, EVP_aes_128_ecb(), nullptr, key, nullptr) == 1 &&
        EVP_CIPHER_CTX_set_padding(ctx_, 0) == 1;
  OPENSSL_cleanse(key, sizeof key);
}

BlockMac::~BlockMac() { EVP_CIPHER_CTX_free(ctx_); }

bool BlockMac::Mac(const uint8_t msg[32], uint8_t tag[16]) const {
  if (!ok_) return false;
  unsigned char block[16], out[16];
  int len = 0;
  MutexLock lock(&mu_);
  if (EVP_EncryptUpdate(ctx_, out, &len, msg, 16) != 1 || len != 16) return false;
  for (int i = 0; i < 16; ++i) block[i] = out[i] ^ msg[16 + i];
  if (EVP_EncryptUpdate(ctx_, tag, &len, block, 16) != 1 || len != 16) return false;
  return true;
}

bool DecodeExtentGrant(absl::string_view grant, ExtentGrantFields* out) {
  if (grant.size() != kExtentGrantBytes) return false;
  const auto* g = reinterpret_cast<const uint8_t*>(grant.data());
  for (int i = 25; i < 32; ++i) {
    if (g[i] != 0) return false;
  }
  out->offset = Get64(g);
  out->length = Get64(g + 8);
  out->expiry_unix_ms = static_cast<int64_t>(Get64(g + 16));
  out->ops = g[24];
  return true;
}

ExtentMac::ExtentMac(absl::string_view data_key)
    : mac_(reinterpret_cast<const uint8_t*>(ExtentKey(data_key).data())) {}

bool ExtentMac::SignInto(const ExtentGrantFields& f, char* out) const {
  uint8_t* g = reinterpret_cast<uint8_t*>(out);
  EncodeFields(f, g);
  return mac_.Mac(g, g + 32);
}

std::string ExtentMac::Sign(const ExtentGrantFields& f) const {
  std::string g(kExtentGrantBytes, '\0');
  if (!SignInto(f, g.data())) return {};
  return g;
}

absl::StatusOr<ExtentGrantFields> ExtentMac::Verify(absl::string_view grant, uint8_t op, absl::Time now) const {
  ExtentGrantFields f;
  if (!DecodeExtentGrant(grant, &f)) return absl::PermissionDeniedError("extent grant: malformed");
  uint8_t fields[32], tag[16];
  EncodeFields(f, fields);
  if (!mac_.Mac(fields, tag) || CRYPTO_memcmp(tag, grant.data() + 32, sizeof tag) != 0) {
    return absl::PermissionDeniedError(
        "extent grant refused: not signed with this segment's key (forged, altered, or for another segment)");
  }
  if ((f.ops & op) == 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("extent grant allows ", (f.ops & kExtentWrite) != 0 ? "writes" : "reads", " only"));
  }
  if (now >= absl::FromUnixMillis(f.expiry_unix_ms)) {
    return absl::PermissionDeniedError(
        absl::StrCat("extent grant expired at ", absl::FormatTime(absl::FromUnixMillis(f.expiry_unix_ms))));
  }
  return f;
}

absl::Status GrantCovers(const ExtentGrantFields& g, uint64_t offset, uint64_t length) {
  if (offset < g.offset || offset - g.offset > g.length || length > g.length - (offset - g.offset)) {
    return absl::PermissionDeniedError(absl::StrCat("extent grant covers [", g.offset, ", +", g.length, "), not [",
                                                    offset, ", +", length, ")"));
  }
  return absl::OkStatus();
}

absl::Status ExtentMac::Check(absl::string_view grant, uint8_t op, uint64_t offset, uint64_t length,
                              absl::Time now) const {
  absl::StatusOr<ExtentGrantFields> f = Verify(grant, op, now);
  if (!f.ok()) return f.status();
  return GrantCovers(*f, offset, length);
}

}  // namespace tierkv::auth
