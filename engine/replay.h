// Trace replay: serves a trace's prompts through an InferenceEngine and
// reports what an operator looks at: hit rate per tier, the infinite-cache
// bound for the same requests, TTFT with and without the cache, store
// traffic, and the windowed hit rate over time (CSV and SVG).
#pragma once

#include <array>

#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "engine/engine.h"
#include "engine/trace.h"
#include "nlohmann/json.hpp"

namespace tierkv::engine {

// The pages an unlimited cache would hold; shared between replays that
// feed the same store (worker A's pages are hits for worker B).
using SeenPages = absl::flat_hash_set<PageKey, PageKeyHash>;

struct ReplayOptions {
  size_t max_prompt_tokens = 0;  // cut prompts (model mode); 0 = whole
  bool progress = false;         // a progress bar on stderr
  // Called before request i is served (tests use it to kill a daemon).
  std::function<void(size_t i)> before_request;
  // Called after request i with its result (the demo compares logits).
  std::function<void(size_t i, const RequestResult& r)> after_request;
  // The infinite cache to measure the bound against (null: a fresh one).
  SeenPages* seen = nullptr;
  // Serves a prompt instead of engine.Serve (prefill-to-decode replay:
  // PdDecode::Serve, over the same engine's cache).
  std::function<RequestResult(absl::Span<const int32_t>)> serve;
};

struct WindowPoint {
  size_t request;
  int64_t timestamp_ms;
  double hit_rate;
};

struct ReplayReport {
  std::string mode;
  size_t requests = 0;
  uint64_t tokens = 0, cached_tokens = 0, l1_tokens = 0, l2_tokens = 0, l3_tokens = 0;
  uint64_t bound_tokens = 0;  // hits an unlimited cache would have had
  uint64_t store_errors = 0;
  uint64_t corrupt_pages = 0;  // pages the store returned with wrong bytes (never used)
  uint64_t failed = 0;  // requests the device failed (RequestResult::status)
  std::string first_failure;
  std::vector<double> ttft, ttft_nocache;
  uint64_t fetched_bytes = 0, put_bytes = 0, put_failures = 0;
  uint64_t reput_pages = 0, reput_bytes = 0;  // written again after the store evicted them
  uint64_t store_evicted_pages = 0;  // set by the caller when it can see the store (0: unknown)
  // Likewise: evicted pages moved to the daemons' SSD tiers, and reads
  // staged back from them.
  uint64_t store_offloaded_pages = 0;
  uint64_t store_ssd_reads = 0;
  // Evicted pages whose move to SSD failed (dropped instead), and SSD
  // replicas the master dropped because their daemon's record was gone.
  uint64_t store_offload_failed = 0;
  uint64_t store_ssd_dropped = 0;
  uint64_t store_stage_no_room = 0;  // SSD hits missed for want of DRAM to stage them
  // Tokens short of the bound, by why each request's cached prefix ended
  // (indexed by StopReason): where a hit rate under the bound went.
  std::array<uint64_t, kStopReasons> short_tokens{};
  double wall_s = 0;
  double tokens_per_s = 0;  // the cost model in effect
  std::vector<WindowPoint> window;
  // Prefill-to-decode replay (`tierkv replay --pd`): requests a prefill
  // peer served and their transfer time (ask to pages landed); the caller
  // sets the rest (`shape` non-empty turns the section on).
  struct Pd {
    std::string shape;  // "1P1D", "2P1D"
    uint64_t requests = 0, fallbacks = 0, bytes = 0;
    double transfer_s = 0;  // pushes' spans, overlapping compute
    double exposed_s = 0;   // of which after compute ended: what TTFT pays
    double raw_GBps = 0;  // the raw engine between the same pools, same run
  } pd;

  double hit_rate() const { return tokens ? static_cast<double>(cached_tokens) / tokens : 0; }
  double bound_rate() const { return tokens ? static_cast<double>(bound_tokens) / tokens : 0; }
  nlohmann::json ToJson() const;
  std::string Table() const;
};

ReplayReport Replay(const std::vector<TraceRequest>& trace, InferenceEngine& engine, const ReplayOptions& options);

// Writes the windowed hit rate as CSV (request, timestamp_ms, hit_rate)
// and as a small SVG line plot.
absl::Status WriteWindowCsv(const ReplayReport& report, const std::string& path);
absl::Status WriteWindowSvg(const ReplayReport& report, const std::string& path);

// One line of a hit-rate-against-capacity plot: a policy's (capacity
// share, hit rate) points, in increasing capacity.
struct CapacitySeries {
  std::string name;
  std::vector<std::pair<double, double>> points;
};
// Writes hit rate against capacity, one line per series, as a small SVG
// line plot (`tierkv sim --svg`); `bound` (the infinite-cache hit rate) is
// drawn dashed when positive.
absl::Status WriteCapacitySvg(const std::vector<CapacitySeries>& series, double bound, const std::string& title,
                              const std::string& path);

}  // namespace tierkv::engine
