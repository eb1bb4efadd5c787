// tierkv-test-worker: one process of a multi-process load test. It puts,
// gets and removes values on a small set of hot keys; every value names its
// writer and key and carries a payload derived from them, so a reader can
// tell a correct value from any other bytes. Prints one JSON line of
// counts; exits 1 if any get returned bytes that do not verify.
//
//   tierkv-test-worker <master> <metadata-url> <worker-id> <keys> <ops> <seed>
//
// Session mode: one long-lived client across a cluster event (a daemon
// restarted, a node lost) that the test causes between two phases. Phase 1
// puts and reads back s1-<i>; the worker then writes <dir>/phase1 and waits
// (up to 120 s) for <dir>/go. Phase 2 puts s2-<i> (a failed put is retried,
// up to 5 times, as an engine would), reads each back, and reads every s1
// key again. Values are ValueFor(key) (a reader in the test checks the same
// bytes). Prints one JSON line; exits 1 if any read returned wrong bytes.
//
//   tierkv-test-worker session <master> <metadata-url> <dir> <keys> <replicas> [transports]
#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "base/crc32c.h"
#include "tests/support/values.h"

namespace {

using tierkv::testing::Payload;
using tierkv::testing::SessionValue;

std::string MakeValue(const std::string& key, int worker, int seq, size_t size) {
  std::string header = absl::StrCat(key, "|", worker, "|", seq, "|", size, "\n");
  return header + Payload(header, size);
}

// True when `v` is exactly some writer's value for `key`.
bool Verifies(const std::string& key, const std::string& v) {
  size_t nl = v.find('\n');
  if (nl == std::string::npos) return false;
  std::string header = v.substr(0, nl + 1);
  std::vector<std::string> parts = absl::StrSplit(v.substr(0, nl), '|');
  size_t size = 0;
  if (parts.size() != 4 || parts[0] != key || !absl::SimpleAtoi(parts[3], &size)) return false;
  return v.size() == nl + 1 + size && v.compare(nl + 1, size, Payload(header, size)) == 0;
}

bool Exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// Waits for `dir`/`name` to appear, woken by the directory's inotify events
// rather than by polling; false if it has not within `timeout`.
bool WaitForFile(const std::string& dir, const std::string& name, absl::Duration timeout) {
  const std::string path = dir + "/" + name;
  const int fd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (fd < 0) {
    std::perror("session: inotify_init1");
    return false;
  }
  if (::inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE) < 0) {
    std::perror("session: inotify_add_watch");
    ::close(fd);
    return false;
  }
  const absl::Time deadline = absl::Now() + timeout;
  // Checked after the watch is in place, so a file made in between is seen.
  while (!Exists(path)) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(ms)) > 0) {
      char events[4096];
      while (::read(fd, events, sizeof events) > 0) {
      }
    }
  }
  ::close(fd);
  return Exists(path);
}

absl::StatusOr<std::unique_ptr<tierkv::client::Client>> NewClient(const char* master, const char* metadata,
                                                                 absl::Duration timeout,
                                                                 std::vector<std::string> transports = {}) {
  tierkv::client::ClientOptions o;
  o.master = master;
  o.metadata = metadata;
  o.transfer_timeout = timeout;
  o.rpc_timeout = timeout;
  o.transports = std::move(transports);
  // As the Python client: a master running --auth token gets the token in this file.
  if (const char* f = std::getenv("TIERKV_TOKEN_FILE"); f != nullptr) o.token_file = f;
  return tierkv::client::Client::Create(o);
}

int Session(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s session <master> <metadata-url> <dir> <keys> <replicas> [transports]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[4];
  int keys = 0, replicas = 0;
  if (!absl::SimpleAtoi(argv[5], &keys) || !absl::SimpleAtoi(argv[6], &replicas) || keys <= 0) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  std::vector<std::string> transports;
  if (argc > 7) transports = absl::StrSplit(argv[7], ',', absl::SkipEmpty());
  auto client = NewClient(argv[2], argv[3], absl::Seconds(5), transports);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 3;
  }
  tierkv::client::PutOptions po;
  po.replicas = replicas;
  int wrong = 0;
  // Reads `key` back: 1 verified, 0 missing (NOT_FOUND), -1 another error.
  auto check = [&](const std::string& key) {
    absl::StatusOr<std::string> v = (*client)->Get(key);
    if (v.ok()) {
      if (*v == SessionValue(key)) return 1;
      ++wrong;
      std::fprintf(stderr, "session: %s returned %zu bytes that are not its value\n", key.c_str(), v->size());
      return -1;
    }
    if (!absl::IsNotFound(v.status())) std::fprintf(stderr, "session: get %s: %s\n", key.c_str(), v.status().ToString().c_str());
    return absl::IsNotFound(v.status()) ? 0 : -1;
  };
  int p1_acked = 0, p1_verified = 0;
  for (int i = 0; i < keys; ++i) {
    std::string key = absl::StrCat("s1-", i);
    absl::Status s = (*client)->Put(key, SessionValue(key), po);
    if (!s.ok()) std::fprintf(stderr, "session: put %s: %s\n", key.c_str(), s.ToString().c_str());
    p1_acked += s.ok();
  }
  for (int i = 0; i < keys; ++i) p1_verified += check(absl::StrCat("s1-", i)) == 1;
  {
    std::ofstream(dir + "/phase1.tmp") << "{\"acked\": " << p1_acked << ", \"verified\": " << p1_verified << "}\n";
    std::rename((dir + "/phase1.tmp").c_str(), (dir + "/phase1").c_str());
  }
  if (!WaitForFile(dir, "go", absl::Seconds(120))) {
    std::fprintf(stderr, "session: no go after 120 s\n");
    return 4;
  }
  int p2_acked = 0, p2_retries = 0, p2_verified = 0;
  for (int i = 0; i < keys; ++i) {
    std::string key = absl::StrCat("s2-", i);
    for (int attempt = 0; attempt < 5; ++attempt) {
      absl::Status s = (*client)->Put(key, SessionValue(key), po);
      if (s.ok()) {
        ++p2_acked;
        break;
      }
      ++p2_retries;
      std::fprintf(stderr, "session: put %s (attempt %d): %s\n", key.c_str(), attempt, s.ToString().c_str());
      // A backoff between retries, as an engine's: nothing here to wait on.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  for (int i = 0; i < keys; ++i) p2_verified += check(absl::StrCat("s2-", i)) == 1;
  int s1_verified = 0, s1_missing = 0, s1_errors = 0;
  for (int i = 0; i < keys; ++i) {
    int r = check(absl::StrCat("s1-", i));
    s1_verified += r == 1;
    s1_missing += r == 0;
    s1_errors += r == -1;
  }
  std::printf("{\"p1_acked\": %d, \"p1_verified\": %d, \"p2_acked\": %d, \"p2_retries\": %d, "
              "\"p2_verified\": %d, \"s1_verified\": %d, \"s1_missing\": %d, \"s1_errors\": %d, \"wrong\": %d}\n",
              p1_acked, p1_verified, p2_acked, p2_retries, p2_verified, s1_verified, s1_missing, s1_errors, wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "session") == 0) return Session(argc, argv);
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s <master> <metadata-url> <worker-id> <keys> <ops> <seed>\n", argv[0]);
    return 2;
  }
  int worker = 0, keys = 0, ops = 0, seed = 0;
  if (!absl::SimpleAtoi(argv[3], &worker) || !absl::SimpleAtoi(argv[4], &keys) ||
      !absl::SimpleAtoi(argv[5], &ops) || !absl::SimpleAtoi(argv[6], &seed) || keys <= 0) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  auto client = NewClient(argv[1], argv[2], absl::Seconds(10));
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 3;
  }
  std::mt19937 rng(seed);
  int puts = 0, gets_ok = 0, misses = 0, removes = 0, errors = 0, corrupt = 0;
  for (int i = 0; i < ops; ++i) {
    std::string key = absl::StrCat("hot-", rng() % keys);
    int op = rng() % 10;
    if (op < 4) {
      auto v = (*client)->Get(key);
      if (v.ok()) {
        if (Verifies(key, *v)) {
          ++gets_ok;
        } else {
          ++corrupt;
          std::fprintf(stderr, "worker %d: %s returned %zu bytes that do not verify\n", worker, key.c_str(), v->size());
        }
      } else if (absl::IsNotFound(v.status())) {
        ++misses;
      } else {
        ++errors;
      }
    } else if (op < 8) {
      size_t size = 1024 + rng() % (256 << 10);
      absl::Status s = (*client)->Put(key, MakeValue(key, worker, i, size));
      if (s.ok()) {
        ++puts;
      } else if (!absl::IsAlreadyExists(s)) {
        ++errors;
      }
    } else {
      absl::Status s = (*client)->Remove(key, /*force=*/op == 9);
      if (s.ok()) ++removes;
    }
  }
  std::printf("{\"worker\": %d, \"puts\": %d, \"gets\": %d, \"misses\": %d, \"removes\": %d, \"errors\": %d, "
              "\"corrupt\": %d}\n",
              worker, puts, gets_ok, misses, removes, errors, corrupt);
  return corrupt == 0 ? 0 : 1;
}
