// ChildProcess: starts one of tierkv's real binaries for an integration
// test and learns its ports from its first line of output
// ("listening rpc=<p> http=<p>" or "listening port=<p> http=<p>"), so tests
// bind port 0 and never race for ports.
//
//   ASSERT_OK_AND_ASSIGN(auto master, ChildProcess::Start(
//       BinaryPath("tierkv-master"), {"--rpc-port=0", "--http-port=0"}));
//   int port = master->port("rpc");
//   master->Kill(SIGKILL);
//
// The destructor SIGKILLs a process that is still running. Stderr goes to
// a log file under the test's temp dir, printed when the test fails.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierkv::testing {

// Path of a built binary (the build directory is compiled in).
std::string BinaryPath(const std::string& name);

// A fresh directory under TEST_TMPDIR or /tmp, removed by the caller.
std::string MakeTempDir(const std::string& prefix);

class ChildProcess {
 public:
  // Starts `binary` with `args` (and extra `env` entries) and waits up to
  // `timeout` for its "listening ..." line. DEADLINE_EXCEEDED if it does
  // not come; UNAVAILABLE if the process exits first (with its stderr).
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(
      const std::string& binary, const std::vector<std::string>& args,
      const std::map<std::string, std::string>& env = {},
      absl::Duration timeout = absl::Seconds(20));
  ~ChildProcess();

  // The port named in the first line ("rpc", "http", "port"); 0 if absent.
  int port(const std::string& name) const;
  pid_t pid() const { return pid_; }
  const std::string& first_line() const { return first_line_; }

  void Kill(int sig);
  // Waits for exit; returns the exit code, 128+signal, or -1 on timeout.
  int Wait(absl::Duration timeout = absl::Seconds(20));
  bool Running();
  std::string Stderr() const;

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = -1;
  int stdout_fd_ = -1;
  std::string first_line_;
  std::string log_path_;
  std::map<std::string, int> ports_;
};

}  // namespace tierkv::testing
