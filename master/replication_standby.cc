// The standby's side of replication: StandbyCopier follows the leader's
// stream of committed batches (or pulls them from a leader that does not
// stream) and applies them to its own store with its position, taking a
// snapshot of the leader's store first when its copy has no place in the
// leader's log. The leader's side is in replication.cc.
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/net/socket.h"
#include "base/status.h"
#include "google/protobuf/io/coded_stream.h"
#include "master/internal/replication_common.h"
#include "master/replication.h"
#include "proto/direct_frame.h"

namespace tierkv::master {

namespace {

// A standby's copy is applied in writes of at most this many mutations, so
// one huge snapshot page or backlog never builds one huge RocksDB batch.
constexpr size_t kApplyChunk = 4096;

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(what, ": ", s.error_message()));
}

Mutation FromWire(const v1::StoreMutation& m) { return {m.key(), m.value(), m.remove()}; }

}  // namespace

StandbyCopier::StandbyCopier(IndexStore* store, std::string self, uint32_t page_bytes, absl::Duration spin,
                             std::string token, std::shared_ptr<grpc::ChannelCredentials> creds, bool tls)
    : store_(store),
      self_(std::move(self)),
      page_bytes_(page_bytes),
      spin_(spin),
      token_(std::move(token)),
      creds_(creds != nullptr ? std::move(creds) : grpc::InsecureChannelCredentials()),
      tls_(tls) {
  pos_ = ReadPosition(store_);
  thread_ = std::thread([this] { Loop(); });
}

StandbyCopier::~StandbyCopier() { Stop(); }

void StandbyCopier::Follow(const std::string& address) {
  MutexLock lock(&mu_);
  if (address == leader_) return;
  leader_ = address;
  ++generation_;
  if (stream_fd_ >= 0) ::shutdown(stream_fd_, SHUT_RDWR);
  cv_.SignalAll();
}

void StandbyCopier::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    if (stream_fd_ >= 0) ::shutdown(stream_fd_, SHUT_RDWR);
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

ReplPosition StandbyCopier::position() {
  MutexLock lock(&mu_);
  return pos_;
}

std::string StandbyCopier::leader() {
  MutexLock lock(&mu_);
  return leader_;
}

uint64_t StandbyCopier::leader_seq() {
  MutexLock lock(&mu_);
  return leader_seq_;
}

uint64_t StandbyCopier::streamed() {
  MutexLock lock(&mu_);
  return streamed_;
}

uint64_t StandbyCopier::snapshots() {
  MutexLock lock(&mu_);
  return snapshots_;
}

void StandbyCopier::Loop() {
  std::string address;
  uint64_t generation = 0;
  std::unique_ptr<v1::MasterHa::Stub> stub;
  bool stream = true;  // until this leader refuses a stream
  absl::Duration backoff = absl::Milliseconds(50);
  std::string last_error;  // logged once, not on every retry
  for (;;) {
    {
      MutexLock lock(&mu_);
      while (!stop_ && leader_.empty()) cv_.WaitFor(&mu_, std::chrono::seconds(1));
      if (stop_) return;
      if (generation != generation_ || stub == nullptr) {
        generation = generation_;
        address = leader_;
        stream = !tls_;  // a leader serving TLS has no direct lane to stream on
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(64 << 20);
        args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
        args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
        stub = v1::MasterHa::NewStub(grpc::CreateCustomChannel(address, creds_, args));
      }
    }
    absl::Status s = Step(stub.get(), address, &stream);
    if (s.ok()) {
      backoff = absl::Milliseconds(50);
      last_error.clear();
      continue;
    }
    if (std::string e(s.message()); e != last_error) {
      TKV_LOG(WARNING) << "standby: copying from " << address << ": " << s;
      last_error = std::move(e);
    }
    MutexLock lock(&mu_);
    if (!stop_ && generation == generation_) cv_.WaitFor(&mu_, absl::ToChronoMilliseconds(backoff));
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

absl::Status StandbyCopier::Step(v1::MasterHa::Stub* stub, const std::string& address, bool* stream) {
  ReplPosition pos;
  bool snapshot;
  {
    MutexLock lock(&mu_);
    snapshot = need_snapshot_ || !pos_.valid;
    need_snapshot_ = false;
    pos = pos_;
  }
  if (snapshot) return TakeSnapshot(stub);
  if (*stream) {
    bool refused = false;
    absl::Status s = StreamFrom(address, pos, &refused);
    if (!refused) return s;
    // A leader that does not stream (auth on, or an older master): pull.
    TKV_LOG(INFO) << "standby: " << address << " refused a replication stream (" << s << "); pulling instead";
    *stream = false;
    return absl::OkStatus();
  }
  v1::PullRequest req;
  req.set_standby(self_);
  req.set_epoch(pos.epoch);
  req.set_next_seq(pos.seq + 1);
  req.set_wait_ms(kPullWaitMs);
  req.set_max_bytes(page_bytes_);
  v1::PullResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  Present(&ctx);
  RETURN_IF_ERROR(FromGrpc(stub->Pull(&ctx, req, &resp), "pull"));
  return Apply(resp, &pos);
}

void StandbyCopier::Present(grpc::ClientContext* ctx) const {
  if (!token_.empty()) ctx->AddMetadata(std::string(auth::kAuthorizationHeader), absl::StrCat("Bearer ", token_));
}

absl::Status StandbyCopier::Apply(const v1::PullResponse& resp, ReplPosition* pos) {
  if (resp.snapshot_needed()) {
    MutexLock lock(&mu_);
    need_snapshot_ = true;
    return absl::OkStatus();
  }
  if (resp.batches_size() == 0) return absl::OkStatus();
  std::vector<Mutation> apply;
  uint64_t seq = pos->seq;
  for (const v1::ReplBatch& b : resp.batches()) {
    if (b.seq() != seq + 1) return absl::DataLossError(absl::StrCat("replication: batch ", b.seq(), " after ", seq));
    seq = b.seq();
    for (const v1::StoreMutation& m : b.mutations()) apply.push_back(FromWire(m));
  }
  const ReplPosition next{resp.epoch(), seq, true};
  apply.push_back({kHaPositionKey, EncodePosition(next), false});
  RETURN_IF_ERROR(store_->Write(apply));
  *pos = next;
  MutexLock lock(&mu_);
  pos_ = next;
  leader_seq_ = std::max(leader_seq_, seq);
  return absl::OkStatus();
}

absl::Status StandbyCopier::StreamFrom(const std::string& address, ReplPosition pos, bool* refused) {
  const absl::Duration patience = absl::Seconds(2);  // ten of the leader's heartbeats
  ASSIGN_OR_RETURN(net::Fd fd, net::Dial(address, absl::Now() + patience));
  uint64_t generation;
  {
    MutexLock lock(&mu_);
    if (stop_) return absl::OkStatus();
    generation = generation_;
    stream_fd_ = fd.get();  // Stop and Follow shut it down
  }
  struct Forget {
    StandbyCopier* self;
    ~Forget() {
      MutexLock lock(&self->mu_);
      self->stream_fd_ = -1;
    }
  } forget{this};
  // Sends a call frame: the request, then an acknowledgement per frame.
  std::string out;
  auto send = [&](uint64_t next_seq) {
    v1::PullRequest req;
    req.set_standby(self_);
    req.set_epoch(pos.epoch);
    req.set_next_seq(next_seq);
    req.set_max_bytes(page_bytes_);
    out.resize(direct::kHeaderSize);
    direct::EncodeCall({direct::DirectMethod::kReplicate, static_cast<uint32_t>(req.ByteSizeLong())}, out.data());
    req.AppendToString(&out);
    return net::WriteFull(fd.get(), out.data(), out.size(), absl::Now() + patience);
  };
  if (!token_.empty()) {
    // A leader running --auth admits a connection by a first ping with a token.
    v1::DirectHello hello;
    hello.set_token(token_);
    out.resize(direct::kHeaderSize);
    direct::EncodeCall({direct::DirectMethod::kPing, static_cast<uint32_t>(hello.ByteSizeLong())}, out.data());
    hello.AppendToString(&out);
    RETURN_IF_ERROR(net::WriteFull(fd.get(), out.data(), out.size(), absl::Now() + patience));
    char h[direct::kHeaderSize];
    RETURN_IF_ERROR(net::ReadFull(fd.get(), h, sizeof h, absl::Now() + patience));
    absl::StatusOr<direct::ReplyHeader> pong = direct::DecodeReply(h, 1 << 20);
    if (!pong.ok()) {
      *refused = true;  // not a direct lane
      return pong.status();
    }
    std::string text(pong->message_length + pong->length, '\0');
    RETURN_IF_ERROR(net::ReadFull(fd.get(), text.data(), text.size(), absl::Now() + patience));
    if (pong->code != 0) {
      *refused = true;
      return absl::Status(static_cast<absl::StatusCode>(pong->code), text.substr(0, pong->message_length));
    }
  }
  RETURN_IF_ERROR(send(pos.seq + 1));
  std::string in;
  bool answered = false;  // a reply frame came: the leader speaks the stream
  // Reads one frame into *resp, adding its batches to those already there.
  auto read = [&](v1::PullResponse* resp) -> absl::Status {
    char h[direct::kHeaderSize];
    const absl::Time deadline = absl::Now() + patience;
    RETURN_IF_ERROR(net::ReadFull(fd.get(), h, sizeof h, deadline));
    absl::StatusOr<direct::ReplyHeader> decoded = direct::DecodeReply(h, 64 << 20);
    if (!decoded.ok()) {
      *refused = !answered;  // not a direct lane (gRPC alone answers there)
      return decoded.status();
    }
    const direct::ReplyHeader reply = *decoded;
    answered = true;
    in.resize(reply.message_length + reply.length);
    RETURN_IF_ERROR(net::ReadFull(fd.get(), in.data(), in.size(), deadline));
    if (reply.code != 0) {
      *refused = true;
      return absl::Status(static_cast<absl::StatusCode>(reply.code), in.substr(0, reply.message_length));
    }
    google::protobuf::io::CodedInputStream frame(reinterpret_cast<const uint8_t*>(in.data()) + reply.message_length,
                                                 static_cast<int>(reply.length));
    if (!resp->MergeFromCodedStream(&frame)) {
      return absl::DataLossError("replication stream: a frame does not parse");
    }
    return absl::OkStatus();
  };
  for (;;) {
    v1::PullResponse resp;
    // The next frame follows the leader's next commit, often within the
    // spin: waking from recv for it would add to a semi-sync round.
    net::SpinUntilReadable(fd.get(), spin_);
    RETURN_IF_ERROR(read(&resp));
    // Frames that came while the last write was applied go in one write,
    // with one acknowledgement: the busier the leader, the larger each.
    for (int more = 0; more < 64 && !resp.snapshot_needed() && resp.ByteSizeLong() < page_bytes_; ++more) {
      pollfd p{fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 0) != 1) break;
      RETURN_IF_ERROR(read(&resp));
    }
    RETURN_IF_ERROR(Apply(resp, &pos));
    {
      MutexLock lock(&mu_);
      streamed_ += resp.batches_size();
      if (stop_ || generation != generation_ || need_snapshot_) return absl::OkStatus();
    }
    RETURN_IF_ERROR(send(pos.seq + 1));
  }
}

absl::Status StandbyCopier::TakeSnapshot(v1::MasterHa::Stub* stub) {
  TKV_LOG(INFO) << "standby: taking a snapshot of the leader's store";
  // Marked incomplete first: a copy cut short here has no position.
  RETURN_IF_ERROR(store_->Write({{kHaSnapshotKey, "1", false}, {kHaPositionKey, "", true}}));
  {
    MutexLock lock(&mu_);
    pos_ = {};
  }
  // What the copy held goes: the leader's pages replace it.
  std::vector<Mutation> batch;
  RETURN_IF_ERROR(store_->Scan("", [&](absl::string_view k, absl::string_view) {
    if (!IsHaKey(k)) batch.push_back({std::string(k), "", true});
    return true;
  }));
  for (size_t i = 0; i < batch.size(); i += kApplyChunk) {
    std::vector<Mutation> chunk(batch.begin() + i, batch.begin() + std::min(batch.size(), i + kApplyChunk));
    RETURN_IF_ERROR(store_->Write(chunk));
  }
  std::string after;
  uint64_t seq = 0, epoch = 0, records = 0;
  for (;;) {
    v1::SnapshotRequest req;
    req.set_standby(self_);
    req.set_after_key(after);
    req.set_seq(seq);
    req.set_max_bytes(page_bytes_);
    v1::SnapshotResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    Present(&ctx);
    RETURN_IF_ERROR(FromGrpc(stub->Snapshot(&ctx, req, &resp), "snapshot"));
    if (after.empty()) {
      seq = resp.seq();
      epoch = resp.epoch();
    } else if (resp.epoch() != epoch || resp.seq() != seq) {
      return absl::AbortedError("snapshot: the leader changed under it");
    }
    std::vector<Mutation> page;
    page.reserve(resp.records_size());
    for (const v1::StoreMutation& r : resp.records()) page.push_back(FromWire(r));
    if (!page.empty()) after = page.back().key;
    records += page.size();
    for (size_t i = 0; i < page.size(); i += kApplyChunk) {
      std::vector<Mutation> chunk(std::make_move_iterator(page.begin() + i),
                                  std::make_move_iterator(page.begin() + std::min(page.size(), i + kApplyChunk)));
      RETURN_IF_ERROR(store_->Write(chunk));
    }
    if (resp.done()) break;
    if (page.empty()) return absl::InternalError("snapshot: a page with nothing in it that is not the last");
  }
  const ReplPosition pos{epoch, seq, true};
  RETURN_IF_ERROR(store_->Write({{kHaPositionKey, EncodePosition(pos), false}, {kHaSnapshotKey, "", true}}));
  TKV_LOG(INFO) << "standby: snapshot of " << records << " records at epoch " << epoch << " batch " << seq;
  MutexLock lock(&mu_);
  pos_ = pos;
  leader_seq_ = seq;
  ++snapshots_;
  return absl::OkStatus();
}

}  // namespace tierkv::master
