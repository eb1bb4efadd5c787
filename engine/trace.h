// Request traces (the repository's data/ folder): JSONL with timestamp, input_length,
// output_length and hash_ids (one id per 512-token block). Replay maps each
// hash id to a deterministic block of token ids, so requests that share a
// hash-id prefix share a token prefix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tierkv::engine {

inline constexpr int kTraceBlockTokens = 512;

struct TraceRequest {
  int64_t timestamp_ms = 0;
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<int64_t> hash_ids;
};

// One line; INVALID_ARGUMENT naming the problem for a malformed one.
absl::StatusOr<TraceRequest> ParseTraceLine(const std::string& line);
// Where a trace named `path` is: `path` itself when it exists; else, for a
// relative path, the same path under the source tree this binary was built
// from and under the install prefix's share/tierkv (so the default
// "data/synthetic_trace.jsonl" works from any working directory). NOT_FOUND
// naming every place looked at.
absl::StatusOr<std::string> ResolveTracePath(const std::string& path);
// The whole file (found by ResolveTracePath); `limit` requests at most (0:
// all). Errors name the line.
absl::StatusOr<std::vector<TraceRequest>> ReadTrace(const std::string& path, size_t offset = 0,
                                                    size_t limit = 0);

// The prompt's token ids: the blocks' tokens, cut to input_length (and to
// max_tokens when non-zero).
std::vector<int32_t> PromptTokens(const TraceRequest& r, int vocab, size_t max_tokens = 0);

}  // namespace tierkv::engine
