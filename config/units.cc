#include "config/units.h"

#include <cctype>
#include <cmath>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tierkv {
namespace {

// Splits "1.5tb" into 1.5 and "tb". The number must be plain decimal: no
// sign, exponent, hex, inf or nan, so "1e9" and "-1" are refused.
absl::Status SplitNumber(absl::string_view text, double* number, std::string* unit) {
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return absl::InvalidArgumentError("empty value");
  size_t i = 0;
  bool digits = false, dot = false;
  for (; i < text.size(); ++i) {
    char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits = true;
    } else if (c == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  if (!digits) return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a number"));
  if (i > 64) return absl::InvalidArgumentError("number too long");
  *number = std::stod(std::string(text.substr(0, i)));
  *unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text.substr(i)));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ParseSize(absl::string_view text) {
  double n;
  std::string unit;
  if (absl::Status s = SplitNumber(text, &n, &unit); !s.ok()) return s;
  double mult;
  if (unit.empty() || unit == "b") {
    mult = 1;
  } else if (unit == "kb") {
    mult = 1e3;
  } else if (unit == "mb") {
    mult = 1e6;
  } else if (unit == "gb") {
    mult = 1e9;
  } else if (unit == "tb") {
    mult = 1e12;
  } else if (unit == "k" || unit == "kib") {
    mult = 1024.0;
  } else if (unit == "m" || unit == "mib") {
    mult = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gib") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "t" || unit == "tib") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown size unit '", unit, "' (use b, kb, mb, gb, tb, kib, mib, gib, tib)"));
  }
  double bytes = std::round(n * mult);
  // 2^63 keeps every size representable as a signed offset too.
  if (!(bytes < 9.2e18)) return absl::InvalidArgumentError("size too large");
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<absl::Duration> ParseDuration(absl::string_view text) {
  double n;
  std::string unit;
  if (absl::Status s = SplitNumber(text, &n, &unit); !s.ok()) return s;
  double seconds;
  if (unit == "ns") {
    seconds = n * 1e-9;
  } else if (unit == "us") {
    seconds = n * 1e-6;
  } else if (unit == "ms") {
    seconds = n * 1e-3;
  } else if (unit == "s") {
    seconds = n;
  } else if (unit == "m") {
    seconds = n * 60;
  } else if (unit == "h") {
    seconds = n * 3600;
  } else if (unit.empty()) {
    return absl::InvalidArgumentError("duration needs a unit (ns, us, ms, s, m, h)");
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown duration unit '", unit, "' (use ns, us, ms, s, m, h)"));
  }
  if (!(seconds < 1e10)) return absl::InvalidArgumentError("duration too large");
  return absl::Seconds(seconds);
}

std::string FormatSize(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.1f %s", v, kUnits[u]);
}

}  // namespace tierkv
