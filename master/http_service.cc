#include "master/http_service.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace tierkv::master {
namespace {

using json = nlohmann::json;

void SendJson(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void SendError(httplib::Response& res, int status, absl::string_view message) {
  SendJson(res, status, json{{"error", message}});
}

int HttpStatusFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

json ExtentsJson(const std::vector<ExtentOut>& extents) {
  json out = json::array();
  for (const ExtentOut& e : extents) {
    out.push_back({{"segment", e.segment}, {"offset", e.offset}, {"length", e.length}, {"tier", e.ssd ? "ssd" : "dram"}});
  }
  return out;
}

json SegmentJson(const SegmentSnapshot& s) {
  return {{"name", s.spec.name},
          {"host", s.spec.host},
          {"capacity", s.spec.capacity},
          {"used", s.used},
          {"incarnation", s.spec.incarnation},
          {"endpoint", s.spec.endpoint},
          {"ssd_capacity", s.spec.ssd_capacity},
          {"ssd_used", s.spec.ssd_used},
          {"state", s.state()},
          {"owner", s.spec.owner},
          {"last_heartbeat_unix_ms", absl::ToUnixMillis(s.last_heartbeat)}};
}

json TenantJson(const TenantUsage& t) {
  return {{"tenant", TenantName(t.tenant)},
          {"quota_bytes", t.limits.quota_bytes},
          {"guaranteed_bytes", t.limits.guaranteed_bytes},
          {"used_bytes", t.used_bytes},
          {"puts_rejected", t.puts_rejected},
          {"quota_evicted_bytes", t.evicted_for_quota}};
}

// The caller of an admitted request (the pre-routing check has passed):
// with auth off, an anonymous admin in the default tenant.
auth::Identity CallerOf(const httplib::Request& req, const HttpLimits& limits) {
  if (limits.auth == nullptr || !limits.auth->enabled()) return {"anonymous", auth::kAnyRole, ""};
  absl::StatusOr<auth::Identity> id =
      limits.auth->Authorize(auth::CredentialsOf(req, limits.auth->certificates()), auth::kAnyRole, req.path);
  return id.ok() ? *id : auth::Identity{};
}

// What read sessions hold reserved, and the reads short of it (0 is the goal).
json ReservationsJson(Master* master) {
  const Reservations::Totals t = master->reservations().totals(absl::ToUnixMillis(master->clock()->Now()));
  return {{"held", t.held},
          {"clients", t.clients},
          {"cap_per_client", master->reservations().cap()},
          {"cap_per_tenant", master->reservations().tenant_cap()},
          {"refused", t.refused},
          {"lookup_shortfalls", t.shortfalls}};
}

// The tenants a caller may see: all for an admin or a caller outside any
// tenant, else its own.
json TenantsJson(Master* master, const auth::Identity& caller) {
  const bool all = (caller.roles & auth::kAdmin) != 0 || caller.tenant.empty();
  json out = json::array();
  for (const TenantUsage& t : master->Tenants()) {
    if (all || t.tenant == caller.tenant) out.push_back(TenantJson(t));
  }
  return out;
}

// The metadata key from ?key=; false (with a 400 sent) when it is missing
// or breaks the key rules.
bool MetadataKey(const httplib::Request& req, httplib::Response& res, const HttpLimits& limits,
                 std::string* key) {
  if (!req.has_param("key")) {
    SendError(res, 400, "missing ?key= parameter");
    return false;
  }
  *key = req.get_param_value("key");
  if (absl::Status s = ValidateKey(*key, limits.max_key_bytes); !s.ok()) {
    SendError(res, 400, s.message());
    return false;
  }
  return true;
}

}  // namespace

void InstallHttpRoutes(httplib::Server* server, Master* master, HttpLimits limits) {
  server->set_payload_max_length(limits.max_body);
  if (limits.auth != nullptr) {
    auth::RequireHttpAuth(server, limits.auth, [limits](const httplib::Request& req) -> uint32_t {
      if (req.path == "/health" || req.path == "/ready" || req.path == "/healthz" || req.path == "/livez") {
        return limits.open_health ? 0 : auth::kAnyRole;
      }
      if (req.path == "/metrics") return limits.open_metrics ? 0 : auth::kAnyRole;
      // Only a daemon publishes or withdraws a segment's descriptor.
      if (req.path == "/metadata" && req.method != "GET" && req.method != "HEAD") return auth::kDaemon;
      // Tenant limits are set by an admin.
      if (absl::StartsWith(req.path, "/v1/tenants/") && req.method != "GET" && req.method != "HEAD") return auth::kAdmin;
      return auth::kClient | auth::kDaemon;
    }, limits.require_certificate);
  }

  server->Get("/metadata", [=](const httplib::Request& req, httplib::Response& res) {
    std::string key;
    if (!MetadataKey(req, res, limits, &key)) return;
    // A deposed leader's descriptors may be stale: its clients ask the next master.
    if (absl::Status s = master->Serving(); !s.ok()) return SendError(res, 503, s.message());
    absl::StatusOr<std::string> v = master->GetMetadata(key);
    if (!v.ok()) return SendError(res, HttpStatusFor(v.status()), absl::IsNotFound(v.status()) ? "metadata not found" : v.status().message());
    res.set_content(*v, "application/octet-stream");
  });
  // Under --auth token the writer's name owns the key (Master::PutMetadata).
  auto writer = [limits](const httplib::Request& req, std::string* name, bool* admin) {
    if (limits.auth == nullptr || !limits.auth->enabled()) return;  // no owners without names
    const auth::Identity id = CallerOf(req, limits);
    *name = id.name;
    *admin = (id.roles & auth::kAdmin) != 0;
  };
  server->Put("/metadata", [=](const httplib::Request& req, httplib::Response& res) {
    std::string key, name;
    bool admin = false;
    if (!MetadataKey(req, res, limits, &key)) return;
    writer(req, &name, &admin);
    absl::Status s = master->PutMetadata(key, req.body, name, admin);
    if (!s.ok()) return SendError(res, HttpStatusFor(s), s.message());
    res.set_content("metadata updated", "text/plain");
  });
  server->Delete("/metadata", [=](const httplib::Request& req, httplib::Response& res) {
    std::string key, name;
    bool admin = false;
    if (!MetadataKey(req, res, limits, &key)) return;
    writer(req, &name, &admin);
    absl::Status s = master->DeleteMetadata(key, name, admin);
    if (!s.ok()) return SendError(res, HttpStatusFor(s), absl::IsNotFound(s) ? "metadata not found" : s.message());
    res.set_content("metadata deleted", "text/plain");
  });

  server->Get("/v1/segments", [=](const httplib::Request&, httplib::Response& res) {
    json out = json::array();
    for (const SegmentSnapshot& s : master->registry().Snapshot()) out.push_back(SegmentJson(s));
    SendJson(res, 200, out);
  });
  server->Get(R"(/v1/segments/(.+))", [=](const httplib::Request& req, httplib::Response& res) {
    std::string name = req.matches[1];
    for (const SegmentSnapshot& s : master->registry().Snapshot()) {
      if (s.spec.name == name) return SendJson(res, 200, SegmentJson(s));
    }
    SendError(res, 404, absl::StrCat("no segment ", name));
  });
  server->Get(R"(/v1/objects/(.+))", [=](const httplib::Request& req, httplib::Response& res) {
    std::string key = req.matches[1];
    if (absl::Status s = ValidateKey(key, limits.max_key_bytes); !s.ok()) {
      return SendError(res, 400, s.message());
    }
    // Looked up in the caller's tenant, like its RPCs.
    absl::StatusOr<ObjectInfo> info = master->index().Describe(TenantKey(CallerOf(req, limits).tenant, key));
    if (!info.ok()) return SendError(res, 404, absl::StrCat("no object ", key));
    json lease = nullptr;
    if (info->lease_expiry != absl::Time()) lease = absl::ToUnixMillis(info->lease_expiry);
    SendJson(res, 200,
             {{"key", key},
              {"size", info->size},
              {"put_id", info->put_id},
              {"state", info->state},
              {"visible", info->visible},
              {"replicas", ExtentsJson(info->replicas)},
              {"lease_expiry_unix_ms", lease},
              {"soft_pin", info->soft_pin},
              {"hard_pin", info->hard_pin},
              {"group", info->group},
              {"cached_children", info->children}});
  });
  server->Get("/v1/tenants", [=](const httplib::Request& req, httplib::Response& res) {
    SendJson(res, 200, TenantsJson(master, CallerOf(req, limits)));
  });
  server->Get(R"(/v1/tenants/([^/]+))", [=](const httplib::Request& req, httplib::Response& res) {
    const std::string name = req.matches[1];
    for (const json& t : TenantsJson(master, CallerOf(req, limits))) {
      if (t["tenant"] == name) return SendJson(res, 200, t);
    }
    SendError(res, 404, absl::StrCat("no tenant ", name, " with limits or use (or not yours to see)"));
  });
  // Body: {"quota_bytes": N, "guaranteed_bytes": M}; either may be left out (0).
  server->Put(R"(/v1/tenants/([^/]+))", [=](const httplib::Request& req, httplib::Response& res) {
    const std::string name = req.matches[1];
    json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    TenantLimits set;
    auto field = [&](const char* f, uint64_t* out) {
      if (!body.contains(f)) return true;
      if (!body[f].is_number_unsigned()) return false;
      *out = body[f].get<uint64_t>();
      return true;
    };
    if (!body.is_object() || !field("quota_bytes", &set.quota_bytes) ||
        !field("guaranteed_bytes", &set.guaranteed_bytes)) {
      return SendError(res, 400, "body must be {\"quota_bytes\": <bytes>, \"guaranteed_bytes\": <bytes>}");
    }
    if (absl::Status s = master->SetTenantLimits(name, set); !s.ok()) {
      return SendError(res, HttpStatusFor(s), s.message());
    }
    SendJson(res, 200, {{"tenant", name}, {"quota_bytes", set.quota_bytes}, {"guaranteed_bytes", set.guaranteed_bytes}});
  });
  server->Delete(R"(/v1/tenants/([^/]+))", [=](const httplib::Request& req, httplib::Response& res) {
    const std::string name = req.matches[1];
    if (absl::Status s = master->SetTenantLimits(name, {}); !s.ok()) return SendError(res, HttpStatusFor(s), s.message());
    SendJson(res, 200, {{"tenant", name}, {"quota_bytes", 0}, {"guaranteed_bytes", 0}});
  });
  server->Get("/v1/stats", [=](const httplib::Request& req, httplib::Response& res) {
    IndexStats st = master->index().Stats();
    // What clients asked and found, per call, cumulative and windowed, and
    // what was possible (docs: README "stats").
    const QueryStats::View view = master->queries().Snapshot(master->clock()->Now());
    // A tenant's caller sees its own tenant's clients and prefixes, named
    // as it knows them; an admin, or a caller outside any tenant, all of
    // them with their tenant.
    const auth::Identity caller = CallerOf(req, limits);
    const bool all = (caller.roles & auth::kAdmin) != 0 || caller.tenant.empty();
    auto rate = [](uint64_t n, uint64_t asked) { return asked ? static_cast<double>(n) / asked : 0.0; };
    auto row_json = [&](const char* label, const QueryStats::Row& r) {
      json row = {{label, std::string(UserKey(r.name))}};
      if (all && !TenantOf(r.name).empty()) row["tenant"] = std::string(TenantOf(r.name));
      for (int k = 0; k < QueryStats::kKinds; ++k) {
        const QueryStats::Counts& t = r.total[k];
        const QueryStats::Counts& w = r.window[k];
        row[QueryStats::KindName(static_cast<QueryStats::Kind>(k))] = {
            {"pages_asked", t.asked},
            {"pages_found", t.found},
            {"pages_possible", t.possible},
            {"bytes_found", t.bytes_found},
            {"hit_rate", rate(t.found, t.asked)},
            {"possible_rate", rate(t.possible, t.asked)},
            {"window_pages_asked", w.asked},
            {"window_pages_found", w.found},
            {"window_pages_possible", w.possible},
            {"window_bytes_found", w.bytes_found},
            {"window_hit_rate", rate(w.found, w.asked)},
            {"window_possible_rate", rate(w.possible, w.asked)}};
      }
      return row;
    };
    auto histo_json = [](const QueryStats::Histo& h) {
      return json{{"le", h.bounds}, {"counts", h.counts}, {"count", h.count}, {"sum", h.sum}};
    };
    json queries = {{"window_s", absl::ToDoubleSeconds(master->queries().window())},
                    {"sketch_bytes", view.sketch_bytes},
                    {"sketch_false_positive_rate", view.sketch_false_positive_rate},
                    {"clients", json::array()},
                    {"prefixes", json::array()},
                    {"prefix_match_pages", histo_json(view.prefix_match_pages)},
                    {"reuse_seconds", json::object()}};
    auto visible = [&](const QueryStats::Row& r) { return all || TenantOf(r.name) == caller.tenant; };
    for (const QueryStats::Row& r : view.clients) {
      if (visible(r)) queries["clients"].push_back(row_json("client", r));
    }
    for (const QueryStats::Row& r : view.prefixes) {
      if (visible(r)) queries["prefixes"].push_back(row_json("key_prefix", r));  // "prefix" is a call
    }
    for (int k = 0; k < QueryStats::kKinds; ++k) {
      queries["reuse_seconds"][QueryStats::KindName(static_cast<QueryStats::Kind>(k))] =
          histo_json(view.reuse_seconds[k]);
    }
    uint64_t used = master->registry().used(), capacity = master->registry().capacity();
    SendJson(res, 200,
             {{"objects", st.objects},
              {"pending", st.pending},
              {"groups", st.groups},
              {"leased", st.leased},
              {"pinned", st.pinned},
              {"evictions", st.evictions},
              {"evicted_bytes", st.evicted_bytes},
              {"index_memory_bytes", st.memory_bytes},
              {"used_bytes", used},
              {"capacity_bytes", capacity},
              {"segments", master->registry().Snapshot().size()},
              {"clients", master->clients_seen()},
              {"reservations", ReservationsJson(master)},
              {"tenants", TenantsJson(master, caller)},
              {"queries", std::move(queries)}});
  });
  server->Get("/metrics", [=](const httplib::Request&, httplib::Response& res) {
    res.set_content(master->metrics().Serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->Get("/v1/ha", [=](const httplib::Request&, httplib::Response& res) {
    const std::string status = master->options().ha_status ? master->options().ha_status() : "";
    res.set_content(status.empty() ? nlohmann::json{{"role", "single"}}.dump() : status, "application/json");
  });
  server->Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });
  // Liveness, answered alike by a standby (master/ha.cc): one probe path
  // for every master of an HA cluster, whichever role it holds now.
  for (const char* probe : {"/healthz", "/livez"}) {
    server->Get(probe, [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
  }
  server->Get("/ready", [=](const httplib::Request&, httplib::Response& res) {
    // Puts fail without a live segment, so a launcher gating clients on
    // /ready must not release them before one has mounted.
    absl::Status ready = master->Readiness();
    res.status = ready.ok() ? 200 : 503;
    res.set_content(ready.ok() ? "ready\n" : absl::StrCat(ready.message(), "\n"), "text/plain");
  });

  server->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler already explained itself
    if (res.status == 404) {
      SendError(res, 404, absl::StrCat("no route for ", req.method, " ", req.path));
    } else if (res.status == 413) {
      SendError(res, 413, "request body too large");
    } else {
      SendError(res, res.status, "bad request");
    }
  });
  server->set_exception_handler([](const httplib::Request&, httplib::Response& res,
                                   std::exception_ptr) { SendError(res, 500, "internal error"); });
}

}  // namespace tierkv::master
