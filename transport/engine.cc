#include "transport/engine.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/log.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/internal/builtin.h"
#include "transport/internal/engine_impl.h"
#include "transport/internal/json_fields.h"
#include "transport/memory.h"

namespace tierkv::transport {
namespace internal {

Engine::~Engine() {
  // Stop serving first so no backend thread touches served memory.
  for (auto& b : backends_) b->Stop();
  queue_.reset();
  for (auto& [name, seg] : served_) {
    if (name != session_id_) (void)options_.metadata->Delete(DescriptorKey(name));
  }
}

absl::Status Engine::Init() {
  if (options_.metadata == nullptr && options_.peer_mode) options_.metadata = NewInMemoryMetadata();  // unused
  if (options_.metadata == nullptr) return absl::InvalidArgumentError("the engine needs a metadata client");
  if (options_.host_id.empty()) options_.host_id = LocalHostId();
  // A wildcard bind advertises a routable address, never 0.0.0.0: peers
  // on other hosts dial it, and segment names are built from it.
  if (options_.backend.advertise.empty()) {
    ASSIGN_OR_RETURN(options_.backend.advertise, ResolveAdvertiseAddress(options_.backend.listen));
  }
  if (options_.host.empty()) options_.host = options_.backend.advertise;
  std::vector<std::string> names = options_.transports;
  bool automatic = names.empty();
  if (automatic) names = {"cuda", "shm", "rdma", "tcp"};
  // tcp is always present: it is the control channel for every handshake.
  std::vector<std::string> create = names;
  if (std::find(create.begin(), create.end(), "tcp") == create.end()) create.push_back("tcp");
  std::vector<std::string> started;
  for (const std::string& n : create) {
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(n, options_.backend);
    if (!b.ok() && automatic && (n == "rdma" || n == "cuda")) {
      // Chosen automatically, rdma and cuda sit out on hosts without a NIC
      // or a GPU (or builds without the cuda target).
      TKV_LOG(DEBUG) << "transport " << n << " not used: " << b.status().message();
      continue;
    }
    if (!b.ok()) return b.status();
    RETURN_IF_ERROR((*b)->Start(this));
    backends_.push_back(std::move(*b));
    started.push_back(n);
  }
  names.erase(std::remove_if(names.begin(), names.end(),
                             [&](const std::string& n) {
                               return std::find(started.begin(), started.end(), n) == started.end();
                             }),
              names.end());
  // Candidate order: as configured, else by rank.
  for (const std::string& n : names) order_.push_back(FindBackend(n));
  if (options_.transports.empty()) {
    std::sort(order_.begin(), order_.end(), [](Backend* a, Backend* b) {
      return a->capabilities().rank > b->capabilities().rank;
    });
  }
  queue_ = std::make_unique<internal::WorkQueue>(std::max(1, options_.workers),
                                                 [this](Task& t) { Run(t); });
  if (options_.peer_mode) {
    std::unique_lock lock(served_mu_);
    InitPeerMode();
  }
  return absl::OkStatus();
}

absl::Status Engine::RegisterMemory(void* addr, uint64_t length, const std::string& location,
                            int memfd) {
  if (addr == nullptr || length == 0) return absl::InvalidArgumentError("empty memory range");
  ASSIGN_OR_RETURN(Location loc, ParseLocation(location));
  char* a = static_cast<char*>(addr);
  auto b = std::make_unique<LocalBuffer>();
  b->addr = a;
  b->length = length;
  b->location = loc;
  b->memfd = memfd;
  {
    std::unique_lock lock(served_mu_);
    if (Overlaps(a, length)) return absl::InvalidArgumentError("range overlaps registered memory");
    b->id = next_buffer_id_++;
    in_flux_[a] = length;
  }
  // Backends that move data from registered memory only (rdma) register
  // it now, so it can be a transfer's local side. That pins every page
  // (seconds for a few hundred GB), so it runs outside served_mu_: the
  // segments served meanwhile keep serving. The range stays reserved in
  // in_flux_ until the buffer is published.
  std::vector<Backend*> refused;
  for (auto& be : backends_) {
    if (!be->capabilities().needs_registered_local) continue;
    absl::StatusOr<std::string> key = be->RegisterBuffer(*b);
    if (!key.ok()) {
      TKV_LOG(WARNING) << be->name() << " cannot use memory at " << location << ": " << key.status().message();
      refused.push_back(be.get());  // its requests go to another transport
    }
  }
  std::unique_lock lock(served_mu_);
  in_flux_.erase(a);
  for (Backend* be : refused) refused_.insert({b->id, be});
  if (options_.peer_mode) AddPeerBuffer(b.get());
  buffers_[a] = std::move(b);
  return absl::OkStatus();
}

absl::Status Engine::UnregisterMemory(void* addr) {
  std::unique_ptr<LocalBuffer> gone;
  {
    std::unique_lock lock(served_mu_);
    auto it = buffers_.find(static_cast<char*>(addr));
    if (it == buffers_.end()) return absl::NotFoundError("no registered buffer starts there");
    // In peer mode a buffer leaves the peer segment with its
    // registration; this exclusive lock has waited for copies into it.
    if (options_.peer_mode) RemovePeerBuffer(it->second.get());
    for (auto& [name, seg] : served_) {
      for (LocalBuffer* b : seg.buffers) {
        if (b == it->second.get()) {
          return absl::FailedPreconditionError(absl::StrCat("buffer is served as segment ", name));
        }
      }
    }
    for (auto& be : backends_) refused_.erase({it->second->id, be.get()});
    gone = std::move(it->second);
    buffers_.erase(it);
    in_flux_[gone->addr] = gone->length;  // no new registration of the range until the backends let go
  }
  // Unpinning is as slow as pinning: outside served_mu_ too.
  for (auto& be : backends_) be->UnregisterBuffer(*gone);
  std::unique_lock lock(served_mu_);
  in_flux_.erase(gone->addr);
  return absl::OkStatus();
}

absl::Status Engine::ServeSegment(const std::string& name, const std::vector<void*>& addrs) {
  if (name.empty()) return absl::InvalidArgumentError("segment name is empty");
  if (addrs.empty()) return absl::InvalidArgumentError("a segment needs at least one buffer");
  if (name == session_id_) return absl::AlreadyExistsError(absl::StrCat(name, " is this engine's peer session"));
  {
    std::unique_lock lock(served_mu_);
    if (served_.contains(name)) return absl::AlreadyExistsError(absl::StrCat("already serving ", name));
    ServedSegment seg{name, next_segment_index_++, NewSegmentId(), {}, {}, {}, {}, {}};
    if (options_.data_grants) seg.data_key = auth::RandomBytes(auth::kDataKeyBytes);
    uint64_t offset = 0;
    for (void* a : addrs) {
      auto it = buffers_.find(static_cast<char*>(a));
      if (it == buffers_.end()) return absl::InvalidArgumentError("segment buffer is not registered");
      LocalBuffer* b = it->second.get();
      seg.buffers.push_back(b);
      seg.offsets.push_back(offset);
      seg.described.push_back(DescribeBuffer(*b, offset));
      offset += b->length;
    }
    seg.descriptor = DescriptorJson(seg);
    served_.emplace(name, std::move(seg));
  }
  return Publish(name);
}

BufferDescriptor Engine::DescribeBuffer(const LocalBuffer& b, uint64_t offset) {
  BufferDescriptor bd{offset, b.length, b.location.ToString(), {}};
  for (auto& be : backends_) {
    absl::StatusOr<std::string> key = be->RegisterBuffer(b);
    if (key.ok() && !key->empty()) bd.keys[be->name()] = *key;
  }
  return bd;
}

std::string Engine::DescriptorJson(const ServedSegment& seg) {
  SegmentDescriptor d;
  d.auth = options_.data_grants;
  d.extent_grants = options_.data_grants;
  d.name = seg.name;
  d.host = options_.host;
  d.host_id = options_.host_id;
  d.segment_index = seg.index;
  d.segment_id = seg.id;
  d.buffers = seg.described;
  for (auto& be : backends_) {
    // shm, cuda and rdma only help when some buffer carries their key.
    const std::string n = be->name();
    if (be->capabilities().keyed_buffers &&
        std::none_of(d.buffers.begin(), d.buffers.end(),
                     [&](const BufferDescriptor& b) { return b.keys.contains(n); })) {
      continue;
    }
    d.transports[be->name()] = be->endpoint();
  }
  d.control = FindBackend("tcp")->endpoint();
  return d.ToJson();
}

absl::Status Engine::Publish(const std::string& name) {
  std::string json;
  {
    std::shared_lock lock(served_mu_);
    auto it = served_.find(name);
    if (it == served_.end()) return absl::NotFoundError(absl::StrCat("not serving ", name));
    json = it->second.descriptor;
  }
  return Annotate(options_.metadata->Put(DescriptorKey(name), json),
                  absl::StrCat("publishing segment ", name));
}

absl::Status Engine::StopServing(const std::string& name) {
  {
    std::unique_lock lock(served_mu_);  // waits for transfers holding pins
    if (served_.erase(name) == 0) return absl::NotFoundError(absl::StrCat("not serving ", name));
  }
  absl::Status st = options_.metadata->Delete(DescriptorKey(name));
  if (!st.ok() && !absl::IsNotFound(st)) return st;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Engine::SegmentDataKey(const std::string& name) {
  std::shared_lock lock(served_mu_);
  auto it = served_.find(name);
  if (it == served_.end()) return absl::NotFoundError(absl::StrCat("not serving ", name));
  return it->second.data_key;
}

void Engine::ObserveEpoch(uint64_t epoch) {
  uint64_t seen = epoch_.load(std::memory_order_relaxed);
  while (epoch > seen && !epoch_.compare_exchange_weak(seen, epoch, std::memory_order_relaxed)) {
  }
}

absl::Status Engine::AdmitWrite(uint64_t epoch) {
  if (epoch == 0) return absl::OkStatus();
  const uint64_t seen = epoch_.load(std::memory_order_relaxed);
  if (epoch < seen) {
    return absl::FailedPreconditionError(absl::StrCat("write granted by master epoch ", epoch,
                                                      "; this daemon follows epoch ", seen,
                                                      " (the granting master was deposed)"));
  }
  ObserveEpoch(epoch);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Engine::DataKey(uint32_t segment_index, uint64_t segment_id) {
  std::shared_lock lock(served_mu_);
  for (const auto& [name, s] : served_) {
    if (s.index == segment_index && s.id == segment_id) return s.data_key;
  }
  return absl::NotFoundError(absl::StrCat("segment #", segment_index, " (id ", segment_id,
                                          ") is not served here; the peer's descriptor is stale"));
}

absl::StatusOr<ServedMemory::Pin> Engine::Resolve(uint32_t segment_index, uint64_t segment_id, uint64_t offset,
                            uint64_t length) {
  std::shared_lock lock(served_mu_);
  const ServedSegment* seg = nullptr;
  for (const auto& [name, s] : served_) {
    if (s.index == segment_index) seg = &s;
  }
  if (seg == nullptr || seg->id != segment_id) {
    return absl::NotFoundError(absl::StrCat("segment #", segment_index, " (id ", segment_id,
                                            ") is not served here; the sender's descriptor is stale"));
  }
  for (size_t i = 0; i < seg->buffers.size(); ++i) {
    uint64_t start = seg->offsets[i];
    const LocalBuffer* b = seg->buffers[i];
    if (offset >= start && RangeWithin(offset - start, length, b->length)) {
      return Pin{b->addr + (offset - start), std::move(lock)};
    }
  }
  return absl::OutOfRangeError(absl::StrCat("range [", offset, ", +", length, ") is outside segment ",
                                            seg->name));
}

absl::StatusOr<std::string> Engine::Handshake(const std::string& transport, const std::string& request,
                                      std::optional<std::pair<uint32_t, uint64_t>> admitted) {
  if (transport == "peer") return PeerHandshake(request, admitted);
  Backend* b = FindBackend(transport);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no transport ", transport, " here"));
  nlohmann::json j = nlohmann::json::parse(request, nullptr, false);
  internal::HandshakeTarget target;
  if (j.is_discarded()) return absl::InvalidArgumentError("handshake is not JSON");
  if (absl::Status st = internal::ReadHandshakeTarget(j, &target); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("handshake: ", st.message()));
  }
  if (options_.data_grants &&
      (!admitted || *admitted != std::make_pair(target.segment_index, target.segment_id))) {
    return absl::UnauthenticatedError(absl::StrCat("handshake for segment #", target.segment_index,
                                                   " needs a data grant for it"));
  }
  std::shared_lock lock(served_mu_);
  for (const auto& [name, s] : served_) {
    if (s.index == target.segment_index && s.id == target.segment_id) {
      return b->ServeHandshake(request, s.buffers.data(), s.buffers.size());
    }
  }
  return absl::NotFoundError(absl::StrCat("segment #", target.segment_index, " (id ", target.segment_id,
                                          ") is not served here; the peer's descriptor is stale"));
}

int Engine::tcp_port() const {
  for (const auto& b : backends_) {
    if (b->name() == "tcp") {
      std::string ep = b->endpoint();
      return std::stoi(ep.substr(ep.rfind(':') + 1));
    }
  }
  return 0;
}

uint64_t Engine::NewSegmentId() {
  std::random_device rd;
  uint64_t id = 1;
  for (int attempt = 0; attempt < 16; ++attempt) {
    id = (static_cast<uint64_t>(rd()) << 32) | rd();
    if (id != 0 && std::none_of(served_.begin(), served_.end(),
                                [&](const auto& kv) { return kv.second.id == id; })) {
      break;
    }
  }
  return id == 0 ? 1 : id;
}

Backend* Engine::FindBackend(const std::string& name) {
  for (auto& b : backends_) {
    if (b->name() == name) return b.get();
  }
  return nullptr;
}

bool Engine::Overlaps(char* a, uint64_t length) {
  for (auto& [start, b] : buffers_) {
    if (a < b->addr + b->length && b->addr < a + length) return true;
  }
  for (auto& [start, len] : in_flux_) {
    if (a < start + len && start < a + length) return true;
  }
  return false;
}

const LocalBuffer* Engine::LocalBufferOf(void* addr, uint64_t length) {
  char* a = static_cast<char*>(addr);
  auto it = buffers_.upper_bound(a);
  if (it == buffers_.begin()) return nullptr;
  --it;
  const LocalBuffer* b = it->second.get();
  if (a < b->addr || !RangeWithin(a - b->addr, length, b->length)) return nullptr;
  return b;
}

}  // namespace internal

std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(EngineOptions options) {
  auto e = std::make_unique<internal::Engine>(std::move(options));
  RETURN_IF_ERROR(e->Init());
  return std::unique_ptr<TransferEngine>(std::move(e));
}

}  // namespace tierkv::transport
