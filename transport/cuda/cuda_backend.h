// The cuda backend (optional: built when the CUDA toolkit is found, see
// transport/CMakeLists.txt; TIERKV_HAVE_CUDA is then defined).
//
// Same-host GPU memory: RegisterBuffer of cuda:<dev> memory exports a CUDA
// IPC handle; the handshake (over the tcp control channel) hands the
// handles over only to a peer with this host's id, which opens them
// (cudaIpcOpenMemHandle; a peer in the same process uses the pointer
// directly, since CUDA refuses to open a process's own handles). Post issues
// cudaMemcpyAsync (cudaMemcpyDefault: device-to-device and device-to-host
// alike) on a stream of its own and waits for it; a copy is never
// abandoned while the GPU may still write into the caller's memory.
//
// The helpers below serve tests and tierkv-bench, which then need no CUDA
// headers (the engine's GPU pool, engine/cuda/, makes its own calls). On a machine with the toolkit but no GPU,
// DeviceCount() fails with the runtime's reason and the backend is
// UNAVAILABLE.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/registry.h"

namespace tierkv::transport::cuda {

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const BackendOptions& options);

// GPUs visible to this process; an error carrying the runtime's reason
// when there is no usable GPU (no driver, no device).
absl::StatusOr<int> DeviceCount();
absl::StatusOr<void*> DeviceAlloc(size_t bytes, int device);
void DeviceFree(void* p);
absl::StatusOr<void*> PinnedAlloc(size_t bytes);
void PinnedFree(void* p);
// A synchronous cudaMemcpy with cudaMemcpyDefault (any direction).
absl::Status Copy(void* dst, const void* src, size_t bytes);
// The device whose memory `p` points into, or -1 for host memory (pinned
// host memory included) and for any pointer CUDA does not know.
int PointerDevice(const void* p);

}  // namespace tierkv::transport::cuda
