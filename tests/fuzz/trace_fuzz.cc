// The trace JSONL reader: every line parses to a request or an error.
#include <cstdint>
#include <string>

#include "absl/strings/str_split.h"
#include "engine/trace.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    absl::StatusOr<tierkv::engine::TraceRequest> r = tierkv::engine::ParseTraceLine(std::string(line));
    if (!r.ok()) continue;
    FUZZ_CHECK(r->input_length >= 0 && r->output_length >= 0);
    // Tokens for a parsed request are always producible, and capped.
    std::vector<int32_t> tokens = tierkv::engine::PromptTokens(*r, 1000, 4096);
    FUZZ_CHECK(tokens.size() <= 4096);
  }
  return 0;
}
