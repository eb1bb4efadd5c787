// The tcp backend's server: serves READ/WRITE of locally served segments
// and the control channel's HANDSHAKE to any number of connections from a
// small, fixed pool of I/O threads.
//
// A store daemon on a decode node faces every prefill rank, thousands of
// connections, most of them idle between batches; a thread each would not
// scale. Instead every connection waits in one epoll set (one-shot, so one
// thread at a time owns it). The I/O thread that wakes for it serves the
// frames that have arrived (at most kFramesPerTurn, so a busy connection
// cannot starve the rest), then hands the connection back to the poller.
// Threads stay at `io_threads` whatever the connection count; per
// connection the server holds an fd and a few hundred bytes.
//
// Every (segment, offset, length) is resolved through ServedMemory, which
// checks the segment's id and the range against the registered buffers
// before any byte is touched. A refused READ gets an error reply and the
// connection stays usable; a refused WRITE has its payload drained (it is
// at most max_frame bytes, through the I/O thread's drain buffer) and then
// gets the error reply. A frame that cannot be trusted to be followed
// correctly (bad magic, a WRITE longer than max_frame) gets an error reply
// and the connection is closed. The process never exits on a bad frame.
//
// Data moves without an extra copy: READ replies are sent straight from
// the registered memory and WRITE payloads received straight into it.
//
// Slow peers: sockets are non-blocking and a thread never waits on a peer.
// Each connection carries the state of its frame in progress (header
// bytes so far, payload bytes so far, reply bytes sent); a turn moves it
// as far as the bytes that are there allow, and a connection that would
// block is parked in the epoll set with that state, waiting for readable
// or writable as its frame needs. A frame (its header, its payload and its
// reply together) must complete within `frame_timeout` of its first byte;
// a TLS handshake, and with data grants the TLS handshake, CHALLENGE and
// AUTH together, within `handshake_timeout` of the accept. A connection
// past either is closed (expired()) when it next wakes or by the sweep,
// whatever it trickles meanwhile. So a peer that stalls or trickles costs
// only its own connection: no I/O thread, no other connection, no Stop()
// waits for it. A served range is pinned (ServedMemory::Pin) only within a
// turn and resolved again on the next, so unregistering memory never
// waits for a parked frame; a range unregistered meanwhile fails the frame
// (a WRITE's rest is drained and refused; a READ's reply, cut short,
// closes the connection).
//
// Vectored frames (WRITEV, READV; wire.h): the range table is received
// first, into the connection (at most 1 MiB: kMaxRanges 16-byte entries,
// or a quarter as many 64-byte ones with per-range grants), and every
// range is resolved before any byte moves; one that fails refuses the
// whole frame (a WRITEV's data drained, the connection kept). A WRITEV's
// data is received straight into a run of its ranges with one recvmsg,
// under one pin for the run (RangeCursor); ranges that do not share a
// buffer, and any over TLS, go through the I/O thread's scratch and are
// copied into place. A READV's reply is staged through the connection's
// reply buffer, at most kVectorChunk at a time. Ranges are resolved again
// for each receive or copy, as a parked WRITE's are.
//
// Data grants: where ServedMemory::DataGrantsRequired(), a connection
// must pass CHALLENGE and AUTH (wire.h) before any READ(V), WRITE(V) or
// HANDSHAKE, which may then name only the segment it was admitted to, and
// only until the grant's expiry; any other frame gets UNAUTHENTICATED and
// the connection closes.
//
// Late writes: a WRITE lands only while it is still wanted, checked when
// its header arrives and again before every receive of its payload into
// served memory: its frame's deadline (kHasDeadline) has not passed, the
// connection's data grant has not expired, and no newer master epoch than
// the one that granted it has been seen (AdmitWrite). Once one fails, no
// further byte of it is written: the rest is drained and the write refused
// (EXPIRED, UNAUTHENTICATED and closed, STALE_EPOCH). Bytes received
// before that may have landed: they are in the extent the write was
// granted, which no other put has been given yet (the master hands it on
// only --revoke-grace after the writer's put was revoked, which follows
// its deadline), and the refused write is never acknowledged, so its put
// is revoked and no reader sees them. So a refused write may leave a
// prefix of its payload, never a byte received after its deadline.
//
// TLS (ServerOptions::tls): a connection's first bytes are its TLS
// handshake, and every frame after it travels inside TLS; the rest is as
// above, bytes copied once more by the cipher (a READ reply of at most
// 16 KiB is gathered with its header into one record).
//
// Limits: at most `max_connections` open; one more gets a BUSY reply and
// is closed (counted in refused(), logged at most every 10 s), as is one
// accepted while the process is out of file descriptors. A connection idle
// (parked with nothing to read) for `idle_timeout` is closed (reaped()).
//
// Threads: `io_threads`, all alike (each accepts, serves and, one of them,
// sweeps idle and expired connections). Stop() shuts every connection down, joins
// them and closes everything. Thread-safe.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/extent_grant.h"
#include "base/mutex.h"
#include "transport/backend.h"
#include "base/net/socket.h"
#include "base/net/tls.h"
#include "transport/tcp/range_cursor.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {

struct ServerOptions {
  std::string listen = "127.0.0.1";
  int port = 0;
  uint64_t max_frame = 64ull << 20;
  int max_connections = 16384;
  int io_threads = 4;
  absl::Duration idle_timeout = absl::Minutes(10);
  // One deadline per frame (header, payload and reply), from its first byte.
  absl::Duration frame_timeout = absl::Seconds(5);
  // One deadline per handshake, from the accept: TLS, and with data grants
  // the CHALLENGE and AUTH too.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Set: every connection is TLS (tls.h), its handshake the first step
  // served, before any frame.
  std::shared_ptr<auth::ServerTlsContext> tls;
};

class Server {
 public:
  Server(ServerOptions options, ServedMemory* served);
  ~Server();
  // Binds and starts the I/O threads. UNAVAILABLE if the port cannot be bound.
  absl::Status Start();
  void Stop();
  int port() const { return port_; }

  size_t open_connections() const { return open_.load(); }
  uint64_t refused() const { return refused_.load(); }  // over the cap, or out of fds
  uint64_t reaped() const { return reaped_.load(); }    // closed after idle_timeout
  uint64_t expired() const { return expired_.load(); }  // closed past a frame or handshake deadline

 private:
  // Where a connection's frame stands.
  enum class Stage : uint8_t { kTlsAccept, kHeader, kBody, kReply };
  // Where a payload goes: served memory (a WRITE), nowhere (refused, so
  // drained through the I/O thread's scratch), Conn::body, Conn::body as a
  // vectored frame's range table, or a WRITEV's ranges (through scratch).
  enum class Sink : uint8_t { kMemory, kDrain, kBuffer, kTable, kRanges };
  // What a step of a turn left the connection in.
  enum class Step : uint8_t { kContinue, kFrameDone, kBlocked, kClose };

  struct Conn {
    uint64_t id = 0;
    net::Fd fd;
    absl::Time last_active;
    bool parked = false;  // waiting in the epoll set (guarded by mu_)
    // The rest is owned by the thread serving the connection, and read by
    // the sweep only while it is parked (under mu_).
    // Data grants: the nonce of its last CHALLENGE, and the segment an
    // AUTH admitted it to.
    std::string nonce;
    std::optional<std::pair<uint32_t, uint64_t>> admitted;
    absl::Time admitted_until = absl::InfiniteFuture();  // the admitting grant's expiry
    // Extent grants: the admitted segment's key for them (set at AUTH), and
    // whether the admitting grant lets the peer map the segment's memory
    // (shm, rdma, cuda handshakes).
    std::shared_ptr<const auth::ExtentMac> extent_mac;
    bool may_map = false;
    // The frame's extent grant's expiry: a WRITE's payload arriving past it
    // lands nothing, whatever deadline the frame names.
    absl::Time grant_until = absl::InfiniteFuture();
    net::SslPtr ssl;  // with ServerOptions::tls, from the accept
    Stage stage = Stage::kHeader;
    bool want_write = false;                        // parked for writable rather than readable
    absl::Time deadline = absl::InfiniteFuture();   // the frame's (or TLS handshake's); infinite between frames
    absl::Time admit_by = absl::InfiniteFuture();   // data grants: admitted by then, or closed
    uint8_t head[kRequestSize + kGrantBlockBytes];  // the header, then its extent grant (kHasGrant)
    size_t head_got = 0;
    RequestHeader req;
    Sink sink = Sink::kDrain;
    uint64_t body_got = 0;
    std::string body;                                 // Sink::kBuffer, Sink::kTable
    absl::Status verdict;                             // the answer due once a refused payload is drained
    bool close_after = false;                         // close once the reply is out
    std::string out;                                  // the reply's header (and small payload or error text)
    size_t out_sent = 0;
    uint64_t payload = 0, payload_sent = 0;           // READ bytes after `out`, from served memory
    std::optional<ServedMemory::Pin> pin;             // held within a turn only
    uint64_t pin_from = 0;                            // body_got / payload_sent when `pin` was resolved
    uint64_t moved = 0;                               // payload and reply bytes moved, ever
    RangeCursor ranges;        // a vectored frame's, once its table has arrived
    uint64_t staged_left = 0;  // READV: reply bytes not yet staged into `out`
  };
  static constexpr int kFramesPerTurn = 64;
  // A READV's reply is staged into Conn::out this much at a time.
  static constexpr uint64_t kVectorChunk = 256 << 10;

  void IoLoop(int index);
  void AcceptSome();
  void Refuse(net::Fd fd, const char* why);
  // Moves `conn`'s frames on as far as they go, then parks or closes it.
  void ServeConn(Conn* conn, uint8_t* scratch);
  // `yielded`: parked after kFramesPerTurn, not because it would block.
  void Park(Conn* conn, bool yielded);
  void Close(Conn* conn);
  // Closes parked connections past a deadline, and idle ones.
  void Sweep();
  // One frame as far as it goes: kFrameDone, kBlocked or kClose.
  Step Advance(Conn* c, uint8_t* scratch);
  Step AcceptTls(Conn* c);
  Step ReadHeader(Conn* c);
  Step Dispatch(Conn* c);
  Step ReadBody(Conn* c, uint8_t* scratch);
  Step FinishBody(Conn* c);
  Step SendReply(Conn* c);
  // Set the frame's next stage.
  Step StartBody(Conn* c, Sink sink, absl::Status verdict = absl::OkStatus(), bool close_after = false);
  // `memory_bytes`: that many READ bytes from c->pin follow `payload`.
  Step StartReply(Conn* c, const absl::Status& status, absl::string_view payload, bool close_after = false,
                  uint64_t memory_bytes = 0);
  Step StartMemoryReply(Conn* c, ServedMemory::Pin pin);
  // The frame's range from `done` bytes in, pinned into c->pin.
  absl::Status Repin(Conn* c, uint64_t done);
  // WRITEV and READV at their header: the shape checks (ranges, caps).
  Step DispatchVector(Conn* c);
  // Once a vectored frame's table has arrived: decodes and resolves every
  // range, and sets where the rest goes (its ranges, or drained).
  void StartRanges(Conn* c);
  // Stages the next part of a READV's reply data into c->out.
  absl::Status StageReply(Conn* c);
  // OK while the WRITE in c->req may still land (see "Late writes" above);
  // otherwise why not: DEADLINE_EXCEEDED, UNAUTHENTICATED, FAILED_PRECONDITION.
  absl::Status WriteAdmitted(const Conn* c);

  // Data and extent grants (server_grants.cc).
  // The header's length: with kHasGrant, the grant after it too.
  static size_t HeadSize(const Conn* c);
  // A frame that needs a connection admitted by a data grant, on one that is
  // not (or to another segment): the refusal; nullopt lets it through.
  std::optional<Step> RefuseUnadmitted(Conn* c);
  // An AUTH frame's payload has arrived: admits the connection or closes it.
  Step FinishAuth(Conn* c);
  // OK when this server needs no extent grants, or the frame's grant (with
  // kRangeGrants: each range's own, `grants`) covers each of `ranges` for
  // its op now; sets c->grant_until to the earliest expiry.
  // PERMISSION_DENIED otherwise.
  absl::Status ExtentAdmitted(Conn* c, absl::Span<const WireRange> ranges,
                              absl::Span<const absl::string_view> grants = {}) const;
  // OK for a handshake on this connection (one that maps memory needs the
  // admitting grant's leave when grants are on).
  absl::Status MapAdmitted(const Conn* c) const;

  const ServerOptions options_;
  ServedMemory* const served_;
  net::Fd listener_;
  net::Fd epoll_;
  net::Fd wake_;     // an eventfd that wakes the I/O threads on Stop
  net::Fd reserve_;  // an fd held back, freed to refuse a connection when out of fds
  int port_ = 0;
  std::vector<std::thread> threads_;
  // One drain buffer per I/O thread, owned here so that leak checkers see
  // it reachable from the server while a thread uses it.
  std::vector<std::unique_ptr<uint8_t[]>> scratch_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> open_{0};
  std::atomic<uint64_t> refused_{0}, reaped_{0}, expired_{0};
  std::atomic<int64_t> last_refusal_log_ms_{0};

  Mutex mu_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 2;  // 0: the wake fd, 1: the listener
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::transport::tcp
