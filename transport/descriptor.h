// SegmentDescriptor: how to reach a segment's memory, published as JSON
// under "tierkv/segments/<name>" in the metadata store.
//
//   {"name": "node1:8800", "host": "node1", "host_id": "<boot id>",
//    "segment_index": 0, "segment_id": 9160473019378290113,
//    "control": "10.0.0.1:8800",
//    "transports": {"tcp": "10.0.0.1:8800", "shm": ""},
//    "buffers": [{"offset": 0, "length": 193273528320, "location": "cpu:0",
//                 "keys": {"rdma": "..."}}]}
//
// `buffers` tile the segment's offset space in order; a request must fall
// inside one buffer. `keys` holds per-transport, per-buffer data (an RDMA
// remote key per NIC, say). docs/wire-formats.md documents every field.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tierkv::transport {

struct BufferDescriptor {
  uint64_t offset = 0;  // within the segment
  uint64_t length = 0;
  std::string location = "cpu:0";
  std::map<std::string, std::string> keys;
};

struct SegmentDescriptor {
  std::string name;
  std::string host;
  std::string host_id;
  uint32_t segment_index = 0;  // the serving engine's local id, carried in frames
  // Random, drawn by the serving engine each time it serves the segment
  // (never 0). Frames and handshakes carry it beside the index, so a
  // server refuses a peer whose descriptor names a segment it no longer
  // serves at that index (it restarted, or another daemon took the port).
  uint64_t segment_id = 0;
  std::string control;         // tcp endpoint of the serving engine's control channel
  // The serving engine admits a connection only with a data grant for
  // this segment (base/auth.h); "auth": true in JSON, absent when false.
  bool auth = false;
  // Every data frame must carry the master's extent grant for what it
  // touches (base/extent_grant.h); "extent_grants": true in JSON. Set with
  // `auth` by servers that check them; a client sends grants only to such
  // a server, as an older one would misread them.
  bool extent_grants = false;
  std::map<std::string, std::string> transports;  // name -> endpoint
  std::vector<BufferDescriptor> buffers;

  uint64_t size() const;
  // The buffer wholly containing [offset, offset+length); OUT_OF_RANGE if
  // none does (including offsets past the end and overflowing lengths).
  absl::StatusOr<const BufferDescriptor*> Locate(uint64_t offset, uint64_t length) const;

  std::string ToJson() const;
  // INVALID_ARGUMENT naming the field for malformed JSON.
  static absl::StatusOr<SegmentDescriptor> FromJson(const std::string& json);
};

// The metadata key a segment's descriptor lives under.
std::string DescriptorKey(const std::string& segment);

}  // namespace tierkv::transport
