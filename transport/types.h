// Types shared by the transfer engine and its backends.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tierkv::transport {

enum class Op : uint8_t { kRead = 1, kWrite = 2 };

// One transfer: READ copies `length` bytes at `offset` in the remote
// `segment` into `local`; WRITE copies from `local` to the remote range.
// `local` is owned by the caller and must stay valid until the batch
// completes.
// The CRC32C of a request's bytes as they landed, when the transport
// worked it out while copying them (see Request::crc). `value` holds the
// CRC to extend when the request is submitted (0: none; the client starts
// from its key's CRC) and the extended CRC once `set`.
struct CopyCrc {
  uint32_t value = 0;
  bool set = false;  // false: not computed; checksum the bytes yourself
};

struct Request {
  Op op = Op::kRead;
  void* local = nullptr;
  std::string segment;
  uint64_t offset = 0;
  uint64_t length = 0;
  // Optional: a transport that copies with the CPU (shm,
  // Capabilities::checksums_copies) checksums the bytes as it copies them,
  // extending the CRC it finds here, and stores the CRC of what landed
  // here, so the caller need not read them a second time; others leave it
  // unset. Only for a request that
  // moves in one slice (EngineOptions::slice_size). Read it only once the
  // request finished OK; it must stay valid as long as the local buffer
  // does.
  CopyCrc* crc = nullptr;
  // A write's master epoch (docs/ha.md): the epoch of the master that
  // granted the extent. A daemon that has seen a newer master refuses it
  // FAILED_PRECONDITION over tcp, so a grant from a deposed master never
  // lands on space its successor handed out. 0: unfenced (one master).
  // One-sided transports (shm, rdma, cuda) cannot check it.
  uint64_t epoch = 0;
  // The master's extent grant for the range (base/extent_grant.h), sent in
  // each tcp frame to a server that needs one (its descriptor says
  // "extent_grants"); empty: none. It must stay valid as `local` does.
  absl::string_view grant;
};

// Where registered memory lives: "cpu:<numa node>" or "cuda:<device>".
struct Location {
  enum Kind { kCpu, kCuda } kind = kCpu;
  int index = 0;
  std::string ToString() const;
};
// INVALID_ARGUMENT for anything but cpu:<n> / cuda:<n>.
absl::StatusOr<Location> ParseLocation(absl::string_view text);

// True when [offset, offset + length) lies inside [0, size), without
// overflow for any inputs.
inline bool RangeWithin(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

// An IPv4 address of one of this host's interfaces.
struct InterfaceAddress {
  std::string interface;
  std::string address;  // dotted quad
  bool loopback = false;
  bool up = false;
};

// The address peers should dial for a server bound to `listen`: `listen`
// itself unless it is the wildcard (0.0.0.0 or empty), else an address of
// an interface that is up and not loopback, preferring the interface of
// the default route (`default_route_interface`, may be empty), then the
// first in `interfaces` order. FAILED_PRECONDITION, saying to set --host,
// when a wildcard has nothing routable to advertise.
absl::StatusOr<std::string> ChooseAdvertiseAddress(const std::string& listen,
                                                   const std::vector<InterfaceAddress>& interfaces,
                                                   const std::string& default_route_interface);
// ChooseAdvertiseAddress over this host's interfaces (getifaddrs) and
// default route (/proc/net/route); logs the choice for a wildcard.
absl::StatusOr<std::string> ResolveAdvertiseAddress(const std::string& listen);

// The element of `ranges` (each with .offset and .length within a segment)
// that holds [offset, offset + length) whole, or null.
template <class R>
const R* FindRange(const std::vector<R>& ranges, uint64_t offset, uint64_t length) {
  for (const R& r : ranges) {
    if (offset >= r.offset && RangeWithin(offset - r.offset, length, r.length)) return &r;
  }
  return nullptr;
}

}  // namespace tierkv::transport
