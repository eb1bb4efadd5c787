#include "tools/embedded.h"

#include "absl/strings/str_cat.h"
#include "config/master_config.h"
#include "config/store_config.h"

namespace tierkv::tools {
namespace {
const char* NoEnv(const char*) { return nullptr; }
}  // namespace

absl::StatusOr<std::unique_ptr<EmbeddedCluster>> EmbeddedCluster::Start(int daemons, uint64_t segment_size,
                                                                         const std::string& transport,
                                                                         const std::string& eviction_policy) {
  auto c = std::make_unique<EmbeddedCluster>();
  std::string policy = "--eviction-policy=" + (eviction_policy.empty() ? "chain" : eviction_policy);
  const char* margv[] = {"tierkv-master", "--rpc-port=0", "--http-port=0", policy.c_str()};
  absl::StatusOr<MasterConfig> mcfg = MasterFlags().Parse(4, margv, nullptr, NoEnv);
  if (!mcfg.ok()) return mcfg.status();
  absl::StatusOr<std::unique_ptr<master::MasterServer>> m = master::MasterServer::Start(*mcfg);
  if (!m.ok()) return m.status();
  c->master_ = std::move(*m);
  for (int i = 0; i < daemons; ++i) {
    std::vector<std::string> args{"tierkv-store",
                                  "--master=" + c->master_address(),
                                  "--metadata=" + c->metadata_url(),
                                  "--port=0",
                                  "--http-port=0",
                                  absl::StrCat("--segment-size=", segment_size),
                                  absl::StrCat("--name=embedded-", i),
                                  "--heartbeat-interval=1s",
                                  "--transport=" + transport};
    std::vector<const char*> argv;
    for (auto& a : args) argv.push_back(a.c_str());
    absl::StatusOr<StoreConfig> scfg = StoreFlags().Parse(static_cast<int>(argv.size()), argv.data(), nullptr, NoEnv);
    if (!scfg.ok()) return scfg.status();
    absl::StatusOr<std::unique_ptr<store::StoreDaemon>> d = store::StoreDaemon::Start(*scfg);
    if (!d.ok()) return d.status();
    c->daemons_.push_back(std::move(*d));
  }
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (auto& d : c->daemons_) {
    while (!d->ready()) {
      if (absl::Now() > deadline) return absl::DeadlineExceededError("store daemons did not mount");
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  return c;
}

EmbeddedCluster::~EmbeddedCluster() {
  for (auto& d : daemons_) d->Stop();
  if (master_) master_->Shutdown();
}

std::string EmbeddedCluster::master_address() const { return absl::StrCat("127.0.0.1:", master_->rpc_port()); }
std::string EmbeddedCluster::metadata_url() const { return absl::StrCat("http://127.0.0.1:", master_->http_port()); }

}  // namespace tierkv::tools
