#include "tests/support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/support/wait.h"

namespace tierkv::testing {

std::string BinaryPath(const std::string& name) {
  return absl::StrCat(TIERKV_BIN_DIR, "/", name);
}

std::string MakeTempDir(const std::string& prefix) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl = absl::StrCat(base ? base : "/tmp", "/", prefix, "XXXXXX");
  char* dir = mkdtemp(tmpl.data());
  return dir ? std::string(dir) : std::string();
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::string& binary, const std::vector<std::string>& args,
    const std::map<std::string, std::string>& env, absl::Duration timeout) {
  static std::atomic<int> counter{0};
  auto child = std::unique_ptr<ChildProcess>(new ChildProcess());
  child->log_path_ = absl::StrCat(MakeTempDir("tierkv-log"), "/", getpid(), "-",
                                  counter.fetch_add(1), ".stderr");
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  std::vector<std::string> argv_s{binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    // Die with the test: a test that crashes must not leave daemons behind
    // holding memory and ports for the tests after it.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(out[1], STDOUT_FILENO);
    int err = open(child->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (err >= 0) dup2(err, STDERR_FILENO);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  close(out[1]);
  child->pid_ = pid;
  child->stdout_fd_ = out[0];

  // Read the first line with a deadline.
  absl::Time deadline = absl::Now() + timeout;
  std::string line;
  while (line.find('\n') == std::string::npos) {
    int ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (ms <= 0) {
      child->Kill(SIGKILL);
      return absl::DeadlineExceededError(absl::StrCat(binary, " printed no listening line: ", child->Stderr()));
    }
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, ms) <= 0) continue;
    char buf[256];
    ssize_t n = read(out[0], buf, sizeof buf);
    if (n <= 0) {
      child->Wait(absl::Seconds(5));
      return absl::UnavailableError(absl::StrCat(binary, " exited before listening (code ",
                                                 child->exit_code_, "): ", child->Stderr()));
    }
    line.append(buf, n);
  }
  child->first_line_ = line.substr(0, line.find('\n'));
  for (absl::string_view word : absl::StrSplit(child->first_line_, ' ')) {
    std::pair<std::string, std::string> kv = absl::StrSplit(word, absl::MaxSplits('=', 1));
    int port;
    if (absl::SimpleAtoi(kv.second, &port)) child->ports_[kv.first] = port;
  }
  return child;
}

ChildProcess::~ChildProcess() {
  if (Running()) {
    Kill(SIGKILL);
    Wait(absl::Seconds(5));
  }
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

int ChildProcess::port(const std::string& name) const {
  auto it = ports_.find(name);
  return it == ports_.end() ? 0 : it->second;
}

void ChildProcess::Kill(int sig) {
  if (pid_ > 0 && !exited_) ::kill(pid_, sig);
}

bool ChildProcess::Running() {
  if (pid_ <= 0 || exited_) return false;
  int status;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exited_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }
  return true;
}

int ChildProcess::Wait(absl::Duration timeout) {
  if (!WaitFor(absl::StrCat("pid ", pid_, " to exit"), timeout, [&] { return !Running(); }).ok()) return -1;
  return exit_code_;
}

std::string ChildProcess::Stderr() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace tierkv::testing
