#include "client/internal/direct_channel.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "proto/master.pb.h"

namespace tierkv::client::internal {
namespace {

using direct::DirectMethod;

// A dial or ping never takes more than this of a call's budget, so a
// master that swallows connections leaves the call time to try gRPC.
constexpr absl::Duration kMaxConnect = absl::Seconds(1);

// True when an idle connection can carry a call: nothing to read (a
// closed one reads EOF; a live master never speaks unasked) and no error.
bool StillOpen(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

}  // namespace

bool DirectChannel::usable() const { return absl::ToUnixNanos(absl::Now()) >= off_until_ns_.load(std::memory_order_relaxed); }

void DirectChannel::BackOff(absl::Duration d) {
  const int64_t until = absl::ToUnixNanos(absl::Now() + d);
  int64_t seen = off_until_ns_.load(std::memory_order_relaxed);
  while (seen < until && !off_until_ns_.compare_exchange_weak(seen, until, std::memory_order_relaxed)) {
  }
}

void DirectChannel::DropIdle() {
  MutexLock lock(&mu_);
  idle_.clear();
}

void DirectChannel::Give(net::Fd fd) {
  MutexLock lock(&mu_);
  if (idle_.size() < kMaxIdleConnections) idle_.push_back({std::move(fd), absl::Now()});
}

absl::StatusOr<net::Fd> DirectChannel::Take(absl::Time deadline, Outcome* failure) {
  *failure = Outcome::kNotSent;
  const absl::Time now = absl::Now();
  {
    MutexLock lock(&mu_);
    while (!idle_.empty()) {
      Idle idle = std::move(idle_.back());
      idle_.pop_back();
      if (now - idle.since < max_idle_ && StillOpen(idle.fd.get())) return std::move(idle.fd);
    }
  }
  const absl::Time connect_by = std::min(deadline, now + kMaxConnect);
  absl::StatusOr<net::Fd> fd = net::Dial(address_, connect_by);
  if (!fd.ok()) {
    // An address the lane cannot dial (a gRPC target URI, say) will not
    // become dialable: gRPC alone serves it.
    BackOff(absl::IsInvalidArgument(fd.status()) ? kUnsupportedBackoff : kDialBackoff);
    return fd.status();
  }
  std::string buf, idle;
  absl::Status answer;
  v1::DirectHello hello;
  if (!token_.empty()) hello.set_token(token_);
  absl::Status s = Exchange(fd->get(), DirectMethod::kPing, &hello, hello.ByteSizeLong(), connect_by, &buf, &answer,
                            &idle);
  if (int64_t ms = 0; s.ok() && answer.ok() && absl::SimpleAtoi(idle, &ms) && ms > 0) {
    MutexLock lock(&mu_);
    max_idle_ = std::min(kMaxIdle, absl::Milliseconds(ms) / 2);
  }
  if (s.ok() && absl::IsUnavailable(answer) && absl::StrContains(answer.message(), kNotLeader)) {
    // A standby's answer (master/ha.h), to the call as much as the ping:
    // the call goes to the next master, and the lane is tried again soon
    // here, as this one may be elected.
    BackOff(kDialBackoff);
    *failure = Outcome::kAnswered;
    return answer;
  }
  if (!s.ok() || !answer.ok()) {
    // A master without the lane hands the frame to gRPC, which closes.
    BackOff(s.ok() || absl::IsUnavailable(s) ? kUnsupportedBackoff : kDialBackoff);
    return absl::UnavailableError(
        absl::StrCat("no direct lane at ", address_, ": ", !s.ok() ? s.message() : answer.message()));
  }
  return fd;
}

absl::Status DirectChannel::Exchange(int fd, DirectMethod method, const google::protobuf::MessageLite* req,
                                     size_t body, absl::Time deadline, std::string* buf, absl::Status* answer,
                                     std::string* message_out) {
  buf->resize(direct::kHeaderSize + body);
  direct::EncodeCall({method, static_cast<uint32_t>(body)}, buf->data());
  if (body > 0) {
    req->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(buf->data() + direct::kHeaderSize));
  }
  RETURN_IF_ERROR(net::WriteFull(fd, buf->data(), buf->size(), deadline));
  char header[direct::kHeaderSize];
  (void)net::SpinUntilReadable(fd, std::min(reply_spin_, deadline - absl::Now()));
  RETURN_IF_ERROR(net::ReadFull(fd, header, sizeof header, deadline));
  absl::StatusOr<direct::ReplyHeader> h = direct::DecodeReply(header, max_message_);
  if (!h.ok()) return absl::UnavailableError(absl::StrCat("reply: ", h.status().message()));
  std::string message(h->message_length, '\0');
  RETURN_IF_ERROR(net::ReadFull(fd, message.data(), message.size(), deadline));
  buf->resize(h->length);
  RETURN_IF_ERROR(net::ReadFull(fd, buf->data(), buf->size(), deadline));
  *answer = h->code == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(h->code), message);
  if (message_out != nullptr) *message_out = std::move(message);
  return absl::OkStatus();
}

DirectChannel::Result DirectChannel::Call(DirectMethod method, const google::protobuf::MessageLite& req,
                                          google::protobuf::MessageLite* resp, absl::Time deadline) {
  // Sizes are computed once: SerializeWithCachedSizes reuses them.
  const size_t body = req.ByteSizeLong();
  if (body > kMaxRequest) return {Outcome::kNotSent, absl::ResourceExhaustedError("large requests go over gRPC")};
  Outcome failure;
  absl::StatusOr<net::Fd> fd = Take(deadline, &failure);
  if (!fd.ok()) return {failure, fd.status()};
  std::string buf;
  absl::Status answer;
  absl::Status s = Exchange(fd->get(), method, &req, body, deadline, &buf, &answer);
  if (!s.ok()) {
    // Whether the master ran it is unknown; the connection's state too,
    // and the pooled ones may be as dead.
    DropIdle();
    return {Outcome::kLost, absl::IsDeadlineExceeded(s) ? s : absl::UnavailableError(s.message())};
  }
  if (answer.ok() && !resp->ParseFromArray(buf.data(), static_cast<int>(buf.size()))) {
    return {Outcome::kAnswered, absl::InternalError("the master's reply does not parse")};
  }
  Give(std::move(*fd));
  return {Outcome::kAnswered, answer};
}

}  // namespace tierkv::client::internal
