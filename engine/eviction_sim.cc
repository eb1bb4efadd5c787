// The page-level eviction simulator (eviction_sim.h). Each policy is a small
// class over dense page ids; the driver feeds them what the store sees.
#include "engine/eviction_sim.h"

#include <algorithm>
#include <memory>
#include <set>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "engine/page_key.h"

namespace tierkv::engine {
namespace {

constexpr uint32_t kNone = UINT32_MAX;

// A doubly linked list over page ids (head = most recent).
class IdList {
 public:
  explicit IdList(size_t n) : prev_(n, kNone), next_(n, kNone), in_(n, false) {}
  bool contains(uint32_t p) const { return in_[p]; }
  uint32_t tail() const { return tail_; }
  void PushHead(uint32_t p) {
    prev_[p] = kNone;
    next_[p] = head_;
    if (head_ != kNone) prev_[head_] = p;
    head_ = p;
    if (tail_ == kNone) tail_ = p;
    in_[p] = true;
  }
  void PushTail(uint32_t p) {
    next_[p] = kNone;
    prev_[p] = tail_;
    if (tail_ != kNone) next_[tail_] = p;
    tail_ = p;
    if (head_ == kNone) head_ = p;
    in_[p] = true;
  }
  // `p` takes `old`'s place; `old` leaves the list.
  void Replace(uint32_t old, uint32_t p) {
    prev_[p] = prev_[old];
    next_[p] = next_[old];
    (prev_[old] != kNone ? next_[prev_[old]] : head_) = p;
    (next_[old] != kNone ? prev_[next_[old]] : tail_) = p;
    prev_[old] = next_[old] = kNone;
    in_[old] = false;
    in_[p] = true;
  }
  void Remove(uint32_t p) {
    if (!in_[p]) return;
    (prev_[p] != kNone ? next_[prev_[p]] : head_) = next_[p];
    (next_[p] != kNone ? prev_[next_[p]] : tail_) = prev_[p];
    prev_[p] = next_[p] = kNone;
    in_[p] = false;
  }

 private:
  std::vector<uint32_t> prev_, next_;
  std::vector<bool> in_;
  uint32_t head_ = kNone, tail_ = kNone;
};

// What every policy shares: membership, capacity and the eviction counters.
class Policy {
 public:
  Policy(const PageTrace& t, size_t capacity) : trace_(t), cap_(capacity), present_(t.unique_pages, false) {}
  virtual ~Policy() = default;
  bool Has(uint32_t p) const { return present_[p]; }
  // A hit on `p` during request `r` (a prefix lookup, then its read).
  virtual void Touch(uint32_t p, size_t r) = 0;
  // `p` was in request `r` but not read (behind the first miss).
  virtual void Seen(uint32_t /*p*/, size_t /*r*/) {}
  // Puts `p`; false when the policy declines to admit it.
  virtual bool Insert(uint32_t p, size_t r) = 0;
  uint64_t evictions = 0;
  std::vector<bool> evicted;  // evicted and not asked for since

 protected:
  void Admit(uint32_t p) {
    present_[p] = true;
    ++size_;
  }
  void Drop(uint32_t p) {
    present_[p] = false;
    --size_;
    ++evictions;
    evicted[p] = true;
  }
  bool Full() const { return size_ > cap_; }
  const PageTrace& trace_;
  const size_t cap_;
  size_t size_ = 0;

 private:
  std::vector<bool> present_;
};

class ExactLru final : public Policy {
 public:
  ExactLru(const PageTrace& t, size_t cap) : Policy(t, cap), list_(t.unique_pages) {}
  void Touch(uint32_t p, size_t) override {
    list_.Remove(p);
    list_.PushHead(p);
  }
  bool Insert(uint32_t p, size_t) override {
    Admit(p);
    list_.PushHead(p);
    while (Full()) {
      uint32_t v = list_.tail();
      list_.Remove(v);
      Drop(v);
    }
    return true;
  }

 private:
  IdList list_;
};

// The master's candidate list: CLOCK over the pages allowed to leave, with a
// reuse counter in place of CLOCK's bit. `leaf_first` restricts candidates
// to pages with no cached child; `chain_recency` decides what a parent
// that rejoins carries.
class MasterClock final : public Policy {
 public:
  struct Options {
    bool leaf_first = true;
    bool chain_recency = true;  // false: the reference bit of its last touch
    uint8_t max_count = 1;
    // A page extending a candidate leaf takes that leaf's place in the
    // list (and not its reference count), so a chain keeps the place of
    // the put that began it.
    bool inherit = false;
  };
  MasterClock(const PageTrace& t, size_t cap, Options o)
      : Policy(t, cap), o_(o), list_(t.unique_pages), count_(t.unique_pages, 0),
        children_(t.unique_pages, 0), link_(t.unique_pages, kNone), access_(t.unique_pages, 0) {}

  void Touch(uint32_t p, size_t) override {
    access_[p] = ++tick_;
    if (count_[p] < o_.max_count) ++count_[p];
  }
  bool Insert(uint32_t p, size_t) override {
    Admit(p);
    count_[p] = 0;
    access_[p] = ++tick_;
    int32_t parent = trace_.parent[p];
    link_[p] = kNone;
    bool placed = false;
    if (o_.leaf_first && parent >= 0 && Has(parent)) {
      link_[p] = static_cast<uint32_t>(parent);
      if (children_[parent]++ == 0) {
        if (o_.inherit && list_.contains(parent)) {
          list_.Replace(parent, p);
          placed = true;
        } else {
          list_.Remove(parent);
        }
      }
    }
    if (!placed) list_.PushHead(p);
    while (Full()) EvictOne();
    return true;
  }

 private:
  void EvictOne() {
    for (;;) {
      uint32_t v = list_.tail();
      list_.Remove(v);
      if (count_[v] > 0) {
        --count_[v];
        list_.PushHead(v);
        continue;
      }
      Drop(v);
      uint32_t parent = link_[v];
      if (parent != kNone && --children_[parent] == 0) {
        if (o_.chain_recency && access_[parent] <= access_[v]) count_[parent] = 0;
        list_.PushTail(parent);
      }
      return;
    }
  }

  const Options o_;
  IdList list_;
  std::vector<uint8_t> count_;
  std::vector<uint32_t> children_, link_;
  std::vector<uint64_t> access_;
  uint64_t tick_ = 0;
};

// Exact LRU among leaves; a lookup touches root to leaf, so each page's
// last touch is its chain's recency.
class LeafLru final : public Policy {
 public:
  // `birth`: leaves ordered by when their chain began instead of by their
  // last touch; a page extending a chain with no other cached branch
  // inherits its parent's birth, a read refreshes nothing.
  LeafLru(const PageTrace& t, size_t cap, bool birth = false)
      : Policy(t, cap), birth_(birth), children_(t.unique_pages, 0), link_(t.unique_pages, kNone), last_(t.unique_pages, 0) {}
  void Touch(uint32_t p, size_t) override {
    if (birth_) return;
    bool leaf = leaves_.erase({last_[p], p}) > 0;
    last_[p] = ++tick_;
    if (leaf) leaves_.insert({last_[p], p});
  }
  bool Insert(uint32_t p, size_t) override {
    Admit(p);
    last_[p] = ++tick_;
    int32_t parent = trace_.parent[p];
    link_[p] = kNone;
    if (parent >= 0 && Has(parent)) {
      link_[p] = static_cast<uint32_t>(parent);
      if (birth_ && children_[parent] == 0 && trace_.parent[parent] >= 0) last_[p] = last_[parent];
      if (children_[parent]++ == 0) leaves_.erase({last_[parent], parent});
    }
    leaves_.insert({last_[p], p});
    while (Full()) {
      auto [t, v] = *leaves_.begin();
      leaves_.erase(leaves_.begin());
      Drop(v);
      uint32_t par = link_[v];
      if (par != kNone && --children_[par] == 0) leaves_.insert({last_[par], par});
    }
    return true;
  }

 private:
  const bool birth_;
  std::set<std::pair<uint64_t, uint32_t>> leaves_;
  std::vector<uint32_t> children_, link_;
  std::vector<uint64_t> last_;
  uint64_t tick_ = 0;
};

// MIN: every put is admitted (as the store admits them), and the cached
// page whose next use (a later request that could hit it) is farthest
// leaves. Admitting nothing that is never used again gives the same
// figures on both traces, so the admission is not where the gap is.
class Belady final : public Policy {
 public:
  Belady(const PageTrace& t, size_t cap) : Policy(t, cap), depth_(t.unique_pages, 0), key_(t.unique_pages) {
    for (uint32_t p = 0; p < t.unique_pages; ++p) {
      if (t.parent[p] >= 0) depth_[p] = depth_[t.parent[p]] + 1;  // parents have lower ids
    }
    // Each page's uses (requests that could hit it), compressed row storage.
    std::vector<uint32_t> n(t.unique_pages + 1, 0);
    for (const auto& r : t.requests) {
      for (uint32_t i = 0; i < r.usable; ++i) ++n[t.pages[r.first + i] + 1];
    }
    for (size_t p = 0; p < t.unique_pages; ++p) n[p + 1] += n[p];
    start_ = n;
    uses_.resize(n.back());
    for (size_t ri = 0; ri < t.requests.size(); ++ri) {
      const auto& r = t.requests[ri];
      for (uint32_t i = 0; i < r.usable; ++i) uses_[n[t.pages[r.first + i]]++] = static_cast<uint32_t>(ri);
    }
    cursor_.assign(start_.begin(), start_.end() - 1);
  }
  void Touch(uint32_t p, size_t r) override { Refresh(p, r); }
  void Seen(uint32_t p, size_t r) override { Refresh(p, r); }
  bool Insert(uint32_t p, size_t r) override {
    Key k{NextUse(p, r), depth_[p], p};
    if (cap_ == 0) return false;
    // Demand paging: the page put now stays; the farthest other one goes.
    while (size_ >= cap_) {
      auto victim = std::prev(cached_.end());
      uint32_t v = std::get<2>(*victim);
      cached_.erase(victim);
      Drop(v);
    }
    Admit(p);
    key_[p] = k;
    cached_.insert(k);
    return true;
  }

 private:
  using Key = std::tuple<uint32_t, uint32_t, uint32_t>;  // next use, depth, page
  uint32_t NextUse(uint32_t p, size_t r) {
    uint32_t& c = cursor_[p];
    while (c < start_[p + 1] && uses_[c] <= r) ++c;
    return c < start_[p + 1] ? uses_[c] : kNone;
  }
  void Refresh(uint32_t p, size_t r) {
    cached_.erase(key_[p]);
    key_[p] = Key{NextUse(p, r), depth_[p], p};
    cached_.insert(key_[p]);
  }
  std::vector<uint32_t> depth_;
  std::vector<Key> key_;
  std::vector<uint32_t> start_, uses_, cursor_;
  std::set<Key> cached_;
};

std::unique_ptr<Policy> MakePolicy(const PageTrace& t, const std::string& name, size_t cap) {
  if (name == "lru") return std::make_unique<ExactLru>(t, cap);
  if (name == "clock") return std::make_unique<MasterClock>(t, cap, MasterClock::Options{.leaf_first = false});
  if (name == "prefix") {
    return std::make_unique<MasterClock>(t, cap, MasterClock::Options{.chain_recency = false});
  }
  if (name == "leaf-lru") return std::make_unique<LeafLru>(t, cap);
  if (name == "birth") return std::make_unique<LeafLru>(t, cap, /*birth=*/true);
  if (name == "chain") return std::make_unique<MasterClock>(t, cap, MasterClock::Options{});
  if (name == "inherit") return std::make_unique<MasterClock>(t, cap, MasterClock::Options{.inherit = true});
  if (name == "belady") return std::make_unique<Belady>(t, cap);
  return nullptr;
}

}  // namespace

absl::StatusOr<std::vector<double>> ParseCapacities(const std::string& list) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    double v = 0;
    if (!absl::SimpleAtod(part, &v) || !(v > 0) || v > 100) {
      return absl::InvalidArgumentError(
          absl::StrCat("capacity '", part, "' is not a share of the written bytes in (0, 100]"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError("no capacity given");
  return out;
}

std::vector<std::string> SimPolicies() { return {"lru", "clock", "prefix", "leaf-lru", "chain", "birth", "inherit", "belady"}; }

PageTrace BuildPageTrace(const std::vector<TraceRequest>& trace, int page_tokens, size_t max_prompt_tokens) {
  PageTrace out;
  out.page_tokens = page_tokens;
  const KeySpace space{"sim", "", ""};
  absl::flat_hash_map<PageKey, uint32_t, PageKeyHash> ids;
  const size_t P = static_cast<size_t>(page_tokens);
  for (const TraceRequest& tr : trace) {
    std::vector<int32_t> prompt = PromptTokens(tr, 512, max_prompt_tokens);
    if (prompt.empty()) continue;
    std::vector<PageKey> keys = PageKeys(absl::MakeConstSpan(prompt).subspan(0, prompt.size() / P * P), page_tokens, space);
    PageTrace::Request r;
    r.first = static_cast<uint32_t>(out.pages.size());
    r.count = static_cast<uint32_t>(keys.size());
    r.usable = static_cast<uint32_t>((prompt.size() - 1) / P);
    r.tokens = prompt.size();
    int32_t parent = -1;
    for (const PageKey& k : keys) {
      auto [it, fresh] = ids.try_emplace(k, static_cast<uint32_t>(out.parent.size()));
      if (fresh) out.parent.push_back(parent);
      out.pages.push_back(it->second);
      parent = static_cast<int32_t>(it->second);
    }
    out.tokens += r.tokens;
    out.requests.push_back(r);
  }
  out.unique_pages = out.parent.size();
  return out;
}

absl::StatusOr<SimResult> Simulate(const PageTrace& t, const std::string& policy, size_t capacity_pages) {
  std::unique_ptr<Policy> pol = MakePolicy(t, policy, capacity_pages);
  if (pol == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("eviction policy '", policy, "' is not one of ", absl::StrJoin(SimPolicies(), ", ")));
  }
  pol->evicted.assign(t.unique_pages, false);
  SimResult res;
  res.policy = policy;
  res.capacity_pages = capacity_pages;
  std::vector<bool> written(t.unique_pages, false);
  for (size_t ri = 0; ri < t.requests.size(); ++ri) {
    const PageTrace::Request& r = t.requests[ri];
    const uint32_t* pages = t.pages.data() + r.first;
    uint32_t hit = 0;
    while (hit < r.usable && pol->Has(pages[hit])) ++hit;
    res.hit_tokens += static_cast<uint64_t>(hit) * t.page_tokens;
    for (uint32_t i = hit; i < r.usable; ++i) {
      if (!pol->Has(pages[i]) && pol->evicted[pages[i]]) {
        ++res.evicted_reused;
        pol->evicted[pages[i]] = false;
      }
    }
    for (uint32_t i = 0; i < hit; ++i) pol->Touch(pages[i], ri);
    for (uint32_t i = hit; i < r.count; ++i) {
      if (pol->Has(pages[i])) pol->Seen(pages[i], ri);
    }
    for (uint32_t i = hit; i < r.count; ++i) {
      uint32_t p = pages[i];
      if (pol->Has(p) || !pol->Insert(p, ri)) continue;
      ++res.puts;
      if (written[p]) ++res.reputs;
      written[p] = true;
    }
  }
  res.evictions = pol->evictions;
  res.hit_rate = t.tokens ? static_cast<double>(res.hit_tokens) / t.tokens : 0;
  return res;
}

}  // namespace tierkv::engine
