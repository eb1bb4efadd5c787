// Extent grants: the master's leave to read or write one extent of a
// daemon's segment (docs/security.md, "Extent grants").
//
// A data grant (base/auth.h) admits a connection to a segment; an extent
// grant names what each frame on it may touch. The master hands one out
// with every replica of a PutStart (write, until the put's timeout) and of
// a GetReplicas (read, until the read's lease ends); the client sends it
// unchanged in each tcp frame to that extent, and the daemon moves no byte
// of a frame whose ranges the grant does not cover, for that op, before its
// expiry. So a grant for a segment no longer lets its holder reach the
// other extents of it, which hold other keys and other tenants' values.
//
// The 48 bytes, little-endian:
//   u64 offset | u64 length | i64 expiry (Unix ms) | u8 ops | u8[7] zero |
//   16-byte tag
// The tag is a two-block AES-128 CBC-MAC of the first 32 bytes under the
// segment's extent key, HMAC-SHA256(data key, label)[0, 16): every grant
// has the same length, for which CBC-MAC is a PRF, and a daemon checks one
// in about 40 ns, so a per-frame check costs nothing a transfer would
// notice. The extent key comes from the data key, which never leaves the
// master and the daemon.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"

struct evp_cipher_ctx_st;  // OpenSSL's EVP_CIPHER_CTX

namespace tierkv::auth {

inline constexpr size_t kExtentGrantBytes = 48;
inline constexpr uint8_t kExtentRead = 1;
inline constexpr uint8_t kExtentWrite = 2;

struct ExtentGrantFields {
  uint64_t offset = 0;
  uint64_t length = 0;
  int64_t expiry_unix_ms = 0;
  uint8_t ops = 0;  // kExtentRead | kExtentWrite
};

// The fields of a grant (not checked); false for a wrong size or nonzero
// padding.
bool DecodeExtentGrant(absl::string_view grant, ExtentGrantFields* out);
// OK when [offset, offset + length) lies inside the granted extent
// (overflow-safe); PERMISSION_DENIED naming both otherwise.
absl::Status GrantCovers(const ExtentGrantFields& grant, uint64_t offset, uint64_t length);

// A two-block AES-128 CBC-MAC under one key: a PRF on 32-byte messages
// (fixed length), at a few tens of nanoseconds each. Thread-safe.
class BlockMac {
 public:
  // A random key when `key` is null.
  explicit BlockMac(const uint8_t* key16 = nullptr);
  ~BlockMac();
  BlockMac(const BlockMac&) = delete;
  BlockMac& operator=(const BlockMac&) = delete;

  // False when OpenSSL could not set the key up; Mac then fails.
  bool ok() const { return ok_; }
  bool Mac(const uint8_t msg[32], uint8_t tag[16]) const;

 private:
  mutable Mutex mu_;
  evp_cipher_ctx_st* ctx_ = nullptr;
  bool ok_ = false;
};

// Signs and checks the extent grants of one segment. Thread-safe.
class ExtentMac {
 public:
  // Keyed from the segment's data key (auth::kDataKeyBytes).
  explicit ExtentMac(absl::string_view data_key);

  // False when OpenSSL could not set the key up: Sign then returns "" and
  // Check refuses everything.
  bool ok() const { return mac_.ok(); }
  // The 48-byte grant for `f` ("" when the cipher failed).
  std::string Sign(const ExtentGrantFields& f) const;
  // The same into `out` (kExtentGrantBytes); false when the cipher failed.
  bool SignInto(const ExtentGrantFields& f, char* out) const;
  // The fields of `grant` when it is one of this key's, for `op`, and `now`
  // is before its expiry; PERMISSION_DENIED saying which part failed
  // otherwise. GrantCovers then checks each range a frame names.
  absl::StatusOr<ExtentGrantFields> Verify(absl::string_view grant, uint8_t op, absl::Time now) const;
  // Verify, and GrantCovers of [offset, offset + length).
  absl::Status Check(absl::string_view grant, uint8_t op, uint64_t offset, uint64_t length, absl::Time now) const;

 private:
  BlockMac mac_;
};

}  // namespace tierkv::auth
