// Private to transport/: typed reads of JSON fields that came from the
// network (handshakes, their answers, descriptor keys).
//
// nlohmann::json throws type_error when a value is read as the wrong type
// (`j.value("lid", 0)` on a string, `j["pid"].get<int>()` on an array), and
// nothing in the transport catches it, so every field a peer controls is
// read through these: a missing field, a wrong type or a value out of range
// is INVALID_ARGUMENT naming the field, never an exception.
//
//   uint64_t psn;
//   RETURN_IF_ERROR(UintField(j, "psn", UINT32_MAX, &psn));
//   uint64_t lid;
//   RETURN_IF_ERROR(UintField(j, "lid", UINT16_MAX, &lid, /*fallback=*/0));
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace tierkv::transport::internal {

// An unsigned integer field <= max. When absent, `fallback` if given.
inline absl::Status UintField(const nlohmann::json& j, const char* field, uint64_t max, uint64_t* out,
                              std::optional<uint64_t> fallback = std::nullopt) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat("expected an object holding '", field, "'"));
  auto it = j.find(field);
  if (it == j.end() && fallback) {
    *out = *fallback;
    return absl::OkStatus();
  }
  if (it == j.end() || !it->is_number_unsigned() || it->get<uint64_t>() > max) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "' must be an unsigned integer <= ", max));
  }
  *out = it->get<uint64_t>();
  return absl::OkStatus();
}

// A signed integer field in [min, max]. When absent, `fallback` if given.
inline absl::Status IntField(const nlohmann::json& j, const char* field, int64_t min, int64_t max, int64_t* out,
                             std::optional<int64_t> fallback = std::nullopt) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat("expected an object holding '", field, "'"));
  auto it = j.find(field);
  if (it == j.end() && fallback) {
    *out = *fallback;
    return absl::OkStatus();
  }
  bool ok = it != j.end() && it->is_number_integer();
  if (ok && it->is_number_unsigned()) ok = it->get<uint64_t>() <= static_cast<uint64_t>(max);
  if (ok && !it->is_number_unsigned()) ok = it->get<int64_t>() >= min && it->get<int64_t>() <= max;
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "' must be an integer in [", min, ", ", max, "]"));
  }
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

// A string field. When absent, `fallback` if given.
inline absl::Status StringField(const nlohmann::json& j, const char* field, std::string* out,
                                std::optional<std::string> fallback = std::nullopt) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat("expected an object holding '", field, "'"));
  auto it = j.find(field);
  if (it == j.end() && fallback) {
    *out = *fallback;
    return absl::OkStatus();
  }
  if (it == j.end() || !it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "' must be a string"));
  }
  *out = it->get<std::string>();
  return absl::OkStatus();
}

// The segment a handshake names: "segment_index" and "segment_id", as
// every backend's Prepare sends them (the engine routes on them).
struct HandshakeTarget {
  uint32_t segment_index = 0;
  uint64_t segment_id = 0;
};
inline absl::Status ReadHandshakeTarget(const nlohmann::json& j, HandshakeTarget* out) {
  uint64_t index = 0, id = 0;
  if (absl::Status s = UintField(j, "segment_index", UINT32_MAX, &index); !s.ok()) return s;
  if (absl::Status s = UintField(j, "segment_id", UINT64_MAX, &id); !s.ok()) return s;
  out->segment_index = static_cast<uint32_t>(index);
  out->segment_id = id;
  return absl::OkStatus();
}

}  // namespace tierkv::transport::internal
