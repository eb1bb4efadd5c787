// The cuda backend's handshake messages, parsed without the CUDA runtime
// (this file is built into every build, so tests and fuzzers reach the
// parsing on hosts without a GPU). Both parsers take bytes from the
// network and answer a status, never an exception.
//
//   request: {"host_id": "<boot id>", "segment_index": 0, "segment_id": ...}
//   answer:  {"pid": 1234, "buffers": [{"index": 0, "handle": "<128 hex>",
//             "addr": 140..., "length": 1048576}]}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tierkv::transport::cuda {

struct CudaAnswer {
  struct Buffer {
    uint64_t index = 0;   // into the descriptor's buffers
    std::string handle;   // cudaIpcMemHandle_t in hex
    uint64_t addr = 0;    // the buffer's address in the serving process
    uint64_t length = 0;
  };
  int64_t pid = 0;
  std::vector<Buffer> buffers;
};

// The requesting peer's host id. INVALID_ARGUMENT when malformed.
absl::StatusOr<std::string> ParseCudaRequest(const std::string& request);
// INVALID_ARGUMENT naming the field when malformed.
absl::StatusOr<CudaAnswer> ParseCudaAnswer(const std::string& answer);

}  // namespace tierkv::transport::cuda
