// FaultProxy: a TCP proxy for tests, between a client and a server on
// loopback, that injects the faults this kernel's missing netem cannot:
// delay every chunk, stall (hold the bytes and forward nothing), truncate
// (close cleanly after N bytes) and reset (RST after N bytes).
//
//   ASSERT_OK_AND_ASSIGN(auto proxy, FaultProxy::Start("127.0.0.2", port, "127.0.0.1:" + port));
//   proxy->Set({FaultProxy::Mode::kStall});
//
// A fault applies to bytes forwarded after Set, on every connection; byte
// counts for truncate/reset are per connection and both directions. One
// thread per connection; the destructor closes everything and joins.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace tierkv::testing {

class FaultProxy {
 public:
  enum class Mode { kPass, kDelay, kStall, kTruncate, kReset };
  struct Fault {
    Mode mode = Mode::kPass;
    absl::Duration delay;      // kDelay: before each forwarded chunk
    uint64_t after_bytes = 0;  // kTruncate / kReset: bytes let through first
  };

  // Listens on listen_host:listen_port (0 picks one) and forwards to
  // `target` (host:port).
  static absl::StatusOr<std::unique_ptr<FaultProxy>> Start(const std::string& listen_host, int listen_port,
                                                           const std::string& target);
  ~FaultProxy();

  void Set(Fault fault);
  int port() const { return port_; }
  // Connections accepted so far, and open now.
  uint64_t accepted() const { return accepted_.load(); }
  int open() const { return open_.load(); }

 private:
  FaultProxy() = default;
  void AcceptLoop();
  void Pump(int client, int server);
  Fault Current();

  int listener_ = -1;
  int port_ = 0;
  std::string target_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<int> open_{0};
  Mutex mu_;
  Fault fault_ ABSL_GUARDED_BY(mu_);
  CondVar fault_changed_;  // signalled by Set and on stopping (a stalled pump waits on it)
  std::thread acceptor_;
  struct PumpThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<PumpThread> pumps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::testing
