// The tcp transport's frames. docs/wire-formats.md has the full contract.
//
// Request (56 bytes, little-endian), then `length` payload bytes for WRITE,
// WRITEV, READV (its range table) and HANDSHAKE:
//   u32 magic 'TKVS' | u8 op | u8 flags | u16 reserved | u32 segment |
//   u32 deadline | u64 segment_id | u64 id | u64 offset | u64 length |
//   u64 epoch
// READ and WRITE name their target twice: `segment` (the index, for the
// lookup) and `segment_id` (the random id the serving engine gave that
// segment, from its descriptor). A server refuses, touching nothing, a
// frame whose id is not the one it serves at that index: the sender holds
// a stale descriptor (the daemon restarted, or another took its address).
// With flag kHasDeadline, `deadline` is the low 32 bits of the Unix time in
// milliseconds after which the sender has given the request up: a server
// refuses a WRITE whose header, or any later part of its payload, arrives
// later (the rest drained, no byte received after the deadline written),
// so bytes delayed past a revoked put never land on the extent.
// A WRITE's `epoch` is that of the master that granted its extent (0:
// none): a server that has seen a newer master refuses it STALE_EPOCH, its
// payload drained, nothing written (docs/ha.md).
// Reply (24 bytes), then `length` payload bytes (READ or READV data,
// HANDSHAKE answer, or an error message). A server over its connection
// cap sends one BUSY reply with id 0 and closes:
//   u32 magic 'TKVA' | u8 status | u8[3] reserved | u64 id | u64 length
//
// Replies come back in request order on a connection, so a client may
// pipeline. For HANDSHAKE, `offset` carries the length of the transport
// name that prefixes the payload.
//
// Vectored frames carry many ranges of one segment under one header and
// one reply, for batches of small scattered entries (P/D transfer moves
// one entry per token per layer). WRITEV and READV name the segment as
// WRITE and READ do (index, id; WRITEV also deadline and epoch); `offset`
// is the number of ranges N (1..kMaxRanges), and the payload opens with
// N little-endian (u64 offset, u64 length) pairs. WRITEV's payload goes on
// with the ranges' data, concatenated in table order, and `length` is
// N * 16 plus that data; READV's payload is the table alone, and its OK
// reply carries the ranges' data, concatenated. The data of either is at
// most the server's frame cap. A server checks every range before it
// moves a byte and refuses the whole frame with the first failing range's
// status, so a vectored frame lands entirely or not at all (save a WRITEV
// cut short by its deadline, as WRITE).
//
// Data grants (base/auth.h), for a server whose segments need
// them: CHALLENGE (no payload) is answered with a fresh 32-byte nonce;
// AUTH names the segment (index and id) and carries the grant and the
// proof (24 + 32 bytes). Until an AUTH passes, READ(V), WRITE(V) and HANDSHAKE
// get UNAUTHENTICATED and the connection closes; afterwards they may name
// only that segment. A refused AUTH closes the connection too.
//
// Extent grants (base/extent_grant.h), for a server that advertises
// "extent_grants" in its descriptor: with flag kHasGrant, the 56-byte
// header is followed by a 48-byte extent grant from the master, and READ,
// WRITE, READV and WRITEV must carry one there, covering every range of
// the frame for its op, before its expiry. A frame without one, or with
// one that does not cover it, gets DENIED (its payload drained, nothing
// moved); the connection stays open, as a grant that merely ran out is
// an ordinary event (the client asks the master again).
//
// A vectored frame may instead carry a grant per range (flag
// kRangeGrants, no grant after the header): each entry of its range table
// is then 64 bytes, the range's (u64 offset, u64 length) and its grant, so
// a batch of small values, each in its own extent, still travels as one
// frame. Every range is checked against its own grant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tierkv::transport::tcp {

// The request magic changes whenever the header grows ("TKVQ" -> "TKVR"
// with the segment id, "TKVR" -> "TKVS" with the epoch), so a peer of an
// old layout is refused as bad magic rather than misread.
inline constexpr uint32_t kRequestMagic = 0x53564b54;  // "TKVS"
inline constexpr uint32_t kReplyMagic = 0x41564b54;    // "TKVA"
inline constexpr size_t kRequestSize = 56;
inline constexpr size_t kReplySize = 24;
inline constexpr uint64_t kMaxHandshake = 64 << 10;
inline constexpr uint64_t kMaxErrorText = 1024;

enum class WireOp : uint8_t {
  kRead = 1,
  kWrite = 2,
  kHandshake = 3,
  kPing = 4,
  kChallenge = 5,
  kAuth = 6,
  kWriteV = 7,
  kReadV = 8,
};
inline constexpr uint8_t kMaxWireOp = 8;

// A vectored frame's limits: ranges per frame, and bytes per range in its
// table (a 1 MiB table at most; with kRangeGrants, a quarter as many).
inline constexpr uint64_t kMaxRanges = 65536;
inline constexpr uint64_t kRangeBytes = 16;

enum class WireStatus : uint8_t {
  kOk = 0,
  kOutOfRange = 1,    // the range is not inside a registered buffer
  kNoSegment = 2,     // unknown or unmounted segment
  kTooLarge = 3,      // length above the server's frame cap
  kBadRequest = 4,    // malformed frame
  kInternal = 5,      // handshake refused, or a server-side failure
  kExpired = 6,       // a WRITE that arrived after its deadline
  kBusy = 7,          // the server is at its connection cap; it closes
  kUnauthenticated = 8,  // no data grant, or one refused; it closes
  kStaleEpoch = 9,       // a WRITE granted by a master older than one the server has seen
  kDenied = 10,          // no extent grant, or one that does not cover the frame
};
inline constexpr uint8_t kMaxWireStatus = 10;

inline constexpr uint8_t kHasDeadline = 1;  // request flag
inline constexpr uint8_t kHasGrant = 2;     // request flag: an extent grant follows the header
inline constexpr uint8_t kRangeGrants = 4;  // request flag (WRITEV, READV): each range carries its grant
inline constexpr size_t kGrantBlockBytes = 48;  // auth::kExtentGrantBytes

// The low 32 bits of a Unix time in milliseconds, and whether such a
// deadline has passed at `now` (wrap-safe for deadlines within ~24 days).
uint32_t DeadlineMs32(absl::Time t);
bool DeadlinePassed(uint32_t deadline_ms32, absl::Time now);

struct RequestHeader {
  WireOp op = WireOp::kRead;
  uint8_t flags = 0;
  uint32_t segment = 0;
  uint64_t id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t deadline_ms32 = 0;  // meaningful with kHasDeadline
  uint64_t segment_id = 0;     // READ(V)/WRITE(V): the target segment's id
  uint64_t epoch = 0;          // WRITE(V): the granting master's epoch (0: none)
};

struct ReplyHeader {
  WireStatus status = WireStatus::kOk;
  uint64_t id = 0;
  uint64_t length = 0;
};

// One entry of a vectored frame's range table.
struct WireRange {
  uint64_t offset = 0;
  uint64_t length = 0;
};

void EncodeRequest(const RequestHeader& h, uint8_t out[kRequestSize]);
// A header as it goes out: with a `grant` (kGrantBlockBytes; empty: none),
// flag kHasGrant set and the grant after it. Returns the bytes written.
inline constexpr size_t kHeadMax = kRequestSize + kGrantBlockBytes;
size_t EncodeHead(RequestHeader h, absl::string_view grant, uint8_t out[kHeadMax]);
void EncodeRange(const WireRange& r, uint8_t out[kRangeBytes]);
WireRange DecodeRange(const uint8_t in[kRangeBytes]);
// Bytes per entry of a vectored frame's range table: kRangeBytes, and the
// grant after each range with kRangeGrants.
inline size_t RangeEntryBytes(const RequestHeader& h) {
  return (h.flags & kRangeGrants) != 0 ? kRangeBytes + kGrantBlockBytes : kRangeBytes;
}

// A WRITEV or READV header against the limits above, with `max_data` the
// server's frame cap on range data: INVALID_ARGUMENT for no ranges or a
// `length` that does not fit the table, RESOURCE_EXHAUSTED for too many
// ranges or WRITEV data above the cap.
absl::Status CheckVectorHeader(const RequestHeader& h, uint64_t max_data);
// Decodes the table (h.offset entries) of a frame CheckVectorHeader
// passed and returns the ranges' total length: a WRITEV's must be the data
// it carries (INVALID_ARGUMENT otherwise, or when the sum overflows), a
// READV's at most `max_data` (RESOURCE_EXHAUSTED). With kRangeGrants and
// `grants`, each range's grant too (views into `table`).
absl::StatusOr<uint64_t> DecodeRanges(const RequestHeader& h, const std::string& table, uint64_t max_data,
                                      std::vector<WireRange>* ranges,
                                      std::vector<absl::string_view>* grants = nullptr);
void EncodeReply(const ReplyHeader& h, uint8_t out[kReplySize]);
// INVALID_ARGUMENT for a wrong magic or unknown op/status. Never reads past
// `size`; sizes below the header size are INVALID_ARGUMENT too.
absl::StatusOr<RequestHeader> DecodeRequest(const uint8_t* data, size_t size);
absl::StatusOr<ReplyHeader> DecodeReply(const uint8_t* data, size_t size);

// The absl status a non-OK reply stands for, with the server's message.
absl::Status ReplyToStatus(WireStatus status, const std::string& message);

}  // namespace tierkv::transport::tcp
