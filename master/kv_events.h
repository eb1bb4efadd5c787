// KvEventPublisher: the master's KV events for KV-aware routers, over
// ZeroMQ in vLLM's KV-events wire layout (docs/kv-events.md has the bytes).
//
// The object index tells the publisher (through IndexListener) of every
// object stored (PutEnd, or restored at start) and every stored object that
// leaves (remove, eviction, a lost segment). Each becomes one event:
// BlockStored{block_hashes=[key], parent_block_hash=parent key or nil,
// token_ids=[], block_size=0, lora_id=nil, medium} or
// BlockRemoved{block_hashes=[key], medium}; a start publishes
// AllBlocksCleared first, so a consumer drops what an older master told it.
//
//   KvEventsOptions o;
//   o.endpoint = "tcp://*:5557";
//   o.replay_endpoint = "tcp://*:5558";
//   KvEventPublisher events(o, &registry);
//   RETURN_IF_ERROR(events.Start());
//   IndexOptions io;
//   io.listener = &events;
//
// Wire: every message on the PUB socket is [topic, seq (8 bytes, big
// endian), payload]; seq counts batches from 0 within an epoch. The payload
// is an EventBatch [ts (float seconds), [event...], nil, epoch] where the
// events are arrays [tag, fields...] (KvEventFormat::kArray, vLLM's older
// msgspec array_like form) or maps {"type": tag, field: value...}
// (KvEventFormat::kMap). The epoch (Unix milliseconds of Start, unique per
// master start or failover) tells a consumer that seq restarted and its
// view must be rebuilt.
//
// Replay: a ROUTER socket answers a request whose last frame is a start seq
// (8 bytes, big endian) with [seq, payload] for every buffered batch from
// that seq on (the last `buffer_batches` batches), then [-1 as 8 bytes, ""],
// each behind the requester's envelope (identity and, for REQ/DEALER-with-
// delimiter peers, the empty frame). Malformed requests are ignored.
//
// Never blocks the master: OnStored/OnRemoved copy the key into a bounded
// queue (queue_capacity events) and return; a full queue drops the event and
// counts it in tierkv_master_kv_events_dropped_total. One publisher thread
// owns both sockets: every batch_interval it answers replay requests and
// publishes what is queued in batches of at most max_batch events.
//
// Thread-safe: the listener calls and counters may be used from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "master/object_index.h"

namespace tierkv::master {

enum class KvEventFormat { kArray, kMap };

// "array" or "map"; INVALID_ARGUMENT otherwise.
absl::StatusOr<KvEventFormat> ParseKvEventFormat(absl::string_view name);

struct KvEventsOptions {
  std::string endpoint;         // PUB socket to bind (tcp://*:5557); empty: no events
  std::string replay_endpoint;  // ROUTER socket to bind; empty: no replay
  std::string topic = "kv-events";
  KvEventFormat format = KvEventFormat::kArray;
  absl::Duration batch_interval = absl::Milliseconds(10);
  size_t max_batch = 1024;       // events per batch
  size_t queue_capacity = 1 << 20;  // events waiting for the publisher thread
  size_t buffer_batches = 10000;    // batches kept for replay
  std::string medium = "cpu";    // the tier the master's segments are (DRAM)
};

struct KvEvent {
  enum class Type { kStored, kRemoved, kAllCleared };
  Type type = Type::kStored;
  std::string key;         // the block hash (sent as msgpack bin)
  std::string parent_key;  // empty: nil
  uint64_t block_size = 0;
};

// One batch's payload: [ts, [event...], nil, epoch] in `format`.
std::string EncodeKvEventBatch(const std::vector<KvEvent>& events, double ts, uint64_t epoch,
                               KvEventFormat format, absl::string_view medium);

class KvEventPublisher final : public IndexListener {
 public:
  // Binds nothing yet; events given before Start wait in the queue.
  // `metrics` must outlive the publisher.
  KvEventPublisher(KvEventsOptions options, metrics::Registry* metrics);
  ~KvEventPublisher() override;  // Stop()
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Binds both sockets and starts the publisher thread. INVALID_ARGUMENT
  // for an endpoint zmq cannot parse, UNAVAILABLE when it cannot be bound,
  // FAILED_PRECONDITION when already started.
  absl::Status Start();
  // Publishes what is queued, then closes the sockets; idempotent.
  void Stop();

  // IndexListener: enqueue only (see the header comment).
  void OnStored(absl::string_view key, absl::string_view parent_key, uint64_t size) override;
  void OnRemoved(absl::string_view key) override;
  // Queues AllBlocksCleared (a start whose consumers must forget the past).
  void OnAllCleared();

  uint64_t epoch() const { return epoch_; }
  // The endpoints as bound (a wildcard port resolved); empty before Start.
  std::string bound_endpoint() const;
  std::string bound_replay_endpoint() const;
  uint64_t dropped() const { return static_cast<uint64_t>(dropped_->Value()); }

 private:
  void Enqueue(KvEvent event);
  void Run();
  // Publishes up to max_batch queued events as one batch; false when none were queued.
  bool PublishOne();
  void ServeReplay();

  const KvEventsOptions options_;
  const uint64_t epoch_;
  metrics::Counter* dropped_;
  metrics::Counter* published_;
  metrics::Counter* batches_;

  mutable Mutex mu_;  // a leaf: taken under the index's shard locks
  std::deque<KvEvent> queue_ ABSL_GUARDED_BY(mu_);
  std::string bound_ ABSL_GUARDED_BY(mu_);
  std::string bound_replay_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopping_{false};
  std::thread thread_;

  // Owned by the publisher thread once started.
  void* context_ = nullptr;
  void* pub_ = nullptr;
  void* replay_ = nullptr;
  uint64_t next_seq_ = 0;
  std::deque<std::pair<uint64_t, std::string>> ring_;
};

}  // namespace tierkv::master
