#include "transport/types.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace tierkv::transport {

std::string Location::ToString() const {
  return absl::StrCat(kind == kCpu ? "cpu:" : "cuda:", index);
}

absl::StatusOr<Location> ParseLocation(absl::string_view text) {
  Location loc;
  absl::string_view rest;
  if (absl::ConsumePrefix(&text, "cpu:")) {
    loc.kind = Location::kCpu;
  } else if (absl::ConsumePrefix(&text, "cuda:")) {
    loc.kind = Location::kCuda;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("location '", text, "' is not cpu:<numa> or cuda:<device>"));
  }
  if (!absl::SimpleAtoi(text, &loc.index) || loc.index < 0 || loc.index > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("bad location index '", text, "'"));
  }
  return loc;
}

}  // namespace tierkv::transport
