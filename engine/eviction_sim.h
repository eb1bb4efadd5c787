// Offline, page-level simulation of the store's eviction policies on a
// trace, against plain LRU and Belady's optimum (MIN), in seconds.
//
//   PageTrace pages = BuildPageTrace(requests, /*page_tokens=*/64);
//   SimResult r = Simulate(pages, "chain", pages.unique_pages / 10);
//
// The model is the store alone, as `tierkv replay` drives it: per request a
// prefix lookup over the pages that may hit (all whole pages but the one
// holding the last token) touches the leading run of cached pages and stops
// at the first miss; then every whole page not cached is put, naming its
// parent (the previous page) when that one is cached. Hit rate is hit
// tokens over prompt tokens, as replay reports it. The engine's own L1/L2
// and the master's watermarks are left out, so the figures bound what the
// store's policy can do rather than repeat replay to the decimal.
//
// Policies (SimPolicies() lists them):
//   lru     exact LRU over all pages
//   clock   CLOCK (second chance) over all pages: the master without
//           parent keys (--eviction-policy=lru)
//   prefix  the master's leaf-first CLOCK as it was first written: only
//           leaves are candidates, a parent whose last child left rejoins
//           at the old end keeping the reference bit of its last touch
//   leaf-lru exact LRU among leaves, a lookup refreshing the whole chain
//   chain   the master's default (--eviction-policy=chain): leaf-first
//           CLOCK whose rejoining parent carries its chain's recency (the
//           child that just left was the oldest leaf), so its reference
//           bit survives only a touch newer than that child's
//   birth   an experiment, not in the master: leaves ordered by when their
//           chain began (a page extending a chain inherits its birth) and
//           not refreshed by reads
//   inherit an experiment, not in the master yet: `chain`, except that a
//           page put as the child of a candidate leaf takes that leaf's
//           place in the list instead of the head (its reference count
//           starts clear), so a chain that is read and extended keeps the
//           place of the put that began it, while a page read and not
//           extended keeps CLOCK's second chance
//   belady  MIN: admits every put and evicts the page whose next use is
//           farthest; deeper first among equals, so it stays prefix-closed
//
// Not thread-safe; pure functions of their inputs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/trace.h"

namespace tierkv::engine {

struct PageTrace {
  struct Request {
    uint32_t first = 0;   // index of its first page in `pages`
    uint32_t count = 0;   // whole pages
    uint32_t usable = 0;  // leading pages that may hit
    uint64_t tokens = 0;  // prompt tokens
  };
  std::vector<uint32_t> pages;   // page ids, request after request
  std::vector<int32_t> parent;   // per page id: the previous page, or -1
  std::vector<Request> requests;
  size_t unique_pages = 0;       // what an unlimited store is written
  uint64_t tokens = 0;
  int page_tokens = 0;
};

// Page ids of every request's whole pages (equal prefixes, equal ids), with
// prompts cut to `max_prompt_tokens` when non-zero, as replay cuts them.
PageTrace BuildPageTrace(const std::vector<TraceRequest>& trace, int page_tokens,
                         size_t max_prompt_tokens = 0);

struct SimResult {
  std::string policy;
  size_t capacity_pages = 0;
  uint64_t hit_tokens = 0;
  double hit_rate = 0;
  uint64_t puts = 0;         // pages written
  uint64_t reputs = 0;       // pages written again after an eviction
  uint64_t evictions = 0;
  uint64_t evicted_reused = 0;  // evictions of pages that a later lookup asked for
};

std::vector<std::string> SimPolicies();

// "0.05,0.1,0.25" -> {0.05, 0.1, 0.25}: shares of the bytes the trace
// writes, each in (0, 100]; INVALID_ARGUMENT naming a bad entry.
absl::StatusOr<std::vector<double>> ParseCapacities(const std::string& list);

// INVALID_ARGUMENT for a policy SimPolicies() does not list.
absl::StatusOr<SimResult> Simulate(const PageTrace& trace, const std::string& policy,
                                   size_t capacity_pages);

}  // namespace tierkv::engine
