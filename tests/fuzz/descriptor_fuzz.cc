// Segment descriptor JSON, as fetched from the metadata server (any peer
// can publish one): it parses or errors, and Locate never answers a range
// that is not inside the buffer it returns.
#include <cstdint>
#include <cstring>
#include <string>

#include "tests/fuzz/fuzz.h"
#include "transport/descriptor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The first 16 bytes pick the range to locate; the rest is the JSON.
  uint64_t offset = 0, length = 0;
  if (size >= 16) {
    std::memcpy(&offset, data, 8);
    std::memcpy(&length, data + 8, 8);
    data += 16;
    size -= 16;
  }
  std::string json(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<tierkv::transport::SegmentDescriptor> d = tierkv::transport::SegmentDescriptor::FromJson(json);
  if (!d.ok()) return 0;
  absl::StatusOr<tierkv::transport::SegmentDescriptor> again =
      tierkv::transport::SegmentDescriptor::FromJson(d->ToJson());
  FUZZ_CHECK(again.ok());
  absl::StatusOr<const tierkv::transport::BufferDescriptor*> b = d->Locate(offset, length);
  if (b.ok()) {
    const tierkv::transport::BufferDescriptor& buf = **b;
    FUZZ_CHECK(offset >= buf.offset);
    FUZZ_CHECK(offset - buf.offset <= buf.length && length <= buf.length - (offset - buf.offset));
  }
  return 0;
}
