// DirectLane: the master's RPC port. It accepts every connection itself
// and reads its first four bytes: a direct call frame
// (proto/direct_frame.h) is served on a thread of the connection's own,
// which runs each call's handler inline, so a lookup costs the master one
// wake-up instead of gRPC's poller hand-offs (docs/performance.md);
// anything else (an HTTP/2 preface) is handed to the gRPC server as it is.
// A thread whose connection closed waits for the next one (at most
// `spare_threads` wait), so clients that reconnect often cost no thread
// start per connection.
// One port for both means whatever reaches gRPC (a proxy, a firewall rule)
// reaches the direct lane too, and a client needs no second address.
//
// Limits, each answered with a status and never a crash:
//   - a request above `max_message` bytes: RESOURCE_EXHAUSTED, and the
//     connection closes (the rest of the frame is not read);
//   - a frame with a bad magic or unknown method: INVALID_ARGUMENT, closes;
//   - a request that does not parse: INVALID_ARGUMENT, the connection stays;
//   - more items than `limits.max_batch`: RESOURCE_EXHAUSTED, as over gRPC;
//   - past `max_connections` direct connections, a new one's first call is
//     answered RESOURCE_EXHAUSTED and it closes (its client uses gRPC);
//     gRPC's connections never count;
//   - past `max_unread` connections not yet past their first bytes, the
//     oldest of them is closed for each new one (a flood of silent
//     connections cannot lock gRPC's out); no thread to be had: closed;
//   - a header's length costs memory only as its bytes arrive; a response
//     above `max_message`: RESOURCE_EXHAUSTED;
//   - a connection that sends nothing for `first_bytes_timeout` after
//     connecting, or is idle for `idle_timeout`, is closed;
//   - with `auth` enabled, a connection's calls are served only after its
//     first call, a ping, carried a token with the client role: otherwise
//     UNAUTHENTICATED or PERMISSION_DENIED, and it closes.
//
// Spinning (net::ServerSpin): a connection's thread that
// polls for the next call a little after its reply spares a client
// calling back to back the wake-up each call would cost; `spin` is the
// window, `max_spinners` the connections spinning at once.
//
// Metrics: tierkv_master_rpc_* per method (shared with gRPC),
// tierkv_master_direct_connections, tierkv_master_direct_refused_total,
// tierkv_master_direct_threads (serving or waiting),
// tierkv_master_direct_threads_started_total,
// tierkv_master_direct_spins_total{outcome="call"|"idle"|"capped"}.
//
//   DirectLane lane(master, &metrics, options);
//   lane.Start(std::move(listener), grpc_server);  // after BuildAndStart
//   ...
//   lane.StopAccepting();  // before the gRPC server's Shutdown
//   grpc_server->Shutdown();
//   lane.Stop();           // joins every connection thread
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "base/auth.h"
#include "base/mutex.h"
#include "master/grpc_service.h"
#include "master/master.h"
#include "master/rpc_handlers.h"
#include "proto/direct_frame.h"
#include "base/net/socket.h"

namespace grpc {
class Server;
}

namespace tierkv::master {

class ReplicationLog;

// A connection's peer as gRPC names one ("ipv4:a.b.c.d:port",
// "ipv6:[..]:port"), from its address; and a gRPC call's peer with the
// "fd:<n>" of a connection the lane handed over resolved to that form, so
// the per-client put cap keys a caller alike on both lanes.
std::string PeerName(const sockaddr_storage& addr);
std::string GrpcPeerName(const std::string& peer);

class DirectLane {
 public:
  struct Options {
    ServiceLimits limits;
    uint32_t max_message = 16 << 20;
    size_t max_connections = 4096;
    size_t max_unread = 1024;
    absl::Duration idle_timeout = absl::Minutes(5);
    absl::Duration first_bytes_timeout = absl::Seconds(10);
    const auth::Authenticator* auth = nullptr;  // null: every caller is admitted
    absl::Duration spin = absl::ZeroDuration();  // 0: never spin; cut to 1 ms
    size_t max_spinners = 1;
    size_t spare_threads = 16;  // idle connection threads kept for reuse
    // A leader's replication log: standbys' kReplicate streams are served
    // from it (a connection's thread is theirs while the stream lasts).
    // Null: such a call is refused FAILED_PRECONDITION.
    ReplicationLog* replication = nullptr;
  };

  // `master`, `metrics` and `options.auth` must outlive it.
  DirectLane(Master* master, rpc::RpcMetrics* metrics, Options options);
  ~DirectLane();
  DirectLane(const DirectLane&) = delete;
  DirectLane& operator=(const DirectLane&) = delete;

  // Serves `listener` (bound and listening). `grpc` is started and takes
  // every connection that is not direct; it must outlive Stop.
  void Start(net::Fd listener, grpc::Server* grpc);
  // No new connections after it returns; idempotent.
  void StopAccepting();
  // StopAccepting, then shuts every direct connection down (a handler
  // running finishes first) and joins the threads. Idempotent.
  void Stop();

  net::ServerSpin::Counts spins() const;
  // Connection threads started so far and alive now; direct connections open.
  struct ThreadCounts {
    uint64_t started = 0;
    int64_t alive = 0;
    int64_t connections = 0;
  };
  ThreadCounts threads() const;

 private:
  struct Conn {
    int fd = -1;  // guarded by mu_; -1 once the thread closed or handed it on
    bool unread = false;  // guarded by mu_; before its first bytes
    std::string peer;     // set before a thread has it
    std::list<std::unique_ptr<Conn>>::iterator self;  // its place in conns_
  };
  struct Worker {
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void AcceptLoop();
  // Serves `conn`, then waits for another handed over by AcceptLoop, until
  // it would be past the spare threads or the lane stops.
  void WorkerLoop(Worker* worker, Conn* conn);
  void Serve(Conn* conn);
  // Closes conn->fd under mu_ (so Stop never shuts a reused number).
  void Close(Conn* conn);
  // Runs one call; false when the connection must close after the reply.
  // `admitted` is the connection's: set by a ping whose token passed,
  // which also sets the connection's `tenant` (master/tenants.h) and
  // whether it may open a replication stream (the token's admin role).
  bool Call(int fd, const std::string& peer, const char* header, std::string* buf, bool* admitted,
            bool* may_replicate, std::string* tenant);
  // Polls `fd` for the next call and counts how the spin ended.
  void SpinForNextCall(int fd, net::SpinTracker* tracker);

  Master* const master_;
  const Options options_;
  rpc::MethodStats stats_[direct::kMaxMethod + 1];
  metrics::Gauge* connections_;
  metrics::Counter* refused_;
  metrics::Gauge* threads_;
  metrics::Counter* threads_started_;
  metrics::Counter* spin_call_;
  metrics::Counter* spin_idle_;
  metrics::Counter* spin_capped_;
  net::ServerSpin spin_;
  net::Fd listener_;
  grpc::Server* grpc_ = nullptr;
  std::thread acceptor_;
  Mutex mu_;
  std::list<std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);  // accepted, not yet closed
  std::list<std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);
  std::deque<Conn*> handoff_ ABSL_GUARDED_BY(mu_);  // accepted, for a waiting worker
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;            // waiting workers not yet handed one
  CondVar work_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  size_t unread_ ABSL_GUARDED_BY(mu_) = 0;  // connections before their first bytes
  size_t direct_ ABSL_GUARDED_BY(mu_) = 0;  // connections identified as direct
  bool accepting_stopped_ = false;
  bool stopped_ = false;
};

}  // namespace tierkv::master
