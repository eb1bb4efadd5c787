// Values that any reader can check: bytes derived from a seed string, so a
// test process and a worker process agree on a key's value without talking.
#pragma once

#include <algorithm>
#include <cstring>
#include <random>
#include <string>

#include "base/crc32c.h"

namespace tierkv::testing {

// `size` bytes derived from `seed`.
inline std::string Payload(const std::string& seed, size_t size) {
  std::string p(size, '\0');
  std::mt19937_64 rng(Crc32c(seed.data(), seed.size()));
  for (size_t i = 0; i < size; i += 8) {
    uint64_t x = rng();
    std::memcpy(p.data() + i, &x, std::min<size_t>(8, size - i));
  }
  return p;
}

// The value of `key` in session runs of tierkv-test-worker: 16 to 80 KiB.
inline std::string SessionValue(const std::string& key) {
  return Payload(key, 16384 + Crc32c(key.data(), key.size()) % 65536);
}

}  // namespace tierkv::testing
