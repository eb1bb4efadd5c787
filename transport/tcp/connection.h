// One client connection to a tcp server, with pipelined batches.
//
// RunBatch writes every slice's request (and WRITE payload) while reading
// replies as they arrive, on a non-blocking socket driven by poll(), so a
// batch never deadlocks on full socket buffers and every step honours the
// deadline. Replies are matched by order and checked by id. A small read
// that starts where the batch's previous read ends (a value's trailer) is
// sent in that read's request and shares its reply, and so its status.
//
// Not thread-safe: a connection is used by one worker at a time (the pool
// in tcp_backend.cc hands it out).
#pragma once

#include <sys/uio.h>

#include <string>

#include "absl/types/span.h"
#include "transport/backend.h"
#include "base/net/socket.h"
#include "base/net/tls.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {

// Where the rest of a joined reply goes once `received` bytes of it have
// landed: one iovec per read still short of its bytes (at most
// joined.size()), in order. Returns how many it wrote.
size_t ScatterRest(absl::Span<Slice* const> joined, uint64_t received, iovec* iov);

class Connection {
 public:
  // `reply_spin`: how long to busy-poll for each reply before sleeping in
  // the kernel (BackendOptions::reply_spin).
  // `ssl`: the connection's TLS (its handshake done), or null for plain.
  Connection(net::Fd fd, std::string endpoint, absl::Duration reply_spin = absl::ZeroDuration(), net::SslPtr ssl = nullptr)
      : fd_(std::move(fd)), endpoint_(std::move(endpoint)), reply_spin_(reply_spin), ssl_(std::move(ssl)) {}

  // Moves the slices of one segment (its index and id, from the
  // descriptor). On a socket error or the deadline, the unfinished slices
  // fail (UNAVAILABLE / DEADLINE_EXCEEDED) and the connection becomes
  // broken; a server at its connection cap fails them UNAVAILABLE too.
  void RunBatch(uint32_t segment, uint64_t segment_id, absl::Span<Slice* const> slices, absl::Time deadline);

  // One control-channel exchange (blocking until the deadline). A server
  // that needs data grants wants Authenticate first; `segment` and
  // `segment_id` name the handshake's segment in its frame.
  absl::StatusOr<std::string> Handshake(const std::string& transport, const std::string& request,
                                        absl::Time deadline, uint32_t segment = 0, uint64_t segment_id = 0);

  // CHALLENGE and AUTH (wire.h) for segment (index, id) with `grant`:
  // OK once the server admitted the connection; UNAUTHENTICATED (the
  // server's reason) when it refused, after which it closes.
  absl::Status Authenticate(uint32_t segment, uint64_t segment_id, const DataGrant& grant, absl::Time deadline);

  bool broken() const { return broken_; }
  // True when the idle connection cannot be used: the server closed it
  // (its idle timeout, a restart) or sent bytes nobody asked for. Does not
  // block.
  bool Stale() const;

 private:
  // Sends one request (its id set here) and reads its reply: the reply's
  // payload, or the server's status; UNAVAILABLE (broken) on I/O errors.
  absl::StatusOr<std::string> Exchange(RequestHeader h, const std::string& body, absl::Time deadline,
                                       const char* what);
  // RunBatch over TLS, in windows of like slices sent and then answered
  // (see there), every call bounded by the deadline.
  void RunBatchTls(uint32_t segment, uint64_t segment_id, absl::Span<Slice* const> slices, absl::Time deadline);

  // Slices [first, first + count) of a batch, sent as one request of
  // `length` bytes.
  struct Frame {
    size_t first = 0;
    size_t count = 1;
    uint64_t length = 0;
  };
  // A read of at most kJoinedRead bytes joins the read it follows, up to
  // kMaxJoined slices and kMaxJoinedFrame bytes. Joining saves a fixed few
  // microseconds per read, which matters for small values only; batches of
  // 1 MiB values read about 10 % slower joined (docs/performance.md).
  static constexpr uint64_t kJoinedRead = 4096;
  static constexpr size_t kMaxJoined = 64;
  static constexpr uint64_t kMaxJoinedFrame = 256 << 10;
  // A TLS window: at most this many slices, and for writes this many
  // payload bytes (beyond one slice), whose replies fit in socket buffers.
  static constexpr size_t kTlsWindow = 64;
  static constexpr uint64_t kTlsWindowBytes = 4 << 20;
  void SetBlocking(bool on);
  // Sets the socket's receive/send timeout so a blocking call returns by
  // about `deadline`, unless the armed one already does.
  void ArmTimeout(absl::Time deadline);
  net::Fd fd_;
  std::string endpoint_;
  // Payload bytes still to come below which a reply is spun for.
  static constexpr uint64_t kSpinPayload = 1 << 20;
  const absl::Duration reply_spin_;
  uint64_t next_id_ = 1;
  bool broken_ = false;
  net::SslPtr ssl_;  // declared after fd_: freed before the socket closes
  bool blocking_ = false;                             // O_NONBLOCK cleared (after the first batch)
  absl::Duration timeout_set_ = absl::ZeroDuration();  // the socket's armed timeout; zero: none
};

}  // namespace tierkv::transport::tcp
