// MasterServer: tierkv-master as an object (the binary's main only parses
// flags and calls Run), so tests and the demo can embed one.
//
// Threads:
//   - one thread accepts on the RPC port; each direct connection has a
//     thread that runs its calls inline (DirectLane, master/direct_lane.h);
//   - --rpc-threads threads each poll a completion queue and run the gRPC
//     handlers inline (MasterRpcService, master/grpc_service.h);
//   - HttpServer's workers (--http-threads) run the HTTP handlers;
//   - one ticker thread calls Master::Tick every --check-interval;
//   - one evictor thread runs ObjectIndex::RunEvictor, so no RPC evicts
//     unless the store is full.
// All of them call into Master, which is thread-safe; the server itself
// holds no locks while they run. Shutdown stops the listeners first, then
// the ticker and the evictor, then flushes the store.
#pragma once

#include <functional>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "base/auth.h"
#include "base/http_server.h"
#include "base/mutex.h"
#include "config/master_config.h"
#include "master/direct_lane.h"
#include "master/grpc_service.h"
#include "master/master.h"
#include "master/replication.h"
#include "base/net/socket.h"

namespace grpc {
class Server;
}

namespace tierkv::master {

// What a master elected leader (master/ha.h) brings to its server.
struct HaHooks {
  std::unique_ptr<IndexStore> store;  // the copy it kept as a standby, used instead of opening --data-dir
  ReplicationLog* log = nullptr;      // on the store already; served as the MasterHa service; outlives the server
  const ServingGate* gate = nullptr;  // MasterOptions::gate
  std::function<std::string()> status_json;  // MasterOptions::ha_status
  uint64_t epoch = 0;                        // MasterOptions::epoch
  // The RPC port, bound and listening already (a standby's, handed over so
  // the port never closes on promotion); invalid: bind it. Unused with TLS.
  net::Fd listener;
};

class MasterServer {
 public:
  // Opens the store, recovers, binds both ports (0 picks a free one) and
  // starts serving. UNAVAILABLE if a port cannot be bound; errors from
  // opening the data directory are passed through.
  static absl::StatusOr<std::unique_ptr<MasterServer>> Start(const MasterConfig& config,
                                                             Clock* clock = Clock::Real(), HaHooks ha = {});
  ~MasterServer();

  int rpc_port() const { return rpc_port_; }
  int http_port() const { return http_port_; }
  Master& master() { return *master_; }

  // Re-reads --token-file (SIGHUP); on an error the tokens in use stay.
  absl::Status ReloadAuth() { return auth_->Reload(); }

  // Stops serving and flushes; idempotent.
  void Shutdown();

 private:
  MasterServer() = default;
  void TickLoop(absl::Duration interval);

  std::unique_ptr<auth::Authenticator> auth_;  // outlives every server below
  std::unique_ptr<Master> master_;
  std::unique_ptr<rpc::RpcMetrics> rpc_metrics_;
  std::unique_ptr<v1::MasterHa::Service> ha_service_;  // with HaHooks::log
  // Declared before grpc_, so destroyed after it: a server is destroyed
  // before its completion queues.
  std::unique_ptr<MasterRpcService> rpc_;
  std::unique_ptr<grpc::Server> grpc_;
  // Destroyed first: its connection threads call into master_, and it
  // hands connections to grpc_.
  std::unique_ptr<DirectLane> direct_;
  std::unique_ptr<HttpServer> http_;
  std::thread ticker_;
  std::thread evictor_;
  Mutex mu_;
  CondVar stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int rpc_port_ = 0;
  int http_port_ = 0;
};

}  // namespace tierkv::master
