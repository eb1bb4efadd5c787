#include "tools/embedded.h"

#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "config/master_config.h"
#include "config/store_config.h"

namespace tierkv::tools {
namespace {
const char* NoEnv(const char*) { return nullptr; }
}  // namespace

absl::StatusOr<std::unique_ptr<EmbeddedCluster>> EmbeddedCluster::Start(int daemons, uint64_t segment_size,
                                                                         const std::string& transport,
                                                                         const std::string& eviction_policy,
                                                                         const EmbeddedSsd& ssd) {
  auto c = std::make_unique<EmbeddedCluster>();
  std::vector<std::string> margs{"tierkv-master", "--rpc-port=0", "--http-port=0",
                                 "--eviction-policy=" + (eviction_policy.empty() ? "chain" : eviction_policy)};
  if (!ssd.admission.empty()) margs.push_back("--ssd-admission=" + ssd.admission);
  std::vector<const char*> margv;
  for (auto& a : margs) margv.push_back(a.c_str());
  absl::StatusOr<MasterConfig> mcfg = MasterFlags().Parse(static_cast<int>(margv.size()), margv.data(), nullptr, NoEnv);
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
    if (ssd.size > 0) {
      std::string tmpl = (std::filesystem::temp_directory_path() / "tierkv-embedded-ssd-XXXXXX").string();
      if (mkdtemp(tmpl.data()) == nullptr) {
        return absl::InternalError(absl::StrCat("cannot make a directory for the SSD tier: ", strerror(errno)));
      }
      c->ssd_dirs_.push_back(tmpl);
      // Regions of a 64th of the tier (1 to 16 MiB): a small tier still
      // reclaims in steps much smaller than itself.
      uint64_t region = std::clamp<uint64_t>(ssd.size / 64 / 4096 * 4096, 1 << 20, 16 << 20);
      args.push_back("--ssd-dir=" + tmpl);
      args.push_back(absl::StrCat("--ssd-size=", std::max<uint64_t>(ssd.size, 4 * region)));
      args.push_back(absl::StrCat("--ssd-region-size=", region));
    }
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
  std::error_code ec;
  for (const std::string& dir : ssd_dirs_) std::filesystem::remove_all(dir, ec);
}

std::string EmbeddedCluster::master_address() const { return absl::StrCat("127.0.0.1:", master_->rpc_port()); }
std::string EmbeddedCluster::metadata_url() const { return absl::StrCat("http://127.0.0.1:", master_->http_port()); }

}  // namespace tierkv::tools
