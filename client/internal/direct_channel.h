// Private to client/. DirectChannel: a MasterClient's pooled connections to the master's
// direct lane (master/direct_lane.h, proto/direct_frame.h), on the same
// host:port as its gRPC channel.
//
// A connection carries one call at a time; a caller takes an idle one or
// dials, and puts it back after a whole reply. A new connection is pinged
// first, so a master that does not speak direct is found before any real
// call is sent on it, and the lane is then left alone for a while
// (`usable()` false; the caller uses gRPC). An idle connection is checked
// (a non-blocking poll) before it carries a call, so one the master closed
// (a restart) is redialed instead of failing a call; connections idle past
// kMaxIdle, or half the idle timeout the master states in its ping reply,
// are not reused, so none is reused as the master closes it. A call whose
// reply is lost empties the pool: the others may be as dead (a master host
// gone without closing them). Requests above kMaxRequest go over gRPC:
// large batches gain nothing from the lane, and gRPC refuses one past the
// master's message limit before sending it.
//
// Thread-safe.
#pragma once

#include <google/protobuf/message_lite.h>

#include <atomic>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "proto/direct_frame.h"
#include "base/net/socket.h"

namespace tierkv::client::internal {

class DirectChannel {
 public:
  static constexpr size_t kMaxIdleConnections = 16;
  static constexpr absl::Duration kMaxIdle = absl::Seconds(60);
  // After a master closed a ping, or a dial failed: how long to use gRPC.
  static constexpr absl::Duration kUnsupportedBackoff = absl::Seconds(30);
  static constexpr absl::Duration kDialBackoff = absl::Milliseconds(500);
  static constexpr size_t kMaxRequest = 1 << 20;

  // `reply_spin`: how long a call busy-polls for its reply before sleeping
  // in the kernel (MasterClientOptions::reply_spin). `token` goes in each
  // connection's ping (MasterClientOptions::token).
  DirectChannel(std::string address, uint32_t max_message, absl::Duration reply_spin = absl::ZeroDuration(),
                std::string token = "")
      : address_(std::move(address)), max_message_(max_message), reply_spin_(reply_spin), token_(std::move(token)) {}

  enum class Outcome {
    kAnswered,  // `status` is the master's answer; OK: *resp holds it
    kNotSent,   // the call never reached the master (no connection, or no direct lane there)
    kLost,      // sent, but no whole reply came: UNAVAILABLE or DEADLINE_EXCEEDED
  };
  struct Result {
    Outcome outcome;
    absl::Status status;
  };
  Result Call(direct::DirectMethod method, const google::protobuf::MessageLite& req,
              google::protobuf::MessageLite* resp, absl::Time deadline);

  // False while the lane is backed off (see above). Lock-free: every call asks.
  bool usable() const;

 private:
  struct Idle {
    net::Fd fd;
    absl::Time since;
  };
  // An idle connection that is still open, or a new, pinged one.
  absl::StatusOr<net::Fd> Take(absl::Time deadline, Outcome* failure);
  void Give(net::Fd fd);
  void DropIdle();
  void BackOff(absl::Duration d);
  // One frame out (`req` of `body` bytes, its sizes already computed; null
  // for none) and its reply in; `buf` holds the reply's response bytes and
  // `message` (if given) its status message.
  absl::Status Exchange(int fd, direct::DirectMethod method, const google::protobuf::MessageLite* req, size_t body,
                        absl::Time deadline, std::string* buf, absl::Status* answer,
                        std::string* message = nullptr);

  const std::string address_;
  const uint32_t max_message_;
  const absl::Duration reply_spin_;
  const std::string token_;
  Mutex mu_;
  std::vector<Idle> idle_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> off_until_ns_{0};  // Unix ns before which the lane is not tried
  absl::Duration max_idle_ ABSL_GUARDED_BY(mu_) = kMaxIdle;
};

}  // namespace tierkv::client::internal
