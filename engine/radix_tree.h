// RadixTree: cached KV pages indexed by token ids at page granularity, as
// in SGLang's HiCache. An edge holds a run of whole pages; a lookup walks
// from the root comparing page-sized token runs and returns the longest
// cached prefix. Inserting a prefix that diverges inside a run splits that
// node. docs/radix-tree.md describes the structure and eviction.
//
// Each page carries its residency (L1 slot, L2 slot), pins held by
// running requests, a hit count, and counts of its children that are in the
// tree and in L1, which make leaf-first eviction O(log n): a page is an L1
// candidate when no child is in L1, and can leave the tree (and L2) when it
// has no child at all and is not in L1.
//
// Not thread-safe: the cache that owns it serialises access.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "engine/page_key.h"

namespace tierkv::engine {

struct TreeNode;

struct TreePage {
  PageKey key;
  TreePage* parent = nullptr;  // previous page of the prefix; null at the root
  TreeNode* node = nullptr;
  int l1_slot = -1;
  int l2_slot = -1;
  int pins = 0;
  uint32_t hits = 0;
  bool in_l3 = false;          // put to the store (as far as this cache knows)
  uint64_t last_access = 0;
  int tree_children = 0;       // child pages in the tree
  int l1_children = 0;         // child pages resident in L1
  uint64_t l1_indexed = 0;     // access stamp under which it sits in the L1 candidates (0: absent)
  uint64_t l2_indexed = 0;     // same for the L2 candidates
};

struct TreeNode {
  TreeNode* parent = nullptr;
  std::vector<int32_t> tokens;  // page_tokens per page
  std::vector<TreePage*> pages;
  std::map<uint64_t, std::unique_ptr<TreeNode>> children;  // by hash of the child's first page
};

class RadixTree {
 public:
  explicit RadixTree(int page_tokens);
  ~RadixTree();

  int page_tokens() const { return page_tokens_; }

  // The longest run of whole pages of `tokens` in the tree, in order.
  std::vector<TreePage*> Match(absl::Span<const int32_t> tokens) const;

  // Adds the whole pages of `tokens` beyond the first `have` (which must be
  // the result of Match), keyed by `keys` (one per whole page). Splits a node
  // when the new pages diverge inside it. Returns the new pages (owned by
  // the tree).
  std::vector<TreePage*> Insert(absl::Span<const int32_t> tokens, const std::vector<PageKey>& keys,
                                size_t have);

  // Removes a page that has no child pages (the last page of a leaf node).
  void Remove(TreePage* page);

  size_t size() const { return pages_.size(); }
  size_t nodes() const;

 private:
  static uint64_t HashPage(absl::Span<const int32_t> page);
  // Splits `node` so that its first `at` pages stay and the rest move to a
  // new child.
  void Split(TreeNode* node, size_t at);

  const int page_tokens_;
  TreeNode root_;
  std::set<TreePage*> pages_;  // ownership
};

}  // namespace tierkv::engine
