#include "transport/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/cuda/cuda_handshake.h"
#include "transport/memory.h"

namespace tierkv::transport::cuda {
namespace {

using json = nlohmann::json;

absl::Status CudaError(absl::string_view what, cudaError_t e) {
  return absl::UnavailableError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

std::string ToHex(const void* p, size_t n) {
  static const char* kHex = "0123456789abcdef";
  const auto* b = static_cast<const uint8_t*>(p);
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += kHex[b[i] >> 4];
    out += kHex[b[i] & 15];
  }
  return out;
}

bool FromHex(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto* b = static_cast<uint8_t*>(out);
  for (size_t i = 0; i < n; ++i) {
    auto nib = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    b[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

struct Mapping {
  uint64_t offset;  // within the segment
  uint64_t length;
  char* addr;
  bool opened;  // from cudaIpcOpenMemHandle (closed with the channel)
};

class CudaChannel final : public PeerChannel {
 public:
  explicit CudaChannel(std::vector<Mapping> maps) : maps_(std::move(maps)) {}
  ~CudaChannel() override {
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
    for (const Mapping& m : maps_) {
      if (m.opened) cudaIpcCloseMemHandle(m.addr);
    }
  }

  void Post(absl::Span<Slice* const> slices, absl::Time deadline) override {
    cudaStream_t stream = nullptr;
    if (cudaError_t e = TakeStream(&stream); e != cudaSuccess) {
      for (Slice* s : slices) s->status = CudaError("cudaStreamCreate", e);
      return;
    }
    std::vector<Slice*> issued;
    for (Slice* s : slices) {
      if (s->length == 0) {
        s->status = absl::OkStatus();
        continue;
      }
      const Mapping* m = FindRange(maps_, s->remote_offset, s->length);
      if (m == nullptr) {
        s->status = absl::OutOfRangeError(absl::StrCat("range [", s->remote_offset, ", +", s->length,
                                                       ") is not inside a GPU buffer"));
        continue;
      }
      char* remote = m->addr + (s->remote_offset - m->offset);
      char* dst = s->op == Op::kRead ? s->local : remote;
      const char* src = s->op == Op::kRead ? remote : s->local;
      cudaError_t e = cudaMemcpyAsync(dst, src, s->length, cudaMemcpyDefault, stream);
      s->status = e == cudaSuccess ? absl::OkStatus() : CudaError("cudaMemcpyAsync", e);
      if (e == cudaSuccess) issued.push_back(s);
    }
    // Poll until the deadline; past it, still wait (the copies are DMA into
    // the caller's memory and cannot be recalled), then report the lateness.
    // The first kSpin of it yields rather than sleeps: a device-to-device
    // copy of a few MiB ends in microseconds, less than a sleep's wake-up.
    cudaError_t e;
    const absl::Time spin_until = absl::Now() + kSpin;
    absl::Time now;
    while ((e = cudaStreamQuery(stream)) == cudaErrorNotReady && (now = absl::Now()) < deadline) {
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    bool late = e == cudaErrorNotReady;
    if (late) e = cudaStreamSynchronize(stream);
    for (Slice* s : issued) {
      if (e != cudaSuccess) {
        s->status = CudaError("cuda copy", e);
        healthy_ = false;
      } else if (late) {
        s->status = absl::DeadlineExceededError("cuda copy finished after its deadline");
      }
    }
    GiveBackStream(stream, e == cudaSuccess);
  }
  bool healthy() const override { return healthy_.load(); }

 private:
  static constexpr absl::Duration kSpin = absl::Microseconds(200);

  // Streams are reused across Posts (several may run at once, one stream
  // each): creating and destroying one per Post cost as much as the copies
  // of a device-to-device batch.
  cudaError_t TakeStream(cudaStream_t* stream) {
    {
      MutexLock lock(&mu_);
      if (!streams_.empty()) {
        *stream = streams_.back();
        streams_.pop_back();
        return cudaSuccess;
      }
    }
    return cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking);
  }

  // A stream whose copies failed is not reused.
  void GiveBackStream(cudaStream_t stream, bool ok) {
    if (ok) {
      MutexLock lock(&mu_);
      streams_.push_back(stream);
      return;
    }
    cudaStreamDestroy(stream);
  }

  std::vector<Mapping> maps_;
  std::atomic<bool> healthy_{true};
  Mutex mu_;
  std::vector<cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
};

class CudaBackend final : public Backend {
 public:
  std::string name() const override { return "cuda"; }
  Capabilities capabilities() const override {
    return {.rank = 200, .same_host_only = true, .cuda_memory = true, .keyed_buffers = true};
  }
  absl::Status Start(ServedMemory*) override { return absl::OkStatus(); }
  void Stop() override {}
  std::string endpoint() const override { return LocalHostId(); }

  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer& b) override {
    if (b.location.kind != Location::kCuda) return absl::FailedPreconditionError("host memory goes by shm");
    cudaIpcMemHandle_t h;
    if (cudaError_t e = cudaIpcGetMemHandle(&h, b.addr); e != cudaSuccess) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot export GPU buffer (it must be the start of a cudaMalloc allocation): ", cudaGetErrorString(e)));
    }
    MutexLock lock(&mu_);
    handles_[b.addr] = ToHex(&h, sizeof(h));
    return std::string("ipc");
  }
  void UnregisterBuffer(const LocalBuffer& b) override {
    MutexLock lock(&mu_);
    handles_.erase(b.addr);
  }

  absl::StatusOr<std::string> ServeHandshake(const std::string& request, const LocalBuffer* const* buffers,
                                             size_t count) override {
    ASSIGN_OR_RETURN(std::string peer, ParseCudaRequest(request));
    if (peer != LocalHostId()) {
      return absl::FailedPreconditionError("cuda IPC refused: the peer is not on this host");
    }
    json out{{"pid", getpid()}, {"buffers", json::array()}};
    MutexLock lock(&mu_);
    for (size_t i = 0; i < count; ++i) {
      auto it = handles_.find(buffers[i]->addr);
      if (it == handles_.end()) continue;
      out["buffers"].push_back({{"index", i},
                                {"handle", it->second},
                                {"addr", reinterpret_cast<uint64_t>(buffers[i]->addr)},
                                {"length", buffers[i]->length}});
    }
    return out.dump();
  }

  absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor& remote,
                                                       const PrepareContext& ctx) override {
    if (!remote.transports.contains("cuda")) {
      return absl::UnavailableError(absl::StrCat("segment ", remote.name, " offers no cuda"));
    }
    if (remote.host_id != ctx.local_host_id) {
      return absl::UnavailableError(absl::StrCat("segment ", remote.name, " is on another host"));
    }
    json req{{"host_id", ctx.local_host_id},
             {"segment_index", remote.segment_index},
             {"segment_id", remote.segment_id}};
    absl::StatusOr<std::string> answer = ctx.handshake(remote.control, "cuda", req.dump(), ctx.deadline);
    if (!answer.ok()) return absl::UnavailableError(answer.status().message());
    absl::StatusOr<CudaAnswer> a = ParseCudaAnswer(*answer);
    if (!a.ok()) return absl::UnavailableError(absl::StrCat("malformed cuda handshake answer: ", a.status().message()));
    const bool same_process = a->pid == getpid();
    std::vector<Mapping> maps;
    for (const CudaAnswer::Buffer& b : a->buffers) {
      if (b.index >= remote.buffers.size() || b.length != remote.buffers[b.index].length) continue;
      const BufferDescriptor& bd = remote.buffers[b.index];
      if (same_process) {
        if (b.addr == 0) continue;
        maps.push_back({bd.offset, bd.length, reinterpret_cast<char*>(b.addr), false});
        continue;
      }
      cudaIpcMemHandle_t h;
      if (!FromHex(b.handle, &h, sizeof(h))) {
        for (const Mapping& m : maps) {
          if (m.opened) cudaIpcCloseMemHandle(m.addr);
        }
        return absl::UnavailableError("malformed IPC handle");
      }
      void* p = nullptr;
      if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
        for (const Mapping& m : maps) {
          if (m.opened) cudaIpcCloseMemHandle(m.addr);
        }
        return CudaError("cudaIpcOpenMemHandle", e);
      }
      maps.push_back({bd.offset, bd.length, static_cast<char*>(p), true});
    }
    if (maps.empty()) return absl::UnavailableError(absl::StrCat("segment ", remote.name, " shares no GPU buffer"));
    return std::unique_ptr<PeerChannel>(new CudaChannel(std::move(maps)));
  }

 private:
  Mutex mu_;
  std::map<char*, std::string> handles_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<int> DeviceCount() {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("no GPU: ", cudaGetErrorString(e)));
  }
  if (n == 0) return absl::UnavailableError("no GPU: the CUDA runtime sees no device");
  return n;
}

absl::StatusOr<void*> DeviceAlloc(size_t bytes, int device) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return CudaError("cudaSetDevice", e);
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) return CudaError("cudaMalloc", e);
  return p;
}

void DeviceFree(void* p) { cudaFree(p); }

absl::StatusOr<void*> PinnedAlloc(size_t bytes) {
  void* p = nullptr;
  if (cudaError_t e = cudaMallocHost(&p, bytes); e != cudaSuccess) return CudaError("cudaMallocHost", e);
  return p;
}

void PinnedFree(void* p) { cudaFreeHost(p); }

absl::Status Copy(void* dst, const void* src, size_t bytes) {
  if (cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault); e != cudaSuccess) return CudaError("cudaMemcpy", e);
  return absl::OkStatus();
}

int PointerDevice(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // host memory CUDA never saw: clear the sticky error
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice ? attr.device : -1;
}

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const BackendOptions&) {
  ASSIGN_OR_RETURN(int n, DeviceCount());
  (void)n;
  return std::unique_ptr<Backend>(new CudaBackend());
}

}  // namespace tierkv::transport::cuda
