// tierkv-master: parses flags and runs a MasterServer until SIGTERM/SIGINT.
// Under systemd (Type=notify) it reports READY=1 once both servers serve
// and STOPPING=1 when a stop signal starts the shutdown. SIGHUP re-reads
// --token-file.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/log.h"
#include "base/notify.h"
#include "base/signals.h"
#include "config/master_config.h"
#include "master/ha.h"
#include "master/server.h"

int main(int argc, char** argv) {
  tierkv::MasterConfig config = tierkv::MasterFlags().ParseOrExit(argc, argv);

  tierkv::BlockStopSignals();  // before any thread starts
  tierkv::RaiseFileLimit();

  if (!config.etcd.empty()) {
    // One of several masters: serves only while elected (master/ha.h).
    auto node = tierkv::master::HaNode::Start(config);
    if (!node.ok()) {
      std::fprintf(stderr, "tierkv-master: %s\n", std::string(node.status().message()).c_str());
      return 1;
    }
    std::printf("ha: %s of cluster %s, serving rpc=%d http=%d while elected\n", config.advertise.c_str(),
                config.cluster_id.c_str(), static_cast<int>(config.rpc_port), static_cast<int>(config.http_port));
    std::fflush(stdout);
    tierkv::NotifyReady(absl::StrCat("ha member ", config.advertise));
    int sig = tierkv::WaitForStopSignal([&node] {
      tierkv::auth::ServerTlsContext::RecheckAll();
      if (absl::Status s = (*node)->ReloadAuth(); !s.ok()) TKV_LOG(WARNING) << "SIGHUP: keeping the tokens in use: " << s.message();
    });
    TKV_LOG(INFO) << "signal " << sig << ": shutting down";
    tierkv::NotifyStopping();
    (*node)->Stop();
    return 0;
  }

  auto server = tierkv::master::MasterServer::Start(config);
  if (!server.ok()) {
    std::fprintf(stderr, "tierkv-master: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  std::printf("listening rpc=%d http=%d\n", (*server)->rpc_port(), (*server)->http_port());
  std::fflush(stdout);
  TKV_LOG(INFO) << "serving gRPC on " << config.listen << ":" << (*server)->rpc_port()
                << ", HTTP on " << config.listen << ":" << (*server)->http_port();
  // Both ports are bound (connections queue from here on): daemons may mount now.
  tierkv::NotifyReady(absl::StrCat("serving rpc=", (*server)->rpc_port(), " http=", (*server)->http_port()));

  int sig = tierkv::WaitForStopSignal([&server] {
    // Renewed certificates: the HTTP port's at its next connection (gRPC's
    // watcher takes them within a minute).
    tierkv::auth::ServerTlsContext::RecheckAll();
    if (absl::Status s = (*server)->ReloadAuth(); s.ok()) {
      TKV_LOG(INFO) << "SIGHUP: token file re-read";
    } else {
      TKV_LOG(WARNING) << "SIGHUP: keeping the tokens in use: " << s.message();
    }
  });
  TKV_LOG(INFO) << "signal " << sig << ": shutting down";
  tierkv::NotifyStopping();
  (*server)->Shutdown();
  return 0;
}
