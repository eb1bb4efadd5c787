#include "tests/support/tls_certs.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace tierkv::testing {
namespace {

// Runs `cmd` in `dir`; its output joins the error.
absl::Status Run(const std::string& dir, const std::string& cmd) {
  const std::string log = dir + "/openssl.log";
  const int rc = std::system(absl::StrCat("cd '", dir, "' && ", cmd, " >'", log, "' 2>&1").c_str());
  if (rc == 0) return absl::OkStatus();
  std::ifstream in(log);
  std::stringstream out;
  out << in.rdbuf();
  return absl::UnavailableError(absl::StrCat("openssl failed (", cmd, "): ", out.str()));
}

// A P-256 key and a certificate for `cn` signed by `ca` (extensions `ext`).
absl::Status Issue(const std::string& dir, const std::string& name, const std::string& cn, const std::string& ca,
                   const std::string& ext) {
  std::ofstream(dir + "/" + name + ".ext") << ext << "\n";
  if (absl::Status s = Run(dir, absl::StrCat("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ",
                                             name, ".key -out ", name, ".csr -subj /CN=", cn));
      !s.ok()) {
    return s;
  }
  return Run(dir, absl::StrCat("openssl x509 -req -in ", name, ".csr -CA ", ca, ".pem -CAkey ", ca,
                               ".key -CAcreateserial -days 2 -out ", name, ".pem -extfile ", name, ".ext"));
}

}  // namespace

absl::StatusOr<TestCerts> MakeTestCerts(const std::string& dir) {
  for (const char* ca : {"ca", "other-ca"}) {
    if (absl::Status s = Run(dir, absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
                                               "-keyout ", ca, ".key -out ", ca, ".pem -days 2 -subj /CN=tierkv-test-",
                                               ca));
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = Issue(dir, "server", "tierkv-master", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost"); !s.ok()) {
    return s;
  }
  if (absl::Status s = Issue(dir, "client", "decode-1", "ca", "subjectAltName=DNS:decode-1.tierkv"); !s.ok()) return s;
  if (absl::Status s = Issue(dir, "rogue", "decode-1", "other-ca", "subjectAltName=DNS:decode-1.tierkv"); !s.ok()) {
    return s;
  }
  auto at = [&](const std::string& f) { return dir + "/" + f; };
  return TestCerts{at("ca.pem"),     at("server.pem"), at("server.key"), at("client.pem"),
                   at("client.key"), at("rogue.pem"),  at("rogue.key"),  at("other-ca.pem")};
}

}  // namespace tierkv::testing
