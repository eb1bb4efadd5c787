#include "transport/descriptor.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "transport/types.h"

namespace tierkv::transport {

using json = nlohmann::json;

uint64_t SegmentDescriptor::size() const {
  uint64_t n = 0;
  for (const BufferDescriptor& b : buffers) n = std::max(n, b.offset + b.length);
  return n;
}

absl::StatusOr<const BufferDescriptor*> SegmentDescriptor::Locate(uint64_t offset,
                                                                  uint64_t length) const {
  for (const BufferDescriptor& b : buffers) {
    if (offset >= b.offset && RangeWithin(offset - b.offset, length, b.length)) return &b;
  }
  return absl::OutOfRangeError(absl::StrCat("range [", offset, ", +", length,
                                            ") is outside every buffer of segment ", name));
}

std::string SegmentDescriptor::ToJson() const {
  json j;
  j["name"] = name;
  j["host"] = host;
  j["host_id"] = host_id;
  j["segment_index"] = segment_index;
  j["segment_id"] = segment_id;
  j["control"] = control;
  if (auth) j["auth"] = true;
  if (extent_grants) j["extent_grants"] = true;
  j["transports"] = transports;
  j["buffers"] = json::array();
  for (const BufferDescriptor& b : buffers) {
    j["buffers"].push_back(
        {{"offset", b.offset}, {"length", b.length}, {"location", b.location}, {"keys", b.keys}});
  }
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

absl::StatusOr<SegmentDescriptor> SegmentDescriptor::FromJson(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("segment descriptor is not a JSON object");
  }
  SegmentDescriptor d;
  auto str = [&](const char* field, std::string* out) -> absl::Status {
    auto it = j.find(field);
    if (it == j.end() || !it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("descriptor field '", field, "' must be a string"));
    }
    *out = it->get<std::string>();
    return absl::OkStatus();
  };
  for (auto [field, out] : {std::pair{"name", &d.name}, {"host", &d.host}, {"host_id", &d.host_id},
                            {"control", &d.control}}) {
    if (absl::Status s = str(field, out); !s.ok()) return s;
  }
  if (d.name.empty()) return absl::InvalidArgumentError("descriptor has an empty name");
  auto idx = j.find("segment_index");
  if (idx == j.end() || !idx->is_number_unsigned() || idx->get<uint64_t>() > UINT32_MAX) {
    return absl::InvalidArgumentError("descriptor field 'segment_index' must be a uint32");
  }
  d.segment_index = idx->get<uint32_t>();
  auto sid = j.find("segment_id");
  if (sid == j.end() || !sid->is_number_unsigned() || sid->get<uint64_t>() == 0) {
    return absl::InvalidArgumentError("descriptor field 'segment_id' must be a non-zero uint64");
  }
  d.segment_id = sid->get<uint64_t>();
  if (auto a = j.find("auth"); a != j.end()) {
    if (!a->is_boolean()) return absl::InvalidArgumentError("descriptor field 'auth' must be a boolean");
    d.auth = a->get<bool>();
  }
  if (auto a = j.find("extent_grants"); a != j.end()) {
    if (!a->is_boolean()) return absl::InvalidArgumentError("descriptor field 'extent_grants' must be a boolean");
    d.extent_grants = a->get<bool>();
  }
  auto tr = j.find("transports");
  if (tr == j.end() || !tr->is_object()) {
    return absl::InvalidArgumentError("descriptor field 'transports' must be an object");
  }
  for (auto& [k, v] : tr->items()) {
    if (!v.is_string()) return absl::InvalidArgumentError("transport endpoints must be strings");
    d.transports[k] = v.get<std::string>();
  }
  auto bufs = j.find("buffers");
  if (bufs == j.end() || !bufs->is_array()) {
    return absl::InvalidArgumentError("descriptor field 'buffers' must be an array");
  }
  if (bufs->size() > 4096) return absl::InvalidArgumentError("descriptor has too many buffers");
  for (const json& b : *bufs) {
    if (!b.is_object() || !b.contains("offset") || !b["offset"].is_number_unsigned() ||
        !b.contains("length") || !b["length"].is_number_unsigned()) {
      return absl::InvalidArgumentError("each buffer needs unsigned 'offset' and 'length'");
    }
    BufferDescriptor bd;
    bd.offset = b["offset"].get<uint64_t>();
    bd.length = b["length"].get<uint64_t>();
    if (bd.length > UINT64_MAX - bd.offset) return absl::InvalidArgumentError("buffer overflows");
    if (b.contains("location")) {
      if (!b["location"].is_string() || !ParseLocation(b["location"].get<std::string>()).ok()) {
        return absl::InvalidArgumentError("buffer 'location' must be cpu:<n> or cuda:<n>");
      }
      bd.location = b["location"].get<std::string>();
    }
    if (b.contains("keys")) {
      if (!b["keys"].is_object()) return absl::InvalidArgumentError("buffer 'keys' must be an object");
      for (auto& [k, v] : b["keys"].items()) {
        if (!v.is_string()) return absl::InvalidArgumentError("buffer keys must be strings");
        bd.keys[k] = v.get<std::string>();
      }
    }
    d.buffers.push_back(std::move(bd));
  }
  return d;
}

std::string DescriptorKey(const std::string& segment) {
  return absl::StrCat("tierkv/segments/", segment);
}

}  // namespace tierkv::transport
