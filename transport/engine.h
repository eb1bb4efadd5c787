// TransferEngine: moves bytes between this process's memory and segments
// that other processes (or this one) serve, without the master in the
// path.
//
//   EngineOptions options;
//   options.metadata = NewInMemoryMetadata();       // or NewHttpMetadata(url)
//   ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(options));
//   // Serving: lend memory as a named segment.
//   ASSIGN_OR_RETURN(auto region, SharedRegion::Create(1 << 30, {}));
//   RETURN_IF_ERROR(engine->RegisterMemory(region->data(), region->size(), "cpu:0", region->fd()));
//   RETURN_IF_ERROR(engine->ServeSegment("node1:8800", {region->data()}));
//   // Client: batched one-sided reads and writes.
//   std::vector<absl::Status> st = engine->Transfer(
//       {{Op::kWrite, buf, "node1:8800", /*offset=*/0, /*length=*/4096}});
//
// Transport selection per remote segment: the configured list in order if
// one was given (`--transport shm,tcp`), else every backend this process
// has, fastest first. The first that proves it can reach the peer (its
// Prepare handshake) is used; a transport that cannot is skipped with a
// warning naming both ends and the reason. The process never aborts over
// an unreachable peer: requests fail with UNAVAILABLE instead. A request
// the chosen transport refuses (local memory rdma has not registered, GPU
// memory on a host-only transport) goes to the next transport that reaches
// the peer and accepts it, logged once per peer and reason; only when none
// does it fail FAILED_PRECONDITION.
//
// Threads: `workers` threads run transfers; backends add their own (the tcp
// server's fixed pool of I/O threads, tcp/server.h). Submit and everything else
// may be called from any thread. Lock order: peers_mu_ -> PeerEntry::mu;
// served_mu_ is independent (held by serving threads while they touch
// served memory). No lock is held across a network wait or a backend's
// registration: a segment's lookup (its descriptor fetch and handshakes)
// runs outside its entry's lock, one at a time per segment, so a dead peer
// costs only the transfers to it, each up to its own deadline.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/backend.h"
#include "transport/metadata.h"
#include "transport/registry.h"
#include "transport/types.h"

namespace tierkv::transport {

struct EngineOptions {
  std::shared_ptr<MetadataClient> metadata;  // required
  // Preference order; empty means every built-in (tcp, shm), fastest first.
  std::vector<std::string> transports;
  BackendOptions backend;                    // listen address, port, connections, ...
  std::string host;                          // advertised host name (default: the listen address)
  std::string host_id;                       // default: LocalHostId(); tests override it
  int workers = 4;
  uint64_t slice_size = 4ull << 20;          // larger requests are cut into slices
  absl::Duration default_timeout = absl::Seconds(30);
  // Serving side: every segment gets a random data key (SegmentDataKey),
  // its descriptor says "auth", and every connection must show a data
  // grant for it before moving bytes or shaking hands (base/auth.h).
  bool data_grants = false;
  // Client side: a data grant for a segment whose descriptor needs one,
  // from the master (the client library asks it and caches the answer;
  // `renew`: the daemon refused the last one). Null: such segments cannot
  // be reached (UNAUTHENTICATED).
  // A fetch must end by `deadline`, the transfer's.
  std::function<absl::StatusOr<DataGrant>(const std::string& segment, bool renew, absl::Time deadline)> grants;
  // Peer-to-peer mode, with no master and no metadata server (what
  // prefill-to-decode transfer runs on): every buffer this engine
  // registers is served at once, in one segment named session_id()
  // ("<advertised address>:<tcp port>", "[v6 address]:<port>"), whose
  // offsets are the buffers' virtual addresses. A request names a peer
  // by its session id as `segment` and the peer's memory by absolute
  // address as `offset`; a range not wholly inside one buffer the peer
  // registered is OUT_OF_RANGE, nothing moved. The peer's table of
  // buffers comes from the peer itself, over its control port, on first
  // use and again whenever an address lies outside every buffer known
  // (the peer registered more since). `metadata` may be null.
  bool peer_mode = false;
  // Requests of one batch to one segment, with the same op and epoch, that
  // continue the previous one's local and remote ranges (per-token entries
  // of one page, say) move as one request; each keeps its own status,
  // that of the whole run. Never for a request with a crc.
  bool coalesce = true;
};

// A short message a peer sent with TransferEngine::Notify.
struct Notification {
  std::string from;  // the sender's session id (its control endpoint)
  std::string name;
  std::string message;
};

// A submitted batch: poll Done() or Wait(), then read statuses(). Thread-safe.
class Batch {
 public:
  virtual ~Batch() = default;
  virtual bool Done() const = 0;
  // True when complete before `deadline`. False seals the batch: every
  // request that had not finished is DEADLINE_EXCEEDED for good, even if
  // the peer's bytes arrive later (poll Done() to wait in steps without
  // sealing). Once Wait returns, true or false, no byte is written into a
  // local buffer of the batch any more: a false Wait revokes the batch's
  // claim on them and returns once a copy in progress (bounded by the
  // bytes already received, never a network wait) has finished, so the
  // caller may free them at once. A backend keeps this by holding the
  // claim around each copy (transport/buffer_claim.h): tcp (plain and
  // TLS), shm and loopback do; rdma and cuda do not yet (a NIC or a DMA
  // engine would have to be stopped first), and a slice a worker is moving
  // for them may still land after a false Wait.
  virtual bool Wait(absl::Time deadline) = 0;
  // One status per request, in submission order. Never OK for a request
  // that has not finished: DEADLINE_EXCEEDED once the batch's deadline
  // passed or a Wait timed out, UNAVAILABLE while it is still in flight.
  virtual std::vector<absl::Status> statuses() const = 0;
};

struct PeerInfo {
  std::string segment;
  std::string host;
  std::string transport;                  // chosen; empty if none reached it
  std::vector<std::string> fallbacks;     // "shm: <reason>" for each transport skipped
};

struct EngineStats {
  uint64_t requests = 0;
  uint64_t failed_requests = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t coalesced = 0;  // requests that moved inside a run another one started
};

class TransferEngine {
 public:
  // INVALID_ARGUMENT without metadata or with an unknown transport name;
  // UNAVAILABLE when the tcp server cannot bind; FAILED_PRECONDITION for a
  // wildcard listen address with nothing routable to advertise.
  static absl::StatusOr<std::unique_ptr<TransferEngine>> Create(EngineOptions options);
  virtual ~TransferEngine() = default;

  // Registers [addr, addr+length) at `location` ("cpu:0", "cuda:1"). Pass
  // the memfd of a SharedRegion so same-host peers can use shm.
  // INVALID_ARGUMENT for a null/empty/overlapping range (overlapping one
  // being registered or unregistered, too) or bad location. Blocks while
  // backends that need registered memory (rdma) pin the range; segments
  // already served keep serving meanwhile.
  virtual absl::Status RegisterMemory(void* addr, uint64_t length, const std::string& location,
                                      int memfd = -1) = 0;
  // FAILED_PRECONDITION while the buffer is part of a served segment;
  // NOT_FOUND if `addr` does not start a registered buffer. Blocks while
  // backends unpin it, without stopping service of other buffers.
  virtual absl::Status UnregisterMemory(void* addr) = 0;

  // Serves registered buffers (given by their start addresses, in order)
  // as segment `name` and publishes its descriptor. ALREADY_EXISTS for a
  // name already served here. If only publishing fails, the segment stays
  // served and the metadata error (UNAVAILABLE when the store is down) is
  // returned; Publish retries it.
  virtual absl::Status ServeSegment(const std::string& name, const std::vector<void*>& buffers) = 0;
  // (Re)publishes a served segment's descriptor, e.g. after the metadata
  // server restarted. NOT_FOUND if `name` is not served here.
  virtual absl::Status Publish(const std::string& name) = 0;
  // Stops serving and unpublishes; waits for transfers touching it.
  virtual absl::Status StopServing(const std::string& name) = 0;
  // The data key of served segment `name` (EngineOptions::data_grants),
  // which its lender registers at the master; "" without data grants,
  // NOT_FOUND for a segment not served here.
  virtual absl::StatusOr<std::string> SegmentDataKey(const std::string& name) = 0;

  // Starts the requests; never blocks on the data (it may block up to the
  // timeout to look up and reach a segment it has not used before, or to
  // wait for another thread's lookup of it).
  virtual std::shared_ptr<Batch> Submit(std::vector<Request> requests,
                                        absl::Duration timeout = absl::ZeroDuration()) = 0;
  // Like Submit, but the calling thread moves one share of the batch
  // itself (all of a batch small enough for one task: a single get or put)
  // before returning, instead of handing it to a worker and waiting for it
  // to wake. Blocks on that share's data, up to the timeout; the other
  // shares run on the workers as with Submit, and so does a share whose
  // transport does not promise to end by the deadline (bounded_post).
  virtual std::shared_ptr<Batch> SubmitHere(std::vector<Request> requests,
                                            absl::Duration timeout = absl::ZeroDuration()) = 0;
  // Submit and wait (the calling thread moves a share, as SubmitHere). Per request: OK; OUT_OF_RANGE (outside the segment);
  // INVALID_ARGUMENT (null local buffer); NOT_FOUND (unknown segment);
  // UNAVAILABLE (unreachable peer); DEADLINE_EXCEEDED.
  virtual std::vector<absl::Status> Transfer(std::vector<Request> requests,
                                             absl::Duration timeout = absl::ZeroDuration()) = 0;

  // Which transport reaches `segment`, and why others did not.
  virtual PeerInfo Describe(const std::string& segment) = 0;
  // A hint that never reaches the peer: true when a request of `length`
  // bytes to `segment` would get Request::crc set: it moves in one slice,
  // and requests there went, the last time, through a transport that
  // checksums as it copies (Capabilities::checksums_copies). A request may
  // still come back without it (another route, a restarted peer): check
  // CopyCrc::set.
  virtual bool ChecksumsCopies(const std::string& segment, uint64_t length) = 0;
  // Forgets cached descriptors and channels (after a peer re-mounts, say).
  virtual void ForgetPeers() = 0;
  // The master epoch its lender's master answered with (docs/ha.md): from
  // now on a tcp write granted by an older epoch is refused. Only raises.
  virtual void ObserveEpoch(uint64_t epoch) = 0;
  virtual EngineStats Stats() const = 0;
  // The tcp server's port (data and control).
  virtual int port() const = 0;
  virtual const std::string& host_id() const = 0;
  // The address peers dial (--host, or resolved from a wildcard --listen).
  virtual const std::string& advertised_address() const = 0;

  // This engine's session id in peer mode: what peers pass as a request's
  // segment to reach its memory; "" otherwise.
  virtual const std::string& session_id() const = 0;
  // Queues (name, message) at the peer-mode engine whose session is
  // `session` ("host:port"), which reads it with TakeNotifications. Call it
  // once a batch's writes are done: they have landed before the message
  // does. OK once the peer holds it; UNAVAILABLE or DEADLINE_EXCEEDED when
  // it cannot be reached by `deadline`; RESOURCE_EXHAUSTED when the peer's
  // queue is full (kMaxQueuedNotifications, or kMaxQueuedNotificationBytes:
  // nothing reads it); the peer's refusal (INVALID_ARGUMENT for a message
  // over 32 KiB, NOT_FOUND from an engine not in peer mode, which takes no
  // notifications).
  virtual absl::Status Notify(const std::string& session, const std::string& name, const std::string& message,
                              absl::Time deadline) = 0;
  // Looks `segment` up afresh, whatever is cached (its descriptor, from
  // the peer itself in peer mode, and a transport's handshake) and returns
  // its descriptor: OK means it answers now. A peer that failed before is
  // used again once a probe succeeds.
  virtual absl::StatusOr<SegmentDescriptor> Probe(const std::string& segment, absl::Time deadline) = 0;
  // Every notification received since the last call, in arrival order;
  // while there is none, waits for one until `wait_until` (by default it
  // returns at once).
  virtual std::vector<Notification> TakeNotifications(absl::Time wait_until = absl::InfinitePast()) = 0;
  static constexpr size_t kMaxQueuedNotifications = 1 << 16;
  static constexpr size_t kMaxQueuedNotificationBytes = 64 << 20;
};

// "host:port", with an IPv6 address in brackets: a peer-mode session id.
std::string JoinHostPort(const std::string& host, int port);

}  // namespace tierkv::transport
