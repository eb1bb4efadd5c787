// EmbeddedCluster: a master and store daemons in this process on free
// loopback ports, for the demo, trace replay and benchmarks.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "master/server.h"
#include "store/daemon.h"

namespace tierkv::tools {

// Each daemon's SSD tier: `size` bytes in a temporary directory of its
// own (removed with the cluster); 0: none. `admission` is the master's
// --ssd-admission (empty: its default).
struct EmbeddedSsd {
  uint64_t size = 0;
  std::string admission;
};

class EmbeddedCluster {
 public:
  // Waits until every daemon is mounted. `eviction_policy` is the
  // master's --eviction-policy (empty: its default).
  static absl::StatusOr<std::unique_ptr<EmbeddedCluster>> Start(int daemons, uint64_t segment_size,
                                                                const std::string& transport = "",
                                                                const std::string& eviction_policy = "",
                                                                const EmbeddedSsd& ssd = {});
  ~EmbeddedCluster();
  std::string master_address() const;
  std::string metadata_url() const;
  master::MasterServer& master() { return *master_; }
  store::StoreDaemon& daemon(size_t i) { return *daemons_[i]; }
  size_t daemons() const { return daemons_.size(); }

 private:
  std::unique_ptr<master::MasterServer> master_;
  std::vector<std::unique_ptr<store::StoreDaemon>> daemons_;
  std::vector<std::string> ssd_dirs_;
};

}  // namespace tierkv::tools
