// The narrow interface every transport backend implements, and the
// engine-side services backends may use.
//
// A backend lives in transport/<name>/, is created by name from the
// registry (registry.h), and keeps all of its state behind this interface:
//
//   capabilities()      what it can do and how it ranks against others
//   Start / Stop        serving side: bind listeners, serve ServedMemory
//   RegisterBuffer      serving side: make a local buffer reachable; the
//                       returned key goes into the segment descriptor
//                       (descriptor.buffers[i].keys[name])
//   Prepare             client side: prove that a remote segment is
//                       reachable (a handshake) and return a PeerChannel
//   PeerChannel::Post   move a group of slices; returns when every slice
//                       has a status or the deadline passed (post + poll)
//   ~PeerChannel        release
//
// How the hardware backends fit without changing the engine:
//
// - rdma (libibverbs RC queue pairs): RegisterBuffer registers the buffer
//   with every NIC (ibv_reg_mr) and returns the remote keys and addresses
//   per NIC as its key string. Prepare exchanges QP numbers, GIDs/LIDs, PSNs
//   and MTU with the server through the control channel
//   (PrepareContext::handshake, the same path shm uses), moves the QPs to
//   RTS and returns a channel holding them. Post stripes the slices over
//   the NICs' QPs as one-sided RDMA READ/WRITE work requests (with a
//   bounded number outstanding per QP) and waits for their completions,
//   which the backend's own completion threads deliver; a slice that fails
//   on one NIC is retried on another. capabilities().needs_registered_local
//   is true: the engine then checks that every local address lies in
//   memory registered through TransferEngine::RegisterMemory, whose buffers
//   the backend registered with the NICs as well.
// - cuda (CUDA IPC): RegisterBuffer of cuda:<dev> memory exports an IPC
//   handle; Prepare checks the peer is on the same host (as shm does) and
//   opens the handles; Post issues cudaMemcpyAsync on a stream of its own
//   (pooled per channel) and waits for it before returning. capabilities().cuda_memory is true.
//
// Thread-safety: a Backend is shared by all engine threads. A PeerChannel's
// Post may be called from several worker threads at once.
#pragma once

#include <cstring>
#include <functional>
#include <optional>
#include <memory>
#include <shared_mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/descriptor.h"
#include "transport/types.h"

namespace tierkv::transport {

// Registered local memory.
struct LocalBuffer {
  uint64_t id = 0;
  char* addr = nullptr;
  uint64_t length = 0;
  Location location;
  int memfd = -1;  // >= 0 when the memory is a memfd mapping other processes can map
};

// A part of a request that one backend moves in one piece.
struct Slice {
  Op op = Op::kRead;
  char* local = nullptr;
  uint64_t remote_offset = 0;  // within the segment
  uint64_t length = 0;
  absl::Status status;  // set by the backend
  CopyCrc* crc = nullptr;  // the Request::crc, when it moves in this one slice
  uint64_t epoch = 0;      // the Request::epoch
  // The Request::grant, copied: a transfer that outlives its caller (one
  // that timed out) must not read the caller's copy.
  absl::string_view grant() const { return {grant_bytes, grant_size}; }
  void set_grant(absl::string_view g) {
    grant_size = g.size() <= sizeof grant_bytes ? static_cast<uint8_t>(g.size()) : 0;
    if (grant_size > 0) std::memcpy(grant_bytes, g.data(), grant_size);
  }
  char grant_bytes[48];
  uint8_t grant_size = 0;
};

struct Capabilities {
  int rank = 0;                   // higher wins when several reach a peer
  bool same_host_only = false;    // shm, cuda
  bool needs_registered_local = false;  // rdma
  bool cuda_memory = false;       // can read and write cuda:<n> memory
  bool checksums_copies = false;  // sets Slice::crc on reads and writes (shm)
  // Post returns by its deadline whatever the peer does, so the engine may
  // run it on a caller's thread (TransferEngine::SubmitHere).
  bool bounded_post = false;
  // Reaches only the remote buffers whose descriptor carries its key (a
  // memfd, an IPC handle, remote keys): requests into other buffers of the
  // same peer go to the next transport.
  bool keyed_buffers = false;
};

// The serving side's view of locally served segments, given to backends by
// the engine. Thread-safe.
class ServedMemory {
 public:
  // Keeps a resolved range mapped while held (unregistering waits for it).
  struct Pin {
    char* addr = nullptr;
    std::shared_lock<std::shared_mutex> hold;
  };
  virtual ~ServedMemory() = default;
  // The local address of [offset, offset+length) in served segment
  // `segment_index`, which must carry `segment_id` (the descriptor's).
  // NOT_FOUND for an unknown (or just unmounted) segment and for one
  // whose id differs (the peer's descriptor is stale), OUT_OF_RANGE when
  // the range is not inside one of its buffers; checked overflow-safe
  // before any byte is touched.
  virtual absl::StatusOr<Pin> Resolve(uint32_t segment_index, uint64_t segment_id, uint64_t offset,
                                      uint64_t length) = 0;
  // Answers a backend's handshake (`transport` names it) arriving on the
  // control channel; the reply goes back to the peer's Prepare. The
  // request is JSON naming "segment_index" and "segment_id"; anything
  // malformed is INVALID_ARGUMENT, a segment not served here NOT_FOUND.
  // Never throws, whatever the bytes.
  // `admitted`: the segment a connection's data grant admits it to
  // (index, id), or none; with data grants on, a handshake for any other
  // segment is UNAUTHENTICATED.
  virtual absl::StatusOr<std::string> Handshake(const std::string& transport, const std::string& request,
                                                std::optional<std::pair<uint32_t, uint64_t>> admitted) = 0;
  // OK for a write granted by master epoch `epoch` (0: unfenced); once a
  // newer epoch was seen (ObserveEpoch, or a write carrying it),
  // FAILED_PRECONDITION naming both. A newer epoch is taken as seen.
  virtual absl::Status AdmitWrite(uint64_t epoch) { return absl::OkStatus(); }
  // Whether every connection must present a data grant (base/auth.h)
  // before it reads, writes or hands shakes.
  virtual bool DataGrantsRequired() const { return false; }
  // The data key of served segment (index, id); NOT_FOUND when not served.
  virtual absl::StatusOr<std::string> DataKey(uint32_t segment_index, uint64_t segment_id) {
    return absl::NotFoundError("no data keys here");
  }
};

class PeerChannel {
 public:
  virtual ~PeerChannel() = default;
  // Moves every slice (all for this channel's segment) and sets each
  // status: OK, DEADLINE_EXCEEDED when the deadline passed first,
  // UNAVAILABLE when the peer could not be reached or went away,
  // OUT_OF_RANGE / NOT_FOUND when the server refused the range.
  virtual void Post(absl::Span<Slice* const> slices, absl::Time deadline) = 0;
  // False once a connection-level failure was seen; the engine then
  // prepares a fresh channel (and re-reads the descriptor) before next use.
  virtual bool healthy() const = 0;
};

// A data grant for one segment (base/auth.h): what a client shows a
// daemon that runs --auth token, from the master.
struct DataGrant {
  std::string grant;        // auth::kGrantBytes
  std::string session_key;  // HMAC-SHA256(the segment's data key, grant)
};

// Fetches a data grant for one segment by `deadline` (the transfer's);
// `renew`: the last one was refused, so a cached grant will not do.
using GrantFn = std::function<absl::StatusOr<DataGrant>(bool renew, absl::Time deadline)>;

struct PrepareContext {
  std::string local_host_id;
  // For a peer whose descriptor says it needs data grants: fetches one
  // for its segment (the engine's EngineOptions::grants); null otherwise.
  GrantFn grant;
  // Sends `request` to the serving engine's control endpoint for backend
  // `transport` and returns its answer.
  std::function<absl::StatusOr<std::string>(const std::string& control, const std::string& transport,
                                            const std::string& request, absl::Time deadline)>
      handshake;
  absl::Time deadline;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Capabilities capabilities() const = 0;

  virtual absl::Status Start(ServedMemory* served) = 0;
  virtual void Stop() = 0;
  // Goes into descriptor.transports[name()].
  virtual std::string endpoint() const = 0;
  // "" when the buffer needs no per-transport key. An error means this
  // backend cannot serve the buffer; the engine leaves its key out, and
  // peers will not choose this backend for it.
  virtual absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer& buffer) = 0;
  virtual void UnregisterBuffer(const LocalBuffer& buffer) = 0;
  // The serving side of Prepare's handshake; UNIMPLEMENTED if none.
  // `request` comes from the network: a malformed one is an error status
  // (INVALID_ARGUMENT), never an exception. Prepare treats the answer the
  // same way (UNAVAILABLE when it is malformed).
  virtual absl::StatusOr<std::string> ServeHandshake(const std::string& request,
                                                     const LocalBuffer* const* buffers,
                                                     size_t count) {
    return absl::UnimplementedError(name() + " has no handshake");
  }

  // UNAVAILABLE (with the reason) when the remote cannot be reached this way.
  virtual absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor& remote,
                                                               const PrepareContext& ctx) = 0;
};

}  // namespace tierkv::transport
