// One client connection to a tcp server, with pipelined batches.
//
// RunBatch writes every slice's request (and WRITE payload) while reading
// replies as they arrive, on a non-blocking socket driven by poll(), so a
// batch never deadlocks on full socket buffers and every step honours the
// deadline. Replies are matched by order and checked by id. A small read
// that starts where the batch's previous read ends (a value's trailer),
// under the same extent grant, is sent in that read's request and shares
// its reply, and so its status. Runs of small slices of one op (and, for
// writes, one epoch) go as vectored frames (READV, WRITEV; wire.h), one
// range per slice with the slice's extent grant, and share their frame's
// status: the server takes or refuses such a frame whole. A slice's grant
// (Slice::grant) goes after its frame's header. Over TLS every slice is
// its own frame.
//
// Not thread-safe: a connection is used by one worker at a time (the pool
// in tcp_backend.cc hands it out).
//
// A caller's buffers are touched only under the batch's claim
// (transport/buffer_claim.h), given to RunBatch: bytes go into (and out
// of) them only as far as they have arrived (or fit the socket), and every
// wait for more happens outside the claim. A receive or send that finds it
// revoked (the caller stopped waiting) drops the connection instead.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"
#include "transport/backend.h"
#include "transport/buffer_claim.h"
#include "base/net/socket.h"
#include "base/net/tls.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {

// Where the rest of a joined (or READV) reply goes once `received` bytes
// of it have landed: one iovec per read still short of its bytes (at most
// joined.size(), and at most `max`), in order. Returns how many it wrote.
size_t ScatterRest(absl::Span<Slice* const> joined, uint64_t received, iovec* iov, size_t max = SIZE_MAX);

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
  // Returns by the deadline (and the last copy) whatever the peer does,
  // however it trickles bytes. `claim`: held around every copy into or
  // out of the slices' buffers; null when nothing can revoke them (the
  // caller's own thread). Once it is revoked, the unfinished slices fail
  // DEADLINE_EXCEEDED and the connection is broken and abandoned().
  void RunBatch(uint32_t segment, uint64_t segment_id, absl::Span<Slice* const> slices, absl::Time deadline,
                BufferClaim* claim = nullptr);

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
  // Broken because the caller stopped waiting, not through the peer.
  bool abandoned() const { return abandoned_; }
  // When the data grant that admitted it expires (the server refuses its
  // frames from then on); InfiniteFuture without one.
  absl::Time admitted_until() const { return admitted_until_; }
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
  void RunBatchTls(uint32_t segment, uint64_t segment_id, absl::Span<Slice* const> slices, absl::Time deadline,
                   BufferClaim* claim);
  // Over TLS: moves [buf, buf+len) to or from the stream, each non-blocking
  // step under `claim`, each wait outside it. CANCELLED once it is revoked.
  absl::Status MoveTls(bool send, char* buf, size_t len, absl::Time deadline, BufferClaim* claim);
  // Over TLS: a WRITE's header and payload, the payload read under `claim`.
  absl::Status SendTlsWrite(const uint8_t* head, size_t head_len, const char* payload, uint64_t length, absl::Time deadline,
                            BufferClaim* claim);

  // Slices [first, first + count) of a batch, sent as one request of
  // `length` data bytes: one range of contiguous slices (a joined read),
  // or with `vectored`, one range per slice; `largest` is its largest
  // slice, `table_at` where its range table starts in the batch's tables,
  // and `wire` its bytes on the wire (header, table and WRITE data).
  struct Frame {
    size_t first = 0;
    size_t count = 1;
    uint64_t length = 0;
    bool vectored = false;
    uint64_t largest = 0;
    size_t table_at = 0;
    uint64_t wire = 0;
    size_t head_len = kRequestSize;  // with an extent grant, kHeadMax
    size_t table_len = 0;            // a vectored frame's range table
  };
  // Builds the frames of a plain (not TLS) batch.
  static void PlanFrames(absl::Span<Slice* const> slices, absl::InlinedVector<Frame, 4>* frames);
  // A read of at most kJoinedRead bytes joins the read it follows, up to
  // kMaxJoined slices and kMaxJoinedFrame bytes. Joining saves a fixed few
  // microseconds per read, which matters for small values only; batches of
  // 1 MiB values read about 10 % slower joined (docs/performance.md).
  static constexpr uint64_t kJoinedRead = 4096;
  static constexpr size_t kMaxJoined = 64;
  static constexpr uint64_t kMaxJoinedFrame = 256 << 10;
  // Slices of at most kVectorSlice bytes join a vectored frame of up to
  // kVectorFrame data bytes and kMaxVectorRanges slices: a frame per small
  // scattered entry costs a header, a server turn and a reply, many times
  // the entry's own time on the wire (docs/pd.md), while the bound keeps
  // a refused frame's cost small and its replies pipelined. Writes join
  // larger (a server receives a WRITEV's data in place; a page of one
  // layer's KV is 72 KiB): P/D pushes run 1.1x the raw engine with these
  // bounds against 0.7x with the reads' (tierkv-bench pd). A READV reply is
  // staged, so reads keep the smaller bounds.
  static constexpr uint64_t kVectorSlice = 64 << 10;
  static constexpr uint64_t kVectorFrame = 256 << 10;
  static constexpr uint64_t kVectorWriteSlice = 128 << 10;
  static constexpr uint64_t kVectorWriteFrame = 1 << 20;
  static constexpr size_t kMaxVectorRanges = 1024;
  // iovecs per sendmsg or recvmsg.
  static constexpr size_t kMaxIov = 256;
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
  bool abandoned_ = false;
  absl::Time admitted_until_ = absl::InfiniteFuture();
  net::SslPtr ssl_;  // declared after fd_: freed before the socket closes
  bool blocking_ = false;                             // O_NONBLOCK cleared (after the first batch)
  absl::Duration timeout_set_ = absl::ZeroDuration();  // the socket's armed timeout; zero: none
};

}  // namespace tierkv::transport::tcp
