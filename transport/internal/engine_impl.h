// Private to transport/: the transfer engine's implementation, one class
// over three files: engine.cc (setup, registration, the serving side),
// engine_client.cc (submitting, routing and running transfers, peer
// lookups) and engine_peer.cc (peer mode: the peer segment, descriptors
// fetched from peers, notifications, coalescing).
//
// Locks: peers_mu_ -> PeerEntry::mu; served_mu_ and notify_mu_ are
// independent of them and of each other (engine.h).
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "base/mutex.h"
#include "transport/backend.h"
#include "transport/engine.h"
#include "transport/internal/batch.h"
#include "transport/internal/peers.h"

namespace tierkv::transport::internal {

struct ServedSegment {
  std::string name;
  uint32_t index;
  uint64_t id;  // random per ServeSegment: frames must name it (descriptor.h)
  std::vector<LocalBuffer*> buffers;
  std::vector<uint64_t> offsets;  // segment offset of each buffer
  std::vector<BufferDescriptor> described;  // each buffer as its descriptor shows it
  std::string descriptor;         // JSON, as published
  std::string data_key;           // EngineOptions::data_grants; "" without
};

class Engine final : public TransferEngine, public ServedMemory {
 public:
  explicit Engine(EngineOptions options) : options_(std::move(options)) {}
  ~Engine() override;
  absl::Status Init();

  // --- registration and serving

  absl::Status RegisterMemory(void* addr, uint64_t length, const std::string& location,
                              int memfd) override;
  absl::Status UnregisterMemory(void* addr) override;
  absl::Status ServeSegment(const std::string& name, const std::vector<void*>& addrs) override;
  absl::Status Publish(const std::string& name) override;
  absl::Status StopServing(const std::string& name) override;
  absl::StatusOr<std::string> SegmentDataKey(const std::string& name) override;

  // --- ServedMemory (called by backends' serving threads)

  bool DataGrantsRequired() const override { return options_.data_grants; }

  void ObserveEpoch(uint64_t epoch) override;
  absl::Status AdmitWrite(uint64_t epoch) override;
  absl::StatusOr<std::string> DataKey(uint32_t segment_index, uint64_t segment_id) override;
  absl::StatusOr<Pin> Resolve(uint32_t segment_index, uint64_t segment_id, uint64_t offset,
                              uint64_t length) override;
  absl::StatusOr<std::string> Handshake(const std::string& transport, const std::string& request,
                                        std::optional<std::pair<uint32_t, uint64_t>> admitted) override;

  // --- client side

  std::shared_ptr<Batch> Submit(std::vector<Request> requests, absl::Duration timeout) override;
  std::shared_ptr<Batch> SubmitHere(std::vector<Request> requests, absl::Duration timeout) override;
  std::vector<absl::Status> Transfer(std::vector<Request> requests, absl::Duration timeout) override;

  // Submit, or with `here` SubmitHere.
  std::shared_ptr<Batch> Start(std::vector<Request> requests, absl::Duration timeout, bool here);
  PeerInfo Describe(const std::string& segment) override;
  bool ChecksumsCopies(const std::string& segment, uint64_t length) override;
  void ForgetPeers() override;
  EngineStats Stats() const override;
  int port() const override { return tcp_port(); }
  const std::string& host_id() const override { return options_.host_id; }
  const std::string& advertised_address() const override { return options_.backend.advertise; }
  const std::string& session_id() const override { return session_id_; }
  absl::Status Notify(const std::string& session, const std::string& name, const std::string& message,
                      absl::Time deadline) override;
  std::vector<Notification> TakeNotifications(absl::Time wait_until) override;
  absl::StatusOr<SegmentDescriptor> Probe(const std::string& segment, absl::Time deadline) override;

 private:
  struct Prepared {
    SegmentDescriptor desc;
    std::shared_ptr<PeerChannel> channel;
    Backend* backend;
    std::string transport;
  };
  int tcp_port() const;

  // Non-zero and unlike any segment served here now; random so that a
  // restarted engine (whose indices start again at 0) never reuses one.
  uint64_t NewSegmentId();
  Backend* FindBackend(const std::string& name);
  // `b` at `offset` as a descriptor shows it, with each backend's key
  // (registering it with them). Caller holds served_mu_.
  BufferDescriptor DescribeBuffer(const LocalBuffer& b, uint64_t offset);
  // The descriptor of `seg` (its buffers as `described`), as JSON.
  std::string DescriptorJson(const ServedSegment& seg);

  // True when [a, a+length) overlaps a registered buffer or a range being
  // (un)registered. Caller holds served_mu_.
  bool Overlaps(char* a, uint64_t length);

  // The registered buffer holding [addr, addr+length), or null. Caller
  // holds served_mu_.
  const LocalBuffer* LocalBufferOf(void* addr, uint64_t length);


  // Why `backend` cannot move request `r` into the peer's buffer `where`
  // ("" when it can): GPU memory needs a cuda-capable transport, a
  // transport that needs registered local memory needs `r.local` inside a
  // buffer it registered, and a keyed one needs its key on `where`.
  std::string Refusal(Backend* backend, const Request& r, bool gpu, const BufferDescriptor* where);

  // The next transport after `peer`'s (in selection order) that the peer
  // offers, that does not refuse `r`, and that reaches it; its channel is
  // cached beside the chosen one. FAILED_PRECONDITION naming `refusal` and
  // each candidate's reason when there is none.
  absl::StatusOr<std::pair<Backend*, std::shared_ptr<PeerChannel>>> Fallback(
      const std::string& segment, const Prepared& peer, const Request& r, bool gpu, const BufferDescriptor* where,
      const std::string& refusal, absl::Time deadline);

  // A registered local range and whether it is GPU memory, remembered
  // across one batch's requests (most lie in the buffer the last one did).
  struct LocalHint {
    char* start = nullptr;
    uint64_t length = 0;
    bool gpu = false;
  };
  // True when [addr, addr+length) lies in registered cuda:<n> memory.
  bool LocalIsGpu(void* addr, uint64_t length, LocalHint* hint);
  std::shared_ptr<PeerEntry> Entry(const std::string& segment);

  // The cached channel to `segment`, else a fresh lookup: its descriptor
  // (the peer may have restarted or moved) and the first transport that
  // reaches it. One lookup per segment at a time, outside the entry's
  // lock; a caller arriving meanwhile waits for it, up to its own
  // deadline (DEADLINE_EXCEEDED), then looks up itself if it failed.
  absl::StatusOr<Prepared> GetPeer(const std::string& segment, absl::Time deadline);

  // GetPeer's lookup, by `deadline`; only the entry's results are stored
  // under its lock.
  absl::StatusOr<Prepared> LookUp(const std::string& segment, absl::Time deadline, PeerEntry& e);
  void Run(Task& t);
  EngineOptions options_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<Backend*> order_;
  std::unique_ptr<WorkQueue> queue_;
  std::shared_mutex served_mu_;
  std::atomic<uint64_t> epoch_{0};  // the newest master epoch seen (ObserveEpoch, AdmitWrite)
  std::map<char*, std::unique_ptr<LocalBuffer>> buffers_;  // guarded by served_mu_
  std::map<std::string, ServedSegment> served_;            // guarded by served_mu_
  // Ranges (start, length) whose backends are registering or unregistering
  // them outside served_mu_; guarded by served_mu_.
  std::map<char*, uint64_t> in_flux_;
  // (buffer id, backend) pairs where the backend could not register the
  // buffer; guarded by served_mu_.
  absl::flat_hash_set<std::pair<uint64_t, Backend*>> refused_;
  uint64_t next_buffer_id_ = 1;
  uint32_t next_segment_index_ = 0;
  Mutex peers_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<PeerEntry>> peers_ ABSL_GUARDED_BY(peers_mu_);
  std::atomic<uint64_t> requests_{0}, failed_{0}, bytes_read_{0}, bytes_written_{0}, coalesced_{0};

  // --- peer mode (engine_peer.cc)
  // Serves the peer segment (session_id_) with no buffers yet.
  void InitPeerMode() ABSL_EXCLUSIVE_LOCKS_REQUIRED(served_mu_);
  // Adds or removes `b` from the peer segment and redraws its descriptor.
  // Caller holds served_mu_ exclusively.
  void AddPeerBuffer(LocalBuffer* b);
  void RemovePeerBuffer(const LocalBuffer* b);
  // The serving side of the "peer" control handshake: {"op": "describe"}
  // answers the peer segment's descriptor, {"op": "notify", ...} queues a
  // notification.
  absl::StatusOr<std::string> PeerHandshake(const std::string& request,
                                            std::optional<std::pair<uint32_t, uint64_t>> admitted);
  // A peer's descriptor (JSON), from the peer itself.
  absl::StatusOr<std::string> FetchPeerDescriptor(const std::string& session, absl::Time deadline);
  // The buffer of `desc` holding each request `idx` names (null for one
  // in none); true when every one is held.
  bool LocateAll(const SegmentDescriptor& desc, const std::vector<Request>& requests, const std::vector<size_t>& idx,
                 std::vector<const BufferDescriptor*>* where);
  // Drops what is cached of `segment` so the next GetPeer looks it up again.
  void Invalidate(const std::string& segment);
  // Whether request `r` may join the run that `lead` starts, `run` bytes
  // long so far (EngineOptions::coalesce): both go over `backend` into the
  // same buffer of the peer's, and the run stays one local range.
  bool Continues(const Request& lead, uint64_t run, const Request& r, const BufferDescriptor* lead_where,
                 const BufferDescriptor* where, Backend* backend);

  std::string session_id_;  // peer mode
  Mutex notify_mu_;
  std::deque<Notification> notifications_ ABSL_GUARDED_BY(notify_mu_);
  size_t notification_bytes_ ABSL_GUARDED_BY(notify_mu_) = 0;
  CondVar notified_;  // signalled when a notification is queued
};

}  // namespace tierkv::transport::internal
