// tierkvctl's configuration: the one table that defines its flags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "config/flags.h"

namespace tierkv {

struct CtlConfig {
  std::string master;     // gRPC host:port
  std::string http;       // the master's HTTP host:port
  std::string token_file;  // the caller's token for a master running --auth token
  // TLS on the master's gRPC port (base/auth.h TlsFiles).
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  bool json = false;
  std::string transport;  // comma-separated preference for put/get/doctor
  int64_t replicas = 0;
  bool force = false;
  absl::Duration timeout;
  absl::Duration interval;  // top
  int64_t iterations = 0;   // top; 0: unbounded
};

const FlagTable<CtlConfig>& CtlFlags();

}  // namespace tierkv
