// Certificates for TLS tests, made at test time with the openssl command:
// a CA, a server certificate it signs for 127.0.0.1 and localhost, a
// client certificate it signs, and a client certificate signed by another
// CA (which a server trusting the first must refuse).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tierkv::testing {

struct TestCerts {
  std::string ca;  // PEM paths
  std::string server_cert, server_key;
  std::string client_cert, client_key;
  std::string rogue_cert, rogue_key;  // signed by another CA
  std::string other_ca;
};

// Writes them under `dir`. UNAVAILABLE when the openssl command is missing
// or fails (its output in the message).
absl::StatusOr<TestCerts> MakeTestCerts(const std::string& dir);

}  // namespace tierkv::testing
