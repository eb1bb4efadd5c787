// Page keys: a chained hash of (parent page key, the page's token ids,
// model id, KV dtype, layout, tensor-parallel rank), printed as 32 hex
// characters. Equal prefixes give equal keys in every worker; a different
// model, dtype or layout can never collide with them. Deterministic across
// processes and machines (no per-process hash seeds).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace tierkv::engine {

struct KeySpace {
  std::string model_id;  // e.g. "tiny-2l-128h-s7" or "synthetic-64B"
  std::string dtype;     // "bf16", "fp16"
  std::string layout;    // e.g. "p64-tp2"
};

struct PageKey {
  uint64_t hi = 0, lo = 0;
  std::string Hex() const;
  bool operator==(const PageKey& o) const { return hi == o.hi && lo == o.lo; }
};

struct PageKeyHash {
  size_t operator()(const PageKey& k) const { return k.hi ^ (k.lo * 31); }
};

// The key of a page following `parent` (zero for the first page).
PageKey ChainKey(const PageKey& parent, absl::Span<const int32_t> page_tokens, const KeySpace& space);
// The store key of one rank's slice of a page (tp > 1), or the page key's
// hex when tp == 1.
std::string RankKey(const PageKey& page, int rank, int tp);

// Keys of every whole page of `tokens`.
std::vector<PageKey> PageKeys(absl::Span<const int32_t> tokens, int page_tokens, const KeySpace& space);

}  // namespace tierkv::engine
