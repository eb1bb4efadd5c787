#include "transport/cuda/cuda_handshake.h"

#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/internal/json_fields.h"

namespace tierkv::transport::cuda {

using json = nlohmann::json;
using internal::IntField;
using internal::StringField;
using internal::UintField;

absl::StatusOr<std::string> ParseCudaRequest(const std::string& request) {
  json req = json::parse(request, nullptr, false);
  std::string host_id;
  if (req.is_discarded() || !StringField(req, "host_id", &host_id).ok()) {
    return absl::InvalidArgumentError("cuda handshake needs a host_id");
  }
  return host_id;
}

absl::StatusOr<CudaAnswer> ParseCudaAnswer(const std::string& answer) {
  json a = json::parse(answer, nullptr, false);
  if (a.is_discarded() || !a.is_object()) return absl::InvalidArgumentError("cuda handshake answer is not a JSON object");
  CudaAnswer out;
  RETURN_IF_ERROR(IntField(a, "pid", 1, INT32_MAX, &out.pid));
  auto bufs = a.find("buffers");
  if (bufs == a.end() || !bufs->is_array() || bufs->size() > 4096) {
    return absl::InvalidArgumentError("field 'buffers' must be an array of at most 4096");
  }
  for (const json& b : *bufs) {
    CudaAnswer::Buffer buf;
    RETURN_IF_ERROR(UintField(b, "index", UINT32_MAX, &buf.index));
    RETURN_IF_ERROR(UintField(b, "length", UINT64_MAX, &buf.length));
    RETURN_IF_ERROR(UintField(b, "addr", UINT64_MAX, &buf.addr, /*fallback=*/0));
    RETURN_IF_ERROR(StringField(b, "handle", &buf.handle, /*fallback=*/std::string()));
    out.buffers.push_back(std::move(buf));
  }
  return out;
}

}  // namespace tierkv::transport::cuda
