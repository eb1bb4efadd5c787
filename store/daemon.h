// StoreDaemon: tierkv-store as an object. It lends a DRAM segment through
// a SegmentLender (allocate lazily, register, serve, mount, heartbeat,
// re-mount) and answers HTTP /ready, /health and /metrics.
//
// /ready is 200 only while the segment is mounted at the master: 503 before
// the first mount and while the master cannot be reached.
//
// Threads: the transfer engine's (tcp server, workers), the lender's
// heartbeat thread, and cpp-httplib's pool for HTTP. Stop() unmounts,
// stops serving and joins everything.
#pragma once

#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "client/lender.h"
#include "client/master_client.h"
#include "config/base/http_server.h"
#include "config/base/metrics.h"
#include "config/store_config.h"
#include "transport/engine.h"


namespace tierkv::store {

class StoreDaemon {
 public:
  // Starts serving at once; mounting happens in the background.
  // INVALID_ARGUMENT for unusable flags (bad master address, metadata URL,
  // transport name); RESOURCE_EXHAUSTED if the memory cannot be reserved;
  // UNAVAILABLE if a port cannot be bound.
  static absl::StatusOr<std::unique_ptr<StoreDaemon>> Start(const StoreConfig& config);
  ~StoreDaemon();

  int port() const { return engine_->port(); }
  int http_port() const { return http_port_; }
  bool ready() const { return lender_->mounted(); }
  const std::string& segment() const { return lender_->name(); }
  void Stop();

 private:
  StoreDaemon() = default;
  void RegisterMetrics();

  std::unique_ptr<client::MasterClient> master_;
  std::unique_ptr<transport::TransferEngine> engine_;
  std::unique_ptr<client::SegmentLender> lender_;
  metrics::Registry metrics_;
  std::unique_ptr<HttpServer> http_;
  std::thread http_thread_;
  int http_port_ = 0;
  bool stopped_ = false;
};

}  // namespace tierkv::store
