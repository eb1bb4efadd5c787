// The transfer engine's peer mode (EngineOptions::peer_mode): the peer
// segment, descriptors fetched from peers, and notifications
// (internal/engine_impl.h).
//
// The peer segment's buffers keep the index they were registered at: a
// backend's handshake (shm's memfds, cuda's IPC handles) names buffers by
// index, so a peer holding an older table must never see an index reused
// for other memory. An unregistered buffer leaves a tombstone (length 0,
// never matched) in its place.
#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/internal/builtin.h"
#include "transport/internal/engine_impl.h"
#include "transport/internal/json_fields.h"

namespace tierkv::transport::internal {
namespace {

// What a tombstone's slot holds: no memory, no memfd, no backend key.
const LocalBuffer kTombstone{};

constexpr size_t kMaxNotificationBytes = 32 << 10;

}  // namespace

void Engine::InitPeerMode() {
  session_id_ = JoinHostPort(options_.backend.advertise, tcp_port());
  ServedSegment seg{session_id_, next_segment_index_++, NewSegmentId(), {}, {}, {}, {}, {}};
  seg.descriptor = DescriptorJson(seg);
  served_.emplace(session_id_, std::move(seg));
  TKV_LOG(INFO) << "transfer engine in peer mode, session " << session_id_;
}

void Engine::AddPeerBuffer(LocalBuffer* b) {
  ServedSegment& seg = served_.at(session_id_);
  const uint64_t address = reinterpret_cast<uintptr_t>(b->addr);
  seg.buffers.push_back(b);
  seg.offsets.push_back(address);
  seg.described.push_back(DescribeBuffer(*b, address));
  seg.descriptor = DescriptorJson(seg);
}

void Engine::RemovePeerBuffer(const LocalBuffer* b) {
  ServedSegment& seg = served_.at(session_id_);
  for (size_t i = 0; i < seg.buffers.size(); ++i) {
    if (seg.buffers[i] != b) continue;
    seg.buffers[i] = const_cast<LocalBuffer*>(&kTombstone);
    seg.offsets[i] = 0;
    seg.described[i] = BufferDescriptor{0, 0, b->location.ToString(), {}};
  }
  seg.descriptor = DescriptorJson(seg);
}

absl::StatusOr<std::string> Engine::PeerHandshake(const std::string& request,
                                                  std::optional<std::pair<uint32_t, uint64_t>> admitted) {
  nlohmann::json j = nlohmann::json::parse(request, nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError("peer handshake is not JSON");
  std::string op;
  RETURN_IF_ERROR(StringField(j, "op", &op));
  // Peer mode has no master to hand out data grants, so an engine that
  // requires them answers no stranger.
  if (options_.data_grants && !admitted) {
    return absl::UnauthenticatedError("this engine needs a data grant before a peer handshake");
  }
  if (op == "describe") {
    if (!options_.peer_mode) return absl::NotFoundError("this engine is not in peer mode");
    std::shared_lock lock(served_mu_);
    return served_.at(session_id_).descriptor;
  }
  if (op == "notify") {
    // A store daemon reads no notifications: queueing them there would
    // only let anyone who reaches its port fill its memory.
    if (!options_.peer_mode) return absl::NotFoundError("this engine is not in peer mode and takes no notifications");
    Notification n;
    std::string encoded;
    RETURN_IF_ERROR(StringField(j, "from", &n.from));
    RETURN_IF_ERROR(StringField(j, "name", &n.name));
    RETURN_IF_ERROR(StringField(j, "message", &encoded));
    if (!absl::Base64Unescape(encoded, &n.message)) {
      return absl::InvalidArgumentError("notification message is not base64");
    }
    if (n.message.size() + n.name.size() > kMaxNotificationBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("notification of ", n.message.size() + n.name.size(), " bytes; the limit is ", kMaxNotificationBytes));
    }
    const size_t bytes = n.from.size() + n.name.size() + n.message.size();
    MutexLock lock(&notify_mu_);
    if (notifications_.size() >= kMaxQueuedNotifications ||
        notification_bytes_ + bytes > kMaxQueuedNotificationBytes) {
      return absl::ResourceExhaustedError(absl::StrCat(notifications_.size(), " notifications (", notification_bytes_,
                                                       " bytes) are queued here and nothing reads them"));
    }
    notification_bytes_ += bytes;
    notifications_.push_back(std::move(n));
    notified_.SignalAll();
    return std::string("{}");
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown peer handshake op '", op.substr(0, 32), "'"));
}

absl::StatusOr<std::string> Engine::FetchPeerDescriptor(const std::string& session, absl::Time deadline) {
  absl::StatusOr<std::string> json =
      TcpHandshake(session, "peer", R"({"op":"describe"})", deadline, nullptr, 0, 0, options_.backend.tls.ca);
  if (!json.ok() && absl::IsNotFound(json.status())) {
    return absl::NotFoundError(absl::StrCat("peer ", session, " is not in peer mode: ", json.status().message()));
  }
  return json;
}

absl::Status Engine::Notify(const std::string& session, const std::string& name, const std::string& message,
                            absl::Time deadline) {
  if (message.size() + name.size() > kMaxNotificationBytes) {
    return absl::InvalidArgumentError(absl::StrCat("notification of ", message.size() + name.size(),
                                                   " bytes; the limit is ", kMaxNotificationBytes));
  }
  nlohmann::json j{{"op", "notify"},
                   {"from", session_id_.empty() ? FindBackend("tcp")->endpoint() : session_id_},
                   {"name", name},
                   {"message", absl::Base64Escape(message)}};
  // A name that is not UTF-8 travels with its bad bytes replaced rather
  // than throwing out of the serializer.
  const std::string request = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  absl::StatusOr<std::string> answer =
      TcpHandshake(session, "peer", request, deadline, nullptr, 0, 0, options_.backend.tls.ca);
  return Annotate(answer.status(), absl::StrCat("notifying ", session));
}

std::vector<Notification> Engine::TakeNotifications(absl::Time wait_until) {
  MutexLock lock(&notify_mu_);
  for (absl::Duration left = wait_until - absl::Now(); notifications_.empty() && left > absl::ZeroDuration();
       left = wait_until - absl::Now()) {
    notified_.WaitFor(&notify_mu_, absl::ToChronoMicroseconds(left) + std::chrono::microseconds(100));
  }
  std::vector<Notification> out(std::make_move_iterator(notifications_.begin()),
                                std::make_move_iterator(notifications_.end()));
  notifications_.clear();
  notification_bytes_ = 0;
  return out;
}

absl::StatusOr<SegmentDescriptor> Engine::Probe(const std::string& segment, absl::Time deadline) {
  Invalidate(segment);
  ASSIGN_OR_RETURN(Prepared p, GetPeer(segment, deadline));
  return p.desc;
}

void Engine::Invalidate(const std::string& segment) {
  std::shared_ptr<PeerEntry> e = Entry(segment);
  MutexLock lock(&e->mu);
  e->desc.reset();
  e->channel.reset();
  e->alternates.clear();
  ++e->generation;
}

bool Engine::Continues(const Request& lead, uint64_t run, const Request& r, const BufferDescriptor* lead_where,
                       const BufferDescriptor* where, Backend* backend) {
  if (!options_.coalesce || r.op != lead.op || r.epoch != lead.epoch || r.grant != lead.grant || r.crc != nullptr ||
      lead.crc != nullptr || where != lead_where) {
    return false;
  }
  if (static_cast<char*>(lead.local) + run != r.local || lead.offset + run != r.offset) return false;
  if (!backend->capabilities().needs_registered_local) return true;
  // rdma moves from one registered buffer per work request.
  std::shared_lock lock(served_mu_);
  return LocalBufferOf(lead.local, run + r.length) != nullptr;
}

}  // namespace tierkv::transport::internal
