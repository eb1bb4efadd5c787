#include "store/daemon.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/strings/str_split.h"
#include "base/auth.h"
#include "base/http_server.h"
#include "base/log.h"
#include "base/status.h"
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

// How long a starting daemon waits for masters it must find (etcd://) or
// ask for the metadata URL; a service manager restarts it after that.
constexpr absl::Duration kMasterWait = absl::Minutes(5);

}  // namespace

absl::StatusOr<std::unique_ptr<StoreDaemon>> StoreDaemon::Start(const StoreConfig& config) {
  ASSIGN_OR_RETURN(std::vector<int> caller_cpus, PinToNode(static_cast<int>(config.numa_node)));
  absl::Cleanup restore = [&caller_cpus] {
    if (!caller_cpus.empty()) (void)transport::PinThisThread(caller_cpus);
  };
  std::unique_ptr<StoreDaemon> d(new StoreDaemon());
  RETURN_IF_ERROR(auth::CheckBind(config.auth, config.listen, config.insecure_allow_remote, "tierkv-store"));
  client::MasterClientOptions mo;
  ASSIGN_OR_RETURN(mo.token, auth::ReadTokenFile(config.token_file));
  mo.tls = {config.tls_ca, config.tls_cert, config.tls_key};
  // Masters found in etcd (or asked for the metadata URL) may not be up
  // yet when the daemon starts, as on a host that starts everything at
  // once: wait for them, a bounded time, saying so.
  std::string metadata_url;
  const absl::Time give_up = absl::Now() + kMasterWait;
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<std::unique_ptr<client::MasterClient>> master = client::MasterClient::Create(config.master, mo);
    absl::StatusOr<std::string> url =
        master.ok() ? client::MetadataUrl(config.metadata, config.master, absl::Seconds(5), mo.token, mo.tls)
                    : absl::StatusOr<std::string>(master.status());
    if (url.ok()) {
      d->master_ = std::move(*master);
      metadata_url = std::move(*url);
      break;
    }
    const bool transient =
        absl::IsUnavailable(url.status()) || absl::IsNotFound(url.status()) || absl::IsDeadlineExceeded(url.status());
    if (!transient || absl::Now() > give_up) return url.status();
    if (attempt == 0) {
      TKV_LOG(WARNING) << "waiting up to " << absl::FormatDuration(kMasterWait) << " for the masters: " << url.status();
    }
    absl::SleepFor(absl::Seconds(1));
  }
  transport::EngineOptions eo;
  ASSIGN_OR_RETURN(std::unique_ptr<transport::MetadataClient> metadata,
                   transport::NewHttpMetadata(
                       metadata_url, absl::Seconds(5), mo.token, mo.tls,
                       client::MetadataRefresher(config.metadata, config.master, absl::Seconds(5), mo.token, mo.tls)));
  eo.metadata = std::move(metadata);
  for (absl::string_view t : absl::StrSplit(config.transport, ',', absl::SkipWhitespace())) {
    eo.transports.emplace_back(t);
  }
  for (absl::string_view t : absl::StrSplit(config.rdma_devices, ',', absl::SkipWhitespace())) {
    eo.backend.rdma_devices.emplace_back(t);
  }
  eo.backend.listen = config.listen;
  eo.backend.tls = mo.tls;
  eo.backend.serve_tls = config.data_tls;
  eo.data_grants = config.auth != "none";  // token or mtls
  eo.backend.advertise = config.host;
  eo.backend.port = static_cast<int>(config.port);
  eo.backend.connections = static_cast<int>(config.connections);
  eo.backend.max_connections = static_cast<int>(config.max_connections);
  eo.backend.io_threads = static_cast<int>(config.io_threads);
  eo.backend.idle_timeout = config.idle_timeout;
  eo.backend.frame_timeout = config.frame_timeout;
  eo.backend.handshake_timeout = config.handshake_timeout;
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
  StoreDaemon* self = d.get();
  // The tier first: the first mount must name it, or the master would
  // drop the replicas it kept for this tier.
  RETURN_IF_ERROR(d->OpenSsd(config));
  lo.describe_tier = [self](v1::Segment* s) { self->DescribeTier(s); };
  if (d->ssd_ != nullptr) {
    lo.keep_ssd_on_stop = true;
    lo.on_mounted = [self] {
      MutexLock lock(&self->sync_mu_);
      self->list_pending_ = true;
      self->sync_cv_.Signal();
    };
  }
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
  if (d->ssd_ != nullptr) d->sync_thread_ = std::thread([self] { self->SyncLoop(); });

  d->RegisterMetrics();
  // With a certificate of our own the HTTP port is HTTPS: its tier orders
  // are signed with grants, so it asks no client certificate.
  d->http_ = std::make_unique<HttpServer>(
      HttpServer::Options{.threads = 2, .max_connections = 1024, .tls = {"", config.tls_cert, config.tls_key}});
  RETURN_IF_ERROR(d->http_->tls_status());
  StoreDaemon* raw = d.get();
  d->http_->Get("/ready", [raw](const httplib::Request&, httplib::Response& res) {
    bool ready = raw->ready();
    res.status = ready ? 200 : 503;
    std::string body = "ready\n";
    if (!ready && raw->lender_->mounted()) body = "mounted; SSD records not yet listed to the master\n";
    if (!ready && !raw->lender_->mounted()) {
      const std::string why = raw->lender_->last_error();
      body = why.empty() ? "not mounted\n" : absl::StrCat("not mounted: ", why, "\n");
    }
    res.set_content(body, "text/plain");
  });
  // 200 while the daemon serves (its DRAM at least); the body's second
  // line says whether the SSD tier is with it.
  d->http_->Get("/health", [raw](const httplib::Request&, httplib::Response& res) {
    res.set_content(absl::StrCat("ok\nssd: ", raw->SsdHealth(), "\n"), "text/plain");
  });
  d->http_->Get("/metrics", [raw](const httplib::Request&, httplib::Response& res) {
    res.set_content(raw->metrics_.Serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  d->http_->Post("/tier/offload", [raw](const httplib::Request& req, httplib::Response& res) {
    raw->ServeTierMove(req, res, /*offload=*/true);
  });
  d->http_->Post("/tier/stage", [raw](const httplib::Request& req, httplib::Response& res) {
    raw->ServeTierMove(req, res, /*offload=*/false);
  });
  // Room for a batch of tier moves (keys up to 4 KiB each).
  d->http_->set_payload_max_length(4 << 20);
  d->http_port_ = d->http_->Bind(config.listen, static_cast<int>(config.http_port));
  if (d->http_port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", config.listen, ":", config.http_port));
  }
  d->http_->Start();
  if (d->ssd_ != nullptr) {
    // An IPv6 literal goes in brackets, as a URL needs it.
    const std::string& host = d->engine_->advertised_address();
    const bool v6 = absl::StrContains(host, ':') && !absl::StartsWith(host, "[");
    d->tier_http_ = auth::HttpUrl(absl::StrCat(v6 ? "[" : "", host, v6 ? "]" : "", ":", d->http_port_),
                                  d->http_->tls());
    d->tier_ready_.store(true, std::memory_order_release);
  }
  return d;
}

absl::Status StoreDaemon::OpenSsd(const StoreConfig& config) {
  if (config.ssd_dir.empty()) return absl::OkStatus();
  ssd_configured_ = true;
  std::error_code ec;
  std::filesystem::create_directories(config.ssd_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("--ssd-dir ", config.ssd_dir, ": ", ec.message()));
  }
  // The region size is part of the file's format (the scan starts a chain
  // at each region), so the size the file was made with wins over a later
  // flag.
  uint64_t region_size = config.ssd_region_size;
  std::filesystem::path layout = std::filesystem::path(config.ssd_dir) / "tierkv-ssd.layout";
  std::filesystem::path data = std::filesystem::path(config.ssd_dir) / "tierkv-ssd.dat";
  std::string id;
  bool have_layout = false;
  if (std::ifstream in(layout); in) {
    have_layout = true;
    for (std::string line; std::getline(in, line);) {
      absl::string_view value = line;
      uint64_t stored = 0;
      if (absl::ConsumePrefix(&value, "region_size=") && absl::SimpleAtoi(value, &stored) &&
          stored >= io::kIoAlign && stored % io::kIoAlign == 0) {
        if (stored != region_size) {
          TKV_LOG(WARNING) << "--ssd-region-size " << region_size << " ignored: " << config.ssd_dir
                           << " was made with regions of " << stored << " bytes";
        }
        region_size = stored;
      } else if (absl::ConsumePrefix(&value, "ssd_id=")) {
        id = std::string(value);
      }
    }
  }
  // A new file (or a layout from before ids) gets a new id: replicas the
  // master holds for another file must not be taken for this one's.
  if (!have_layout || id.empty() || !std::filesystem::exists(data, ec)) {
    id = client::RandomId();
    std::ofstream out(layout, std::ios::trunc);
    out << "region_size=" << region_size << "\nssd_id=" << id << "\n";
    if (!out.flush()) return absl::FailedPreconditionError(absl::StrCat("--ssd-dir ", config.ssd_dir, ": cannot write ", layout.string()));
  }
  io::FileIoOptions fo;
  fo.path = data.string();
  fo.size = config.ssd_size / io::kIoAlign * io::kIoAlign;
  fo.direct = config.ssd_direct;
  absl::StatusOr<std::unique_ptr<io::FileIo>> file = io::OpenUringFile(fo);
  if (!file.ok()) {
    if (!absl::IsResourceExhausted(file.status())) return Annotate(file.status(), "--ssd-dir");
    ssd_failure_ = std::string(file.status().message());
  } else {
    SsdTierOptions so;
    so.region_size = region_size;
    so.high_watermark = config.ssd_high_watermark;
    so.low_watermark = config.ssd_low_watermark;
    so.slow_io = config.ssd_slow_io;
    so.on_drop = [this](const std::string& key) { OnSsdDrop(key); };
    absl::StatusOr<std::unique_ptr<SsdTier>> tier = SsdTier::Open(std::move(*file), so);
    if (tier.ok()) {
      ssd_ = std::move(*tier);
      ssd_id_ = id;
      SsdStats st = ssd_->Stats();
      TKV_LOG(INFO) << "SSD tier at " << fo.path << ": " << FormatSize(st.capacity) << ", " << st.recovered
                    << " records found, " << st.torn << " torn skipped" << (st.direct ? "" : ", buffered I/O");
      return absl::OkStatus();
    }
    if (absl::IsInvalidArgument(tier.status())) return Annotate(tier.status(), "--ssd-size");
    ssd_failure_ = std::string(tier.status().message());
  }
  TKV_LOG(ERROR) << "SSD tier at " << config.ssd_dir << " is down: " << ssd_failure_ << "; serving DRAM only";
  return absl::OkStatus();
}

namespace {

// OK when [offset, offset+length) lies inside a segment of `size` bytes.
absl::Status CheckExtent(const TierMove& m, uint64_t size) {
  if (m.length == 0 || m.offset > size || m.length > size - m.offset) {
    return absl::InvalidArgumentError(absl::StrCat("extent ", m.offset, "+", m.length, " outside the segment of ", size,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

absl::Status NoTier(bool configured, const std::string& failure) {
  return absl::UnavailableError(configured ? absl::StrCat("SSD tier failed: ", failure) : "no SSD tier (--ssd-dir)");
}

}  // namespace

std::vector<absl::Status> StoreDaemon::OffloadToSsd(const std::vector<TierMove>& moves) {
  std::vector<absl::Status> out(moves.size());
  if (ssd_ == nullptr) return std::vector<absl::Status>(moves.size(), NoTier(ssd_configured_, ssd_failure_));
  std::vector<SsdWrite> writes;
  std::vector<size_t> at;
  for (size_t i = 0; i < moves.size(); ++i) {
    out[i] = CheckExtent(moves[i], lender_->size());
    if (!out[i].ok()) continue;
    writes.push_back({moves[i].key, lender_->data() + moves[i].offset, moves[i].length});
    at.push_back(i);
  }
  std::vector<absl::Status> got = ssd_->WriteBatch(writes);
  for (size_t j = 0; j < at.size(); ++j) out[at[j]] = got[j];
  return out;
}

std::vector<absl::StatusOr<uint64_t>> StoreDaemon::StageFromSsd(const std::vector<TierMove>& moves,
                                                                 std::chrono::steady_clock::time_point deadline) {
  std::vector<absl::StatusOr<uint64_t>> out(moves.size(), uint64_t{0});
  if (ssd_ == nullptr) {
    return std::vector<absl::StatusOr<uint64_t>>(moves.size(), NoTier(ssd_configured_, ssd_failure_));
  }
  std::vector<SsdRead> reads;
  std::vector<size_t> at;
  for (size_t i = 0; i < moves.size(); ++i) {
    if (absl::Status s = CheckExtent(moves[i], lender_->size()); !s.ok()) {
      out[i] = s;
      continue;
    }
    reads.push_back({moves[i].key, lender_->data() + moves[i].offset, moves[i].length, deadline});
    at.push_back(i);
  }
  std::vector<absl::StatusOr<uint64_t>> got = ssd_->ReadBatch(reads);
  for (size_t j = 0; j < at.size(); ++j) out[at[j]] = got[j];
  return out;
}

void StoreDaemon::DescribeTier(v1::Segment* s) const {
  if (ssd_ == nullptr) return;
  s->set_ssd_id(ssd_id_);
  if (!tier_ready_.load(std::memory_order_acquire)) return;
  s->set_tier_http(tier_http_);
  TierSize(s);
}

template <class Message>
void StoreDaemon::TierSize(Message* m) const {
  const SsdStats st = ssd_->Stats();
  m->set_ssd_capacity(st.failed ? 0 : st.capacity);  // a failed tier takes no offloads
  m->set_ssd_used(st.used);
}

void StoreDaemon::ServeTierMove(const httplib::Request& req, httplib::Response& res, bool offload) {
  // With --auth token the segment has a data key: orders that copy between
  // the tier and served memory need the same grant a transfer does, and
  // offloads, which erase and write records by name, the master's own key.
  absl::StatusOr<std::string> key = engine_->SegmentDataKey(lender_->name());
  const bool needs_leave = key.ok() && !key->empty();
  if (!key.ok() || !key->empty()) {
    absl::Status ok = key.ok() ? auth::CheckTierRequest(*key, req, absl::Now(),
                                                        offload ? auth::TierSigner::kMaster : auth::TierSigner::kGrantHolder)
                               : key.status();
    if (!ok.ok()) {
      res.status = 401;
      res.set_content(absl::StrCat(ok.message(), "\n"), "text/plain");
      return;
    }
  }
  v1::TierMoveRequest in;
  if (!in.ParseFromString(req.body)) {
    res.status = 400;
    res.set_content("not a TierMoveRequest\n", "text/plain");
    return;
  }
  std::vector<TierMove> moves;
  moves.reserve(in.items_size());
  for (const v1::TierMoveItem& it : in.items()) moves.push_back({it.key(), it.offset(), it.length()});
  v1::TierMoveResponse out;
  auto put = [&out](const absl::Status& st) {
    v1::ItemStatus* s = out.add_status();
    if (st.ok()) return;
    s->set_code(static_cast<int>(st.code()));
    s->set_message(std::string(st.message()));
  };
  if (offload) {
    // The master's order carries the key's current value: a record an
    // earlier value of the key left behind gives way to it.
    if (ssd_ != nullptr) {
      for (const TierMove& m : moves) {
        if (ssd_->SizeOf(m.key)) (void)ssd_->Erase(m.key);
      }
    }
    for (const absl::Status& st : OffloadToSsd(moves)) put(st);
  } else {
    // The reader says how long its extent stays its own (the rest of its
    // lease, header X-Tierkv-Stage-Within-Ms); past that the extent is
    // left alone, so the master may reuse it soon after the lease.
    auto deadline = std::chrono::steady_clock::time_point::max();
    int64_t within_ms = 0;
    if (absl::SimpleAtoi(req.get_header_value("X-Tierkv-Stage-Within-Ms"), &within_ms) && within_ms >= 0) {
      // Leases run seconds; a day bounds the sum below the clock's range.
      constexpr int64_t kLongestMs = 24 * 3600 * 1000;
      deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::min(within_ms, kLongestMs));
    }
    // A grant for the segment is not leave to stage a given object: each
    // item needs the master's leave for its key, extent and lease, so no
    // tenant can copy another's record into memory it reads.
    std::vector<absl::StatusOr<uint64_t>> got(moves.size(), absl::InternalError("not staged"));
    std::vector<TierMove> allowed;
    std::vector<size_t> at;
    for (size_t i = 0; i < moves.size(); ++i) {
      const v1::TierMoveItem& it = in.items(static_cast<int>(i));
      absl::Status leave = needs_leave ? auth::CheckStageProof(*key, it.key(), it.offset(), it.length(),
                                                               it.expiry_unix_ms(), it.proof(), absl::Now())
                                       : absl::OkStatus();
      if (!leave.ok()) {
        got[i] = leave;
        continue;
      }
      allowed.push_back(moves[i]);
      at.push_back(i);
    }
    // And no write lands past the earliest leave's expiry, whatever the
    // order's own header says.
    const absl::Time now = absl::Now();
    for (size_t j : at) {
      const int64_t expiry = in.items(static_cast<int>(j)).expiry_unix_ms();
      if (!needs_leave || expiry <= 0) continue;
      const auto left = std::chrono::milliseconds(std::max<int64_t>(0, absl::ToInt64Milliseconds(absl::FromUnixMillis(expiry) - now)));
      deadline = std::min(deadline, std::chrono::steady_clock::now() + left);
    }
    std::vector<absl::StatusOr<uint64_t>> staged = StageFromSsd(allowed, deadline);
    for (size_t j = 0; j < at.size() && j < staged.size(); ++j) got[at[j]] = std::move(staged[j]);
    for (size_t i = 0; i < got.size(); ++i) {
      // The reader's extent is the object's size: a record of another
      // size is not this object's value.
      // A record the master believes in but the tier lacks: tell it, so
      // readers stop being sent here for it.
      if (absl::IsNotFound(got[i].status()) && ssd_ != nullptr) OnSsdDrop(moves[i].key);
      if (got[i].ok() && *got[i] != moves[i].length) {
        put(absl::FailedPreconditionError(
            absl::StrCat("the record of ", moves[i].key, " holds ", *got[i], " bytes, not ", moves[i].length)));
      } else {
        put(got[i].status());
      }
    }
  }
  res.set_content(out.SerializeAsString(), "application/x-protobuf");
}

std::string StoreDaemon::SsdHealth() const {
  if (!ssd_configured_) return "off";
  if (ssd_ == nullptr) return absl::StrCat("failed: ", ssd_failure_);
  SsdStats st = ssd_->Stats();
  if (st.failed) return absl::StrCat("failed: ", st.failure);
  return absl::StrCat("ok ", st.records, " records, ", st.used, "/", st.capacity, " bytes",
                      st.direct ? "" : ", buffered I/O");
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
  if (ssd_configured_) RegisterSsdMetrics();
}

void StoreDaemon::RegisterSsdMetrics() {
  auto gauge = [this](const char* name, const char* help) -> metrics::Gauge& {
    return metrics::BuildGauge().Name(name).Help(help).Register(metrics_).Add({});
  };
  auto& failed = gauge("tierkv_store_ssd_failed", "1 while the SSD tier is down (the daemon serves DRAM only)");
  auto& capacity = gauge("tierkv_store_ssd_capacity_bytes", "Bytes of the SSD tier's file usable for records");
  auto& used = gauge("tierkv_store_ssd_used_bytes", "Bytes of values held on the SSD tier");
  auto& records = gauge("tierkv_store_ssd_records", "Values held on the SSD tier");
  auto& regions = gauge("tierkv_store_ssd_regions_in_use", "SSD regions holding records");
  auto& direct = gauge("tierkv_store_ssd_direct_io", "1 when the SSD file is read and written with O_DIRECT");
  auto& recovered = gauge("tierkv_store_ssd_recovered_records", "Records the start-up scan found");
  auto& torn = gauge("tierkv_store_ssd_torn_records",
                     "Torn group blocks (each a batch of records) the start-up scan skipped");
  auto& events = metrics::BuildCounter()
                     .Name("tierkv_store_ssd_records_dropped_total")
                     .Help("SSD records dropped by the tier, by reason (reclaim, corrupt)")
                     .Register(metrics_);
  auto& refreshed = metrics::BuildCounter()
                        .Name("tierkv_store_ssd_records_refreshed_total")
                        .Help("SSD records read in a region soon to be reclaimed, and re-appended")
                        .Register(metrics_)
                        .Add({});
  auto& bytes = metrics::BuildCounter()
                    .Name("tierkv_store_ssd_bytes_total")
                    .Help("Value bytes moved to and from the SSD tier, by direction")
                    .Register(metrics_);
  metrics_.AddCollectHook([this, &failed, &capacity, &used, &records, &regions, &direct, &recovered, &torn,
                           &events, &refreshed, &bytes] {
    auto catch_up = [](metrics::Counter& c, uint64_t v) {
      if (static_cast<double>(v) > c.Value()) c.Increment(static_cast<double>(v) - c.Value());
    };
    SsdStats st;
    if (ssd_ != nullptr) st = ssd_->Stats();
    failed.Set(ssd_ == nullptr || st.failed ? 1 : 0);
    capacity.Set(static_cast<double>(st.capacity));
    used.Set(static_cast<double>(st.used));
    records.Set(static_cast<double>(st.records));
    regions.Set(static_cast<double>(st.regions_in_use));
    direct.Set(st.direct ? 1 : 0);
    recovered.Set(static_cast<double>(st.recovered));
    torn.Set(static_cast<double>(st.torn));
    catch_up(events.Add({{"reason", "reclaim"}}), st.reclaimed);
    catch_up(events.Add({{"reason", "corrupt"}}), st.corrupt);
    catch_up(refreshed, st.refreshed);
    catch_up(bytes.Add({{"direction", "read"}}), st.bytes_read);
    catch_up(bytes.Add({{"direction", "write"}}), st.bytes_written);
  });
}

void StoreDaemon::OnSsdDrop(const std::string& key) {
  MutexLock lock(&sync_mu_);
  // Past a bound a listing says it all at once.
  if (gone_.size() >= (1u << 20)) {
    gone_.clear();
    list_pending_ = true;
  } else {
    gone_.push_back(key);
  }
  sync_cv_.Signal();
}

void StoreDaemon::SyncLoop() {
  MutexLock lock(&sync_mu_);
  while (!sync_stop_) {
    // The listing names the tier's HTTP address, known once it serves.
    const bool ready = tier_ready_.load(std::memory_order_acquire);
    if (!ready || (!list_pending_ && gone_.empty())) {
      sync_cv_.WaitFor(&sync_mu_, std::chrono::milliseconds(ready ? 1000 : 10));
      continue;
    }
    const bool list = list_pending_;
    // The lender counts a mount before it asks for this listing.
    const uint64_t for_mount = lender_->mounts();
    list_pending_ = false;
    std::vector<std::string> gone;
    gone.swap(gone_);  // a listing taken after these drops supersedes them
    sync_mu_.Unlock();
    bool sent = list ? SendListing() : SendGone(gone);
    sync_mu_.Lock();
    if (sent && list) listed_mount_.store(for_mount, std::memory_order_release);
    if (!sent) {
      if (list) {
        list_pending_ = true;
      } else if (gone_.size() + gone.size() <= (1u << 20)) {
        gone_.insert(gone_.end(), gone.begin(), gone.end());
      } else {
        list_pending_ = true;
      }
      sync_cv_.WaitFor(&sync_mu_, std::chrono::seconds(1));  // the master is away: try once a second
    }
  }
}

bool StoreDaemon::SendListing() {
  if (ssd_->failed()) return true;  // nothing to list; the heartbeat says the tier is down
  std::vector<std::pair<std::string, uint64_t>> records = ssd_->Records();
  v1::SsdRecordsRequest req;
  req.set_segment(lender_->name());
  req.set_incarnation(lender_->incarnation());
  req.set_listing(++listing_seq_);
  req.set_tier_http(tier_http_);
  TierSize(&req);
  constexpr size_t kBatch = 8192;
  uint64_t erased = 0, confirmed = 0;
  size_t i = 0;
  do {
    req.clear_present();
    for (size_t end = std::min(records.size(), i + kBatch); i < end; ++i) {
      v1::SsdRecord* r = req.add_present();
      r->set_key(records[i].first);
      r->set_size(records[i].second);
    }
    req.set_complete(i == records.size());
    absl::StatusOr<v1::SsdRecordsResponse> resp = master_->SyncSsdRecords(req);
    if (resp.ok() && resp->has_status()) resp = client::FromItem(resp->status());
    if (!resp.ok()) {
      TKV_LOG(WARNING) << "listing SSD records to the master: " << resp.status();
      return false;
    }
    confirmed += resp->confirmed();
    for (const std::string& k : resp->unknown()) erased += ssd_->Erase(k).ok() ? 1 : 0;
  } while (i < records.size());
  listings_done_.fetch_add(1);
  TKV_LOG(INFO) << "SSD records listed to the master: " << confirmed << " kept, " << erased
                << " erased (no replica in the index)";
  return true;
}

bool StoreDaemon::SendGone(const std::vector<std::string>& gone) {
  if (gone.empty()) return true;
  v1::SsdRecordsRequest req;
  req.set_segment(lender_->name());
  req.set_incarnation(lender_->incarnation());
  for (const std::string& k : gone) req.add_gone(k);
  absl::StatusOr<v1::SsdRecordsResponse> resp = master_->SyncSsdRecords(req);
  if (resp.ok() && resp->has_status()) resp = client::FromItem(resp->status());
  if (resp.ok()) return true;
  TKV_LOG(WARNING) << "reporting " << req.gone_size() << " dropped SSD records: " << resp.status();
  // Not mounted so: the listing after the next mount covers them.
  return absl::IsFailedPrecondition(resp.status());
}

void StoreDaemon::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (sync_thread_.joinable()) {
    {
      MutexLock lock(&sync_mu_);
      sync_stop_ = true;
    }
    sync_cv_.SignalAll();
    sync_thread_.join();
  }
  if (lender_) lender_->Stop();  // unmount first: clients stop choosing us
  if (http_) http_->Stop();
  lender_.reset();
  engine_.reset();
  ssd_.reset();
}

StoreDaemon::~StoreDaemon() { Stop(); }

}  // namespace tierkv::store
