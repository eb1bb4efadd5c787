#include "transport/registry.h"

#include <map>

#include "absl/strings/str_join.h"
#include "base/mutex.h"
#include "transport/internal/builtin.h"
#include "transport/rdma/rdma_backend.h"
#ifdef TIERKV_HAVE_CUDA
#include "transport/cuda/cuda_backend.h"
#endif

namespace tierkv::transport {
namespace {

struct Registry {
  Mutex mu;
  std::map<std::string, BackendFactory> factories ABSL_GUARDED_BY(mu);
};

Registry& Get() {
  static Registry* r = [] {
    auto* reg = new Registry();
    MutexLock lock(&reg->mu);
    reg->factories["tcp"] = internal::NewTcpBackend;
    reg->factories["shm"] = internal::NewShmBackend;
    reg->factories["loopback"] = internal::NewLoopbackBackend;
    reg->factories["rdma"] = [](const BackendOptions& o) { return rdma::NewRdmaBackend(o, rdma::RealVerbs()); };
#ifdef TIERKV_HAVE_CUDA
    reg->factories["cuda"] = cuda::NewCudaBackend;
#endif
    return reg;
  }();
  return *r;
}

}  // namespace

void RegisterBackend(const std::string& name, BackendFactory factory) {
  Registry& r = Get();
  MutexLock lock(&r.mu);
  r.factories[name] = std::move(factory);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& name,
                                                       const BackendOptions& options) {
  Registry& r = Get();
  BackendFactory f;
  {
    MutexLock lock(&r.mu);
    auto it = r.factories.find(name);
    if (it == r.factories.end()) {
      std::vector<std::string> names;
      for (auto& [n, _] : r.factories) names.push_back(n);
      return absl::NotFoundError("unknown transport '" + name + "' (known: " +
                                 absl::StrJoin(names, ", ") + ")");
    }
    f = it->second;
  }
  return f(options);
}

std::vector<std::string> RegisteredBackends() {
  Registry& r = Get();
  MutexLock lock(&r.mu);
  std::vector<std::string> names;
  for (auto& [n, _] : r.factories) names.push_back(n);
  return names;
}

}  // namespace tierkv::transport
