// The master's HTTP face (cpp-httplib):
//
//   GET|PUT|DELETE /metadata?key=K   opaque values, Mooncake-compatible:
//                                    GET of a missing key is 404
//   GET /v1/segments                 JSON list of segments
//   GET /v1/segments/{name}          one segment (404 if unknown)
//   GET /v1/objects/{key}            replicas, size, state, lease, pin
//   GET /v1/stats                    index and capacity figures
//   GET /metrics                     Prometheus text format 0.0.4
//   GET /health                      200 while this master serves (a
//                                    standby answers 503: master/ha.h)
//   GET /healthz, /livez             liveness: 200 while the process is up,
//                                    answered by a standby too
//   GET /ready                       200 once persistence is loaded and at
//                                    least one segment is live; else 503
//                                    with the reason as the body
//
// With --auth token every path needs a bearer token (base/auth.h):
// PUT and DELETE /metadata the daemon role, other reads the client or
// daemon role; /health, /ready, /healthz and /livez are open while
// `open_health`, /metrics while `open_metrics`. A request without an
// accepted token gets 401, one whose caller lacks the role 403, each with
// the reason as the body. A metadata key belongs to the caller that first
// wrote it: another daemon's PUT or DELETE of it gets 403 naming the owner
// (an admin's passes).
//
// Malformed requests get 400 and unknown paths 404, each with a JSON body
// {"error": "..."}; bodies over the limit get 413.
#pragma once

#include "base/auth.h"
#include "httplib.h"
#include "master/master.h"

namespace tierkv::master {

struct HttpLimits {
  size_t max_body = 16 << 20;
  size_t max_key_bytes = 4096;
  const auth::Authenticator* auth = nullptr;  // null: every caller is admitted; must outlive the server
  bool open_metrics = false;
  bool open_health = true;
  // Served over TLS with a client CA: a request to anything but the open
  // probes also needs a verified client certificate, as the gRPC port does.
  bool require_certificate = false;
};

// Installs the routes on `server`; `master` must outlive it.
void InstallHttpRoutes(httplib::Server* server, Master* master, HttpLimits limits);

}  // namespace tierkv::master
