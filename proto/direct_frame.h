// The master's direct RPC frames: the hot client RPCs (puts, lookups,
// removes, stats) as the same protobuf messages gRPC carries, each behind a
// 16-byte header on a plain TCP connection to the master's RPC port. The
// master tells a direct connection from an HTTP/2 (gRPC) one by its first
// four bytes, so both share one port and whatever reaches one (a proxy, a
// firewall rule, a Kubernetes service) reaches the other. docs/wire-formats.md
// has the contract.
//
// A connection carries one call at a time: a call header and its request,
// then a reply header, its status message and its response. A reply's code
// is an absl::StatusCode; a non-OK reply has no response bytes.
//
//   char h[kHeaderSize];
//   EncodeCall({DirectMethod::kGetReplicas, len}, h);
//   ... send h and the request, read kHeaderSize bytes into r ...
//   ASSIGN_OR_RETURN(ReplyHeader reply, DecodeReply(r, max_length));
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace tierkv::direct {

inline constexpr size_t kHeaderSize = 16;
// Neither is a prefix of the HTTP/2 connection preface ("PRI * HTTP/2.0").
inline constexpr uint32_t kCallMagic = 0x434b4b54;   // "TKKC"
inline constexpr uint32_t kReplyMagic = 0x524b4b54;  // "TKKR"
// Status messages are cut to this many bytes.
inline constexpr uint32_t kMaxMessage = 4096;

// Only calls a client makes per operation travel direct; daemons' mounts
// and heartbeats, and long handlers (RemoveAll, UnmountSegment, SSD
// listings), stay on gRPC, whose queues keep them apart
// (master/grpc_service.h).
enum class DirectMethod : uint8_t {
  kPutStart = 1,
  kPutEnd = 2,
  kPutRevoke = 3,
  kGetReplicas = 4,
  kExists = 5,
  kPrefixMatch = 6,
  kRemove = 7,
  kStats = 8,
  // A client's first call on a new connection, answered OK with nothing,
  // so a master that does not speak direct (it closes) is told from one
  // that died during a real call. Its body is a v1::DirectHello carrying
  // the client's token; a master with auth on answers a missing or
  // refused one with that status and closes, as it does a connection
  // whose first call is not a ping.
  kPing = 9,
  // A standby master's replication stream (master/replication.h): its
  // first call, a v1::PullRequest, turns the connection into a stream of
  // replies, each a v1::PullResponse the leader sends as batches commit
  // (or every 200 ms with none), while the standby sends a PullRequest
  // call after each one it applied, acknowledging it; no reply answers
  // those. Only a master leading with standbys serves it.
  kReplicate = 10,
};
inline constexpr uint8_t kMaxMethod = 10;
// The gRPC method name (as metrics label it).
const char* MethodName(DirectMethod m);

// Call: u32 magic | u8 method | u8[3] reserved | u32 reserved | u32 length.
// No deadline travels: the master reads a call only when it is free to run
// it (a connection's calls come one at a time to a thread of its own), so
// no call waits in a queue past its caller's patience.
struct CallHeader {
  DirectMethod method = DirectMethod::kGetReplicas;
  uint32_t length = 0;
};
// Reply: u32 magic | u8 code | u8[3] reserved | u32 message_length | u32 length.
struct ReplyHeader {
  uint8_t code = 0;
  uint32_t message_length = 0;
  uint32_t length = 0;
};

void EncodeCall(const CallHeader& h, char out[kHeaderSize]);
void EncodeReply(const ReplyHeader& h, char out[kHeaderSize]);
// INVALID_ARGUMENT for a bad magic or an unknown method; RESOURCE_EXHAUSTED
// for a length above `max_length`.
absl::StatusOr<CallHeader> DecodeCall(const char in[kHeaderSize], uint32_t max_length);
// INVALID_ARGUMENT for a bad magic, a code outside absl's, or a non-OK
// reply with response bytes; RESOURCE_EXHAUSTED for lengths past the caps.
absl::StatusOr<ReplyHeader> DecodeReply(const char in[kHeaderSize], uint32_t max_length);

}  // namespace tierkv::direct
