#include "master/server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/http_server.h"
#include "base/log.h"
#include "base/status.h"
#include "httplib.h"
#include "master/direct_lane.h"
#include "master/grpc_service.h"
#include "master/http_service.h"
#include "proto/channel_credentials.h"

namespace tierkv::master {

namespace {

// The cores this process may run on: its affinity mask, capped by a cgroup
// v2 CPU quota (a container limited to 2 CPUs on a 64-core node has 2).
unsigned UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  unsigned n = sched_getaffinity(0, sizeof(set), &set) == 0 ? static_cast<unsigned>(CPU_COUNT(&set))
                                                            : std::thread::hardware_concurrency();
  std::ifstream f("/sys/fs/cgroup/cpu.max");
  std::string quota, period;
  uint64_t q = 0, p = 0;
  if (f >> quota >> period && absl::SimpleAtoi(quota, &q) && absl::SimpleAtoi(period, &p) && p > 0) {
    n = std::min<unsigned>(n, static_cast<unsigned>(std::max<uint64_t>(1, q / p)));
  }
  return std::max(1u, n);
}

// The flag, or by default a quarter of the cores (1 to 16). RPC threads: on
// a small host one thread avoids a hand-off per RPC; on a large one the
// master serves many clients side by side without taking the cores the
// daemons' and clients' threads need. Direct-lane spinners: on a small host
// a second spinner would take the core the client itself runs on.
unsigned QuarterOfTheCores(int64_t flag) {
  if (flag > 0) return static_cast<unsigned>(flag);
  return std::clamp(UsableCores() / 4, 1u, 16u);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MasterServer>> MasterServer::Start(const MasterConfig& config,
                                                                  Clock* clock, HaHooks ha) {
  std::unique_ptr<MasterServer> s(new MasterServer());
  RETURN_IF_ERROR(auth::CheckBind(config.auth, config.listen, config.insecure_allow_remote, "tierkv-master"));
  ASSIGN_OR_RETURN(s->auth_, auth::Authenticator::Create(config.auth, config.token_file));
  std::unique_ptr<IndexStore> store = std::move(ha.store);  // a leader's copy, already open
  if (store == nullptr && config.data_dir.empty()) {
    store = NewMemStore();
  } else if (store == nullptr) {
    ASSIGN_OR_RETURN(store, OpenRocksDbStore(config.data_dir));
  }
  MasterOptions options;
  options.segment_ttl = config.segment_ttl;
  options.ssd_grace = config.ssd_grace;
  options.data_grant_ttl = config.data_grant_ttl;
  options.callers_authenticated = s->auth_->enabled();
  options.tls = {config.tls_ca, config.tls_cert, config.tls_key};
  options.max_pending_per_client = static_cast<uint64_t>(config.max_pending_per_client);
  options.max_pending_per_tenant = static_cast<uint64_t>(config.max_pending_per_tenant);
  options.max_reservations_per_client = static_cast<uint64_t>(config.max_reservations_per_client);
  options.max_reservations_per_tenant = static_cast<uint64_t>(config.max_reservations_per_tenant);
  options.queries.key_prefix_separator = config.query_stats_key_prefix_separator;
  options.queries.max_prefixes = static_cast<size_t>(config.query_stats_max_prefixes);
  options.queries.sketch_bytes = static_cast<size_t>(config.hit_bound_sketch_bytes);
  options.index.shards = static_cast<int>(config.shards);
  options.index.lease_ttl = config.lease_ttl;
  options.index.pressure_lease = config.pressure_lease;
  options.index.put_timeout = config.put_timeout;
  options.index.revoke_grace = config.revoke_grace;
  options.index.offload_timeout = config.ssd_offload_timeout;
  options.index.offload_unread = config.ssd_admission == "all";
  options.index.high_watermark = config.high_watermark;
  options.index.low_watermark = config.low_watermark;
  ASSIGN_OR_RETURN(options.index.eviction, master::ParseEvictionPolicy(config.eviction_policy));
  options.index.max_key_bytes = static_cast<size_t>(config.max_key_bytes);
  options.kv_events.endpoint = config.kv_events_endpoint;
  options.kv_events.replay_endpoint = config.kv_events_replay_endpoint;
  options.kv_events.topic = config.kv_events_topic;
  ASSIGN_OR_RETURN(options.kv_events.format, ParseKvEventFormat(config.kv_events_format));
  options.kv_events.batch_interval = config.kv_events_batch_interval;
  options.kv_events.max_batch = static_cast<size_t>(config.kv_events_max_batch);
  options.kv_events.buffer_batches = static_cast<size_t>(config.kv_events_buffer);
  options.kv_events.queue_capacity = static_cast<size_t>(config.kv_events_queue);
  options.gate = ha.gate;
  options.ha_status = std::move(ha.status_json);
  options.epoch = ha.epoch;
  ASSIGN_OR_RETURN(s->master_, Master::Create(options, std::move(store), clock));

  // Debian's Abseil is built without NDEBUG, so every absl::Mutex lock in
  // gRPC (several per RPC) also updates a global lock graph for deadlock
  // detection: about a tenth of the server's CPU per lookup RPC
  // (docs/performance.md). tierkv's own locks are std::mutex (Mutex).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  s->rpc_metrics_ = std::make_unique<rpc::RpcMetrics>(s->master_.get());
  const ServiceLimits limits{static_cast<size_t>(config.max_batch)};
  s->rpc_ = std::make_unique<MasterRpcService>(s->master_.get(), s->rpc_metrics_.get(), limits,
                                               static_cast<int>(QuarterOfTheCores(config.rpc_threads)), s->auth_.get());
  const auth::TlsFiles tls{config.tls_ca, config.tls_cert, config.tls_key};
  absl::StatusOr<net::Fd> listener;
  grpc::ServerBuilder builder;
  if (tls.enabled()) {
    // gRPC owns the port and its TLS; the direct lane, plain TCP, is off
    // (it would carry tokens and answers in the clear).
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> creds, MasterServerCredentials(tls));
    builder.AddListeningPort(absl::StrCat(config.listen, ":", config.rpc_port), creds, &s->rpc_port_);
    TKV_LOG(INFO) << "gRPC over TLS" << (tls.ca.empty() ? "" : ", client certificates required")
                  << "; the direct lane is off";
  } else {
    // The port is ours: the direct lane reads each connection's first bytes
    // and hands gRPC the ones that are not direct calls.
    if (ha.listener.valid()) {
      sockaddr_storage bound{};
      socklen_t len = sizeof bound;
      getsockname(ha.listener.get(), reinterpret_cast<sockaddr*>(&bound), &len);
      s->rpc_port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      listener = std::move(ha.listener);
    } else {
      listener = net::Listen(config.listen, static_cast<int>(config.rpc_port), &s->rpc_port_);
    }
    if (!listener.ok()) {
      return absl::UnavailableError(absl::StrCat("cannot serve RPCs on ", config.listen, ":", config.rpc_port, ": ",
                                                 listener.status().message()));
    }
  }
  // Bandwidth probing pings ride on data frames and cost a write and a
  // wake-up each; lookups are small, latency-bound messages.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  s->rpc_->Register(&builder);
  if (ha.log != nullptr) {
    s->ha_service_ = NewMasterHaService(ha.log, s->auth_.get());
    builder.RegisterService(s->ha_service_.get());
  }
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_size));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_size));
  s->grpc_ = builder.BuildAndStart();
  if (s->grpc_ == nullptr || (tls.enabled() && s->rpc_port_ == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot start the gRPC server on ", config.listen, ":", config.rpc_port));
  }
  s->rpc_->Start();
  if (!tls.enabled()) {
    DirectLane::Options direct;
    direct.limits = limits;
    direct.max_message = static_cast<uint32_t>(config.max_message_size);
    direct.max_connections = static_cast<size_t>(config.direct_max_connections);
    direct.idle_timeout = config.direct_idle_timeout;
    direct.spin = config.direct_spin;
    direct.max_spinners = QuarterOfTheCores(config.direct_spinners);
    direct.auth = s->auth_.get();
    direct.replication = ha.log;
    s->direct_ = std::make_unique<DirectLane>(s->master_.get(), s->rpc_metrics_.get(), direct);
    s->direct_->Start(std::move(*listener), s->grpc_.get());
  }

  HttpServer::Options http;
  http.threads = static_cast<int>(config.http_threads);
  http.max_connections = static_cast<size_t>(config.http_max_connections);
  http.idle_timeout = config.http_idle_timeout;
  http.tls = tls;  // one certificate for both ports: clients trust one name
  s->http_ = std::make_unique<HttpServer>(http);
  if (!s->http_->tls_status().ok()) {
    if (s->direct_) s->direct_->StopAccepting();
    s->grpc_->Shutdown();
    return s->http_->tls_status();
  }
  InstallHttpRoutes(s->http_.get(), s->master_.get(),
                    {static_cast<size_t>(config.max_http_body), static_cast<size_t>(config.max_key_bytes),
                     s->auth_.get(), config.open_metrics, config.open_health, !tls.ca.empty()});
  s->http_port_ = s->http_->Bind(config.listen, static_cast<int>(config.http_port));
  if (s->http_port_ <= 0) {
    if (s->direct_) s->direct_->StopAccepting();
    s->grpc_->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("cannot serve HTTP on ", config.listen, ":", config.http_port));
  }
  s->master_->set_http_port(s->http_port_);
  s->http_->Start();
  s->evictor_ = std::thread([m = s->master_.get()] { m->index().RunEvictor(); });
  s->ticker_ = std::thread([srv = s.get(), interval = config.check_interval] { srv->TickLoop(interval); });
  return s;
}

void MasterServer::TickLoop(absl::Duration interval) {
  auto period = absl::ToChronoMilliseconds(interval);
  MutexLock lock(&mu_);
  while (!stopping_) {
    stop_cv_.WaitFor(&mu_, period);
    if (stopping_) break;
    mu_.Unlock();
    master_->Tick();
    mu_.Lock();
  }
}

void MasterServer::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  stop_cv_.SignalAll();
  if (http_) http_->Stop();
  // No connection reaches gRPC once it is shut down.
  if (direct_) direct_->StopAccepting();
  if (grpc_) grpc_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (rpc_) rpc_->Stop();
  if (direct_) direct_->Stop();
  if (ticker_.joinable()) ticker_.join();
  if (master_) master_->index().StopEvictor();
  if (evictor_.joinable()) evictor_.join();
  if (master_) {
    if (absl::Status st = master_->Flush(); !st.ok()) TKV_LOG(ERROR) << "flush at shutdown: " << st;
  }
}

MasterServer::~MasterServer() { Shutdown(); }

}  // namespace tierkv::master
