// HttpServer: cpp-httplib's server, with connections that hold no thread
// while they are idle. Every tierkv HTTP endpoint (master, store daemon,
// metrics) runs on it.
//
// Plain httplib gives a connection a pool thread for as long as it stays
// open, so a few dozen idle keep-alive connections starve every other
// request. Here a connection holds a worker only while a request is in it;
// between requests it waits in an epoll set, and the first byte of its next
// request hands it back to a worker.
//
// Caps, each from Options:
//   - at most `max_connections` open; one more is answered 503 and closed;
//   - a connection idle for `idle_timeout` is closed;
//   - a request must arrive whole within `request_timeout` (a trickling
//     sender cannot hold a worker);
//   - bodies over set_payload_max_length get 413 (httplib's own check).
//
// With Options::tls (a certificate and key) every connection is TLS: the
// handshake runs on a worker once the first bytes arrive, bounded by
// `request_timeout`, and a peer that fails it is closed (counted in
// tls_handshake_failures()). With a CA in it, a client certificate is asked
// for and, when one is sent, must be signed by that CA; whether a request
// without one is served is the routes' call (auth::VerifiedPeerNames). The files are
// re-read when they change, checked at most every auth::kTlsRefreshSeconds,
// so renewed certificates take effect without a restart; a renewal that
// does not load is logged and the files in use stay.
//
// Usage is httplib's: install routes, Bind, listen_after_bind() on a thread,
// then stop(); the destructor closes whatever is still parked.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/time/time.h"
#include "base/auth.h"
#include "base/mutex.h"
#include "httplib.h"

namespace tierkv {

class HttpServer : public httplib::Server {
 public:
  struct Options {
    int threads = 4;
    size_t max_connections = 8192;
    absl::Duration idle_timeout = absl::Seconds(60);
    absl::Duration request_timeout = absl::Seconds(10);
    auth::TlsFiles tls;  // cert and key: serve TLS; ca: verify client certificates
  };

  // With Options::tls set, check tls_status() before Bind.
  explicit HttpServer(Options options);
  HttpServer() : HttpServer(Options{}) {}
  ~HttpServer() override;

  // Binds host:port (0 picks a free port) with a deep accept backlog
  // (httplib's own is 5, which drops connections arriving in a burst).
  // The bound port, or -1.
  int Bind(const std::string& host, int port);

  // After a successful Bind: serves on a thread of its own, returning once
  // the accept loop runs (or after `wait`, with a warning).
  void Start(absl::Duration wait = absl::Seconds(10));
  // Stops serving and joins that thread, whether or not the loop had begun
  // (httplib's stop() alone does nothing to a loop not running yet, which
  // would then serve forever). Idempotent; the destructor calls it.
  void Stop();

  // Serves the request held in `request` (bytes as a client would send
  // them, possibly several pipelined requests) and returns everything the
  // server wrote back. No socket is involved: for fuzzing and tests.
  std::string ServeBytes(std::string_view request);

  size_t open_connections() const { return open_.load(); }
  uint64_t tls_handshake_failures() const { return tls_failures_.load(); }
  // Asked for in Options (served, or refused whole when it did not load).
  bool tls() const { return tls_ != nullptr || !tls_status_.ok(); }
  // OK, or why the TLS files given in Options do not load (naming the
  // file); a server whose TLS did not load refuses every connection.
  const absl::Status& tls_status() const { return tls_status_; }


 private:
  struct Conn;
  class SocketStream;
  class MemoryStream;

  bool process_and_close_socket(socket_t sock) override;
  void PollLoop();
  void WorkLoop();
  // Serves the requests that have arrived on `conn`, then parks or closes it.
  void ServeConn(Conn* conn);
  // Completes `conn`'s TLS handshake within the request timeout.
  bool Handshake(Conn* conn);
  void Park(Conn* conn);
  // Ends `conn` gracefully: shut for writing, the rest read (lingering).
  void Close(Conn* conn);
  // A lingering connection's pending bytes read and dropped; true when the
  // peer closed and `conn` is gone.
  bool Drain(Conn* conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the socket and forgets `conn`.
  void Release(Conn* conn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::atomic<size_t> open_{0};
  std::atomic<bool> stopping_{false};
  std::unique_ptr<auth::ServerTlsContext> tls_;
  absl::Status tls_status_;
  std::atomic<uint64_t> tls_failures_{0};

  Mutex mu_;
  CondVar cv_;
  std::deque<Conn*> ready_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<int, std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::thread poller_;
  std::vector<std::thread> workers_;
  std::thread serving_;                 // Start's accept loop
  std::atomic<bool> served_{false};     // that loop has returned
};

}  // namespace tierkv
