#include "engine/radix_tree.h"

#include <algorithm>
#include <cstring>

namespace tierkv::engine {

RadixTree::RadixTree(int page_tokens) : page_tokens_(page_tokens) {}

RadixTree::~RadixTree() {
  for (TreePage* p : pages_) delete p;
}

uint64_t RadixTree::HashPage(absl::Span<const int32_t> page) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : page) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ull;
  return h;
}

size_t RadixTree::nodes() const {
  size_t n = 0;
  std::vector<const TreeNode*> stack{&root_};
  while (!stack.empty()) {
    const TreeNode* x = stack.back();
    stack.pop_back();
    ++n;
    for (const auto& [h, c] : x->children) stack.push_back(c.get());
  }
  return n - 1;  // the root holds no pages
}

std::vector<TreePage*> RadixTree::Match(absl::Span<const int32_t> tokens) const {
  std::vector<TreePage*> out;
  const size_t P = page_tokens_;
  const TreeNode* node = &root_;
  size_t at = 0;
  while (at + P <= tokens.size()) {
    auto it = node->children.find(HashPage(tokens.subspan(at, P)));
    if (it == node->children.end()) break;
    const TreeNode* child = it->second.get();
    size_t i = 0;
    for (; i < child->pages.size() && at + P <= tokens.size(); ++i, at += P) {
      if (std::memcmp(&child->tokens[i * P], &tokens[at], P * sizeof(int32_t)) != 0) break;
      out.push_back(child->pages[i]);
    }
    if (i < child->pages.size()) break;  // diverged or ran out inside this node
    node = child;
  }
  return out;
}

void RadixTree::Split(TreeNode* node, size_t at) {
  const size_t P = page_tokens_;
  auto tail = std::make_unique<TreeNode>();
  tail->parent = node;
  tail->tokens.assign(node->tokens.begin() + at * P, node->tokens.end());
  tail->pages.assign(node->pages.begin() + at, node->pages.end());
  tail->children = std::move(node->children);
  for (auto& [h, c] : tail->children) c->parent = tail.get();
  for (TreePage* p : tail->pages) p->node = tail.get();
  node->tokens.resize(at * P);
  node->pages.resize(at);
  node->children.clear();
  uint64_t h = HashPage(absl::MakeConstSpan(tail->tokens).subspan(0, P));
  node->children[h] = std::move(tail);
}

std::vector<TreePage*> RadixTree::Insert(absl::Span<const int32_t> tokens, const std::vector<PageKey>& keys,
                                         size_t have) {
  const size_t P = page_tokens_;
  const size_t whole = std::min(tokens.size() / P, keys.size());
  std::vector<TreePage*> added;
  if (have >= whole) return added;
  // Find where the matched prefix ends: a node and a page index in it.
  TreeNode* node = &root_;
  size_t in_node = 0;  // pages of `node` matched
  size_t page = 0;
  TreePage* parent = nullptr;
  while (page < have) {
    if (in_node == node->pages.size()) {
      node = node->children.at(HashPage(tokens.subspan(page * P, P))).get();
      in_node = 0;
    }
    parent = node->pages[in_node];
    ++in_node;
    ++page;
  }
  if (node != &root_ && in_node < node->pages.size()) {
    Split(node, in_node);  // the new pages diverge inside `node`
  }
  // Extend a leaf in place (keeps runs long), or hang a new child.
  TreeNode* target;
  uint64_t first = HashPage(tokens.subspan(have * P, P));
  if (node != &root_ && node->children.empty()) {
    target = node;
  } else if (node->children.contains(first)) {
    return added;  // a different page with the same hash: leave it uncached
  } else {
    auto child = std::make_unique<TreeNode>();
    child->parent = node;
    target = child.get();
    node->children[first] = std::move(child);
  }
  for (size_t i = have; i < whole; ++i) {
    auto* p = new TreePage();
    p->key = keys[i];
    p->parent = parent;
    p->node = target;
    if (parent != nullptr) ++parent->tree_children;
    target->tokens.insert(target->tokens.end(), tokens.begin() + i * P, tokens.begin() + (i + 1) * P);
    target->pages.push_back(p);
    pages_.insert(p);
    added.push_back(p);
    parent = p;
  }
  return added;
}

void RadixTree::Remove(TreePage* page) {
  TreeNode* node = page->node;
  // Only a page with no children can go: the last page of a leaf node.
  if (page->tree_children != 0 || node->pages.empty() || node->pages.back() != page ||
      !node->children.empty()) {
    return;
  }
  node->pages.pop_back();
  node->tokens.resize(node->pages.size() * page_tokens_);
  if (page->parent != nullptr) --page->parent->tree_children;
  pages_.erase(page);
  delete page;
  if (node->pages.empty()) {
    TreeNode* parent = node->parent;
    for (auto it = parent->children.begin(); it != parent->children.end(); ++it) {
      if (it->second.get() == node) {
        parent->children.erase(it);
        break;
      }
    }
    // A parent left with one child and no branching could be merged back;
    // runs stay correct unmerged, so that is left to the next split.
  }
}

}  // namespace tierkv::engine
