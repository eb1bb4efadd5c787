// L3Store: the cache's view of tierkv (the offload tier), narrow enough to
// have an in-memory twin for tests.
//
// TierkvL3 adapts client::Client: PrefixMatch is one RPC, Get one batched
// read straight into L2 slots, Put one batched put with parent keys and
// tensor-parallel groups. Every call is bounded by its deadline; an
// unreachable store yields errors (the engine then recomputes), never a
// hang.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "base/mutex.h"

namespace tierkv::engine {

struct L3Put {
  std::string key;
  absl::string_view value;
  std::string group;
  std::string parent_key;
};

class L3Store {
 public:
  virtual ~L3Store() = default;
  virtual absl::StatusOr<size_t> PrefixMatch(const std::vector<std::string>& keys) = 0;
  // Reads each key into its buffer (which has exactly the value's size).
  virtual std::vector<absl::Status> Get(const std::vector<std::string>& keys,
                                        const std::vector<absl::Span<char>>& outs,
                                        absl::Duration timeout) = 0;
  virtual std::vector<absl::Status> Put(const std::vector<L3Put>& items) = 0;
};

// The in-memory twin: a map, with groups and a capacity in keys (LRU-free:
// it refuses puts when full). SetLatency models a slow store: a Get takes
// `per_key` for each key in turn, honours its timeout (keys not reached by
// then are DEADLINE_EXCEEDED) and returns when it is over.
class InMemoryL3 final : public L3Store {
 public:
  explicit InMemoryL3(size_t max_keys = SIZE_MAX) : max_keys_(max_keys) {}
  absl::StatusOr<size_t> PrefixMatch(const std::vector<std::string>& keys) override;
  std::vector<absl::Status> Get(const std::vector<std::string>& keys, const std::vector<absl::Span<char>>& outs,
                                absl::Duration timeout) override;
  std::vector<absl::Status> Put(const std::vector<L3Put>& items) override;
  // Removes a key (a store-side eviction), for tests.
  void Drop(const std::string& key);
  void SetUnavailable(bool down);
  void SetLatency(absl::Duration per_key);
  size_t size();

 private:
  Mutex mu_;
  std::map<std::string, std::string> data_ ABSL_GUARDED_BY(mu_);
  size_t max_keys_;
  bool down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration latency_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
};

class TierkvL3 final : public L3Store {
 public:
  TierkvL3(client::Client* client, bool parent_keys) : client_(client), parent_keys_(parent_keys) {}
  absl::StatusOr<size_t> PrefixMatch(const std::vector<std::string>& keys) override;
  std::vector<absl::Status> Get(const std::vector<std::string>& keys, const std::vector<absl::Span<char>>& outs,
                                absl::Duration timeout) override;
  std::vector<absl::Status> Put(const std::vector<L3Put>& items) override;

 private:
  client::Client* client_;
  bool parent_keys_;  // false: plain LRU at the store (for comparison)
};

}  // namespace tierkv::engine
