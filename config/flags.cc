#include "config/flags.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "config/units.h"

namespace tierkv {
namespace {

absl::Status CheckBounds(const FlagSpec& spec, double v, absl::string_view text, absl::string_view source) {
  if (v < spec.min || v > spec.max) {
    return absl::InvalidArgumentError(absl::StrFormat("--%s%s: value '%s' is out of range [%g, %g]",
                                                      spec.name, source, text, spec.min, spec.max));
  }
  return absl::OkStatus();
}

// Parses `text` for `spec` and stores it into cfg. `source` says where the
// text came from ("", or " (from TIERKV_X)") for the error line.
absl::Status ApplyValue(const FlagSpec& spec, void* cfg, absl::string_view text,
                        absl::string_view source) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", spec.name, source, ": invalid value '", text, "': ", why));
  };
  switch (spec.type) {
    case FlagType::kBool: {
      std::string t = absl::AsciiStrToLower(text);
      bool v;
      if (t == "true" || t == "1" || t == "yes" || t == "on") {
        v = true;
      } else if (t == "false" || t == "0" || t == "no" || t == "off") {
        v = false;
      } else {
        return bad("expected true or false");
      }
      spec.store(cfg, &v);
      return absl::OkStatus();
    }
    case FlagType::kInt: {
      int64_t v;
      if (!absl::SimpleAtoi(text, &v)) return bad("expected an integer");
      if (absl::Status s = CheckBounds(spec, static_cast<double>(v), text, source); !s.ok()) return s;
      spec.store(cfg, &v);
      return absl::OkStatus();
    }
    case FlagType::kSize: {
      absl::StatusOr<uint64_t> v = ParseSize(text);
      if (!v.ok()) return bad(v.status().message());
      if (absl::Status s = CheckBounds(spec, static_cast<double>(*v), text, source); !s.ok()) return s;
      spec.store(cfg, &*v);
      return absl::OkStatus();
    }
    case FlagType::kDuration: {
      absl::StatusOr<absl::Duration> v = ParseDuration(text);
      if (!v.ok()) return bad(v.status().message());
      if (absl::Status s = CheckBounds(spec, absl::ToDoubleSeconds(*v), text, source); !s.ok()) return s;
      spec.store(cfg, &*v);
      return absl::OkStatus();
    }
    case FlagType::kDouble: {
      double v;
      if (!absl::SimpleAtod(text, &v) || std::isnan(v)) return bad("expected a number");
      if (absl::Status s = CheckBounds(spec, v, text, source); !s.ok()) return s;
      spec.store(cfg, &v);
      return absl::OkStatus();
    }
    case FlagType::kString: {
      if (!spec.choices.empty() && std::find(spec.choices.begin(), spec.choices.end(), text) == spec.choices.end()) {
        return bad(absl::StrCat("expected one of ", absl::StrJoin(spec.choices, ", ")));
      }
      std::string v(text);
      spec.store(cfg, &v);
      return absl::OkStatus();
    }
  }
  return absl::InternalError("unknown flag type");
}

absl::StatusOr<std::string> ReadConfigFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--config: cannot read ", path, ": ", std::strerror(errno)));
  }
  std::string text;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) {
    text.append(buf, n);
    if (text.size() > (1 << 20)) {
      std::fclose(f);
      return absl::InvalidArgumentError(absl::StrCat("--config: ", path, " is larger than 1 MiB"));
    }
  }
  std::fclose(f);
  return text;
}

// The value of --config on the command line, or TIERKV_CONFIG; "" if none.
std::string ConfigPath(int argc, const char* const* argv,
                       const std::function<const char*(const char*)>& getenv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (absl::ConsumePrefix(&arg, "--config=")) return std::string(arg);
    if (arg == "--config" && i + 1 < argc) return argv[i + 1];
  }
  const char* env = getenv("TIERKV_CONFIG");
  return env != nullptr ? env : "";
}

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseConfigText(absl::string_view text) {
  std::vector<std::pair<std::string, std::string>> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": expected 'name = value'"));
    }
    absl::string_view name = absl::StripAsciiWhitespace(line.substr(0, eq));
    absl::string_view value = absl::StripAsciiWhitespace(line.substr(eq + 1));
    if (name.empty() || name.find_first_of(" \t\0") != absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": bad flag name '", name, "'"));
    }
    out.emplace_back(std::string(name), std::string(value));
  }
  return out;
}

std::string FlagEnvName(absl::string_view flag) {
  std::string out = "TIERKV_";
  for (char c : flag) out += c == '-' ? '_' : absl::ascii_toupper(c);
  return out;
}

const char* Getenv(const char* name) { return std::getenv(name); }

// In the largest unit that holds it whole, so that ParseDuration reads it
// back (absl's own form, "1m30s" or a bare "0", it does not).
std::string PrintDuration(absl::Duration d) {
  if (d == absl::InfiniteDuration()) return absl::FormatDuration(d);
  const int64_t ns = absl::ToInt64Nanoseconds(d);
  static constexpr std::pair<int64_t, const char*> kUnits[] = {
      {3'600'000'000'000, "h"}, {60'000'000'000, "m"}, {1'000'000'000, "s"}, {1'000'000, "ms"}, {1'000, "us"}};
  if (ns == 0) return "0s";
  for (const auto& [per, unit] : kUnits) {
    if (ns % per == 0) return absl::StrCat(ns / per, unit);
  }
  return absl::StrCat(ns, "ns");
}

absl::StatusOr<ParsedArgs> ParseFlags(const std::vector<FlagSpec>& specs, void* cfg, int argc,
                                      const char* const* argv,
                                      const std::function<const char*(const char*)>& getenv) {
  absl::flat_hash_map<std::string, const FlagSpec*> by_name;
  for (const FlagSpec& s : specs) by_name[s.name] = &s;

  // Defaults first, then the config file, the environment, the command line.
  for (const FlagSpec& s : specs) {
    if (absl::Status st = ApplyValue(s, cfg, s.default_value, " (default)"); !st.ok()) return st;
  }
  if (std::string path = ConfigPath(argc, argv, getenv); !path.empty()) {
    absl::StatusOr<std::string> text = ReadConfigFile(path);
    if (!text.ok()) return text.status();
    absl::StatusOr<std::vector<std::pair<std::string, std::string>>> entries = ParseConfigText(*text);
    if (!entries.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", entries.status().message()));
    for (const auto& [name, value] : *entries) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": unknown flag '", name, "' (see --help)"));
      }
      if (absl::Status st = ApplyValue(*it->second, cfg, value, absl::StrCat(" (from ", path, ")")); !st.ok()) {
        return st;
      }
    }
  }
  for (const FlagSpec& s : specs) {
    std::string env = FlagEnvName(s.name);
    if (const char* v = getenv(env.c_str()); v != nullptr) {
      if (absl::Status st = ApplyValue(s, cfg, v, absl::StrCat(" (from ", env, ")")); !st.ok()) {
        return st;
      }
    }
  }

  ParsedArgs out;
  bool flags_done = false;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (flags_done || arg.size() < 2 || arg.substr(0, 2) != "--") {
      out.positional.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    absl::string_view body = arg.substr(2);
    absl::string_view name = body, value;
    bool has_value = false;
    if (size_t eq = body.find('='); eq != absl::string_view::npos) {
      name = body.substr(0, eq);
      value = body.substr(eq + 1);
      has_value = true;
    }
    if (name == "help" || name == "h") {
      out.help = true;
      continue;
    }
    if (name == "print-config") {
      out.print_config = true;
      continue;
    }
    if (name == "config") {  // read above, before the environment
      if (!has_value) ++i;
      continue;
    }
    auto it = by_name.find(std::string(name));
    if (it == by_name.end() && !has_value && name.substr(0, 3) == "no-") {
      auto neg = by_name.find(std::string(name.substr(3)));
      if (neg != by_name.end() && neg->second->type == FlagType::kBool) {
        bool f = false;
        neg->second->store(cfg, &f);
        continue;
      }
    }
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    const FlagSpec& spec = *it->second;
    if (!has_value) {
      if (spec.type == FlagType::kBool) {
        bool t = true;
        spec.store(cfg, &t);
        continue;
      }
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      value = argv[++i];
    }
    if (absl::Status st = ApplyValue(spec, cfg, value, ""); !st.ok()) return st;
  }
  return out;
}

std::string FlagsHelp(const std::vector<FlagSpec>& specs, absl::string_view binary,
                      absl::string_view summary) {
  static constexpr const char* kTypeNames[] = {"bool", "int", "size", "duration", "number", "string"};
  std::string out = absl::StrCat("usage: ", binary, " [flags]\n", summary, "\n\nflags:\n");
  for (const FlagSpec& s : specs) {
    absl::StrAppendFormat(&out, "  --%-22s %-8s %s\n", s.name, kTypeNames[static_cast<int>(s.type)],
                          s.help);
    absl::StrAppendFormat(&out, "  %-33s default '%s', env %s\n", "", s.default_value,
                          FlagEnvName(s.name));
  }
  out += "  --config                  file of 'name = value' lines (as --print-config prints);\n";
  out += "                            below the environment and the command line; env TIERKV_CONFIG\n";
  out += "  --print-config            print the resolved configuration and exit\n";
  out += "  --help                    print this text and exit\n";
  return out;
}

std::string FlagsDump(const std::vector<FlagSpec>& specs, const void* cfg) {
  std::string out;
  for (const FlagSpec& s : specs) absl::StrAppend(&out, s.name, " = ", s.print(cfg), "\n");
  return out;
}

void ExitWithUsageError(absl::string_view binary, absl::string_view message) {
  std::fprintf(stderr, "%.*s: %.*s\n", static_cast<int>(binary.size()), binary.data(),
               static_cast<int>(message.size()), message.data());
  std::exit(2);
}

void ExitWithText(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::exit(0);
}

}  // namespace tierkv
