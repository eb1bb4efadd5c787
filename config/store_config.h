// tierkv-store's configuration: the one table that defines its flags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "config/flags.h"

namespace tierkv {

struct StoreConfig {
  std::string master;         // host:port of the master's gRPC
  std::string metadata;       // http://host:port of the metadata server
  std::string token_file;     // this daemon's token for the master
  // TLS on the master's gRPC port (base/auth.h TlsFiles).
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string auth;           // none | token: data grants on the transfer port
  bool insecure_allow_remote = false;
  bool data_tls = false;
  uint64_t segment_size = 0;
  std::string listen;
  std::string host;           // address peers dial; default: --listen
  int64_t port = 0;           // transfer (tcp) port
  int64_t http_port = 0;      // /ready, /health, /metrics
  std::string name;           // segment name; default host:port
  std::string transport;      // comma-separated preference; empty = auto
  std::string rdma_devices;   // comma-separated NIC names
  bool hugepages = false;
  bool prefault = false;
  int64_t prefault_threads = 0;  // 0: one per CPU the daemon may use
  bool mlock = false;
  int64_t numa_node = -1;        // -1: no binding
  absl::Duration heartbeat_interval;
  int64_t connections = 0;
  int64_t max_connections = 0;  // tcp server: open connections it accepts
  int64_t io_threads = 0;       // tcp server: threads serving every connection
  absl::Duration idle_timeout;  // tcp server: an idle connection is closed after this
  absl::Duration frame_timeout;      // tcp server: one deadline per frame, from its first byte
  absl::Duration handshake_timeout;  // tcp server: one deadline per handshake, from the accept
  // The SSD tier (store/ssd_tier.h); off while ssd_dir is empty.
  std::string ssd_dir;
  uint64_t ssd_size = 0;
  uint64_t ssd_region_size = 0;
  double ssd_high_watermark = 0;
  double ssd_low_watermark = 0;
  absl::Duration ssd_slow_io;
  bool ssd_direct = true;
};

const FlagTable<StoreConfig>& StoreFlags();

}  // namespace tierkv
