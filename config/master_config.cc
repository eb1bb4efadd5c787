#include "config/master_config.h"

#include "absl/strings/str_cat.h"

namespace tierkv {

const FlagTable<MasterConfig>& MasterFlags() {
  using C = MasterConfig;
  static const FlagTable<C>* table = new FlagTable<C>(
      "tierkv-master",
      "The tierkv master: segment registry, object index, metadata and metrics. /health is 200 "
      "while it serves; /ready is 200 once persistence is loaded (the HTTP port opens after "
      "RocksDB recovery) and at least one segment is mounted, else 503 with the reason "
      "(\"no segment mounted\"), so gate clients on /ready and launchers of daemons on /health.",
      {
          StringFlag<C>("listen", &C::listen, "127.0.0.1", "address the gRPC and HTTP servers bind"),
          ChoiceFlag<C>("auth", &C::auth, "none", {"none", "token", "mtls"},
                        "who may call: none (anyone; only on a loopback --listen unless "
                        "--insecure-allow-remote), token (a bearer token from --token-file on every "
                        "RPC and HTTP request) or mtls (the caller's client certificate, verified against "
                        "--tls-ca and named by a cert: line of --token-file); docs/security.md"),
          StringFlag<C>("token-file", &C::token_file, "",
                        "for --auth token: the accepted tokens, one '<token> <name> <roles> "
                        "[expires=<RFC 3339>] [tenant=<name>]' per line (roles: daemon, client, admin); "
                        "for --auth mtls: 'cert:<certificate name> <name> <roles> ...' lines; re-read on SIGHUP"),
          StringFlag<C>("tls-cert", &C::tls_cert, "",
                        "PEM certificate chain: serve gRPC and HTTP over TLS (the direct lane is then off); "
                        "with --tls-key; re-read every minute"),
          StringFlag<C>("tls-key", &C::tls_key, "", "PEM private key of --tls-cert"),
          StringFlag<C>("tls-ca", &C::tls_ca, "",
                        "PEM certificates that sign clients' certificates: with it every gRPC caller, and every "
                        "HTTP request but the open probes, must present one they sign (mutual TLS); it also "
                        "verifies daemons' HTTPS and, with --etcd, a standby's leader; needs --tls-cert"),
          BoolFlag<C>("insecure-allow-remote", &C::insecure_allow_remote, "false",
                      "serve --auth none on a routable --listen (logged as a warning)"),
          BoolFlag<C>("open-metrics", &C::open_metrics, "false",
                      "with --auth token, serve /metrics without a token (for a scraper that sends none)"),
          BoolFlag<C>("open-health", &C::open_health, "true",
                      "with --auth token, serve /health, /ready, /healthz and /livez without a token (for probes)"),
          IntFlag<C>("rpc-port", &C::rpc_port, "50051", 0, 65535,
                     "RPC port (gRPC, and the clients' direct lane on the same port); 0 picks a free one"),
          IntFlag<C>("http-port", &C::http_port, "8080", 0, 65535,
                     "HTTP port (metadata, /v1 queries, /metrics, /health, /ready); 0 picks one"),
          StringFlag<C>("data-dir", &C::data_dir, "",
                        "RocksDB directory for the registry, index and metadata; empty keeps "
                        "them in memory only"),
          DurationFlag<C>("segment-ttl", &C::segment_ttl, "10s", 0.01, 86400,
                          "a segment whose heartbeats stop this long is unmounted"),
          DurationFlag<C>("put-timeout", &C::put_timeout, "30s", 0.01, 86400,
                          "a put not committed this long after PutStart is reclaimed"),
          DurationFlag<C>("revoke-grace", &C::revoke_grace, "5s", 0, 3600,
                          "space of a revoked or timed-out put is reused only this long after "
                          "(bytes still in flight from its writer must not land on a new object)"),
          DurationFlag<C>("lease-ttl", &C::lease_ttl, "5s", 0.001, 3600,
                          "how long a read lease keeps an object from eviction"),
          DurationFlag<C>("pressure-lease", &C::pressure_lease, "2s", 0.001, 3600,
                          "the read lease (at most --lease-ttl) for 10 s after DRAM was evicted or ran short; "
                          "such reads are given back by their readers when done; docs/eviction.md"),
          DurationFlag<C>("ssd-offload-timeout", &C::ssd_offload_timeout, "2s", 0.01, 600,
                          "how long the evictor waits for a daemon to copy evicted objects to its SSD "
                          "tier; objects it has not confirmed by then are dropped"),
          ChoiceFlag<C>("ssd-admission", &C::ssd_admission, "read", {"read", "all"},
                        "which evicted objects move to their daemon's SSD tier: read (read at least once "
                        "since their put) or all; docs/eviction.md"),
          DurationFlag<C>("ssd-grace", &C::ssd_grace, "10m", 0, 86400 * 7,
                          "how long the SSD replicas of a daemon that stopped stay indexed (not served) "
                          "for a restart with the same --ssd-dir to take over; 0: they leave with the "
                          "segment"),
          DurationFlag<C>("data-grant-ttl", &C::data_grant_ttl, "10m", 1, 86400,
                          "how long a data grant admits new connections to a daemon running --auth token "
                          "(clients fetch a new one as it runs out; open connections stay)"),
          DurationFlag<C>("check-interval", &C::check_interval, "500ms", 0.001, 60,
                          "period of liveness checks, reclaiming and eviction"),
          DoubleFlag<C>("high-watermark", &C::high_watermark, "0.95", 0.01, 1,
                        "eviction starts when used/capacity passes this"),
          DoubleFlag<C>("low-watermark", &C::low_watermark, "0.90", 0, 1,
                        "eviction stops at this used/capacity"),
          ChoiceFlag<C>("eviction-policy", &C::eviction_policy, "chain", {"chain", "prefix", "lru"},
                        "chain (leaf-first, a parent keeps its chain's recency), prefix (leaf-first as first "
                        "written, for comparison) or lru (ignore parent keys); docs/eviction.md"),
          IntFlag<C>("shards", &C::shards, "16", 1, 256, "object index shards"),
          IntFlag<C>("max-key-bytes", &C::max_key_bytes, "4096", 1, 1 << 20, "longest key accepted"),
          IntFlag<C>("max-batch", &C::max_batch, "65536", 1, 1 << 24, "most keys in one RPC"),
          IntFlag<C>("max-pending-per-client", &C::max_pending_per_client, "65536", 0, 1ll << 32,
                     "most puts one client may have between PutStart and PutEnd; 0: no cap"),
          IntFlag<C>("max-pending-per-tenant", &C::max_pending_per_tenant, "1048576", 0, 1ll << 40,
                     "most puts all clients of one tenant may have between PutStart and PutEnd; 0: no cap"),
          IntFlag<C>("max-reservations-per-client", &C::max_reservations_per_client, "65536", 0, 1ll << 32,
                     "most values one client's read sessions may hold reserved at once; 0: no cap"),
          IntFlag<C>("max-reservations-per-tenant", &C::max_reservations_per_tenant, "1048576", 0, 1ll << 40,
                     "most values all clients of one tenant may hold reserved at once; 0: no cap"),
          StringFlag<C>("query-stats-key-prefix-separator", &C::query_stats_key_prefix_separator, "",
                        "query stats also count per key prefix: the part of a key before the first "
                        "occurrence of this string (\"llama3@...\" -> \"llama3\" for \"@\"); empty: "
                        "per client only"),
          IntFlag<C>("query-stats-max-prefixes", &C::query_stats_max_prefixes, "64", 1, 1 << 16,
                     "most key prefixes counted by name; later ones count as \"other\""),
          SizeFlag<C>("hit-bound-sketch-bytes", &C::hit_bound_sketch_bytes, "8mib", 0, 1ull << 34,
                      "Bloom filter of keys ever stored, for the bound on the hit rate (\"possible\"): "
                      "about 1 % false positives up to bytes*8/9.6 distinct keys (870k per MiB); 0: "
                      "no bound"),
          SizeFlag<C>("max-message-size", &C::max_message_size, "16mib", 1024, 1u << 31,
                      "largest gRPC message received or sent"),
          SizeFlag<C>("max-http-body", &C::max_http_body, "16mib", 1024, 1u << 31,
                      "largest HTTP request body (413 beyond)"),
          IntFlag<C>("rpc-threads", &C::rpc_threads, "0", 0, 256,
                     "gRPC threads, each polling its own completion queue and running the handlers "
                     "it takes inline; one has no hand-off between threads per RPC (the lowest "
                     "latency), more serve many clients and long batches side by side; 0: a quarter "
                     "of the usable cores (affinity, cgroup CPU quota), at least 1 and at most 16 (docs/performance.md)"),
          IntFlag<C>("http-threads", &C::http_threads, "8", 1, 256,
                     "HTTP worker threads (a connection holds one only while a request is in it)"),
          IntFlag<C>("http-max-connections", &C::http_max_connections, "8192", 1, 1 << 20,
                     "open HTTP connections beyond this are answered 503 and closed"),
          DurationFlag<C>("http-idle-timeout", &C::http_idle_timeout, "60s", 0.01, 86400,
                          "an HTTP connection idle this long is closed"),
          IntFlag<C>("direct-max-connections", &C::direct_max_connections, "4096", 1, 1 << 20,
                     "clients' direct-lane connections (each served by a thread of its own) beyond this "
                     "are refused, and those clients use gRPC; docs/wire-formats.md"),
          DurationFlag<C>("direct-idle-timeout", &C::direct_idle_timeout, "5m", 0.01, 86400,
                          "a direct-lane connection idle this long is closed (clients reuse theirs only "
                          "within 60 s)"),
          DurationFlag<C>("direct-spin", &C::direct_spin, "100us", 0, 0.001,
                          "after a reply, a direct-lane connection whose calls come back to back (the "
                          "last within twice this of the reply before it) polls for its next call this "
                          "long before sleeping, which saves its client a wake-up per call; replication "
                          "streams between masters poll as long for the next frame or acknowledgement; "
                          "0s: never spin (docs/performance.md)"),
          IntFlag<C>("direct-spinners", &C::direct_spinners, "0", 0, 256,
                     "at most this many direct-lane connections spin at once (others sleep); 0: a "
                     "quarter of the usable cores, 1 to 16"),
          StringFlag<C>("etcd", &C::etcd, "",
                        "etcd members (host:port,...) for high availability: masters of one --cluster-id "
                        "elect a leader there, the others copy its store and take over when it is lost; "
                        "needs --data-dir and --advertise. Empty: a single master. docs/ha.md"),
          StringFlag<C>("cluster-id", &C::cluster_id, "default",
                        "with --etcd: the masters that elect one leader among them (keys under /tierkv/<id>/)"),
          StringFlag<C>("advertise", &C::advertise, "",
                        "with --etcd: host:port of this master's RPC port as the other masters and clients "
                        "dial it"),
          DurationFlag<C>("ha-lease-ttl", &C::ha_lease_ttl, "3s", 2, 60,
                          "with --etcd: the leader's etcd lease; a lost leader is replaced about this long "
                          "after it stopped renewing, and it stops serving a third of it before that"),
          ChoiceFlag<C>("ha-sync", &C::ha_sync, "semi", {"semi", "async"},
                        "with --etcd: semi (a write is acknowledged once a standby has it, unless none "
                        "answers within --ha-sync-timeout) or async (standbys may lag behind what was "
                        "acknowledged)"),
          DurationFlag<C>("ha-sync-timeout", &C::ha_sync_timeout, "1s", 0.001, 60,
                          "with --ha-sync semi: how long a write waits for a standby before the leader "
                          "goes on without one (logged; until a standby has caught up again)"),
          StringFlag<C>("ha-token-file", &C::ha_token_file, "",
                        "with --etcd and --auth token: a file whose first word is the token this master "
                        "presents to the leader as a standby; the leader's --token-file must give its caller "
                        "the admin role (replication reads every tenant's index)"),
          StringFlag<C>("kv-events-endpoint", &C::kv_events_endpoint, "",
                        "ZeroMQ PUB endpoint for KV events in vLLM's layout (tcp://*:5557; a "
                        "port of * picks one, logged); empty: no events. docs/kv-events.md"),
          StringFlag<C>("kv-events-replay-endpoint", &C::kv_events_replay_endpoint, "",
                        "ZeroMQ ROUTER endpoint answering replay requests from a sequence "
                        "number; empty: no replay"),
          StringFlag<C>("kv-events-topic", &C::kv_events_topic, "kv-events",
                        "topic frame of every KV event message"),
          ChoiceFlag<C>("kv-events-format", &C::kv_events_format, "array", {"array", "map"},
                        "event encoding: array (vLLM's msgspec array_like, tag first) or map "
                        "(field names and a \"type\" tag)"),
          DurationFlag<C>("kv-events-batch-interval", &C::kv_events_batch_interval, "10ms", 0.001, 60,
                          "events are gathered this long into one batch"),
          IntFlag<C>("kv-events-max-batch", &C::kv_events_max_batch, "1024", 1, 1 << 20,
                     "most events in one batch"),
          IntFlag<C>("kv-events-buffer", &C::kv_events_buffer, "10000", 0, 1 << 24,
                     "recent batches kept for replay"),
          IntFlag<C>("kv-events-queue", &C::kv_events_queue, "1048576", 1, 1ll << 30,
                     "events waiting to be published; beyond it they are dropped and counted "
                     "(tierkv_master_kv_events_dropped_total), so the master never waits"),
      },
      [](const C& c) {
        if (!c.etcd.empty() && (c.data_dir.empty() || c.advertise.empty())) {
          return absl::InvalidArgumentError("--etcd needs --data-dir (the copy a standby keeps) and --advertise");
        }
        if (!c.etcd.empty() && c.rpc_port == 0) {
          return absl::InvalidArgumentError("--etcd needs a fixed --rpc-port: the other masters dial --advertise");
        }
        if (c.low_watermark > c.high_watermark) {
          return absl::InvalidArgumentError("--low-watermark must not exceed --high-watermark");
        }
        if (!c.etcd.empty() && c.auth == "token" && c.ha_token_file.empty()) {
          return absl::InvalidArgumentError(
              "--etcd with --auth token needs --ha-token-file: standbys present its token (admin role) to the leader");
        }
        if (c.auth != "none" && c.token_file.empty()) {
          return absl::InvalidArgumentError(absl::StrCat("--auth ", c.auth, " needs --token-file"));
        }
        if (c.auth == "mtls" && (c.tls_cert.empty() || c.tls_ca.empty())) {
          return absl::InvalidArgumentError(
              "--auth mtls needs --tls-cert, --tls-key and --tls-ca (the CA that signs callers' certificates)");
        }
        if (c.tls_cert.empty() != c.tls_key.empty()) {
          return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
        }
        if (!c.tls_ca.empty() && c.tls_cert.empty()) return absl::InvalidArgumentError("--tls-ca needs --tls-cert");
        if (!c.etcd.empty() && !c.tls_cert.empty() && c.tls_ca.empty()) {
          return absl::InvalidArgumentError(
              "--etcd with --tls-cert needs --tls-ca: a standby verifies its leader's certificate with it");
        }
        if (c.kv_events_endpoint.empty() && !c.kv_events_replay_endpoint.empty()) {
          return absl::InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint");
        }
        return absl::OkStatus();
      });
  return *table;
}

}  // namespace tierkv
