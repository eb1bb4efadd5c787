// tierkv-store: parses flags and runs a StoreDaemon until SIGTERM/SIGINT.
// Under systemd (Type=notify) it reports READY=1 once the segment is
// mounted at the master, not when it merely listens, and STOPPING=1 when
// a stop signal starts the unmount.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/log.h"
#include "base/notify.h"
#include "base/signals.h"
#include "config/store_config.h"
#include "store/daemon.h"

namespace {

// Reports the mount state to the service manager: READY=1 at the first
// mount, STATUS= at every change after. The lender exposes the state as a
// flag, not an event, so this polls it; 50 ms is far below systemd's start
// timeout and costs nothing.
class MountNotifier {
 public:
  explicit MountNotifier(const tierkv::store::StoreDaemon* daemon)
      : daemon_(daemon), thread_([this] { Loop(); }) {}
  ~MountNotifier() { Stop(); }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    bool was_ready = false;
    bool notified = false;
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      bool ready = daemon_->ready();
      if (ready && !notified) {
        tierkv::NotifyReady(absl::StrCat("segment ", daemon_->segment(), " mounted"));
        notified = true;
      } else if (notified && ready != was_ready) {
        tierkv::NotifyStatus(ready ? absl::StrCat("segment ", daemon_->segment(), " mounted")
                                   : std::string("not mounted: master unreachable, re-mounting"));
      }
      was_ready = ready;
      cv_.wait_for(lock, std::chrono::milliseconds(50), [this] { return stopping_; });
    }
  }

  const tierkv::store::StoreDaemon* const daemon_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace

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
  MountNotifier notifier(daemon->get());
  // SIGHUP: renewed certificates (HTTP, --data-tls) are read at the next
  // connection.
  int sig = tierkv::WaitForStopSignal([] {
    tierkv::auth::ServerTlsContext::RecheckAll();
    TKV_LOG(INFO) << "SIGHUP: TLS files are re-read at the next connection";
  });
  TKV_LOG(INFO) << "signal " << sig << ": unmounting and exiting";
  tierkv::NotifyStopping();
  notifier.Stop();
  (*daemon)->Stop();
  return 0;
}
