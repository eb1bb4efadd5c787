// Prompts and engine configurations shared by the engine's tests.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/engine.h"

namespace tierkv::engine {

// `n` deterministic tokens below `vocab`, different for each seed.
inline std::vector<int32_t> Tokens(size_t n, int seed, int vocab = 512) {
  std::vector<int32_t> t(n);
  uint64_t x = seed;
  for (auto& v : t) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int32_t>((x >> 33) % vocab);
  }
  return t;
}

// The small transformer with `page`-token pages and pools small enough
// for tests to fill.
inline EngineConfig SmallModel(int page = 16) {
  EngineConfig c;
  c.page_tokens = page;
  c.l1_pages = 64;
  c.l2_pages = 256;
  return c;
}

}  // namespace tierkv::engine
