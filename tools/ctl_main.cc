// tierkvctl: the operator's CLI. Read-only views come from the master's
// HTTP query endpoints; put/get/rm/doctor use the client library.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "base/auth.h"
#include "base/log.h"
#include "base/status.h"
#include "config/ctl_config.h"
#include "config/units.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "proto/etcd_client.h"

namespace tierkv {
namespace {

using json = nlohmann::json;

int Fail(const std::string& what) {
  std::fprintf(stderr, "tierkvctl: %s\n", what.c_str());
  return 1;
}

// The master HTTP addresses of --http: one, or every master of a
// high-availability group (docs/ha.md), tried in turn; for
// etcd://h:p/<cluster>, those the cluster's masters report.
absl::StatusOr<std::vector<std::string>> HttpAddresses(const CtlConfig& c) {
  std::string list = c.http;
  if (IsEtcdMasterAddress(c.http)) {
    ASSIGN_OR_RETURN(std::string token, auth::ReadTokenFile(c.token_file));
    ASSIGN_OR_RETURN(list, client::DiscoverMetadata(c.http, c.timeout, token, {c.tls_ca, c.tls_cert, c.tls_key}));
  }
  std::vector<std::string> out;
  for (absl::string_view a : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    if (!absl::ConsumePrefix(&a, "http://")) absl::ConsumePrefix(&a, "https://");
    out.emplace_back(a);
  }
  return out;
}

// A client of one master HTTP address presenting our token (and
// certificate): HTTPS when we were given TLS files, as a master with
// --tls-cert serves both its ports over TLS.
absl::StatusOr<std::unique_ptr<httplib::Client>> MasterHttp(const CtlConfig& c, const std::string& address) {
  if (address.rfind(':') == std::string::npos) return absl::InvalidArgumentError("--http must be host:port");
  const auth::TlsFiles tls{c.tls_ca, c.tls_cert, c.tls_key};
  ASSIGN_OR_RETURN(auto cli, auth::NewHttpClient(auth::HttpUrl(address, tls.enabled()), tls, c.timeout));
  ASSIGN_OR_RETURN(std::string token, auth::ReadTokenFile(c.token_file));
  if (!token.empty()) cli->set_bearer_token_auth(token.c_str());
  return cli;
}

// `send` on each --http address until one answers other than 503 (a
// master that is not the leader); `address` is the one that did.
absl::StatusOr<httplib::Result> SendToLeader(
    const CtlConfig& c, const std::function<httplib::Result(httplib::Client&)>& send, std::string* address) {
  ASSIGN_OR_RETURN(std::vector<std::string> addresses, HttpAddresses(c));
  if (addresses.empty()) return absl::InvalidArgumentError("--http is empty");
  absl::Status last;
  for (const std::string& a : addresses) {
    *address = a;
    ASSIGN_OR_RETURN(std::unique_ptr<httplib::Client> cli, MasterHttp(c, a));
    httplib::Result res = send(*cli);
    if (!res) {
      last = absl::UnavailableError(absl::StrCat("master HTTP ", a, ": ", httplib::to_string(res.error())));
    } else if (res->status == 503 && addresses.size() > 1) {
      last = absl::UnavailableError(absl::StrCat("master HTTP ", a, ": ", res->body));
    } else {
      return res;
    }
  }
  return last;
}

absl::StatusOr<json> FetchJson(const CtlConfig& c, const std::string& path) {
  std::string address;
  ASSIGN_OR_RETURN(httplib::Result res, SendToLeader(c, [&](httplib::Client& cli) { return cli.Get(path); }, &address));
  json j = json::parse(res->body, nullptr, false);
  if (res->status == 401 || res->status == 403) {
    const std::string why = j.is_object() && j.contains("error") ? j["error"].get<std::string>() : res->body;
    return absl::Status(res->status == 401 ? absl::StatusCode::kUnauthenticated : absl::StatusCode::kPermissionDenied,
                        absl::StrCat("master HTTP ", address, " refused ", path, ": ", why));
  }
  if (res->status == 404) {
    return absl::NotFoundError(j.is_object() && j.contains("error") ? j["error"].get<std::string>() : path);
  }
  if (res->status != 200 || j.is_discarded()) {
    return absl::InternalError(absl::StrCat("master answered ", res->status, " for ", path));
  }
  return j;
}

// Sends `body` to the master's HTTP API with `method`; the JSON answer,
// or the master's error as a status.
absl::StatusOr<json> SendJsonTo(const CtlConfig& c, const std::string& method, const std::string& path,
                                const std::string& body) {
  std::string address;
  ASSIGN_OR_RETURN(httplib::Result res, SendToLeader(c, [&](httplib::Client& cli) {
    return method == "PUT" ? cli.Put(path, body, "application/json") : cli.Delete(path);
  }, &address));
  json j = json::parse(res->body, nullptr, false);
  if (res->status != 200) {
    const std::string why = j.is_object() && j.contains("error") ? j["error"].get<std::string>() : res->body;
    return absl::FailedPreconditionError(absl::StrCat(method, " ", path, ": HTTP ", res->status, ": ", why));
  }
  return j;
}

int Tenants(const CtlConfig& c, const std::vector<std::string>& args) {
  if (args.size() >= 2 && (args[1] == "set" || args[1] == "clear")) {
    const bool set = args[1] == "set";
    if ((set && (args.size() < 4 || args.size() > 5)) || (!set && args.size() != 3)) {
      return Fail("usage: tenants set <tenant> <quota> [<guaranteed>] | tenants clear <tenant>");
    }
    json body = json::object();
    if (set) {
      absl::StatusOr<uint64_t> quota = ParseSize(args[3]);
      if (!quota.ok()) return Fail(absl::StrCat("quota: ", quota.status().message()));
      uint64_t guaranteed = 0;
      if (args.size() == 5) {
        absl::StatusOr<uint64_t> g = ParseSize(args[4]);
        if (!g.ok()) return Fail(absl::StrCat("guaranteed: ", g.status().message()));
        guaranteed = *g;
      }
      body = {{"quota_bytes", *quota}, {"guaranteed_bytes", guaranteed}};
    }
    absl::StatusOr<json> out = SendJsonTo(c, set ? "PUT" : "DELETE", "/v1/tenants/" + args[2], body.dump());
    if (!out.ok()) return Fail(std::string(out.status().message()));
    std::printf("tenant %s: quota %s, guaranteed %s\n", args[2].c_str(),
                FormatSize((*out)["quota_bytes"].get<uint64_t>()).c_str(),
                FormatSize((*out)["guaranteed_bytes"].get<uint64_t>()).c_str());
    return 0;
  }
  if (args.size() != 1) return Fail("usage: tenants | tenants set <tenant> <quota> [<guaranteed>] | tenants clear <tenant>");
  absl::StatusOr<json> tenants = FetchJson(c, "/v1/tenants");
  if (!tenants.ok()) return Fail(std::string(tenants.status().message()));
  if (c.json) {
    std::printf("%s\n", tenants->dump().c_str());
    return 0;
  }
  std::printf("%-24s %12s %12s %12s %6s %14s %14s\n", "TENANT", "QUOTA", "GUARANTEED", "USED", "USE%", "PUTS REFUSED",
              "QUOTA EVICTED");
  for (const json& t : *tenants) {
    const uint64_t quota = t["quota_bytes"], used = t["used_bytes"], guaranteed = t["guaranteed_bytes"];
    std::printf("%-24s %12s %12s %12s %6s %14llu %14s\n", t["tenant"].get<std::string>().c_str(),
                quota ? FormatSize(quota).c_str() : "-", guaranteed ? FormatSize(guaranteed).c_str() : "-",
                FormatSize(used).c_str(), quota ? absl::StrFormat("%.1f%%", 100.0 * used / quota).c_str() : "-",
                static_cast<unsigned long long>(t["puts_rejected"].get<uint64_t>()),
                FormatSize(t["quota_evicted_bytes"].get<uint64_t>()).c_str());
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<client::Client>> Connect(const CtlConfig& c) {
  client::ClientOptions o;
  o.master = c.master;
  std::vector<std::string> urls;
  ASSIGN_OR_RETURN(std::vector<std::string> addresses, HttpAddresses(c));
  for (const std::string& a : addresses) urls.push_back(auth::HttpUrl(a, !c.tls_ca.empty()));
  o.metadata = absl::StrJoin(urls, ",");
  o.token_file = c.token_file;
  o.tls = {c.tls_ca, c.tls_cert, c.tls_key};
  o.rpc_timeout = c.timeout;
  o.transfer_timeout = c.timeout;
  for (absl::string_view t : absl::StrSplit(c.transport, ',', absl::SkipWhitespace())) o.transports.emplace_back(t);
  return client::Client::Create(o);
}

int Segments(const CtlConfig& c) {
  absl::StatusOr<json> segs = FetchJson(c, "/v1/segments");
  if (!segs.ok()) return Fail(std::string(segs.status().message()));
  if (c.json) {
    std::printf("%s\n", segs->dump().c_str());
    return 0;
  }
  int64_t now = absl::ToUnixMillis(absl::Now());
  std::printf("%-28s %-16s %-10s %12s %12s %6s %12s %12s %10s\n", "SEGMENT", "HOST", "STATE", "CAPACITY", "USED",
              "USE%", "SSD", "SSD USED", "HEARTBEAT");
  for (const json& s : *segs) {
    uint64_t cap = s["capacity"], used = s["used"];
    // Masters that predate the SSD tier send no ssd_* fields.
    uint64_t ssd_cap = s.value("ssd_capacity", uint64_t{0}), ssd_used = s.value("ssd_used", uint64_t{0});
    std::printf("%-28s %-16s %-10s %12s %12s %5.1f%% %12s %12s %8.1fs\n", s["name"].get<std::string>().c_str(),
                s["host"].get<std::string>().c_str(), s["state"].get<std::string>().c_str(),
                FormatSize(cap).c_str(), FormatSize(used).c_str(), cap ? 100.0 * used / cap : 0.0,
                ssd_cap ? FormatSize(ssd_cap).c_str() : "-", ssd_cap ? FormatSize(ssd_used).c_str() : "-",
                (now - s["last_heartbeat_unix_ms"].get<int64_t>()) / 1000.0);
  }
  return 0;
}

// The hit rate clients see, whatever engine they run, against what any
// cache could have served: "hit rate 31 % of a possible 37 %".
void PrintHitRates(const json& q) {
  std::printf("\n");
  const json& all = q["clients"][0];
  for (const char* call : {"prefix", "exists", "get"}) {
    if (!all.contains(call) || all[call].value("pages_asked", uint64_t{0}) == 0) continue;
    const json& t = all[call];
    std::printf("%-22s hit rate %.1f %% of a possible %.1f %% (%llu of %llu pages, %llu possible, %s found)\n",
                absl::StrCat(call, " pages").c_str(), 100 * t.value("hit_rate", 0.0),
                100 * t.value("possible_rate", 0.0), static_cast<unsigned long long>(t.value("pages_found", uint64_t{0})),
                static_cast<unsigned long long>(t.value("pages_asked", uint64_t{0})),
                static_cast<unsigned long long>(t.value("pages_possible", uint64_t{0})),
                FormatSize(t.value("bytes_found", uint64_t{0})).c_str());
  }
  std::printf("\n%-32s %-7s %12s %12s %12s %7s %7s   %s\n", "CLIENT / PREFIX", "CALL", "ASKED", "FOUND", "POSSIBLE",
              "HIT%", "BOUND%", absl::StrCat("LAST ", static_cast<int>(q.value("window_s", 0.0)), " s").c_str());
  for (const char* group : {"clients", "prefixes"}) {
    if (!q.contains(group)) continue;
    for (const json& r : q[group]) {
      const std::string name =
          r.contains("client") ? "client " + r.value("client", "?") : "prefix " + r.value("key_prefix", "?");
      for (const char* call : {"prefix", "exists", "get"}) {
        if (!r.contains(call)) continue;
        const json& p = r[call];
        if (p.value("pages_asked", uint64_t{0}) == 0) continue;
        std::printf("%-32s %-7s %12llu %12llu %12llu %6.1f%% %6.1f%%   %6.1f%% of %.1f%% (%llu asked)\n", name.c_str(),
                    call, static_cast<unsigned long long>(p.value("pages_asked", uint64_t{0})),
                    static_cast<unsigned long long>(p.value("pages_found", uint64_t{0})),
                    static_cast<unsigned long long>(p.value("pages_possible", uint64_t{0})),
                    100 * p.value("hit_rate", 0.0), 100 * p.value("possible_rate", 0.0),
                    100 * p.value("window_hit_rate", 0.0), 100 * p.value("window_possible_rate", 0.0),
                    static_cast<unsigned long long>(p.value("window_pages_asked", uint64_t{0})));
      }
    }
  }
}

int Stats(const CtlConfig& c) {
  absl::StatusOr<json> st = FetchJson(c, "/v1/stats");
  if (!st.ok()) return Fail(std::string(st.status().message()));
  if (c.json) {
    std::printf("%s\n", st->dump().c_str());
    return 0;
  }
  for (auto& [k, v] : st->items()) {
    if (k == "queries") continue;
    std::printf("%-22s %s\n", k.c_str(), v.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  }
  const json& q = (*st)["queries"];
  if (!q.is_object() || !q.contains("clients")) return 0;
  PrintHitRates(q);
  return 0;
}

// The leader's account of its group (/v1/ha): role, epoch, standbys and
// how far behind each is.
int Ha(const CtlConfig& c) {
  absl::StatusOr<json> ha = FetchJson(c, "/v1/ha");
  if (!ha.ok()) return Fail(std::string(ha.status().message()));
  if (c.json) {
    std::printf("%s\n", ha->dump().c_str());
    return 0;
  }
  if (ha->value("role", "") == "single") {
    std::printf("a single master (no --etcd): no standbys\n");
    return 0;
  }
  std::printf("leader %s  epoch %llu  cluster %s  sync %s  batch %llu  degraded writes %llu\n",
              ha->value("self", "?").c_str(), static_cast<unsigned long long>(ha->value("epoch", uint64_t{0})),
              ha->value("cluster_id", "?").c_str(), ha->value("sync", "?").c_str(),
              static_cast<unsigned long long>(ha->value("last_seq", uint64_t{0})),
              static_cast<unsigned long long>(ha->value("degraded_writes", uint64_t{0})));
  if (!ha->value("serving", true)) {
    std::printf("not serving: waiting for etcd to confirm its lease (it steps down if etcd does not)\n");
  }
  std::printf("%-28s %12s %10s %12s %10s\n", "STANDBY", "ACKED", "LAG", "SNAPSHOTTING", "SEEN");
  for (const json& s : (*ha)["standbys"]) {
    std::printf("%-28s %12llu %10llu %12s %9.1fs\n", s.value("name", "?").c_str(),
                static_cast<unsigned long long>(s.value("acked_seq", uint64_t{0})),
                static_cast<unsigned long long>(s.value("lag_batches", uint64_t{0})),
                s.value("snapshotting", false) ? "yes" : "no", s.value("last_seen_seconds_ago", 0.0));
  }
  return 0;
}

// Ctrl-C ends `top` between refreshes.
volatile std::sig_atomic_t g_stop = 0;
void OnInterrupt(int) { g_stop = 1; }

// Live view of /v1/stats: per client and key prefix, the window's hit rate
// against its bound, plus capacity and evictions per second.
int Top(const CtlConfig& c) {
  std::signal(SIGINT, OnInterrupt);
  const bool tty = isatty(fileno(stdout));
  uint64_t last_evictions = 0;
  absl::Time last = absl::InfinitePast();
  for (int64_t i = 0; !g_stop && (c.iterations == 0 || i < c.iterations); ++i) {
    if (i > 0) {
      // Sleep in slices so Ctrl-C is prompt.
      absl::Time until = absl::Now() + c.interval;
      while (!g_stop && absl::Now() < until) absl::SleepFor(std::min(absl::Milliseconds(50), until - absl::Now()));
      if (g_stop) break;
    }
    absl::StatusOr<json> st = FetchJson(c, "/v1/stats");
    if (!st.ok()) return Fail(std::string(st.status().message()));
    const absl::Time now = absl::Now();
    const uint64_t evictions = st->value("evictions", uint64_t{0});
    std::string rate = "-";
    if (last != absl::InfinitePast() && now > last) {
      rate = absl::StrFormat("%.1f", (evictions - std::min(evictions, last_evictions)) / absl::ToDoubleSeconds(now - last));
    }
    last = now;
    last_evictions = evictions;
    if (tty) std::printf("\033[H\033[2J");
    const json& q = (*st)["queries"];
    const uint64_t used = st->value("used_bytes", uint64_t{0}), cap = st->value("capacity_bytes", uint64_t{0});
    std::printf("tierkvctl top  %s  every %s  window %d s\n", c.http.c_str(), absl::FormatDuration(c.interval).c_str(),
                static_cast<int>(q.value("window_s", 0.0)));
    std::printf("capacity %s of %s (%.1f%%)  objects %llu  evictions/s %s  bound false positives %.2g\n",
                FormatSize(used).c_str(), FormatSize(cap).c_str(), cap ? 100.0 * used / cap : 0.0,
                static_cast<unsigned long long>(st->value("objects", uint64_t{0})), rate.c_str(),
                q.value("sketch_false_positive_rate", 0.0));
    std::printf("%-32s %-7s %10s %10s %10s %7s %7s\n", "CLIENT / PREFIX", "CALL", "ASKED", "FOUND", "POSSIBLE", "HIT%",
                "BOUND%");
    for (const char* group : {"clients", "prefixes"}) {
      if (!q.contains(group)) continue;
      for (const json& r : q[group]) {
        const std::string name = r.contains("client") ? "client " + r.value("client", "?")
                                                      : "prefix " + r.value("key_prefix", "?");
        for (const char* call : {"prefix", "exists", "get"}) {
          if (!r.contains(call)) continue;
          const json& w = r[call];
          const uint64_t asked = w.value("window_pages_asked", uint64_t{0});
          if (asked == 0) continue;
          std::printf("%-32s %-7s %10llu %10llu %10llu %6.1f%% %6.1f%%\n", name.c_str(), call,
                      static_cast<unsigned long long>(asked),
                      static_cast<unsigned long long>(w.value("window_pages_found", uint64_t{0})),
                      static_cast<unsigned long long>(w.value("window_pages_possible", uint64_t{0})),
                      100 * w.value("window_hit_rate", 0.0), 100 * w.value("window_possible_rate", 0.0));
        }
      }
    }
    std::fflush(stdout);
  }
  return 0;
}

int Key(const CtlConfig& c, const std::string& key) {
  absl::StatusOr<json> obj = FetchJson(c, "/v1/objects/" + httplib::detail::encode_query_param(key));
  if (!obj.ok()) return Fail(std::string(obj.status().message()));
  if (c.json) {
    std::printf("%s\n", obj->dump().c_str());
    return 0;
  }
  for (auto& [k, v] : obj->items()) {
    if (k == "replicas") continue;
    std::printf("%-16s %s\n", k.c_str(), v.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  }
  for (const json& r : (*obj)["replicas"]) {
    std::printf("replica          %s @ %llu (+%llu)\n", r["segment"].get<std::string>().c_str(),
                static_cast<unsigned long long>(r["offset"].get<uint64_t>()),
                static_cast<unsigned long long>(r["length"].get<uint64_t>()));
  }
  return 0;
}

int Put(const CtlConfig& c, const std::string& key, const std::string& file) {
  std::stringstream ss;
  if (file == "-") {
    ss << std::cin.rdbuf();
  } else {
    std::ifstream in(file, std::ios::binary);
    if (!in) return Fail("cannot read " + file);
    ss << in.rdbuf();
  }
  std::string data = ss.str();
  auto cli = Connect(c);
  if (!cli.ok()) return Fail(std::string(cli.status().message()));
  client::PutOptions o;
  o.replicas = static_cast<int>(c.replicas);
  absl::Status s = (*cli)->Put(key, data, o);
  if (!s.ok()) return Fail(s.ToString());
  if (c.json) {
    std::printf("%s\n", json{{"key", key}, {"bytes", data.size()}}.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  } else {
    std::printf("put %s (%zu bytes)\n", key.c_str(), data.size());
  }
  return 0;
}

int Get(const CtlConfig& c, const std::string& key, const std::string& file) {
  auto cli = Connect(c);
  if (!cli.ok()) return Fail(std::string(cli.status().message()));
  absl::StatusOr<std::string> v = (*cli)->Get(key);
  if (!v.ok()) return Fail(v.status().ToString());
  if (file == "-") {
    std::fwrite(v->data(), 1, v->size(), stdout);
  } else {
    std::ofstream out(file, std::ios::binary);
    out.write(v->data(), static_cast<std::streamsize>(v->size()));
    if (!out) return Fail("cannot write " + file);
  }
  return 0;
}

int Remove(const CtlConfig& c, const std::string& key) {
  auto cli = Connect(c);
  if (!cli.ok()) return Fail(std::string(cli.status().message()));
  absl::Status s = (*cli)->Remove(key, c.force);
  if (!s.ok()) return Fail(s.ToString());
  if (!c.json) std::printf("removed %s\n", key.c_str());
  return 0;
}

// For each segment: the transport this host would use and why others were
// skipped, the median latency of a 4 KiB read, and read bandwidth over up
// to 64 MiB. Probes only read, so they never disturb stored data.
int Doctor(const CtlConfig& c) {
  absl::StatusOr<json> segs = FetchJson(c, "/v1/segments");
  if (!segs.ok()) return Fail(std::string(segs.status().message()));
  auto cli = Connect(c);
  if (!cli.ok()) return Fail(std::string(cli.status().message()));
  transport::TransferEngine& engine = (*cli)->engine();
  json report = json::array();
  for (const json& s : *segs) {
    std::string name = s["name"];
    uint64_t capacity = s["capacity"];
    transport::PeerInfo info = engine.Describe(name);
    json row{{"segment", name}, {"host", s["host"]}, {"state", s["state"]}, {"transport", info.transport},
             {"fallbacks", info.fallbacks}};
    if (!info.transport.empty()) {
      // Probed through objects of its own, put there, read back and
      // removed: daemons that check extent grants let no client read raw
      // offsets, and an object's path is the one users take. Repeated gets
      // of one key read from the replica cache: the transport's latency.
      client::Client& cl = **cli;
      client::PutOptions here;
      here.preferred_segment = name;
      const std::string probe = absl::StrCat("__tierkv_doctor/", name, "/");
      bool ok = cl.Put(probe + "small", std::string(4096, 'd'), here).ok();
      // The segment is a preference: one full, or another tenant's, puts
      // the probe elsewhere, whose figures are not this segment's.
      absl::StatusOr<json> where =
          ok ? FetchJson(c, "/v1/objects/" + httplib::detail::encode_query_param(probe + "small"))
             : absl::StatusOr<json>(absl::UnavailableError("the probe put failed"));
      const bool landed = where.ok() && where->contains("replicas") && (*where)["replicas"].is_array() &&
                          !(*where)["replicas"].empty() && (*where)["replicas"][0].value("segment", "") == name;
      if (ok && !landed) {
        (void)cl.Remove(probe + "small", /*force=*/true);
        row["probe_ok"] = false;
        row["probe"] = "skipped: the master placed the probe on another segment (this one full, or another tenant's)";
        report.push_back(row);
        continue;
      }
      std::vector<double> lat;
      for (int i = 0; i < 10 && ok; ++i) {
        absl::Time t0 = absl::Now();
        ok = cl.Get(probe + "small").ok();
        lat.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      }
      std::sort(lat.begin(), lat.end());
      const std::string mib(1 << 20, 'D');
      std::vector<client::PutItem> items;
      std::vector<std::string> keys;
      for (uint64_t n = 0; n < 16 && (n + 1) * (8u << 20) <= capacity; ++n) {
        keys.push_back(absl::StrCat(probe, "bw/", n));
        items.push_back({keys.back(), mib});
      }
      for (const absl::Status& st : cl.BatchPut(items, here)) ok = ok && st.ok();
      absl::Time t0 = absl::Now();
      for (const absl::StatusOr<std::string>& got : cl.BatchGet(keys)) ok = ok && got.ok();
      double secs = absl::ToDoubleSeconds(absl::Now() - t0);
      keys.push_back(probe + "small");
      for (const std::string& k : keys) (void)cl.Remove(k, /*force=*/true);
      row["probe_ok"] = ok;
      row["latency_us_p50"] = lat.empty() ? 0.0 : lat[lat.size() / 2];
      row["bandwidth_GBps"] = secs > 0 ? items.size() * double(1 << 20) / secs / 1e9 : 0;
    }
    report.push_back(row);
  }
  if (c.json) {
    std::printf("%s\n", report.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    return 0;
  }
  std::printf("%-28s %-10s %-10s %12s %12s  %s\n", "SEGMENT", "STATE", "TRANSPORT", "LATENCY(us)", "GB/s",
              "FALLBACKS");
  for (const json& r : report) {
    std::string fb;
    for (const auto& f : r["fallbacks"]) fb += (fb.empty() ? "" : "; ") + f.get<std::string>();
    std::printf("%-28s %-10s %-10s %12.1f %12.2f  %s\n", r["segment"].get<std::string>().c_str(),
                r["state"].get<std::string>().c_str(),
                r["transport"].get<std::string>().empty() ? "NONE" : r["transport"].get<std::string>().c_str(),
                r.value("latency_us_p50", 0.0), r.value("bandwidth_GBps", 0.0), fb.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace tierkv

int main(int argc, char** argv) {
  std::vector<std::string> args;
  tierkv::CtlConfig config = tierkv::CtlFlags().ParseOrExit(argc, argv, &args);
  tierkv::SetLogLevel(tierkv::LogLevel::kError);
  auto need = [&](size_t n) {
    if (args.size() != n) tierkv::ExitWithUsageError("tierkvctl", "wrong number of arguments for '" + args[0] + "' (see --help)");
  };
  if (args.empty()) tierkv::ExitWithUsageError("tierkvctl", "missing subcommand (see --help)");
  const std::string& cmd = args[0];
  if (cmd == "segments") return need(1), tierkv::Segments(config);
  if (cmd == "stats") return need(1), tierkv::Stats(config);
  if (cmd == "top") return need(1), tierkv::Top(config);
  if (cmd == "key") return need(2), tierkv::Key(config, args[1]);
  if (cmd == "put") return need(3), tierkv::Put(config, args[1], args[2]);
  if (cmd == "get") return need(3), tierkv::Get(config, args[1], args[2]);
  if (cmd == "rm") return need(2), tierkv::Remove(config, args[1]);
  if (cmd == "doctor") return need(1), tierkv::Doctor(config);
  if (cmd == "tenants") return tierkv::Tenants(config, args);
  if (cmd == "ha") return need(1), tierkv::Ha(config);
  tierkv::ExitWithUsageError("tierkvctl", "unknown subcommand '" + cmd + "'");
}
