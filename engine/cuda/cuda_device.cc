#include "engine/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "engine/cuda/kernels.h"

namespace tierkv::engine::cuda {
namespace {

// Device memory, grown on demand and never shrunk (chunks are bounded by
// the page size; scores by the longest prompt seen).
struct DeviceBuffer {
  void* p = nullptr;
  size_t size = 0;
  ~DeviceBuffer() {
    if (p != nullptr) cudaFree(p);
  }
};

struct PinnedBuffer {
  void* p = nullptr;
  size_t size = 0;
  ~PinnedBuffer() {
    if (p != nullptr) cudaFreeHost(p);
  }
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal), name_(absl::StrCat("cuda:", ordinal)) {}

  ~CudaDevice() override {
    (void)Flush();
    cudaSetDevice(ordinal_);
    if (compute_ != nullptr) cudaStreamSynchronize(compute_);
    if (copy_ != nullptr) cudaStreamSynchronize(copy_);
    for (cudaEvent_t e : {copied_, computed_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaStream_t s : {compute_, copy_}) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  absl::Status Init() {
    if (absl::Status s = Check(cudaSetDevice(ordinal_), "cudaSetDevice"); !s.ok()) return s;
    for (cudaStream_t* s : {&compute_, &copy_}) {
      if (absl::Status st = Check(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking), "cudaStreamCreate"); !st.ok()) {
        return st;
      }
    }
    for (cudaEvent_t* e : {&copied_, &computed_}) {
      if (absl::Status st = Check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate"); !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  }

  std::string name() const override { return name_; }
  bool host_addressable() const override { return false; }

  absl::StatusOr<char*> Allocate(size_t bytes) override {
    if (!error_.ok()) return error_;
    void* p = nullptr;
    cudaSetDevice(ordinal_);
    if (cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1)); e != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky
      return absl::ResourceExhaustedError(
          absl::StrCat(name_, ": cudaMalloc of ", bytes, " bytes: ", cudaGetErrorString(e)));
    }
    return static_cast<char*>(p);
  }

  void Free(char* p, size_t) override {
    (void)Flush();
    cudaSetDevice(ordinal_);
    cudaStreamSynchronize(copy_);
    cudaStreamSynchronize(compute_);
    cudaFree(p);
  }

  absl::Status RegisterHost(char* p, size_t bytes) override {
    if (cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault); e != cudaSuccess) {
      cudaGetLastError();
      return absl::UnavailableError(absl::StrCat(name_, ": cudaHostRegister of ", bytes,
                                                 " bytes: ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }

  void UnregisterHost(char* p) override {
    (void)Flush();
    cudaSetDevice(ordinal_);
    cudaStreamSynchronize(copy_);
    cudaHostUnregister(p);
  }

  absl::Status CopyIn(char* l1, const char* host, size_t bytes) override {
    if (!error_.ok()) return error_;
    return Queue(Direction::kIn, l1, host, bytes);
  }

  absl::Status CopyOut(char* host, const char* l1, size_t bytes) override {
    if (!error_.ok()) return error_;
    if (kernels_pending_) {
      // The copy must see the K/V the kernels wrote: queued copies out were
      // issued after earlier kernels, so they go first, then the wait.
      if (absl::Status s = Flush(); !s.ok()) return s;
      cudaSetDevice(ordinal_);
      if (absl::Status s = Check(cudaEventRecord(computed_, compute_), "cudaEventRecord"); !s.ok()) return s;
      if (absl::Status s = Check(cudaStreamWaitEvent(copy_, computed_, 0), "cudaStreamWaitEvent"); !s.ok()) return s;
      kernels_pending_ = false;
    }
    return Queue(Direction::kOut, host, l1, bytes);
  }

  absl::Status Attention(const AttentionChunk& c) override {
    if (!error_.ok()) return error_;
    cudaSetDevice(ordinal_);
    const KvLayout& L = *c.layout;
    const size_t n = static_cast<size_t>(c.tokens);
    const size_t len = c.begin + n;
    const size_t q_elems = n * c.heads * L.head_dim;
    const size_t kv_elems = n * L.kv_heads * L.head_dim;
    const size_t table_bytes = c.pages->size() * sizeof(char*);
    // Inputs staged in pinned memory: q, k, v, then the page table.
    const size_t in_bytes = (q_elems + 2 * kv_elems) * sizeof(float) + table_bytes;
    if (absl::Status s = Reserve(&staging_in_, in_bytes); !s.ok()) return s;
    if (absl::Status s = Reserve(&staging_out_, q_elems * sizeof(float)); !s.ok()) return s;
    if (absl::Status s = Reserve(&inputs_, in_bytes); !s.ok()) return s;
    if (absl::Status s = Reserve(&out_, q_elems * sizeof(float)); !s.ok()) return s;
    if (absl::Status s = Reserve(&scores_, n * c.heads * len * sizeof(float)); !s.ok()) return s;
    char* in = static_cast<char*>(staging_in_.p);
    std::memcpy(in, c.q, q_elems * sizeof(float));
    std::memcpy(in + q_elems * sizeof(float), c.k, kv_elems * sizeof(float));
    std::memcpy(in + (q_elems + kv_elems) * sizeof(float), c.v, kv_elems * sizeof(float));
    std::memcpy(in + (q_elems + 2 * kv_elems) * sizeof(float), c.pages->data(), table_bytes);
    if (absl::Status s = Flush(); !s.ok()) return s;
    if (copies_pending_) {
      // Restored pages must have landed before the kernels read them, and
      // pages copied out must have left before the kernels write them.
      if (absl::Status s = Check(cudaEventRecord(copied_, copy_), "cudaEventRecord"); !s.ok()) return s;
      if (absl::Status s = Check(cudaStreamWaitEvent(compute_, copied_, 0), "cudaStreamWaitEvent"); !s.ok()) return s;
      copies_pending_ = false;
    }
    char* dev = static_cast<char*>(inputs_.p);
    if (absl::Status s = Check(cudaMemcpyAsync(dev, in, in_bytes, cudaMemcpyHostToDevice, compute_), "cudaMemcpyAsync");
        !s.ok()) {
      return s;
    }
    const auto* q = reinterpret_cast<const float*>(dev);
    const auto* k = q + q_elems;
    const auto* v = k + kv_elems;
    auto* const* pages = reinterpret_cast<char* const*>(dev + (q_elems + 2 * kv_elems) * sizeof(float));
    const KernelLayout kl = L.kernel();
    if (absl::Status s = Check(static_cast<cudaError_t>(LaunchWriteKv(kl, c.layer, c.begin, c.tokens, k, v, pages, compute_)),
                               "write K/V kernel");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Check(static_cast<cudaError_t>(LaunchAttention(kl, c.layer, c.begin, c.tokens, c.heads, q, pages,
                                                                        static_cast<float*>(scores_.p),
                                                                        static_cast<float*>(out_.p), compute_)),
                               "attention kernel");
        !s.ok()) {
      return s;
    }
    kernels_pending_ = true;
    if (absl::Status s = Check(cudaMemcpyAsync(staging_out_.p, out_.p, q_elems * sizeof(float), cudaMemcpyDeviceToHost,
                                               compute_),
                               "cudaMemcpyAsync");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Check(cudaStreamSynchronize(compute_), "attention"); !s.ok()) return s;
    std::memcpy(c.out, staging_out_.p, q_elems * sizeof(float));
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (!error_.ok()) return error_;
    if (absl::Status s = Flush(); !s.ok()) return s;
    cudaSetDevice(ordinal_);
    if (absl::Status s = Check(cudaStreamSynchronize(copy_), "copies"); !s.ok()) return s;
    if (absl::Status s = Check(cudaStreamSynchronize(compute_), "kernels"); !s.ok()) return s;
    copies_pending_ = kernels_pending_ = false;
    return absl::OkStatus();
  }

 private:
  enum class Direction { kIn, kOut };

  // Copies are queued and issued together: one cudaMemcpyAsync costs a few
  // microseconds of CPU, as long as a 64 KiB page takes to cross PCIe, so
  // issuing pages one by one capped restores of small pages at a third of
  // the link. The queue holds one direction; a copy the other way, or a
  // second copy to a destination already queued (copies in one batch run
  // in no set order; L1 copies are whole pages, so a destination is known
  // by its start), issues it first, and so does everything that must see
  // the copies land (Attention, Sync, Free, UnregisterHost). After an
  // error the queue is dropped: the device answers with the error anyway.
  absl::Status Queue(Direction d, char* dst, const char* src, size_t bytes) {
    if (!batch_.dsts.empty() && (d != batch_.direction || batch_.dst_set.contains(dst))) {
      if (absl::Status s = Flush(); !s.ok()) return s;
    }
    batch_.direction = d;
    batch_.dsts.push_back(dst);
    batch_.srcs.push_back(src);
    batch_.sizes.push_back(bytes);
    batch_.dst_set.insert(dst);
    if (batch_.dsts.size() >= kMaxBatch) return Flush();
    return absl::OkStatus();
  }

  absl::Status Flush() {
    if (batch_.dsts.empty()) return absl::OkStatus();
    if (!error_.ok()) {
      ClearBatch();
      return error_;
    }
    cudaSetDevice(ordinal_);
    copies_pending_ = true;  // the next kernels wait for these copies
    const char* what = batch_.direction == Direction::kIn ? "copies L2 to L1" : "copies L1 to L2";
    cudaError_t e = cudaSuccess;
#if CUDART_VERSION >= 13000
    if (batch_.dsts.size() > 1) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t first = 0;
      e = cudaMemcpyBatchAsync(batch_.dsts.data(), batch_.srcs.data(), batch_.sizes.data(), batch_.dsts.size(), &attr,
                               &first, 1, copy_);
      if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue) {
        // A driver or memory kind the batch call refuses: one call each.
        cudaGetLastError();
        e = IssueEach();
      }
    } else {
      e = IssueEach();
    }
#else
    e = IssueEach();
#endif
    ClearBatch();
    return Check(e, what);
  }

  void ClearBatch() {
    batch_.dsts.clear();
    batch_.srcs.clear();
    batch_.sizes.clear();
    batch_.dst_set.clear();
  }

  cudaError_t IssueEach() {
    const cudaMemcpyKind kind = batch_.direction == Direction::kIn ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    for (size_t i = 0; i < batch_.dsts.size(); ++i) {
      if (cudaError_t e = cudaMemcpyAsync(batch_.dsts[i], batch_.srcs[i], batch_.sizes[i], kind, copy_);
          e != cudaSuccess) {
        return e;
      }
    }
    return cudaSuccess;
  }

  // Records the first failure; the device then answers with it.
  absl::Status Check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return absl::OkStatus();
    error_ = absl::UnavailableError(absl::StrCat(name_, ": ", what, ": ", cudaGetErrorString(e)));
    TKV_LOG(ERROR) << error_.message();
    return error_;
  }

  template <typename Buffer>
  absl::Status Reserve(Buffer* b, size_t bytes) {
    if (b->size >= bytes) return absl::OkStatus();
    // The old buffer may still be read by queued work.
    if (absl::Status s = Check(cudaStreamSynchronize(compute_), "kernels"); !s.ok()) return s;
    size_t want = std::max(bytes, b->size * 2);
    void* p = nullptr;
    cudaError_t e;
    if constexpr (std::is_same_v<Buffer, PinnedBuffer>) {
      if (b->p != nullptr) cudaFreeHost(b->p);
      e = cudaMallocHost(&p, want);
    } else {
      if (b->p != nullptr) cudaFree(b->p);
      e = cudaMalloc(&p, want);
    }
    b->p = nullptr;
    b->size = 0;
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(name_, ": ", want, " bytes of scratch: ", cudaGetErrorString(e)));
    }
    b->p = p;
    b->size = want;
    return absl::OkStatus();
  }

  const int ordinal_;
  const std::string name_;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cudaEvent_t copied_ = nullptr, computed_ = nullptr;
  bool copies_pending_ = false, kernels_pending_ = false;
  static constexpr size_t kMaxBatch = 4096;
  struct {
    Direction direction = Direction::kIn;
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    absl::flat_hash_set<const void*> dst_set;
  } batch_;
  absl::Status error_;
  PinnedBuffer staging_in_, staging_out_;
  DeviceBuffer inputs_, out_, scores_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("cuda:", ordinal, ": no GPU usable: ", cudaGetErrorString(e)));
  }
  if (ordinal >= count) {
    return absl::UnavailableError(absl::StrCat("cuda:", ordinal, ": this host has ", count, " GPU(s)"));
  }
  auto d = std::make_unique<CudaDevice>(ordinal);
  if (absl::Status s = d->Init(); !s.ok()) return s;
  return std::unique_ptr<Device>(std::move(d));
}

}  // namespace tierkv::engine::cuda
