// The engine's L1 pool on a GPU (see engine/device.h for the contract).
// Built with TIERKV_HAVE_CUDA only.
//
// Streams: copies between L1 and host memory go on a copy stream (queued,
// then issued together as one batch call), attention on a compute stream.
// Before a kernel that may touch L1, the compute stream waits for an event
// recorded after the last copies issued; before a copy out, the copy stream
// waits for the last kernel. So a batch of restores is
// issued without the CPU waiting, and the CPU's own work (the layer's
// projections) runs while it lands. Host buffers for attention's inputs and
// outputs are pinned and reused across calls.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/device.h"

namespace tierkv::engine::cuda {

// UNAVAILABLE with the runtime's reason when the GPU cannot be used.
absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal);

}  // namespace tierkv::engine::cuda
