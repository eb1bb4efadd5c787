#include "store/daemon.h"

#include <unistd.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "config/base/http_server.h"
#include "config/base/log.h"
#include "config/base/status.h"
#include "config/units.h"
#include "httplib.h"
#include "transport/numa.h"

namespace tierkv::store {
namespace {

// Checks --numa-node and pins the calling thread to the node's CPUs, so
// every thread Start creates (engine workers, tcp server, prefault, HTTP)
// inherits them. Returns the CPUs to restore the caller to afterwards
// (empty when nothing was changed).
absl::StatusOr<std::vector<int>> PinToNode(int node) {
  if (node < 0) return std::vector<int>{};
  ASSIGN_OR_RETURN(transport::NumaTopology topo, transport::NumaTopology::Load());
  if (absl::Status s = topo.Check(node); !s.ok()) return Annotate(s, absl::StrCat("--numa-node ", node));
  const std::vector<int>& cpus = topo.cpus(node);
  if (cpus.empty()) {
    TKV_LOG(WARNING) << "NUMA node " << node << " has no CPUs; its memory is used, threads stay unpinned";
    return std::vector<int>{};
  }
  absl::StatusOr<std::vector<int>> previous = transport::PinThisThread(cpus);
  if (!previous.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("--numa-node ", node, ": ", previous.status().message()));
  }
  return previous;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StoreDaemon>> StoreDaemon::Start(const StoreConfig& config) {
  ASSIGN_OR_RETURN(std::vector<int> caller_cpus, PinToNode(static_cast<int>(config.numa_node)));
  absl::Cleanup restore = [&caller_cpus] {
    if (!caller_cpus.empty()) (void)transport::PinThisThread(caller_cpus);
  };
  std::unique_ptr<StoreDaemon> d(new StoreDaemon());
  ASSIGN_OR_RETURN(d->master_, client::MasterClient::Create(config.master));
  transport::EngineOptions eo;
  ASSIGN_OR_RETURN(std::unique_ptr<transport::MetadataClient> metadata,
                   transport::NewHttpMetadata(config.metadata));
  eo.metadata = std::move(metadata);
  for (absl::string_view t : absl::StrSplit(config.transport, ',', absl::SkipWhitespace())) {
    eo.transports.emplace_back(t);
  }
  for (absl::string_view t : absl::StrSplit(config.rdma_devices, ',', absl::SkipWhitespace())) {
    eo.backend.rdma_devices.emplace_back(t);
  }
  eo.backend.listen = config.listen;
  eo.backend.advertise = config.host;
  eo.backend.port = static_cast<int>(config.port);
  eo.backend.connections = static_cast<int>(config.connections);
  eo.backend.max_connections = static_cast<int>(config.max_connections);
  eo.backend.io_threads = static_cast<int>(config.io_threads);
  eo.backend.idle_timeout = config.idle_timeout;
  ASSIGN_OR_RETURN(d->engine_, transport::TransferEngine::Create(eo));

  char host[256] = {};
  gethostname(host, sizeof host - 1);
  client::LenderOptions lo;
  // Named by the address peers dial, so daemons on different nodes bound
  // to 0.0.0.0 on the same port never share a name.
  lo.name = config.name.empty() ? absl::StrCat(d->engine_->advertised_address(), ":", d->engine_->port()) : config.name;
  lo.host = host;
  lo.size = config.segment_size;
  lo.prefault = config.prefault;
  lo.prefault_threads = static_cast<int>(config.prefault_threads);
  lo.hugepages = config.hugepages;
  lo.mlock = config.mlock;
  lo.numa_node = static_cast<int>(config.numa_node);
  lo.heartbeat_interval = config.heartbeat_interval;
  absl::StatusOr<std::unique_ptr<client::SegmentLender>> lender =
      client::SegmentLender::Start(lo, d->engine_.get(), d->master_.get());
  if (!lender.ok()) {
    // Name the flag that asked for what this host cannot give.
    const absl::Status& st = lender.status();
    if (absl::IsResourceExhausted(st)) {
      return Annotate(st, absl::StrCat("--segment-size ", FormatSize(config.segment_size)));
    }
    if (absl::IsFailedPrecondition(st) && config.mlock) return Annotate(st, "--mlock");
    if (absl::IsInvalidArgument(st) && config.numa_node >= 0) {
      return Annotate(st, absl::StrCat("--numa-node ", config.numa_node));
    }
    return st;
  }
  d->lender_ = std::move(*lender);

  d->RegisterMetrics();
  d->http_ = std::make_unique<HttpServer>(HttpServer::Options{.threads = 2, .max_connections = 1024});
  StoreDaemon* raw = d.get();
  d->http_->Get("/ready", [raw](const httplib::Request&, httplib::Response& res) {
    bool ready = raw->ready();
    res.status = ready ? 200 : 503;
    res.set_content(ready ? "ready\n" : "not mounted\n", "text/plain");
  });
  d->http_->Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });
  d->http_->Get("/metrics", [raw](const httplib::Request&, httplib::Response& res) {
    res.set_content(raw->metrics_.Serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  d->http_->set_payload_max_length(1 << 16);
  d->http_port_ = d->http_->Bind(config.listen, static_cast<int>(config.http_port));
  if (d->http_port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", config.listen, ":", config.http_port));
  }
  d->http_->Start();
  return d;
}

void StoreDaemon::RegisterMetrics() {
  auto& mounted = metrics::BuildGauge().Name("tierkv_store_mounted").Help("1 while the segment is mounted at the master").Register(metrics_);
  auto& capacity = metrics::BuildGauge().Name("tierkv_store_segment_bytes").Help("Bytes this daemon lends").Register(metrics_);
  auto& mounts = metrics::BuildCounter().Name("tierkv_store_mounts_total").Help("Successful mounts (first and re-mounts)").Register(metrics_);
  auto& failures = metrics::BuildCounter().Name("tierkv_store_heartbeat_failures_total").Help("Failed mounts and heartbeats").Register(metrics_);
  auto& served = metrics::BuildCounter().Name("tierkv_store_client_bytes_total").Help("Bytes this process moved as a client, by direction").Register(metrics_);
  metrics_.AddCollectHook([this, &mounted, &capacity, &mounts, &failures, &served] {
    auto catch_up = [](metrics::Counter& c, uint64_t v) {
      if (static_cast<double>(v) > c.Value()) c.Increment(static_cast<double>(v) - c.Value());
    };
    mounted.Add({}).Set(lender_->mounted() ? 1 : 0);
    capacity.Add({}).Set(static_cast<double>(lender_->size()));
    catch_up(mounts.Add({}), lender_->mounts());
    catch_up(failures.Add({}), lender_->heartbeat_failures());
    transport::EngineStats st = engine_->Stats();
    catch_up(served.Add({{"direction", "read"}}), st.bytes_read);
    catch_up(served.Add({{"direction", "write"}}), st.bytes_written);
  });
}

void StoreDaemon::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (lender_) lender_->Stop();  // unmount first: clients stop choosing us
  if (http_) http_->Stop();
  lender_.reset();
  engine_.reset();
}

StoreDaemon::~StoreDaemon() { Stop(); }

}  // namespace tierkv::store
