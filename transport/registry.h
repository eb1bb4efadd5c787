// Backends are created by name: "tcp", "shm", "loopback", "rdma" (fails
// UNAVAILABLE on hosts without an RDMA NIC), and "cuda" when the optional
// CUDA target is built. Tests may register others (a fake-fabric rdma).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/auth.h"
#include "transport/backend.h"

namespace tierkv::transport {

// Settings every backend may read; each uses what applies to it.
struct BackendOptions {
  std::string listen = "127.0.0.1";  // address servers bind
  std::string advertise;             // address peers dial (default: listen)
  int port = 0;                      // tcp data/control port; 0 picks one
  int connections = 4;               // tcp connections per peer
  // How long a tcp client busy-polls for a reply before sleeping in the
  // kernel: each wake-up from a sleep costs a few (bare metal) to tens
  // (virtual machines) of microseconds. 0 never spins.
  absl::Duration reply_spin = absl::Microseconds(50);
  uint64_t max_frame = 64ull << 20;  // largest request a server accepts
  // The tcp server (tcp/server.h): open connections beyond this are
  // refused; I/O threads serving them all; an idle connection's lifetime.
  int max_connections = 16384;
  int io_threads = 4;
  absl::Duration idle_timeout = absl::Minutes(10);
  // A frame (header, payload and reply) must finish this long after its
  // first byte, and a handshake (TLS, grant challenge) after the accept, or
  // the server closes the connection: a stalled peer holds nothing longer.
  absl::Duration frame_timeout = absl::Seconds(5);
  absl::Duration handshake_timeout = absl::Seconds(10);
  std::vector<std::string> rdma_devices;
  // `tls.ca` verifies the daemons this process dials at tls:// endpoints
  // (the system's trust store without one); with `serve_tls` the tcp
  // server speaks TLS with `tls.cert` and `tls.key` and advertises
  // tls://host:port (a daemon's --data-tls; tcp/tls.h).
  auth::TlsFiles tls;
  bool serve_tls = false;
};

using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<Backend>>(const BackendOptions&)>;

// Registers a factory; a later registration of the same name replaces it.
void RegisterBackend(const std::string& name, BackendFactory factory);
// NOT_FOUND naming the known backends when `name` is unknown.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& name,
                                                       const BackendOptions& options);
std::vector<std::string> RegisteredBackends();

}  // namespace tierkv::transport
