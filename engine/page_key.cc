#include "engine/page_key.h"

#include "absl/strings/str_format.h"

namespace tierkv::engine {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

struct Hasher {
  uint64_t a, b;
  void Add(uint64_t v) {
    a = Mix(a ^ v) + 0x9e3779b97f4a7c15ull;
    b = Mix(b + v * 0xc2b2ae3d27d4eb4full) ^ (a >> 17);
  }
  void Add(const std::string& s) {
    Add(s.size());
    for (unsigned char ch : s) Add(ch);
  }
};

}  // namespace

std::string PageKey::Hex() const { return absl::StrFormat("%016x%016x", hi, lo); }

PageKey ChainKey(const PageKey& parent, absl::Span<const int32_t> page_tokens, const KeySpace& space) {
  Hasher h{0x243f6a8885a308d3ull, 0x13198a2e03707344ull};
  h.Add(parent.hi);
  h.Add(parent.lo);
  h.Add(space.model_id);
  h.Add(space.dtype);
  h.Add(space.layout);
  h.Add(page_tokens.size());
  for (int32_t t : page_tokens) h.Add(static_cast<uint32_t>(t));
  return {Mix(h.a), Mix(h.b ^ h.a)};
}

std::string RankKey(const PageKey& page, int rank, int tp) {
  if (tp <= 1) return page.Hex();
  return absl::StrFormat("%s-r%d", page.Hex(), rank);
}

std::vector<PageKey> PageKeys(absl::Span<const int32_t> tokens, int page_tokens, const KeySpace& space) {
  std::vector<PageKey> keys;
  PageKey parent;
  for (size_t at = 0; at + page_tokens <= tokens.size(); at += page_tokens) {
    parent = ChainKey(parent, tokens.subspan(at, page_tokens), space);
    keys.push_back(parent);
  }
  return keys;
}

}  // namespace tierkv::engine
