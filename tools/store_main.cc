// tierkv-store: parses flags and runs a StoreDaemon until SIGTERM/SIGINT.
#include <cstdio>

#include "config/base/log.h"
#include "config/base/signals.h"
#include "config/store_config.h"
#include "store/daemon.h"

int main(int argc, char** argv) {
  tierkv::StoreConfig config = tierkv::StoreFlags().ParseOrExit(argc, argv);
  tierkv::BlockStopSignals();  // before any thread starts
  tierkv::RaiseFileLimit();

  auto daemon = tierkv::store::StoreDaemon::Start(config);
  if (!daemon.ok()) {
    std::fprintf(stderr, "tierkv-store: %s\n", std::string(daemon.status().message()).c_str());
    // As for a bad flag value: what the flags ask for cannot be had here
    // (a missing NUMA node, more memory than the host can back, a refused
    // mlock), so retrying the same command will not help.
    absl::StatusCode code = daemon.status().code();
    bool refused = code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kResourceExhausted ||
                   code == absl::StatusCode::kFailedPrecondition;
    return refused ? 2 : 1;
  }
  std::printf("listening port=%d http=%d\n", (*daemon)->port(), (*daemon)->http_port());
  std::fflush(stdout);
  TKV_LOG(INFO) << "lending " << config.segment_size << " bytes as segment " << (*daemon)->segment() << " at "
                << (*daemon)->location();
  int sig = tierkv::WaitForStopSignal();
  TKV_LOG(INFO) << "signal " << sig << ": unmounting and exiting";
  (*daemon)->Stop();
  return 0;
}
