// Declarative flag tables: one table per binary drives parsing, env vars,
// validation, --help and --print-config.
//
// Each row names a field of the binary's config struct once:
//
//   struct MasterConfig { int64_t rpc_port; absl::Duration segment_ttl; };
//   const FlagTable<MasterConfig> kTable("tierkv-master", "the cluster master", {
//       IntFlag<MasterConfig>("rpc-port", &MasterConfig::rpc_port, "50051", 0, 65535,
//                             "gRPC port; 0 picks a free one"),
//       DurationFlag<MasterConfig>("segment-ttl", &MasterConfig::segment_ttl, "10s",
//                                  "a segment missing heartbeats this long is dropped"),
//   });
//   MasterConfig config = kTable.ParseOrExit(argc, argv);
//
// Precedence: command line, then TIERKV_<NAME_IN_UPPER_SNAKE>, then the
// default. Accepted syntax: --name=value, --name value, and for booleans a
// bare --name or --no-name. Bad input yields INVALID_ARGUMENT whose message
// is one line naming the flag; ParseOrExit prints it and exits with 2.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierkv {

enum class FlagType { kBool, kInt, kSize, kDuration, kDouble, kString };

// A type-erased row; built by the *Flag helpers below.
struct FlagSpec {
  std::string name;
  FlagType type;
  std::string default_value;
  double min;  // bounds for numbers (bytes for sizes, seconds for durations)
  double max;
  std::string help;
  // Stores a parsed value into the config object `cfg`; the value has the
  // C++ type matching `type` (bool, int64_t, uint64_t, absl::Duration,
  // double, std::string).
  std::function<void(void* cfg, const void* value)> store;
  // Renders the field's current value in `cfg` for --print-config.
  std::function<std::string(const void* cfg)> print;
  // kString: the only values accepted (empty: any); others are
  // INVALID_ARGUMENT naming them.
  std::vector<std::string> choices = {};
};

// "segment-size" -> "TIERKV_SEGMENT_SIZE".
std::string FlagEnvName(absl::string_view flag);

// The result of parsing: the args that were not flags (subcommands, files).
struct ParsedArgs {
  std::vector<std::string> positional;
  bool help = false;
  bool print_config = false;
};

// A config file's entries: one `name = value` per line (the format
// --print-config prints), `#` starts a comment, blank lines are skipped,
// values are trimmed. INVALID_ARGUMENT naming the line for anything else.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseConfigText(absl::string_view text);

// Parses argv (and the environment through `getenv`) into `cfg` using
// `specs`. Precedence, lowest first: defaults, the file named by --config
// (or TIERKV_CONFIG), the environment, the command line. Non-template core
// of FlagTable.
absl::StatusOr<ParsedArgs> ParseFlags(const std::vector<FlagSpec>& specs, void* cfg, int argc,
                                      const char* const* argv,
                                      const std::function<const char*(const char*)>& getenv);
std::string FlagsHelp(const std::vector<FlagSpec>& specs, absl::string_view binary,
                      absl::string_view summary);
std::string FlagsDump(const std::vector<FlagSpec>& specs, const void* cfg);

template <class C>
class FlagTable {
 public:
  // `validate` checks rules that span fields (low <= high watermark); its
  // error message should name the flags involved.
  FlagTable(std::string binary, std::string summary, std::vector<FlagSpec> specs,
            std::function<absl::Status(const C&)> validate = nullptr)
      : binary_(std::move(binary)),
        summary_(std::move(summary)),
        specs_(std::move(specs)),
        validate_(std::move(validate)) {}

  // Parses into a default-constructed C. Positional args land in *positional
  // when it is non-null (and are an error otherwise).
  absl::StatusOr<C> Parse(int argc, const char* const* argv,
                          std::vector<std::string>* positional = nullptr,
                          const std::function<const char*(const char*)>& getenv = DefaultGetenv(),
                          ParsedArgs* parsed_out = nullptr) const {
    C cfg{};
    absl::StatusOr<ParsedArgs> parsed = ParseFlags(specs_, &cfg, argc, argv, getenv);
    if (!parsed.ok()) return parsed.status();
    if (parsed->help) {
      if (parsed_out != nullptr) *parsed_out = *parsed;
      return cfg;
    }
    if (positional != nullptr) {
      *positional = parsed->positional;
    } else if (!parsed->positional.empty()) {
      return absl::InvalidArgumentError("unexpected argument '" + parsed->positional[0] + "'");
    }
    if (parsed_out != nullptr) *parsed_out = *parsed;
    if (validate_) {
      if (absl::Status s = validate_(cfg); !s.ok()) return s;
    }
    return cfg;
  }

  // Parse for main(): --help prints usage and exits 0; --print-config prints
  // the resolved values and exits 0; an error prints "<binary>: <message>"
  // and exits 2.
  C ParseOrExit(int argc, const char* const* argv,
                std::vector<std::string>* positional = nullptr) const;

  std::string Help() const { return FlagsHelp(specs_, binary_, summary_); }
  std::string Dump(const C& cfg) const { return FlagsDump(specs_, &cfg); }
  const std::vector<FlagSpec>& specs() const { return specs_; }

 private:
  static std::function<const char*(const char*)> DefaultGetenv();
  std::string binary_;
  std::string summary_;
  std::vector<FlagSpec> specs_;
  std::function<absl::Status(const C&)> validate_;
};

// Prints and exits as ParseOrExit documents.
[[noreturn]] void ExitWithUsageError(absl::string_view binary, absl::string_view message);
[[noreturn]] void ExitWithText(const std::string& text);
const char* Getenv(const char* name);

template <class C>
std::function<const char*(const char*)> FlagTable<C>::DefaultGetenv() {
  return &Getenv;
}

template <class C>
C FlagTable<C>::ParseOrExit(int argc, const char* const* argv,
                            std::vector<std::string>* positional) const {
  ParsedArgs parsed;
  std::vector<std::string> pos;
  absl::StatusOr<C> cfg = Parse(argc, argv, &pos, DefaultGetenv(), &parsed);
  if (parsed.help) ExitWithText(Help());
  if (!cfg.ok()) ExitWithUsageError(binary_, cfg.status().message());
  if (positional != nullptr) {
    *positional = std::move(pos);
  } else if (!pos.empty()) {
    ExitWithUsageError(binary_, "unexpected argument '" + pos[0] + "'");
  }
  if (parsed.print_config) ExitWithText(Dump(*cfg));
  return *std::move(cfg);
}

// Row builders. `default_value` is text parsed exactly like user input, so
// defaults obey the same bounds.
std::string PrintDuration(absl::Duration d);

template <class C>
FlagSpec BoolFlag(std::string name, bool C::*field, std::string def, std::string help) {
  return {std::move(name), FlagType::kBool, std::move(def), 0, 1, std::move(help),
          [field](void* c, const void* v) { static_cast<C*>(c)->*field = *static_cast<const bool*>(v); },
          [field](const void* c) -> std::string {
            return static_cast<const C*>(c)->*field ? "true" : "false";
          }};
}

template <class C>
FlagSpec IntFlag(std::string name, int64_t C::*field, std::string def, double min, double max,
                 std::string help) {
  return {std::move(name), FlagType::kInt, std::move(def), min, max, std::move(help),
          [field](void* c, const void* v) { static_cast<C*>(c)->*field = *static_cast<const int64_t*>(v); },
          [field](const void* c) { return std::to_string(static_cast<const C*>(c)->*field); }};
}

template <class C>
FlagSpec SizeFlag(std::string name, uint64_t C::*field, std::string def, double min, double max,
                  std::string help) {
  return {std::move(name), FlagType::kSize, std::move(def), min, max, std::move(help),
          [field](void* c, const void* v) { static_cast<C*>(c)->*field = *static_cast<const uint64_t*>(v); },
          [field](const void* c) { return std::to_string(static_cast<const C*>(c)->*field); }};
}

template <class C>
FlagSpec DurationFlag(std::string name, absl::Duration C::*field, std::string def, double min_s,
                      double max_s, std::string help) {
  return {std::move(name), FlagType::kDuration, std::move(def), min_s, max_s, std::move(help),
          [field](void* c, const void* v) {
            static_cast<C*>(c)->*field = *static_cast<const absl::Duration*>(v);
          },
          [field](const void* c) { return PrintDuration(static_cast<const C*>(c)->*field); }};
}

template <class C>
FlagSpec DoubleFlag(std::string name, double C::*field, std::string def, double min, double max,
                    std::string help) {
  return {std::move(name), FlagType::kDouble, std::move(def), min, max, std::move(help),
          [field](void* c, const void* v) { static_cast<C*>(c)->*field = *static_cast<const double*>(v); },
          [field](const void* c) { return std::to_string(static_cast<const C*>(c)->*field); }};
}

template <class C>
FlagSpec StringFlag(std::string name, std::string C::*field, std::string def, std::string help) {
  return {std::move(name), FlagType::kString, std::move(def), 0, 0, std::move(help),
          [field](void* c, const void* v) {
            static_cast<C*>(c)->*field = *static_cast<const std::string*>(v);
          },
          [field](const void* c) { return static_cast<const C*>(c)->*field; }};
}

// A string flag that takes one of `choices` (a policy, a format, a mode).
template <class C>
FlagSpec ChoiceFlag(std::string name, std::string C::*field, std::string def, std::vector<std::string> choices,
                    std::string help) {
  FlagSpec spec = StringFlag<C>(std::move(name), field, std::move(def), std::move(help));
  spec.choices = std::move(choices);
  return spec;
}

}  // namespace tierkv
