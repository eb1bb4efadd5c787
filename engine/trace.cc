#include "engine/trace.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace tierkv::engine {

absl::StatusOr<TraceRequest> ParseTraceLine(const std::string& line) {
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("not a JSON object");
  TraceRequest r;
  auto num = [&](const char* field, int64_t* out, bool required) -> absl::Status {
    auto it = j.find(field);
    if (it == j.end()) {
      return required ? absl::InvalidArgumentError(absl::StrCat("missing '", field, "'")) : absl::OkStatus();
    }
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("'", field, "' must be a non-negative integer"));
    }
    *out = it->get<int64_t>();
    return absl::OkStatus();
  };
  if (absl::Status s = num("timestamp", &r.timestamp_ms, false); !s.ok()) return s;
  if (absl::Status s = num("input_length", &r.input_length, true); !s.ok()) return s;
  if (absl::Status s = num("output_length", &r.output_length, false); !s.ok()) return s;
  auto ids = j.find("hash_ids");
  if (ids == j.end() || !ids->is_array()) return absl::InvalidArgumentError("'hash_ids' must be an array");
  for (const auto& id : *ids) {
    if (!id.is_number_integer()) return absl::InvalidArgumentError("hash ids must be integers");
    r.hash_ids.push_back(id.get<int64_t>());
  }
  if (r.input_length > static_cast<int64_t>(r.hash_ids.size()) * kTraceBlockTokens) {
    return absl::InvalidArgumentError("input_length exceeds its blocks");
  }
  return r;
}

absl::StatusOr<std::string> ResolveTracePath(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return path;
  std::vector<fs::path> tried = {fs::absolute(path, ec)};
  if (fs::path(path).is_relative()) {
    tried.push_back(fs::path(TIERKV_SOURCE_ROOT) / path);
    fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) tried.push_back(exe.parent_path().parent_path() / "share" / "tierkv" / path);
    for (size_t i = 1; i < tried.size(); ++i) {
      if (fs::is_regular_file(tried[i], ec)) return tried[i].string();
    }
  }
  std::string where;
  for (const fs::path& t : tried) absl::StrAppend(&where, where.empty() ? "" : ", ", t.string());
  return absl::NotFoundError(absl::StrCat("cannot open trace ", path, " (looked at ", where, ")"));
}

absl::StatusOr<std::vector<TraceRequest>> ReadTrace(const std::string& path, size_t offset, size_t limit) {
  absl::StatusOr<std::string> found = ResolveTracePath(path);
  if (!found.ok()) return found.status();
  std::ifstream in(*found);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace ", *found));
  std::vector<TraceRequest> out;
  std::string line;
  size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (n <= offset) continue;
    absl::StatusOr<TraceRequest> r = ParseTraceLine(line);
    if (!r.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", r.status().message()));
    out.push_back(std::move(*r));
    if (limit > 0 && out.size() >= limit) break;
  }
  return out;
}

std::vector<int32_t> PromptTokens(const TraceRequest& r, int vocab, size_t max_tokens) {
  size_t len = static_cast<size_t>(r.input_length);
  if (max_tokens > 0) len = std::min(len, max_tokens);
  std::vector<int32_t> tokens;
  tokens.reserve(len);
  for (int64_t id : r.hash_ids) {
    uint64_t x = static_cast<uint64_t>(id) * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
    for (int i = 0; i < kTraceBlockTokens && tokens.size() < len; ++i) {
      x += 0x9e3779b97f4a7c15ull;
      uint64_t z = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      tokens.push_back(static_cast<int32_t>(z % static_cast<uint64_t>(vocab)));
    }
    if (tokens.size() >= len) break;
  }
  return tokens;
}

}  // namespace tierkv::engine
