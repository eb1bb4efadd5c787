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
// connection the server holds an fd and a few dozen bytes.
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
// the registered memory and WRITE payloads received straight into it. A
// started frame is served with blocking calls, each bounded by
// `frame_timeout`, so a peer that stalls mid-frame holds one I/O thread
// for at most that long per stalled call.
//
// Data grants: where ServedMemory::DataGrantsRequired(), a connection
// must pass CHALLENGE and AUTH (wire.h) before any READ, WRITE or
// HANDSHAKE, which may then name only the segment it was admitted to; any
// other frame gets UNAUTHENTICATED and the connection closes.
//
// TLS (ServerOptions::tls): a connection's first bytes are its TLS
// handshake, and every frame after it travels inside TLS; the rest is as
// above, bytes copied once more by the cipher.
//
// Limits: at most `max_connections` open; one more gets a BUSY reply and
// is closed (counted in refused(), logged at most every 10 s), as is one
// accepted while the process is out of file descriptors. A connection idle
// (parked with nothing to read) for `idle_timeout` is closed (reaped()).
//
// Threads: `io_threads`, all alike (each accepts, serves and, one of them,
// sweeps idle connections). Stop() shuts every connection down, joins
// them and closes everything. Thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "base/mutex.h"
#include "transport/backend.h"
#include "base/net/socket.h"
#include "base/net/tls.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {

struct ServerOptions {
  std::string listen = "127.0.0.1";
  int port = 0;
  uint64_t max_frame = 64ull << 20;
  int max_connections = 16384;
  int io_threads = 4;
  absl::Duration idle_timeout = absl::Minutes(10);
  absl::Duration frame_timeout = absl::Seconds(30);
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

 private:
  struct Conn {
    uint64_t id = 0;
    net::Fd fd;
    absl::Time last_active;
    bool parked = false;  // waiting in the epoll set (guarded by mu_)
    // Data grants (owned by the thread serving the connection): the
    // nonce of its last CHALLENGE, and the segment an AUTH admitted it to.
    std::string nonce;
    std::optional<std::pair<uint32_t, uint64_t>> admitted;
    net::SslPtr ssl;  // with ServerOptions::tls, once its handshake is done
  };
  static constexpr int kFramesPerTurn = 64;

  void IoLoop(int index);
  void AcceptSome();
  void Refuse(net::Fd fd, const char* why);
  // Serves the frames that have arrived on `conn`, then parks or closes it.
  void ServeConn(Conn* conn, uint8_t* scratch);
  void Park(Conn* conn);
  void Close(Conn* conn);
  void ReapIdle();
  // Returns false when the connection must close.
  bool ServeOne(Conn* conn, uint8_t* scratch);
  // CHALLENGE and AUTH; false when the connection must close.
  bool ServeGrant(Conn* conn, const RequestHeader& h);

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
  std::atomic<uint64_t> refused_{0}, reaped_{0};
  std::atomic<int64_t> last_refusal_log_ms_{0};

  Mutex mu_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 2;  // 0: the wake fd, 1: the listener
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::transport::tcp
