// tierkv-master's configuration: the one table that defines its flags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "config/flags.h"

namespace tierkv {

struct MasterConfig {
  std::string listen;
  std::string auth;        // none | token (base/auth.h)
  std::string token_file;  // the accepted tokens, for --auth token
  // TLS on the master's gRPC port (base/auth.h TlsFiles).
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  bool insecure_allow_remote = false;
  bool open_metrics = false;  // /metrics without a token
  bool open_health = true;    // /health and /ready without a token
  int64_t rpc_port = 0;
  int64_t http_port = 0;
  std::string data_dir;
  absl::Duration segment_ttl;
  absl::Duration put_timeout;
  absl::Duration revoke_grace;
  absl::Duration ssd_offload_timeout;
  absl::Duration ssd_grace;
  absl::Duration data_grant_ttl;
  std::string ssd_admission;  // read | all
  absl::Duration lease_ttl;
  absl::Duration pressure_lease;
  absl::Duration check_interval;
  double high_watermark = 0;
  double low_watermark = 0;
  std::string eviction_policy;  // lru | prefix | chain
  int64_t shards = 0;
  int64_t max_key_bytes = 0;
  int64_t max_batch = 0;
  int64_t max_pending_per_client = 0;
  int64_t max_pending_per_tenant = 0;
  int64_t max_reservations_per_client = 0;
  int64_t max_reservations_per_tenant = 0;
  std::string query_stats_key_prefix_separator;
  int64_t query_stats_max_prefixes = 0;
  uint64_t hit_bound_sketch_bytes = 0;
  uint64_t max_message_size = 0;
  uint64_t max_http_body = 0;
  int64_t http_threads = 0;
  int64_t rpc_threads = 0;
  int64_t http_max_connections = 0;
  absl::Duration http_idle_timeout;
  int64_t direct_max_connections = 0;
  absl::Duration direct_idle_timeout;
  absl::Duration direct_spin;
  int64_t direct_spinners = 0;
  // High availability (master/ha.h).
  std::string etcd;
  std::string cluster_id;
  std::string advertise;
  absl::Duration ha_lease_ttl;
  std::string ha_sync;  // semi | async
  absl::Duration ha_sync_timeout;
  std::string ha_token_file;  // the token a standby presents under --auth token
  std::string kv_events_endpoint;
  std::string kv_events_replay_endpoint;
  std::string kv_events_topic;
  std::string kv_events_format;
  absl::Duration kv_events_batch_interval;
  int64_t kv_events_max_batch = 0;
  int64_t kv_events_buffer = 0;
  int64_t kv_events_queue = 0;
};

const FlagTable<MasterConfig>& MasterFlags();

}  // namespace tierkv
