// tierkv's (demo, trace replay and eviction simulation) configuration: one table for its flags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "config/flags.h"

namespace tierkv {

struct TierkvConfig {
  std::string master;        // host:port; empty = an embedded cluster
  std::string metadata;      // http://host:port (with --master)
  std::string token_file;    // with --master: the token for a master running --auth token
  // TLS on the master's gRPC port (base/auth.h TlsFiles).
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string trace;
  int64_t offset = 0;
  int64_t requests = 0;
  std::string mode;          // model | synthetic
  int64_t model_requests = 0;
  int64_t max_prompt_tokens = 0;
  int64_t page_tokens = 0;
  int64_t l1_pages = 0;
  int64_t l2_pages = 0;
  std::string l1_device;     // auto | cpu | cuda:<n>
  uint64_t kv_bytes_per_token = 0;
  double tokens_per_s = 0;
  std::string prefetch;
  absl::Duration prefetch_timeout;
  std::string write_policy;
  int64_t selective_hits = 0;
  int64_t tp = 0;
  int64_t window = 0;
  bool parent_keys = true;
  std::string eviction_policy;  // the embedded master's: lru | prefix | chain
  std::string capacity;         // sim (a list) and replay: shares of the bytes the trace writes
  int64_t daemons = 0;
  uint64_t store_size = 0;
  std::string ssd_capacity;   // replay: the embedded daemons' SSD tiers, as a share like capacity
  std::string ssd_admission;  // the embedded master's --ssd-admission
  std::string transport;
  std::string pd;             // replay: "" (off), 1P1D or 2P1D
  bool json = false;
  bool progress = true;
  std::string csv;
  std::string svg;
  int64_t metrics_port = 0;
};

const FlagTable<TierkvConfig>& TierkvFlags();

}  // namespace tierkv
