// Device: where the engine's L1 pool lives, and every operation that touches
// an L1 page. The cache and the model never dereference an L1 page
// themselves; they pass page addresses to the device, so L1 may be GPU
// memory the CPU cannot read.
//
//   cpu       host memory; copies are memcpy, attention is the reference
//             loop (HostAttention).
//   cuda:<n>  GPU memory (built with TIERKV_HAVE_CUDA). Copies between L1
//             and host memory go on a copy stream, queued and issued as one
//             cudaMemcpyBatchAsync, and waited for once; K/V writes and
//             attention are kernels on a compute stream that waits (on the
//             GPU, not the CPU) for the copies issued before them. So restoring a
//             prefix from L2 overlaps the CPU's work on the first layer.
//
// Ordering: operations take effect in the order they are issued. A copy
// into L1 is seen by later Attention calls; a copy out of L1 sees every
// earlier Attention's K/V writes. Host memory passed to CopyIn/CopyOut must
// stay valid and untouched until Sync() returns OK. After an error the
// device answers every later call with that error.
//
// Not thread-safe: one engine thread drives a device.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model.h"

namespace tierkv::engine {

// One chunk of one layer: its tokens' K and V go into their pages (bf16),
// then each query token attends causally to every position up to itself.
struct AttentionChunk {
  const KvLayout* layout = nullptr;
  int layer = 0;
  size_t begin = 0;  // absolute position of the chunk's first token
  int tokens = 0;
  int heads = 0;     // query heads (a multiple of layout->kv_heads)
  const float* q = nullptr;  // [tokens][heads][head_dim], host, RoPE applied
  const float* k = nullptr;  // [tokens][kv_heads][head_dim], host, RoPE applied
  const float* v = nullptr;  // [tokens][kv_heads][head_dim], host
  // L1 addresses of pages 0 .. (begin + tokens - 1) / page_tokens.
  const std::vector<char*>* pages = nullptr;
  float* out = nullptr;      // [tokens][heads][head_dim], host
};

class Device {
 public:
  virtual ~Device() = default;
  // "cpu" or "cuda:<n>".
  virtual std::string name() const = 0;
  // Whether the CPU may read and write L1 pages directly.
  virtual bool host_addressable() const = 0;
  // L1 pool memory.
  virtual absl::StatusOr<char*> Allocate(size_t bytes) = 0;
  virtual void Free(char* p, size_t bytes) = 0;
  // The memfd behind L1 memory Allocate returned (so same-host peers can
  // map it: shm transfers), or -1.
  virtual int MemoryFd(const char* p) const { return -1; }
  // Host memory that copies will use often (the L2 pool): pinned for DMA.
  // A failure only costs speed; the caller may carry on.
  virtual absl::Status RegisterHost(char* p, size_t bytes) = 0;
  virtual void UnregisterHost(char* p) = 0;
  // Host -> L1 and L1 -> host; may return before the bytes have moved.
  virtual absl::Status CopyIn(char* l1, const char* host, size_t bytes) = 0;
  virtual absl::Status CopyOut(char* host, const char* l1, size_t bytes) = 0;
  // Writes the chunk's K/V into its pages and computes attention into
  // `out`; `out` is filled when this returns.
  virtual absl::Status Attention(const AttentionChunk& chunk) = 0;
  // Waits for everything issued.
  virtual absl::Status Sync() = 0;
};

// "cpu", "cuda:<n>", or "auto" (cuda:0 when a GPU is usable, else cpu).
// A GPU is used only after it passes CheckDevice. An unusable device is an
// error that says why; with "auto" it is a warning, and L1 stays in host
// memory.
absl::StatusOr<std::unique_ptr<Device>> NewDevice(const std::string& name);
std::unique_ptr<Device> NewCpuDevice();

// The reference: writes K/V and computes attention on host-addressable
// pages, in a fixed order, so the result depends only on the inputs.
void HostAttention(const AttentionChunk& chunk);

// Runs a small attention chunk (two pages, positions past one page) on the
// device and compares it with HostAttention: the K/V bytes must be equal
// and the outputs within 1e-3. Catches a GPU the kernels were not built
// for, or one that computes wrong results, before it holds anyone's KV.
absl::Status CheckDevice(Device& device);

}  // namespace tierkv::engine
