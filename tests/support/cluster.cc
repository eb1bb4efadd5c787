#include "tests/support/cluster.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/support/wait.h"

namespace tierkv::testing {

TestCluster::~TestCluster() {
  daemons_.clear();
  master_.reset();
  if (!data_dir_.empty()) std::filesystem::remove_all(data_dir_);
}

std::string TestCluster::master_address() const { return absl::StrCat("127.0.0.1:", rpc_port_); }
// A cluster whose callers use TLS has a master serving both its ports over it.
std::string TestCluster::metadata_url() const {
  return auth::HttpUrl(absl::StrCat("127.0.0.1:", http_port_), options_.tls.enabled());
}

absl::Status TestCluster::Start(ClusterOptions options) {
  options_ = std::move(options);
  if (options_.persist) data_dir_ = MakeTempDir("tierkv-cluster-data");
  if (absl::Status s = StartMaster(); !s.ok()) return s;
  daemons_.resize(options_.daemons);
  for (int i = 0; i < options_.daemons; ++i) {
    if (absl::Status s = StartDaemon(i); !s.ok()) return s;
  }
  return WaitForLiveSegments(options_.daemons);
}

absl::Status TestCluster::StartMaster() {
  std::vector<std::string> args{absl::StrCat("--rpc-port=", rpc_port_),
                                absl::StrCat("--http-port=", http_port_),
                                "--segment-ttl=" + options_.segment_ttl,
                                "--put-timeout=" + options_.put_timeout, "--check-interval=100ms"};
  if (!data_dir_.empty()) args.push_back("--data-dir=" + data_dir_);
  args.insert(args.end(), options_.master_flags.begin(), options_.master_flags.end());
  master_.reset();
  absl::StatusOr<std::unique_ptr<ChildProcess>> m;
  // A port just released by a killed master can take a moment to be free:
  // a restart on the old ports is tried until it binds (a fresh master,
  // on ports of its own choosing, is tried once).
  (void)WaitFor("the master to start on its ports", absl::Seconds(5), [&] {
    m = ChildProcess::Start(BinaryPath("tierkv-master"), args);
    return m.ok() || rpc_port_ == 0;
  });
  if (!m.ok()) return m.status();
  master_ = std::move(*m);
  rpc_port_ = master_->port("rpc");
  http_port_ = master_->port("http");
  return absl::OkStatus();
}

absl::Status TestCluster::StartDaemon(int i) {
  std::vector<std::string> args{"--master=" + master_address(), "--metadata=" + metadata_url(),
                                "--segment-size=" + options_.segment_size, "--port=0", "--http-port=0",
                                "--heartbeat-interval=200ms", absl::StrCat("--name=daemon-", i)};
  args.insert(args.end(), options_.daemon_flags.begin(), options_.daemon_flags.end());
  daemons_[i].reset();
  auto d = ChildProcess::Start(BinaryPath("tierkv-store"), args);
  if (!d.ok()) return d.status();
  daemons_[i] = std::move(*d);
  return absl::OkStatus();
}

absl::Status TestCluster::WaitForLiveSegments(size_t n, absl::Duration timeout) {
  size_t live = 0;
  absl::Status waited = WaitFor(absl::StrCat(n, " segments live at the master"), timeout, [&] {
    absl::StatusOr<std::string> body = HttpGet("/v1/segments");
    if (!body.ok()) return false;
    nlohmann::json j = nlohmann::json::parse(*body, nullptr, false);
    live = 0;
    if (j.is_array()) {
      for (const auto& s : j) live += s.value("state", "") == "live";
    }
    return live == n;
  });
  if (waited.ok()) return waited;
  return absl::DeadlineExceededError(absl::StrCat(waited.message(), " (", live, " live)"));
}

absl::StatusOr<std::unique_ptr<client::Client>> TestCluster::NewClient(std::vector<std::string> transports,
                                                                       const std::string& token) {
  client::ClientOptions o;
  o.master = master_address();
  o.metadata = metadata_url();
  o.transports = std::move(transports);
  o.transfer_timeout = absl::Seconds(10);
  o.token = token.empty() ? options_.token : token;
  o.tls = options_.tls;
  return client::Client::Create(o);
}

absl::StatusOr<std::string> TestCluster::HttpGet(const std::string& path, int port, const std::string& token) {
  ASSIGN_OR_RETURN(
      auto cli,
      auth::NewHttpClient(
          auth::HttpUrl(absl::StrCat("127.0.0.1:", port == 0 ? http_port_ : port), options_.tls.enabled()),
          options_.tls, absl::Seconds(5)));
  if (!token.empty() || !options_.token.empty()) cli->set_bearer_token_auth(token.empty() ? options_.token : token);
  auto res = cli->Get(path);
  if (!res) return absl::UnavailableError(httplib::to_string(res.error()));
  if (res->status != 200) return absl::Status(absl::StatusCode::kUnknown, absl::StrCat("HTTP ", res->status));
  return res->body;
}

std::string TestCluster::Logs() {
  std::string out;
  if (master_) absl::StrAppend(&out, "--- master\n", master_->Stderr());
  for (size_t i = 0; i < daemons_.size(); ++i) {
    if (daemons_[i]) absl::StrAppend(&out, "--- daemon ", i, "\n", daemons_[i]->Stderr());
  }
  return out;
}

}  // namespace tierkv::testing
