// TestCluster: a real tierkv cluster for integration tests: one
// tierkv-master and N tierkv-store daemons as child processes on loopback
// ports, with short TTLs so liveness tests run in seconds.
//
//   TestCluster cluster;
//   ASSERT_OK(cluster.Start({.daemons = 3, .segment_size = "256mib"}));
//   auto client = cluster.NewClient();
//   cluster.daemon(0).Kill(SIGKILL);
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "tests/support/process.h"

namespace tierkv::testing {

struct ClusterOptions {
  int daemons = 3;
  std::string segment_size = "256mib";
  std::string segment_ttl = "1s";
  std::string put_timeout = "30s";
  bool persist = false;  // give the master a data directory
  std::vector<std::string> master_flags;
  std::vector<std::string> daemon_flags;
  // The bearer token NewClient and HttpGet present (a master running
  // --auth token); empty: none.
  std::string token;
  // TLS files NewClient and HttpGet use (master_flags and daemon_flags
  // carry the binaries' own); given, the master's ports and the daemons'
  // HTTP are taken to serve TLS; empty: plain.
  auth::TlsFiles tls;
};

class TestCluster {
 public:
  ~TestCluster();
  absl::Status Start(ClusterOptions options);

  // Restarts the master on the same ports (and data directory).
  absl::Status StartMaster();
  absl::Status StartDaemon(int i);
  // Waits until exactly `n` segments are live at the master.
  absl::Status WaitForLiveSegments(size_t n, absl::Duration timeout = absl::Seconds(20));

  ChildProcess& master() { return *master_; }
  ChildProcess& daemon(int i) { return *daemons_[i]; }
  int rpc_port() const { return rpc_port_; }
  int http_port() const { return http_port_; }
  std::string master_address() const;
  std::string metadata_url() const;

  // A client of this cluster; `transports` empty = auto. `token` replaces
  // the options' token when not empty.
  absl::StatusOr<std::unique_ptr<client::Client>> NewClient(std::vector<std::string> transports = {},
                                                            const std::string& token = "");
  // GET on the master's HTTP port (with `token`, else the options'); the
  // body, or an error for non-200.
  absl::StatusOr<std::string> HttpGet(const std::string& path, int port = 0, const std::string& token = "");
  // Prints the children's stderr (for failing tests).
  std::string Logs();

 private:
  ClusterOptions options_;
  std::string data_dir_;
  int rpc_port_ = 0;
  int http_port_ = 0;
  std::unique_ptr<ChildProcess> master_;
  std::vector<std::unique_ptr<ChildProcess>> daemons_;
};

}  // namespace tierkv::testing
