// Parsing and printing of the human units operators write in flags.
//
// Sizes: a number (possibly fractional) and an optional unit, case-insensitive:
//   b, kb/mb/gb/tb (powers of 1000), kib/mib/gib/tib (powers of 1024), and
//   k/m/g/t as 1024-based shorthands.   "512mb", "180gb", "1.5tb", "4gib".
// Durations: a number and one of ns, us, ms, s, m, h.   "500ms", "10s", "1.5m".
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierkv {

// INVALID_ARGUMENT for an empty, malformed, negative or overflowing value.
absl::StatusOr<uint64_t> ParseSize(absl::string_view text);
absl::StatusOr<absl::Duration> ParseDuration(absl::string_view text);

// "1.5 GiB", "512 B": for humans, not for parsing back exactly.
std::string FormatSize(uint64_t bytes);

}  // namespace tierkv
