// The tcp backend's server: serves READ/WRITE of locally served segments
// and the control channel's HANDSHAKE, one thread per connection.
//
// Every (segment, offset, length) is resolved through ServedMemory, which
// checks it against the registered buffers before any byte is touched. A
// refused READ gets an error reply and the connection stays usable; a
// refused WRITE has its payload drained (it is at most max_frame bytes)
// and then gets the error reply. A frame that cannot be trusted to be
// followed correctly (bad magic, a WRITE longer than max_frame) gets an
// error reply and the connection is closed. The process never exits on a
// bad frame.
//
// Data moves without an extra copy: READ replies are sent straight from
// the registered memory and WRITE payloads received straight into it.
//
// Threads: one acceptor, one per live connection (at most
// `max_connections`; more are refused at accept). Stop() closes the
// listener and every connection and joins all threads.
#pragma once

#include <atomic>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "config/base/mutex.h"
#include "transport/backend.h"
#include "transport/tcp/socket.h"

namespace tierkv::transport::tcp {

struct ServerOptions {
  std::string listen = "127.0.0.1";
  int port = 0;
  uint64_t max_frame = 64ull << 20;
  int max_connections = 1024;
  absl::Duration idle_timeout = absl::Minutes(10);
  absl::Duration frame_timeout = absl::Seconds(30);
};

class Server {
 public:
  Server(ServerOptions options, ServedMemory* served);
  ~Server();
  // Binds and starts accepting. UNAVAILABLE if the port cannot be bound.
  absl::Status Start();
  void Stop();
  int port() const { return port_; }

 private:
  struct Conn {
    Fd fd;
    std::thread thread;
    std::atomic<bool> done{false};
    // Drain buffer for refused writes. Owned here rather than on the
    // thread's stack so that it stays reachable from the server while
    // the thread runs (leak checkers scan heap chains reliably).
    std::unique_ptr<uint8_t[]> scratch;
  };
  void AcceptLoop();
  void Serve(Conn* conn);
  // Returns false when the connection must close.
  bool ServeOne(int fd, uint8_t* scratch);
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ServerOptions options_;
  ServedMemory* const served_;
  Fd listener_;
  int port_ = 0;
  int wake_[2] = {-1, -1};  // a pipe that wakes the acceptor on Stop
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  Mutex mu_;
  std::list<std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::transport::tcp
