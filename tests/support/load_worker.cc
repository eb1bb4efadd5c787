// tierkv-test-worker: one process of a multi-process load test. It puts,
// gets and removes values on a small set of hot keys; every value names its
// writer and key and carries a payload derived from them, so a reader can
// tell a correct value from any other bytes. Prints one JSON line of
// counts; exits 1 if any get returned bytes that do not verify.
//
//   tierkv-test-worker <master> <metadata-url> <worker-id> <keys> <ops> <seed>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "config/base/crc32c.h"

namespace {

std::string Payload(const std::string& header, size_t size) {
  std::string p(size, '\0');
  std::mt19937_64 rng(tierkv::Crc32c(header.data(), header.size()));
  for (size_t i = 0; i < size; i += 8) {
    uint64_t x = rng();
    std::memcpy(p.data() + i, &x, std::min<size_t>(8, size - i));
  }
  return p;
}

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

}  // namespace

int main(int argc, char** argv) {
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
  tierkv::client::ClientOptions o;
  o.master = argv[1];
  o.metadata = argv[2];
  o.transfer_timeout = absl::Seconds(10);
  auto client = tierkv::client::Client::Create(o);
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
