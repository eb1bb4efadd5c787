// The KV-event publisher: encoding (msgpack-cxx, header-only) and the one
// thread that owns the ZeroMQ sockets. See kv_events.h for the contract.
#include "master/kv_events.h"

#include <zmq.h>

#include <cstring>

#include <msgpack.hpp>

#include "absl/strings/str_cat.h"
#include "base/log.h"

namespace tierkv::master {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackBin(Packer& pk, absl::string_view b) {
  pk.pack_bin(static_cast<uint32_t>(b.size()));
  pk.pack_bin_body(b.data(), static_cast<uint32_t>(b.size()));
}

void PackStr(Packer& pk, absl::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// One event in vLLM's field order. In array form the tag leads, as msgspec
// writes a tagged array_like struct; in map form "type" carries it.
void PackEvent(Packer& pk, const KvEvent& e, KvEventFormat format, absl::string_view medium) {
  const bool map = format == KvEventFormat::kMap;
  auto field = [&](absl::string_view name) {
    if (map) PackStr(pk, name);
  };
  auto hashes = [&] {
    field("block_hashes");
    pk.pack_array(1);
    PackBin(pk, e.key);
  };
  switch (e.type) {
    case KvEvent::Type::kStored:
      map ? pk.pack_map(7) : pk.pack_array(7);
      field("type");
      PackStr(pk, "BlockStored");
      hashes();
      field("parent_block_hash");
      if (e.parent_key.empty()) {
        pk.pack_nil();
      } else {
        PackBin(pk, e.parent_key);
      }
      field("token_ids");
      pk.pack_array(0);
      field("block_size");
      pk.pack_uint64(e.block_size);
      field("lora_id");
      pk.pack_nil();
      field("medium");
      PackStr(pk, medium);
      break;
    case KvEvent::Type::kRemoved:
      map ? pk.pack_map(3) : pk.pack_array(3);
      field("type");
      PackStr(pk, "BlockRemoved");
      hashes();
      field("medium");
      PackStr(pk, medium);
      break;
    case KvEvent::Type::kAllCleared:
      map ? pk.pack_map(1) : pk.pack_array(1);
      field("type");
      PackStr(pk, "AllBlocksCleared");
      break;
  }
}

std::string BigEndian(int64_t v) {
  std::string out(8, '\0');
  uint64_t u = static_cast<uint64_t>(v);
  for (int i = 7; i >= 0; --i, u >>= 8) out[i] = static_cast<char>(u & 0xff);
  return out;
}

std::string ZmqError(absl::string_view what) { return absl::StrCat(what, ": ", zmq_strerror(zmq_errno())); }

// Sends `frames` as one multipart message without blocking (a PUB drops for
// a subscriber at its high-water mark; a ROUTER drops for a gone peer).
void SendFrames(void* socket, const std::vector<absl::string_view>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    int flags = ZMQ_DONTWAIT | (i + 1 < frames.size() ? ZMQ_SNDMORE : 0);
    if (zmq_send(socket, frames[i].data(), frames[i].size(), flags) < 0) return;
  }
}

absl::Status Bind(void* socket, const std::string& endpoint, std::string* bound) {
  if (zmq_bind(socket, endpoint.c_str()) != 0) {
    std::string msg = ZmqError(absl::StrCat("binding kv events endpoint ", endpoint));
    return zmq_errno() == EINVAL || zmq_errno() == EPROTONOSUPPORT ? absl::InvalidArgumentError(msg)
                                                                   : absl::UnavailableError(msg);
  }
  char buf[256];
  size_t len = sizeof(buf);
  if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, buf, &len) == 0 && len > 0) {
    *bound = std::string(buf, strnlen(buf, len));
  } else {
    *bound = endpoint;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<KvEventFormat> ParseKvEventFormat(absl::string_view name) {
  if (name == "array") return KvEventFormat::kArray;
  if (name == "map") return KvEventFormat::kMap;
  return absl::InvalidArgumentError(absl::StrCat("kv events format \"", name, "\": want array or map"));
}

std::string EncodeKvEventBatch(const std::vector<KvEvent>& events, double ts, uint64_t epoch,
                               KvEventFormat format, absl::string_view medium) {
  msgpack::sbuffer buf;
  Packer pk(&buf);
  // vLLM's EventBatch is array_like: [ts, events, data_parallel_rank]; the
  // epoch rides as a fourth element, which msgspec decoders ignore.
  pk.pack_array(4);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvEvent& e : events) PackEvent(pk, e, format, medium);
  pk.pack_nil();
  pk.pack_uint64(epoch);
  return std::string(buf.data(), buf.size());
}

KvEventPublisher::KvEventPublisher(KvEventsOptions options, metrics::Registry* metrics)
    : options_(std::move(options)),
      epoch_(static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()))) {
  dropped_ = &metrics::BuildCounter()
                  .Name("tierkv_master_kv_events_dropped_total")
                  .Help("KV events dropped because the publisher's queue was full")
                  .Register(*metrics)
                  .Add({});
  published_ = &metrics::BuildCounter()
                    .Name("tierkv_master_kv_events_published_total")
                    .Help("KV events published")
                    .Register(*metrics)
                    .Add({});
  batches_ = &metrics::BuildCounter()
                  .Name("tierkv_master_kv_events_batches_total")
                  .Help("KV event batches published")
                  .Register(*metrics)
                  .Add({});
}

KvEventPublisher::~KvEventPublisher() { Stop(); }

absl::Status KvEventPublisher::Start() {
  if (context_ != nullptr) return absl::FailedPreconditionError("kv events already started");
  context_ = zmq_ctx_new();
  if (context_ == nullptr) return absl::UnavailableError(ZmqError("zmq_ctx_new"));
  auto fail = [&](absl::Status st) {
    if (pub_ != nullptr) zmq_close(pub_);
    if (replay_ != nullptr) zmq_close(replay_);
    zmq_ctx_term(context_);
    pub_ = replay_ = context_ = nullptr;
    return st;
  };
  // Shutdown waits at most this long for unsent messages.
  const int linger_ms = 200;
  std::string bound, bound_replay;
  pub_ = zmq_socket(context_, ZMQ_PUB);
  if (pub_ == nullptr) return fail(absl::UnavailableError(ZmqError("zmq_socket(PUB)")));
  zmq_setsockopt(pub_, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
  if (absl::Status st = Bind(pub_, options_.endpoint, &bound); !st.ok()) return fail(st);
  if (!options_.replay_endpoint.empty()) {
    replay_ = zmq_socket(context_, ZMQ_ROUTER);
    if (replay_ == nullptr) return fail(absl::UnavailableError(ZmqError("zmq_socket(ROUTER)")));
    zmq_setsockopt(replay_, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
    // A replay answers with the whole ring: let it queue (memory is bounded by the ring).
    int hwm = static_cast<int>(std::min<size_t>(options_.buffer_batches + 16, INT32_MAX));
    zmq_setsockopt(replay_, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    if (absl::Status st = Bind(replay_, options_.replay_endpoint, &bound_replay); !st.ok()) return fail(st);
  }
  {
    MutexLock lock(&mu_);
    bound_ = bound;
    bound_replay_ = bound_replay;
  }
  TKV_LOG(INFO) << "kv events: publishing on " << bound << " (topic \"" << options_.topic << "\", epoch "
                << epoch_ << ")" << (bound_replay.empty() ? "" : ", replay on ") << bound_replay;
  thread_ = std::thread([this] { Run(); });
  return absl::OkStatus();
}

void KvEventPublisher::Stop() {
  if (stopping_.exchange(true)) return;
  if (thread_.joinable()) thread_.join();
  if (pub_ != nullptr) zmq_close(pub_);
  if (replay_ != nullptr) zmq_close(replay_);
  if (context_ != nullptr) zmq_ctx_term(context_);
  pub_ = replay_ = context_ = nullptr;
}

std::string KvEventPublisher::bound_endpoint() const {
  MutexLock lock(&mu_);
  return bound_;
}

std::string KvEventPublisher::bound_replay_endpoint() const {
  MutexLock lock(&mu_);
  return bound_replay_;
}

void KvEventPublisher::Enqueue(KvEvent event) {
  {
    MutexLock lock(&mu_);
    if (queue_.size() < options_.queue_capacity) {
      queue_.push_back(std::move(event));
      return;
    }
  }
  dropped_->Increment();
}

void KvEventPublisher::OnStored(absl::string_view key, absl::string_view parent_key, uint64_t size) {
  Enqueue({KvEvent::Type::kStored, std::string(key), std::string(parent_key), 0});
}

void KvEventPublisher::OnRemoved(absl::string_view key) {
  Enqueue({KvEvent::Type::kRemoved, std::string(key), "", 0});
}

void KvEventPublisher::OnAllCleared() { Enqueue({KvEvent::Type::kAllCleared, "", "", 0}); }

bool KvEventPublisher::PublishOne() {
  std::vector<KvEvent> events;
  {
    MutexLock lock(&mu_);
    size_t n = std::min(queue_.size(), std::max<size_t>(options_.max_batch, 1));
    if (n == 0) return false;
    events.assign(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.begin() + n));
    queue_.erase(queue_.begin(), queue_.begin() + n);
  }
  double ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  std::string payload = EncodeKvEventBatch(events, ts, epoch_, options_.format, options_.medium);
  uint64_t seq = next_seq_++;
  std::string seq_bytes = BigEndian(static_cast<int64_t>(seq));
  SendFrames(pub_, {options_.topic, seq_bytes, payload});
  published_->Increment(static_cast<double>(events.size()));
  batches_->Increment();
  if (options_.buffer_batches > 0) {
    if (ring_.size() >= options_.buffer_batches) ring_.pop_front();
    ring_.emplace_back(seq, std::move(payload));
  }
  return true;
}

void KvEventPublisher::ServeReplay() {
  for (;;) {
    std::vector<std::string> frames;
    for (int more = 1; more != 0;) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, replay_, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&msg);
        if (frames.empty()) return;  // nothing (more) to read
        break;
      }
      // Cap what one request may make us hold: envelope + delimiter + seq.
      if (frames.size() < 8) {
        frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
      }
      more = zmq_msg_more(&msg);
      zmq_msg_close(&msg);
    }
    // [identity, start] or [identity, "", start]; anything else is ignored.
    if ((frames.size() != 2 && frames.size() != 3) || frames.back().size() != 8 ||
        (frames.size() == 3 && !frames[1].empty())) {
      continue;
    }
    uint64_t start = 0;
    for (unsigned char c : frames.back()) start = (start << 8) | c;
    std::vector<absl::string_view> envelope(frames.begin(), frames.end() - 1);
    for (const auto& [seq, payload] : ring_) {
      if (seq < start) continue;
      std::string seq_bytes = BigEndian(static_cast<int64_t>(seq));
      std::vector<absl::string_view> out = envelope;
      out.push_back(seq_bytes);
      out.push_back(payload);
      SendFrames(replay_, out);
    }
    std::string end = BigEndian(-1);
    std::vector<absl::string_view> out = envelope;
    out.push_back(end);
    out.push_back("");
    SendFrames(replay_, out);
  }
}

void KvEventPublisher::Run() {
  const long interval_ms = std::max<long>(1, static_cast<long>(absl::ToInt64Milliseconds(options_.batch_interval)));
  // Bounded per call, so a flood of events cannot starve replay requests;
  // true while events remain queued.
  auto publish = [this] {
    bool more = true;
    for (int i = 0; i < 64 && more; ++i) more = PublishOne();
    return more;
  };
  for (;;) {
    const bool stopping = stopping_.load();
    const bool more = publish();
    if (stopping && !more) break;
    zmq_pollitem_t items[1] = {{replay_, 0, ZMQ_POLLIN, 0}};
    if (zmq_poll(items, replay_ != nullptr ? 1 : 0, more ? 0 : interval_ms) > 0) {
      // What was committed before the request is in its answer.
      publish();
      ServeReplay();
    }
  }
}

}  // namespace tierkv::master
