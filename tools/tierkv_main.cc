// tierkv: the demo and trace replay (engine/replay.h) against a cluster
// given by --master, or an embedded one; and `sim`, the offline page-level
// eviction simulator (engine/eviction_sim.h).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include <csignal>

#include "base/http_server.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "config/units.h"
#include "config/tierkv_config.h"
#include "absl/strings/str_format.h"
#include "engine/eviction_sim.h"
#include "engine/pd.h"
#include "engine/replay.h"
#include "httplib.h"
#include "tools/embedded.h"

namespace tierkv {
namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "tierkv: %s\n", what.c_str());
  return 1;
}

struct Session {
  std::unique_ptr<tools::EmbeddedCluster> cluster;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<engine::TierkvL3> l3;
};

absl::StatusOr<Session> Connect(const TierkvConfig& c, const tools::EmbeddedSsd& ssd = {}) {
  Session s;
  client::ClientOptions o;
  if (c.master.empty()) {
    auto cluster = tools::EmbeddedCluster::Start(static_cast<int>(c.daemons), c.store_size, c.transport,
                                                 c.eviction_policy, ssd);
    if (!cluster.ok()) return cluster.status();
    s.cluster = std::move(*cluster);
    o.master = s.cluster->master_address();
    o.metadata = s.cluster->metadata_url();
  } else {
    o.master = c.master;
    o.metadata = c.metadata;  // empty: client::MetadataUrl's choice
    o.token_file = c.token_file;
    o.tls = {c.tls_ca, c.tls_cert, c.tls_key};
  }
  for (absl::string_view t : absl::StrSplit(c.transport, ',', absl::SkipWhitespace())) o.transports.emplace_back(t);
  o.transfer_timeout = absl::Seconds(5);
  o.rpc_timeout = absl::Seconds(2);
  auto cli = client::Client::Create(o);
  if (!cli.ok()) return cli.status();
  s.client = std::move(*cli);
  s.l3 = std::make_unique<engine::TierkvL3>(s.client.get(), c.parent_keys);
  return s;
}

// A synthetic page's bytes, as the engine rounds them (engine.cc).
uint64_t SyntheticPageBytes(const TierkvConfig& c) {
  uint64_t unit = 8 * static_cast<uint64_t>(c.tp);
  return (c.kv_bytes_per_token * c.page_tokens + unit - 1) / unit * unit;
}

absl::StatusOr<engine::EngineConfig> EngineConfigFor(const TierkvConfig& c, bool synthetic) {
  engine::EngineConfig e;
  e.synthetic = synthetic;
  e.page_tokens = static_cast<int>(c.page_tokens);
  e.tp = static_cast<int>(c.tp);
  e.l1_pages = c.l1_pages;
  e.l2_pages = c.l2_pages;
  e.synthetic_bytes_per_token = c.kv_bytes_per_token;
  e.tokens_per_s = c.tokens_per_s;
  auto prefetch = engine::ParsePrefetchPolicy(c.prefetch);
  if (!prefetch.ok()) return prefetch.status();
  e.prefetch = *prefetch;
  e.prefetch_timeout = c.prefetch_timeout;
  auto write = engine::ParseWritePolicy(c.write_policy);
  if (!write.ok()) return write.status();
  e.write = *write;
  e.selective_hits = static_cast<int>(c.selective_hits);
  e.window = c.window;
  if (!synthetic && e.model.kv_heads % e.tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tp must divide the model's ", e.model.kv_heads, " KV heads"));
  }
  auto device = engine::NewDevice(c.l1_device);
  if (!device.ok()) return absl::InvalidArgumentError(absl::StrCat("--l1-device: ", device.status().message()));
  e.device = std::move(*device);
  return e;
}

// Serves the engines' (and an embedded master's) metrics while running, as
// one exposition: each engine's series carry its `engine` label. Every
// registry added must outlive the server.
class MetricsServer {
 public:
  explicit MetricsServer(int port) {
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      std::vector<metrics::Source> sources;
      {
        MutexLock lock(&mu_);
        sources = sources_;
      }
      res.set_content(metrics::SerializeAll(sources), "text/plain; version=0.0.4; charset=utf-8");
    });
    port_ = server_.Bind("127.0.0.1", port);
    if (port_ > 0) server_.Start();
  }
  ~MetricsServer() { server_.Stop(); }
  int port() const { return port_; }
  void Add(metrics::Registry* r, metrics::Labels labels = {}) {
    MutexLock lock(&mu_);
    sources_.push_back({r, std::move(labels)});
  }

 private:
  HttpServer server_{HttpServer::Options{.threads = 2}};
  Mutex mu_;
  std::vector<metrics::Source> sources_ ABSL_GUARDED_BY(mu_);
  int port_ = -1;
};

void WriteOutputs(const TierkvConfig& c, const engine::ReplayReport& r) {
  if (!c.csv.empty()) {
    if (absl::Status s = engine::WriteWindowCsv(r, c.csv); !s.ok()) Fail(s.ToString());
  }
  if (!c.svg.empty()) {
    if (absl::Status s = engine::WriteWindowSvg(r, c.svg); !s.ok()) Fail(s.ToString());
  }
}

// Prefill-to-decode replay (--pd): `prefills` prefill engines and the
// decode engine `decode`, all on the same store, each with a transfer
// engine in peer mode; the trace's prompts go to decode.
struct PdCluster {
  std::vector<std::unique_ptr<engine::InferenceEngine>> prefill_engines;
  std::vector<std::unique_ptr<transport::TransferEngine>> transfers;  // prefills', then decode's
  std::vector<std::unique_ptr<engine::PdPrefill>> prefills;
  std::unique_ptr<engine::PdDecode> decode;

  ~PdCluster() {
    decode.reset();
    prefills.clear();  // before the transfer engines and engines they use
    transfers.clear();
  }
};

absl::StatusOr<std::unique_ptr<PdCluster>> StartPd(const TierkvConfig& c, const engine::EngineConfig& ecfg,
                                                   engine::InferenceEngine* decode, engine::L3Store* l3) {
  auto pd = std::make_unique<PdCluster>();
  const int n = c.pd == "2P1D" ? 2 : 1;
  transport::EngineOptions o;
  o.peer_mode = true;
  for (absl::string_view t : absl::StrSplit(c.transport, ',', absl::SkipWhitespace())) o.transports.emplace_back(t);
  std::vector<std::string> sessions;
  for (int i = 0; i < n; ++i) {
    pd->prefill_engines.push_back(std::make_unique<engine::InferenceEngine>(ecfg, l3));
    ASSIGN_OR_RETURN(auto te, transport::TransferEngine::Create(o));
    ASSIGN_OR_RETURN(auto p, engine::PdPrefill::Create(pd->prefill_engines.back().get(), te.get()));
    sessions.push_back(te->session_id());
    pd->transfers.push_back(std::move(te));
    pd->prefills.push_back(std::move(p));
  }
  ASSIGN_OR_RETURN(auto te, transport::TransferEngine::Create(o));
  ASSIGN_OR_RETURN(pd->decode, engine::PdDecode::Create(decode, te.get(), sessions));
  pd->transfers.push_back(std::move(te));
  return pd;
}

// The raw engine between the P/D pair's pools, in the same run: the
// decode's L1 pool written from the first prefill's in one request.
double RawPdGBps(PdCluster& pd, engine::InferenceEngine& decode) {
  engine::KvPool& from = pd.prefill_engines[0]->cache().l1_pool();
  engine::KvPool& to = decode.cache().l1_pool();
  const uint64_t bytes = std::min(from.bytes(), to.bytes());
  transport::TransferEngine* prefill = pd.transfers[0].get();
  const std::string session = pd.transfers.back()->session_id();
  std::vector<transport::Request> one{
      {transport::Op::kWrite, from.base(), session, reinterpret_cast<uintptr_t>(to.base()), bytes}};
  (void)prefill->Transfer(one);  // warm: channel and pages
  const absl::Time t0 = absl::Now();
  constexpr int kRounds = 5;
  for (int i = 0; i < kRounds; ++i) {
    if (!prefill->Transfer(one)[0].ok()) return 0;
  }
  return kRounds * static_cast<double>(bytes) / absl::ToDoubleSeconds(absl::Now() - t0) / 1e9;
}

int Replay(const TierkvConfig& c) {
  bool synthetic = c.mode == "synthetic";
  auto ecfg = EngineConfigFor(c, synthetic);
  if (!ecfg.ok()) ExitWithUsageError("tierkv", ecfg.status().message());
  auto trace = engine::ReadTrace(c.trace, c.offset, c.requests);
  if (!trace.ok()) return Fail(std::string(trace.status().message()));
  const size_t max_prompt = c.max_prompt_tokens > 0 ? c.max_prompt_tokens : (synthetic ? 0 : 1536);
  TierkvConfig sized = c;
  tools::EmbeddedSsd ssd;
  ssd.admission = c.ssd_admission;
  if (!c.ssd_capacity.empty()) {
    auto caps = engine::ParseCapacities(c.ssd_capacity);
    if (!caps.ok() || caps->size() != 1) ExitWithUsageError("tierkv", "--ssd-capacity: one share, e.g. 1.0");
    if (!c.master.empty() || !synthetic) {
      ExitWithUsageError("tierkv", "--ssd-capacity sizes the embedded cluster in synthetic mode (no --master)");
    }
    engine::PageTrace pages = engine::BuildPageTrace(*trace, static_cast<int>(c.page_tokens), max_prompt);
    // A page on disk takes its record: a 64-byte header, the key (page
    // keys are under 128 bytes) and the value, padded to 4 KiB.
    const uint64_t record = (64 + 128 + SyntheticPageBytes(c) + 4095) / 4096 * 4096;
    ssd.size = static_cast<uint64_t>((*caps)[0] * pages.unique_pages * record / c.daemons);
  }
  if (!c.capacity.empty()) {
    // The embedded store holds this share of what the trace writes, the
    // same measure `tierkv sim` uses.
    auto caps = engine::ParseCapacities(c.capacity);
    if (!caps.ok() || caps->size() != 1) ExitWithUsageError("tierkv", "--capacity: replay takes one share, e.g. 0.1");
    if (!c.master.empty() || !synthetic) {
      ExitWithUsageError("tierkv", "--capacity sizes the embedded cluster in synthetic mode (no --master)");
    }
    engine::PageTrace pages = engine::BuildPageTrace(*trace, static_cast<int>(c.page_tokens), max_prompt);
    double total = (*caps)[0] * pages.unique_pages * SyntheticPageBytes(c);
    sized.store_size = std::max<uint64_t>(1 << 20, static_cast<uint64_t>(total / c.daemons));
  }
  auto session = Connect(sized, ssd);
  if (!session.ok()) return Fail(session.status().ToString());
  engine::InferenceEngine eng(*ecfg, session->l3.get());
  MetricsServer metrics(static_cast<int>(c.metrics_port));
  metrics.Add(&eng.metrics());
  if (session->cluster) metrics.Add(&session->cluster->master().master().metrics());
  if (!c.json) {
    std::printf("replaying %zu requests from %s (%s mode, L1 on %s); metrics at http://127.0.0.1:%d/metrics\n",
                trace->size(), c.trace.c_str(), c.mode.c_str(), eng.device().name().c_str(), metrics.port());
  }
  engine::ReplayOptions opts;
  opts.progress = c.progress && !c.json;
  opts.max_prompt_tokens = max_prompt;
  std::unique_ptr<PdCluster> pd;
  if (!c.pd.empty()) {
    absl::StatusOr<std::unique_ptr<PdCluster>> started = StartPd(c, *ecfg, &eng, session->l3.get());
    if (!started.ok()) return Fail(absl::StrCat("--pd: ", started.status().message()));
    pd = std::move(*started);
    opts.serve = [&pd](absl::Span<const int32_t> prompt) { return pd->decode->Serve(prompt); };
  }
  engine::ReplayReport r = engine::Replay(*trace, eng, opts);
  if (pd) {
    r.pd.shape = c.pd;
    r.pd.fallbacks = pd->decode->stats().fallbacks;
    r.pd.bytes = pd->decode->stats().bytes_received;
    r.pd.raw_GBps = RawPdGBps(*pd, eng);
    pd.reset();
  }
  if (session->cluster) {
    // The embedded store was this replay's alone: its evictions are ours.
    master::IndexStats st = session->cluster->master().master().index().Stats();
    r.store_evicted_pages = st.evictions / c.tp;
    r.store_offloaded_pages = st.offloaded / c.tp;
    r.store_ssd_reads = st.staged / c.tp;
    r.store_offload_failed = st.offload_failed / c.tp;
    r.store_stage_no_room = st.stage_no_room / c.tp;
    r.store_ssd_dropped = session->cluster->master().master().ssd_replicas_dropped() / c.tp;
  }
  WriteOutputs(c, r);
  if (c.json) {
    std::printf("%s\n", r.ToJson().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("%s", r.Table().c_str());
  }
  return 0;
}

// Page-level hit rates of every policy at each capacity, from the trace
// alone: what the store's policy can reach, in seconds.
int Sim(const TierkvConfig& c) {
  auto caps = engine::ParseCapacities(c.capacity.empty() ? "0.05,0.1,0.25,0.5" : c.capacity);
  if (!caps.ok()) ExitWithUsageError("tierkv", absl::StrCat("--capacity: ", caps.status().message()));
  auto trace = engine::ReadTrace(c.trace, c.offset, c.requests);
  if (!trace.ok()) return Fail(std::string(trace.status().message()));
  absl::Time t0 = absl::Now();
  engine::PageTrace pages =
      engine::BuildPageTrace(*trace, static_cast<int>(c.page_tokens), static_cast<size_t>(c.max_prompt_tokens));
  const uint64_t page_bytes = SyntheticPageBytes(c);
  const std::vector<std::string> policies = engine::SimPolicies();
  nlohmann::json runs = nlohmann::json::array();
  std::string table = absl::StrFormat("  %-9s %9s", "capacity", "pages");
  for (const std::string& p : policies) absl::StrAppendFormat(&table, " %9s", p);
  table += "\n";
  std::string churn = absl::StrFormat("  %-9s %9s", "capacity", "policy");
  absl::StrAppendFormat(&churn, " %10s %10s %10s %10s\n", "puts", "re-puts", "evictions", "evicted+asked");
  std::vector<engine::CapacitySeries> series(policies.size());
  for (size_t i = 0; i < policies.size(); ++i) series[i].name = policies[i];
  std::vector<double> sorted = *caps;
  std::sort(sorted.begin(), sorted.end());
  for (double cap : sorted) {
    size_t cap_pages = static_cast<size_t>(cap * pages.unique_pages);
    absl::StrAppendFormat(&table, "  %-9s %9zu", absl::StrFormat("%g %%", 100 * cap), cap_pages);
    for (size_t i = 0; i < policies.size(); ++i) {
      const std::string& p = policies[i];
      absl::StatusOr<engine::SimResult> r = engine::Simulate(pages, p, cap_pages);
      if (!r.ok()) return Fail(r.status().ToString());
      series[i].points.emplace_back(cap, r->hit_rate);
      absl::StrAppendFormat(&table, " %8.1f%%", 100 * r->hit_rate);
      absl::StrAppendFormat(&churn, "  %-9s %9s %10d %10d %10d %10d\n", absl::StrFormat("%g %%", 100 * cap), p,
                            r->puts, r->reputs, r->evictions, r->evicted_reused);
      runs.push_back({{"capacity", cap},
                      {"capacity_pages", cap_pages},
                      {"policy", p},
                      {"hit_rate", r->hit_rate},
                      {"puts", r->puts},
                      {"reputs", r->reputs},
                      {"evictions", r->evictions},
                      {"evicted_reused", r->evicted_reused}});
    }
    table += "\n";
  }
  double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  if (!c.svg.empty()) {
    // What an unlimited store would hit: every policy at full size.
    absl::StatusOr<engine::SimResult> all = engine::Simulate(pages, "lru", pages.unique_pages);
    absl::Status st = engine::WriteCapacitySvg(
        series, all.ok() ? all->hit_rate : 0,
        absl::StrCat("store hit rate against capacity by eviction policy (", c.trace, ")"), c.svg);
    if (!st.ok()) return Fail(st.ToString());
  }
  if (c.json) {
    std::printf("%s\n", nlohmann::json{{"trace", c.trace},
                                       {"requests", pages.requests.size()},
                                       {"page_tokens", c.page_tokens},
                                       {"pages_written", pages.unique_pages},
                                       {"bytes_written", pages.unique_pages * page_bytes},
                                       {"runs", runs}}
                            .dump()
                            .c_str());
    return 0;
  }
  std::printf("tierkv sim: %s, %zu requests, %lld-token pages, %zu pages written (%s at %s a page); "
              "hit rate of prompt tokens\n\n%s\n%s\n  (%.1f s)\n",
              c.trace.c_str(), pages.requests.size(), static_cast<long long>(c.page_tokens), pages.unique_pages,
              FormatSize(pages.unique_pages * page_bytes).c_str(), FormatSize(page_bytes).c_str(), table.c_str(),
              churn.c_str(), secs);
  return 0;
}

// The demo: worker A (the small model) serves a first batch cold and
// offloads its KV to tierkv; worker B, a fresh engine as on another GPU,
// serves the same batch from tierkv and must produce bit-identical logits;
// then the rest of the trace replays in synthetic mode at full length.
struct PdDemo {
  bool identical = false;
  size_t pages = 0;
  uint64_t bytes = 0;
  double transfer_s = 0;
  double exposed_s = 0;
  std::string error;
};

// One request through a prefill engine and a decode engine (no store, so
// every page crosses), against `want`, the logits of a local prefill.
PdDemo PdDemoRequest(const TierkvConfig& c, const engine::EngineConfig& ecfg, const engine::TraceRequest& request,
                     size_t cut, const std::vector<float>& want) {
  PdDemo out;
  std::vector<int32_t> prompt = engine::PromptTokens(request, ecfg.model.vocab, cut);
  if (prompt.empty()) {
    out.error = "no request to send";
    return out;
  }
  engine::InferenceEngine prefill_engine(ecfg, nullptr), decode_engine(ecfg, nullptr);
  transport::EngineOptions o;
  o.peer_mode = true;
  for (absl::string_view t : absl::StrSplit(c.transport, ',', absl::SkipWhitespace())) o.transports.emplace_back(t);
  auto prefill_te = transport::TransferEngine::Create(o);
  auto decode_te = transport::TransferEngine::Create(o);
  if (!prefill_te.ok() || !decode_te.ok()) {
    out.error = std::string((prefill_te.ok() ? decode_te.status() : prefill_te.status()).message());
    return out;
  }
  auto prefill = engine::PdPrefill::Create(&prefill_engine, prefill_te->get());
  if (!prefill.ok()) {
    out.error = std::string(prefill.status().message());
    return out;
  }
  auto decode = engine::PdDecode::Create(&decode_engine, decode_te->get(), {(*prefill_te)->session_id()});
  if (!decode.ok()) {
    out.error = std::string(decode.status().message());
    return out;
  }
  engine::RequestResult r = (*decode)->Serve(prompt);
  if (!r.pd) out.error = (*decode)->stats().last_error;
  out.identical = r.pd && r.logits == want;
  out.pages = (*decode)->stats().pages_received;
  out.bytes = (*decode)->stats().bytes_received;
  out.transfer_s = r.pd_transfer_s;
  out.exposed_s = r.pd_exposed_s;
  decode->reset();
  prefill->reset();
  return out;
}

int Demo(TierkvConfig c) {
  size_t total = c.requests > 0 ? c.requests : 0;
  auto trace = engine::ReadTrace(c.trace, c.offset, total);
  if (!trace.ok()) return Fail(std::string(trace.status().message()));
  size_t model_n = std::min<size_t>(c.model_requests, trace->size());
  auto session = Connect(c);
  if (!session.ok()) return Fail(session.status().ToString());
  auto mcfg = EngineConfigFor(c, false);
  auto scfg = EngineConfigFor(c, true);
  if (!mcfg.ok()) ExitWithUsageError("tierkv", mcfg.status().message());
  if (!scfg.ok()) ExitWithUsageError("tierkv", scfg.status().message());
  scfg->device = mcfg->device;  // one device (one set of streams) for all
  engine::InferenceEngine worker_a(*mcfg, session->l3.get());
  engine::InferenceEngine worker_b(*mcfg, session->l3.get());
  std::optional<engine::InferenceEngine> synth;  // made in phase 3; declared here to outlive the server
  MetricsServer metrics(static_cast<int>(c.metrics_port));
  metrics.Add(&worker_a.metrics(), {{"engine", "a"}});
  if (session->cluster) metrics.Add(&session->cluster->master().master().metrics());
  const long long cut = c.max_prompt_tokens > 0 ? c.max_prompt_tokens : 1536;
  if (!c.json) {
    std::printf("tierkv demo: embedded cluster (master %s, %zu store daemons of %s); metrics at "
                "http://127.0.0.1:%d/metrics\n",
                session->cluster ? session->cluster->master_address().c_str() : c.master.c_str(),
                session->cluster ? session->cluster->daemons() : 0, FormatSize(c.store_size).c_str(), metrics.port());
    std::printf("\n[1/4] worker A, small transformer (%d layers, hidden %d, L1 and attention on %s): first %zu "
                "requests cold, prompts cut to %lld tokens\n",
                mcfg->model.layers, mcfg->model.hidden, mcfg->device->name().c_str(), model_n, cut);
  }
  engine::ReplayOptions opts;
  opts.progress = c.progress && !c.json;
  opts.max_prompt_tokens = cut;
  std::vector<std::vector<float>> logits(model_n);
  engine::SeenPages seen;  // A's pages count toward B's bound
  opts.seen = &seen;
  opts.after_request = [&](size_t i, const engine::RequestResult& r) { logits[i] = r.logits; };
  std::vector<engine::TraceRequest> first(trace->begin(), trace->begin() + model_n);
  engine::ReplayReport ra = engine::Replay(first, worker_a, opts);
  if (!c.json) {
    std::printf("%s", ra.Table().c_str());
    std::printf("\n[2/4] worker B, a fresh engine (empty L1/L2): the same %zu requests, prefixes from tierkv\n",
                model_n);
  }
  metrics.Add(&worker_b.metrics(), {{"engine", "b"}});
  size_t identical = 0;
  opts.after_request = [&](size_t i, const engine::RequestResult& r) { identical += r.logits == logits[i]; };
  engine::ReplayReport rb = engine::Replay(first, worker_b, opts);
  if (!c.json) {
    std::printf("%s", rb.Table().c_str());
    std::printf("  %-32s %zu of %zu requests\n", "logits bit-identical to A", identical, model_n);
    double cold = 0, warm = 0;
    for (double t : ra.ttft) cold += t;
    for (double t : rb.ttft) warm += t;
    std::printf("  %-32s %.1f ms cold (A) -> %.1f ms warm (B): %.1fx faster\n", "measured mean TTFT",
                1e3 * cold / std::max<size_t>(1, ra.ttft.size()), 1e3 * warm / std::max<size_t>(1, rb.ttft.size()),
                warm > 0 ? cold / warm : 0.0);
  }

  // Prefill-to-decode: the first request again, computed by a prefill
  // engine and pushed page by page into a fresh decode engine's pool.
  const PdDemo pd = PdDemoRequest(c, *mcfg, first.empty() ? engine::TraceRequest{} : first[0], cut,
                                  logits.empty() ? std::vector<float>{} : logits[0]);
  if (!c.json) {
    std::printf("\n[3/4] prefill-to-decode (docs/pd.md): request 0 computed by a prefill engine, its KV pushed "
                "page by page into a decode engine's pool over the transfer engine in peer mode\n");
    if (pd.error.empty()) {
      std::printf("  %-32s %zu pages, %s, as computed over %.1f ms; %.2f ms of it after the last page\n",
                  "pushed to decode", pd.pages, FormatSize(pd.bytes).c_str(), 1e3 * pd.transfer_s, 1e3 * pd.exposed_s);
      std::printf("  %-32s %s\n", "logits bit-identical to A", pd.identical ? "yes" : "NO");
    } else {
      std::printf("  %-32s %s\n", "P/D did not run", pd.error.c_str());
    }
  }

  // The synthetic phase computes at the rate the model measured.
  if (scfg->tokens_per_s == 0) scfg->tokens_per_s = worker_a.tokens_per_s();
  synth.emplace(*scfg, session->l3.get());
  metrics.Add(&synth->metrics(), {{"engine", "synthetic"}});
  std::vector<engine::TraceRequest> rest(trace->begin() + model_n, trace->end());
  if (!c.json) {
    std::printf("\n[4/4] synthetic mode: requests %zu..%zu at full length, %s of KV per token, compute at %.0f "
                "tokens/s\n",
                model_n, trace->size(), FormatSize(c.kv_bytes_per_token).c_str(), scfg->tokens_per_s);
  }
  opts.after_request = nullptr;
  opts.seen = nullptr;
  opts.max_prompt_tokens = c.max_prompt_tokens;
  engine::ReplayReport rs = engine::Replay(rest, *synth, opts);
  WriteOutputs(c, rs);
  if (c.json) {
    std::printf("%s\n", nlohmann::json{{"worker_a", ra.ToJson()},
                                       {"worker_b", rb.ToJson()},
                                       {"logits_identical", identical},
                                       {"pd", {{"identical", pd.identical}, {"pages", pd.pages}, {"bytes", pd.bytes},
                                               {"transfer_s", pd.transfer_s}, {"exposed_transfer_s", pd.exposed_s},
                                               {"error", pd.error}}},
                                       {"model_requests", model_n},
                                       {"synthetic", rs.ToJson()}}
                            .dump()
                            .c_str());
  } else {
    std::printf("%s", rs.Table().c_str());
    if (!c.csv.empty() || !c.svg.empty()) {
      std::printf("\nwindowed hit rate written to %s %s\n", c.csv.c_str(), c.svg.c_str());
    }
  }
  return identical == model_n && (model_n == 0 || pd.identical) ? 0 : 1;
}

}  // namespace
}  // namespace tierkv

int main(int argc, char** argv) {
  std::vector<std::string> args;
  tierkv::TierkvConfig config = tierkv::TierkvFlags().ParseOrExit(argc, argv, &args);
  if (args.size() != 1) tierkv::ExitWithUsageError("tierkv", "expected one subcommand: demo, replay or sim (see --help)");
  tierkv::SetLogLevel(tierkv::LogLevel::kWarning);
  signal(SIGPIPE, SIG_IGN);
  if (args[0] == "replay") return tierkv::Replay(config);
  if (args[0] == "demo") return tierkv::Demo(config);
  if (args[0] == "sim") return tierkv::Sim(config);
  tierkv::ExitWithUsageError("tierkv", "unknown subcommand '" + args[0] + "'");
}
