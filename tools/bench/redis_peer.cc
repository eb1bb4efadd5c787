#include "tools/bench/redis_peer.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tools/bench/harness.h"
#include "base/net/socket.h"

extern char** environ;

namespace tierkv::bench {
namespace {

// The first executable `name` on PATH, or "".
std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path ? path : "/usr/bin:/bin", ':')) {
    std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", name);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

struct ContextDeleter {
  void operator()(redisContext* c) const { redisFree(c); }
};
using Context = std::unique_ptr<redisContext, ContextDeleter>;
struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

absl::StatusOr<Context> Connect(int port) {
  timeval tv{2, 0};
  Context c(redisConnectWithTimeout("127.0.0.1", port, tv));
  if (!c) return absl::UnavailableError("redis: out of memory");
  if (c->err) return absl::UnavailableError(absl::StrCat("redis on port ", port, ": ", c->errstr));
  return c;
}

absl::StatusOr<Reply> Command(redisContext* c, const std::vector<std::string>& args) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const std::string& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  Reply r(static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data())));
  if (!r) return absl::UnavailableError(absl::StrCat("redis: ", c->errstr));
  if (r->type == REDIS_REPLY_ERROR) return absl::UnavailableError(absl::StrCat("redis: ", r->str));
  return r;
}

// Sends `batch` commands (SET key value, or GET key) as one pipeline and
// reads every reply; for GET, each reply must be a string of `value` bytes.
absl::Status Pipeline(redisContext* c, bool set, const std::vector<std::string>& keys, const std::string& value) {
  for (const std::string& k : keys) {
    const char* argv[3] = {set ? "SET" : "GET", k.data(), value.data()};
    size_t lens[3] = {3, k.size(), value.size()};
    if (redisAppendCommandArgv(c, set ? 3 : 2, argv, lens) != REDIS_OK) {
      return absl::UnavailableError(absl::StrCat("redis: ", c->errstr));
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(c, &raw) != REDIS_OK || raw == nullptr) {
      return absl::UnavailableError(absl::StrCat("redis: ", c->errstr));
    }
    Reply r(static_cast<redisReply*>(raw));
    if (r->type == REDIS_REPLY_ERROR) return absl::UnavailableError(absl::StrCat("redis: ", r->str));
    if (!set && (r->type != REDIS_REPLY_STRING || r->len != value.size())) {
      return absl::DataLossError(absl::StrCat("redis: ", keys[i], " came back with the wrong size"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<RedisPeer>> RedisPeer::Start(uint64_t max_memory) {
  const std::string binary = FindOnPath("redis-server");
  if (binary.empty()) return absl::NotFoundError("redis-server is not installed (no redis-server on PATH)");
  absl::Status last = absl::UnavailableError("redis-server did not start");
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::unique_ptr<RedisPeer> peer(new RedisPeer());
    peer->port_ = net::FreeLoopbackPort();
    if (peer->port_ == 0) return absl::UnavailableError("no free loopback port for redis-server");
    std::vector<std::string> args = {binary,         "--port",      std::to_string(peer->port_),
                                     "--bind",       "127.0.0.1",   "--save",
                                     "",             "--appendonly", "no",
                                     "--maxmemory",  std::to_string(max_memory),
                                     "--maxmemory-policy", "allkeys-lru",
                                     "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    int rc = posix_spawn(&peer->pid_, binary.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      peer->pid_ = -1;
      return absl::UnavailableError(absl::StrCat("cannot start ", binary, ": ", strerror(rc)));
    }
    // Up when it answers PING; bounded, and given up early if it exited.
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (absl::Now() < until) {
      int status = 0;
      if (waitpid(peer->pid_, &status, WNOHANG) == peer->pid_) {
        peer->pid_ = -1;
        last = absl::UnavailableError(absl::StrCat("redis-server exited at start (port ", peer->port_, ")"));
        break;
      }
      absl::StatusOr<Context> c = Connect(peer->port_);
      if (c.ok() && Command(c->get(), {"PING"}).ok()) {
        absl::StatusOr<Reply> info = Command(c->get(), {"INFO", "server"});
        peer->version_ = "redis-server";
        if (info.ok() && (*info)->type == REDIS_REPLY_STRING) {
          for (absl::string_view line : absl::StrSplit((*info)->str, "\r\n")) {
            if (absl::ConsumePrefix(&line, "redis_version:")) peer->version_ = absl::StrCat("redis-server ", line);
          }
        }
        return peer;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  return last;
}

RedisPeer::~RedisPeer() {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  for (int i = 0; i < 200; ++i) {
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
    absl::SleepFor(absl::Milliseconds(10));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
}

absl::Status RegisterRedisCases(const RedisPeer& peer, uint64_t value, int batch, int threads,
                                const std::string& prefix) {
  const int port = peer.port();
  const std::string payload(value, 'x');
  {
    absl::StatusOr<Context> c = Connect(port);
    if (!c.ok()) return c.status();
    for (int t = 0; t < threads; ++t) {
      std::vector<std::string> keys;
      for (int i = 0; i < batch; ++i) keys.push_back(absl::StrCat(prefix, "-get-", t, "-", i));
      if (absl::Status s = Pipeline(c->get(), true, keys, payload); !s.ok()) return s;
    }
  }
  auto counter = std::make_shared<std::atomic<uint64_t>>(0);
  auto run = [port, value, batch, prefix, counter](benchmark::State& state, bool set) {
    absl::StatusOr<Context> c = Connect(port);
    if (!c.ok()) {
      state.SkipWithError(std::string(c.status().message()).c_str());
      return;
    }
    std::string data(value, set ? 'p' : 'x');
    std::vector<std::string> keys(batch);
    for (int i = 0; i < batch; ++i) keys[i] = absl::StrCat(prefix, "-get-", state.thread_index(), "-", i);
    LatencyRecorder lat;
    for (auto _ : state) {
      if (set) {
        for (int i = 0; i < batch; ++i) keys[i] = absl::StrCat(prefix, "-put-", counter->fetch_add(1));
      }
      absl::Time t0 = absl::Now();
      absl::Status s = Pipeline(c->get(), set, keys, data);
      lat.Add(absl::Now() - t0);
      if (!s.ok()) {
        state.SkipWithError(std::string(s.message()).c_str());
        return;
      }
    }
    state.SetBytesProcessed(state.iterations() * batch * value);
    state.SetItemsProcessed(state.iterations() * batch);
    lat.Publish(state);
  };
  benchmark::RegisterBenchmark((prefix + "/put").c_str(), [run](benchmark::State& s) { run(s, true); })
      ->UseRealTime()
      ->Threads(threads);
  benchmark::RegisterBenchmark((prefix + "/get").c_str(), [run](benchmark::State& s) { run(s, false); })
      ->UseRealTime()
      ->Threads(threads);
  return absl::OkStatus();
}

}  // namespace tierkv::bench
