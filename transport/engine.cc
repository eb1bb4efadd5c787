#include "transport/engine.h"

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <shared_mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/auth.h"
#include "base/log.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/internal/batch.h"
#include "transport/internal/builtin.h"
#include "transport/internal/json_fields.h"
#include "transport/internal/peers.h"
#include "transport/memory.h"

namespace tierkv::transport {
namespace {

using internal::BatchImpl;
using internal::PeerEntry;
using internal::Task;

struct ServedSegment {
  std::string name;
  uint32_t index;
  uint64_t id;  // random per ServeSegment: frames must name it (descriptor.h)
  std::vector<LocalBuffer*> buffers;
  std::vector<uint64_t> offsets;  // segment offset of each buffer
  std::string descriptor;         // JSON, as published
  std::string data_key;           // EngineOptions::data_grants; "" without
};

class Engine final : public TransferEngine, public ServedMemory {
 public:
  explicit Engine(EngineOptions options) : options_(std::move(options)) {}
  ~Engine() override {
    // Stop serving first so no backend thread touches served memory.
    for (auto& b : backends_) b->Stop();
    queue_.reset();
    for (auto& [name, seg] : served_) {
      (void)options_.metadata->Delete(DescriptorKey(name));
    }
  }

  absl::Status Init() {
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
    return absl::OkStatus();
  }

  // --- registration and serving

  absl::Status RegisterMemory(void* addr, uint64_t length, const std::string& location,
                              int memfd) override {
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
    buffers_[a] = std::move(b);
    return absl::OkStatus();
  }

  absl::Status UnregisterMemory(void* addr) override {
    std::unique_ptr<LocalBuffer> gone;
    {
      std::unique_lock lock(served_mu_);
      auto it = buffers_.find(static_cast<char*>(addr));
      if (it == buffers_.end()) return absl::NotFoundError("no registered buffer starts there");
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

  absl::Status ServeSegment(const std::string& name, const std::vector<void*>& addrs) override {
    if (name.empty()) return absl::InvalidArgumentError("segment name is empty");
    if (addrs.empty()) return absl::InvalidArgumentError("a segment needs at least one buffer");
    SegmentDescriptor d;
    {
      std::unique_lock lock(served_mu_);
      if (served_.contains(name)) return absl::AlreadyExistsError(absl::StrCat("already serving ", name));
      ServedSegment seg{name, next_segment_index_++, NewSegmentId(), {}, {}, {}, {}};
      if (options_.data_grants) seg.data_key = auth::RandomBytes(auth::kDataKeyBytes);
      d.auth = options_.data_grants;
      d.name = name;
      d.host = options_.host;
      d.host_id = options_.host_id;
      d.segment_index = seg.index;
      d.segment_id = seg.id;
      uint64_t offset = 0;
      for (void* a : addrs) {
        auto it = buffers_.find(static_cast<char*>(a));
        if (it == buffers_.end()) return absl::InvalidArgumentError("segment buffer is not registered");
        LocalBuffer* b = it->second.get();
        BufferDescriptor bd{offset, b->length, b->location.ToString(), {}};
        for (auto& be : backends_) {
          absl::StatusOr<std::string> key = be->RegisterBuffer(*b);
          if (key.ok() && !key->empty()) bd.keys[be->name()] = *key;
        }
        seg.buffers.push_back(b);
        seg.offsets.push_back(offset);
        d.buffers.push_back(bd);
        offset += b->length;
      }
      for (auto& be : backends_) {
        // shm, cuda and rdma only help when some buffer carries their key.
        const std::string n = be->name();
        if ((n == "shm" || n == "cuda" || n == "rdma") &&
            std::none_of(d.buffers.begin(), d.buffers.end(),
                         [&](const BufferDescriptor& b) { return b.keys.contains(n); })) {
          continue;
        }
        d.transports[be->name()] = be->endpoint();
      }
      d.control = FindBackend("tcp")->endpoint();
      seg.descriptor = d.ToJson();
      served_.emplace(name, std::move(seg));
    }
    return Publish(name);
  }

  absl::Status Publish(const std::string& name) override {
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

  absl::Status StopServing(const std::string& name) override {
    {
      std::unique_lock lock(served_mu_);  // waits for transfers holding pins
      if (served_.erase(name) == 0) return absl::NotFoundError(absl::StrCat("not serving ", name));
    }
    absl::Status st = options_.metadata->Delete(DescriptorKey(name));
    if (!st.ok() && !absl::IsNotFound(st)) return st;
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> SegmentDataKey(const std::string& name) override {
    std::shared_lock lock(served_mu_);
    auto it = served_.find(name);
    if (it == served_.end()) return absl::NotFoundError(absl::StrCat("not serving ", name));
    return it->second.data_key;
  }

  // --- ServedMemory (called by backends' serving threads)

  bool DataGrantsRequired() const override { return options_.data_grants; }

  void ObserveEpoch(uint64_t epoch) override {
    uint64_t seen = epoch_.load(std::memory_order_relaxed);
    while (epoch > seen && !epoch_.compare_exchange_weak(seen, epoch, std::memory_order_relaxed)) {
    }
  }

  absl::Status AdmitWrite(uint64_t epoch) override {
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

  absl::StatusOr<std::string> DataKey(uint32_t segment_index, uint64_t segment_id) override {
    std::shared_lock lock(served_mu_);
    for (const auto& [name, s] : served_) {
      if (s.index == segment_index && s.id == segment_id) return s.data_key;
    }
    return absl::NotFoundError(absl::StrCat("segment #", segment_index, " (id ", segment_id,
                                            ") is not served here; the peer's descriptor is stale"));
  }

  absl::StatusOr<Pin> Resolve(uint32_t segment_index, uint64_t segment_id, uint64_t offset,
                              uint64_t length) override {
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

  absl::StatusOr<std::string> Handshake(const std::string& transport, const std::string& request,
                                        std::optional<std::pair<uint32_t, uint64_t>> admitted) override {
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

  // --- client side

  std::shared_ptr<Batch> Submit(std::vector<Request> requests, absl::Duration timeout) override {
    return Start(std::move(requests), timeout, /*here=*/false);
  }

  std::shared_ptr<Batch> SubmitHere(std::vector<Request> requests, absl::Duration timeout) override {
    return Start(std::move(requests), timeout, /*here=*/true);
  }

  std::vector<absl::Status> Transfer(std::vector<Request> requests, absl::Duration timeout) override {
    if (timeout <= absl::ZeroDuration()) timeout = options_.default_timeout;
    std::shared_ptr<Batch> b = SubmitHere(std::move(requests), timeout);
    // Every task ends by the deadline; the margin covers the last wake-up.
    // A Wait that runs out seals the batch, so what did not finish reads
    // DEADLINE_EXCEEDED.
    (void)b->Wait(absl::Now() + timeout + absl::Seconds(5));
    return b->statuses();
  }

  // Submit, or with `here` SubmitHere.
  std::shared_ptr<Batch> Start(std::vector<Request> requests, absl::Duration timeout, bool here) {
    if (timeout <= absl::ZeroDuration()) timeout = options_.default_timeout;
    absl::Time deadline = absl::Now() + timeout;
    auto batch = std::make_shared<BatchImpl>(requests.size(), deadline);
    requests_.fetch_add(requests.size(), std::memory_order_relaxed);

    // Group by segment, keeping request order within each.
    std::map<std::string, std::vector<size_t>> by_segment;
    for (size_t i = 0; i < requests.size(); ++i) {
      const Request& r = requests[i];
      if (r.length == 0) continue;  // nothing to move: OK
      if (r.local == nullptr) {
        batch->SetStatus(i, absl::InvalidArgumentError("request has no local buffer"));
        continue;
      }
      by_segment[r.segment].push_back(i);
    }
    struct Plan {
      Backend* backend;
      std::shared_ptr<PeerChannel> channel;
      std::string segment;
      size_t first_slice, end_slice;
    };
    std::vector<Plan> plans;
    for (auto& [segment, idx] : by_segment) {
      absl::StatusOr<Prepared> peer = GetPeer(segment, deadline);
      if (!peer.ok()) {
        for (size_t i : idx) batch->SetStatus(i, peer.status());
        continue;
      }
      // Each request goes to the chosen transport unless that one refuses
      // its memory; then to the next transport that reaches the peer.
      std::map<Backend*, std::pair<std::shared_ptr<PeerChannel>, std::vector<size_t>>> routes;
      for (size_t i : idx) {
        const Request& r = requests[i];
        absl::StatusOr<const BufferDescriptor*> where = peer->desc.Locate(r.offset, r.length);
        if (!where.ok()) {
          batch->SetStatus(i, where.status());
          continue;
        }
        const bool gpu = LocalIsGpu(r.local, r.length) || (*where)->location.rfind("cuda:", 0) == 0;
        std::string refusal = Refusal(peer->backend, r, gpu);
        if (refusal.empty()) {
          auto& route = routes[peer->backend];
          route.first = peer->channel;
          route.second.push_back(i);
          continue;
        }
        absl::StatusOr<std::pair<Backend*, std::shared_ptr<PeerChannel>>> alt =
            Fallback(segment, *peer, r, gpu, refusal, deadline);
        if (!alt.ok()) {
          batch->SetStatus(i, alt.status());
          continue;
        }
        auto& route = routes[alt->first];
        route.first = alt->second;
        route.second.push_back(i);
      }
      for (auto& [backend, route] : routes) {
        size_t first = batch->slices.size();
        for (size_t i : route.second) {
          const Request& r = requests[i];
          for (uint64_t done = 0; done < r.length; done += options_.slice_size) {
            Slice s;
            s.op = r.op;
            s.local = static_cast<char*>(r.local) + done;
            s.remote_offset = r.offset + done;
            s.length = std::min(options_.slice_size, r.length - done);
            if (r.length <= options_.slice_size) s.crc = r.crc;
            s.epoch = r.epoch;
            batch->slices.push_back(s);
            batch->slice_request.push_back(i);
          }
        }
        plans.push_back({backend, route.first, segment, first, batch->slices.size()});
      }
    }
    batch->Start();
    // Spread each channel's slices over the workers by bytes, at most 64
    // slices per task, and no task for less than kMinTaskBytes where the
    // rest can take it: a hop to a worker and back costs a few tens of
    // microseconds, more than moving a small value, so a single get's value
    // and trailer move together. With `here`, the last task is this
    // thread's, run once the others are queued so they move in parallel
    // with it, unless its backend may overstay the deadline (the caller
    // must not be held past it).
    constexpr uint64_t kMinTaskBytes = 256 << 10;
    std::optional<Task> mine;
    bool mine_bounded = false;
    for (const Plan& p : plans) {
      uint64_t left = 0;
      for (size_t k = p.first_slice; k < p.end_slice; ++k) left += batch->slices[k].length;
      const uint64_t workers = static_cast<uint64_t>(std::max(1, options_.workers));
      const uint64_t per_task = std::max<uint64_t>((left + workers - 1) / workers, kMinTaskBytes);
      for (size_t k = p.first_slice; k < p.end_slice;) {
        Task t{batch, p.channel, p.segment, {}, deadline};
        uint64_t bytes = 0;
        while (k < p.end_slice && t.slices.size() < 64) {
          Slice* s = &batch->slices[k++];
          t.slices.push_back(s);
          bytes += s->length;
          left -= s->length;
          if (bytes >= per_task && left >= kMinTaskBytes) break;
        }
        if (mine) queue_->Push(std::move(*mine));
        mine = std::move(t);
        mine_bounded = p.backend->capabilities().bounded_post;
      }
    }
    if (mine) {
      if (here && mine_bounded) {
        Run(*mine);
      } else {
        queue_->Push(std::move(*mine));
      }
    }
    return batch;
  }

  PeerInfo Describe(const std::string& segment) override {
    PeerInfo info;
    info.segment = segment;
    absl::StatusOr<Prepared> p = GetPeer(segment, absl::Now() + absl::Seconds(5));
    std::shared_ptr<PeerEntry> e = Entry(segment);
    MutexLock lock(&e->mu);
    if (e->desc) info.host = e->desc->host;
    info.fallbacks = e->fallbacks;
    if (p.ok()) {
      info.transport = p->transport;
    } else {
      info.fallbacks.push_back(std::string(p.status().message()));
    }
    return info;
  }

  bool ChecksumsCopies(const std::string& segment, uint64_t length) override {
    if (length > options_.slice_size) return false;
    std::shared_ptr<PeerEntry> e = Entry(segment);
    MutexLock lock(&e->mu);
    return e->channel != nullptr && e->backend != nullptr && e->backend->capabilities().checksums_copies;
  }

  void ForgetPeers() override {
    MutexLock lock(&peers_mu_);
    peers_.clear();
  }

  EngineStats Stats() const override {
    return {requests_.load(), failed_.load(), bytes_read_.load(), bytes_written_.load()};
  }
  int port() const override { return tcp_port(); }
  const std::string& host_id() const override { return options_.host_id; }
  const std::string& advertised_address() const override { return options_.backend.advertise; }

 private:
  struct Prepared {
    SegmentDescriptor desc;
    std::shared_ptr<PeerChannel> channel;
    Backend* backend;
    std::string transport;
  };

  int tcp_port() const {
    for (const auto& b : backends_) {
      if (b->name() == "tcp") {
        std::string ep = b->endpoint();
        return std::stoi(ep.substr(ep.rfind(':') + 1));
      }
    }
    return 0;
  }

  // Non-zero and unlike any segment served here now; random so that a
  // restarted engine (whose indices start again at 0) never reuses one.
  uint64_t NewSegmentId() {
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

  Backend* FindBackend(const std::string& name) {
    for (auto& b : backends_) {
      if (b->name() == name) return b.get();
    }
    return nullptr;
  }

  // True when [a, a+length) overlaps a registered buffer or a range being
  // (un)registered. Caller holds served_mu_.
  bool Overlaps(char* a, uint64_t length) {
    for (auto& [start, b] : buffers_) {
      if (a < b->addr + b->length && b->addr < a + length) return true;
    }
    for (auto& [start, len] : in_flux_) {
      if (a < start + len && start < a + length) return true;
    }
    return false;
  }

  // The registered buffer holding [addr, addr+length), or null. Caller
  // holds served_mu_.
  const LocalBuffer* LocalBufferOf(void* addr, uint64_t length) {
    char* a = static_cast<char*>(addr);
    auto it = buffers_.upper_bound(a);
    if (it == buffers_.begin()) return nullptr;
    --it;
    const LocalBuffer* b = it->second.get();
    if (a < b->addr || !RangeWithin(a - b->addr, length, b->length)) return nullptr;
    return b;
  }

  // The location of the registered buffer holding [addr, addr+length), if any.
  std::optional<Location> LocalLocation(void* addr, uint64_t length) {
    std::shared_lock lock(served_mu_);
    const LocalBuffer* b = LocalBufferOf(addr, length);
    if (b == nullptr) return std::nullopt;
    return b->location;
  }

  // Why `backend` cannot move request `r` ("" when it can): GPU memory
  // needs a cuda-capable transport, and a transport that needs registered
  // local memory needs `r.local` inside a buffer it registered.
  std::string Refusal(Backend* backend, const Request& r, bool gpu) {
    const Capabilities caps = backend->capabilities();
    if (gpu && !caps.cuda_memory) return absl::StrCat("transport ", backend->name(), " cannot move GPU memory");
    if (!caps.needs_registered_local) return "";
    std::shared_lock lock(served_mu_);
    const LocalBuffer* b = LocalBufferOf(r.local, r.length);
    if (b == nullptr) return absl::StrCat("transport ", backend->name(), " needs the local buffer registered");
    if (!refused_.contains({b->id, backend})) return "";
    return absl::StrCat("transport ", backend->name(), " could not register the local buffer");
  }

  // The next transport after `peer`'s (in selection order) that the peer
  // offers, that does not refuse `r`, and that reaches it; its channel is
  // cached beside the chosen one. FAILED_PRECONDITION naming `refusal` and
  // each candidate's reason when there is none.
  absl::StatusOr<std::pair<Backend*, std::shared_ptr<PeerChannel>>> Fallback(
      const std::string& segment, const Prepared& peer, const Request& r, bool gpu, const std::string& refusal,
      absl::Time deadline) {
    std::vector<std::string> reasons{refusal};
    std::vector<Backend*> candidates;
    for (Backend* b : order_) {
      if (b == peer.backend || !peer.desc.transports.contains(b->name())) continue;
      std::string no = Refusal(b, r, gpu);
      if (no.empty()) {
        candidates.push_back(b);
      } else {
        reasons.push_back(no);
      }
    }
    std::shared_ptr<PeerEntry> e = Entry(segment);
    PrepareContext ctx = internal::PeerContext(options_, segment, peer.desc, deadline);
    for (Backend* b : candidates) {
      std::shared_ptr<PeerChannel> ch;
      uint64_t generation;
      {
        MutexLock lock(&e->mu);
        generation = e->generation;
        auto it = e->alternates.find(b->name());
        if (it != e->alternates.end() && it->second && it->second->healthy()) ch = it->second;
      }
      if (!ch) {
        // A handshake: over the network, so not under the entry's lock.
        absl::StatusOr<std::unique_ptr<PeerChannel>> made = b->Prepare(peer.desc, ctx);
        if (!made.ok()) {
          reasons.push_back(absl::StrCat(b->name(), ": ", made.status().message()));
          continue;
        }
        ch = std::move(*made);
      }
      MutexLock lock(&e->mu);
      if (e->generation == generation) {
        // Cache it, unless another thread cached a healthy one meanwhile.
        std::shared_ptr<PeerChannel>& cached = e->alternates[b->name()];
        if (cached && cached != ch && cached->healthy()) {
          ch = cached;
        } else {
          cached = ch;
        }
      }
      // A refusal is normal for unregistered buffers: say so once per peer.
      if (e->logged.insert(absl::StrCat(b->name(), ": ", refusal)).second) {
        TKV_LOG(INFO) << refusal << " for segment " << segment << "; such requests go over " << b->name();
      }
      return std::make_pair(b, ch);
    }
    return absl::FailedPreconditionError(absl::StrCat("no transport to segment ", segment,
                                                      " can move this request: ", absl::StrJoin(reasons, "; ")));
  }

  // True when [addr, addr+length) lies in registered cuda:<n> memory.
  bool LocalIsGpu(void* addr, uint64_t length) {
    std::optional<Location> loc = LocalLocation(addr, length);
    return loc && loc->kind == Location::kCuda;
  }

  std::shared_ptr<PeerEntry> Entry(const std::string& segment) {
    MutexLock lock(&peers_mu_);
    auto& e = peers_[segment];
    if (!e) e = std::make_shared<PeerEntry>();
    return e;
  }

  // The cached channel to `segment`, else a fresh lookup: its descriptor
  // (the peer may have restarted or moved) and the first transport that
  // reaches it. One lookup per segment at a time, outside the entry's
  // lock; a caller arriving meanwhile waits for it, up to its own
  // deadline (DEADLINE_EXCEEDED), then looks up itself if it failed.
  absl::StatusOr<Prepared> GetPeer(const std::string& segment, absl::Time deadline) {
    std::shared_ptr<PeerEntry> e = Entry(segment);
    {
      MutexLock lock(&e->mu);
      while (true) {
        if (e->channel && e->channel->healthy() && e->desc) {
          return Prepared{*e->desc, e->channel, e->backend, e->transport};
        }
        if (!e->looking_up) break;
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) {
          return absl::DeadlineExceededError(absl::StrCat("segment ", segment,
                                                          " is still being looked up (its descriptor or its "
                                                          "daemon is slow to answer)"));
        }
        e->looked_up.WaitFor(&e->mu, absl::ToChronoMicroseconds(std::min(left, absl::Seconds(1))));
      }
      e->looking_up = true;
    }
    absl::StatusOr<Prepared> p = LookUp(segment, deadline, *e);
    MutexLock lock(&e->mu);
    e->looking_up = false;
    e->looked_up.SignalAll();
    return p;
  }

  // GetPeer's lookup, by `deadline`; only the entry's results are stored
  // under its lock.
  absl::StatusOr<Prepared> LookUp(const std::string& segment, absl::Time deadline, PeerEntry& e) {
    absl::StatusOr<std::string> json = options_.metadata->Get(DescriptorKey(segment), deadline);
    if (!json.ok()) {
      if (absl::IsNotFound(json.status())) {
        return absl::NotFoundError(absl::StrCat("segment ", segment, " is not published"));
      }
      return Annotate(json.status(), absl::StrCat("looking up segment ", segment));
    }
    ASSIGN_OR_RETURN(SegmentDescriptor desc, SegmentDescriptor::FromJson(*json));
    PrepareContext ctx = internal::PeerContext(options_, segment, desc, deadline);
    std::vector<std::string> reasons;
    std::shared_ptr<PeerChannel> channel;
    Backend* chosen = nullptr;
    for (Backend* b : order_) {
      if (!desc.transports.contains(b->name())) {
        reasons.push_back(absl::StrCat(b->name(), ": not offered by the peer"));
        continue;
      }
      absl::StatusOr<std::unique_ptr<PeerChannel>> ch = b->Prepare(desc, ctx);
      if (ch.ok()) {
        channel = std::move(*ch);
        chosen = b;
        break;
      }
      TKV_LOG(WARNING) << "transport " << b->name() << " cannot reach segment " << segment
                       << " on host " << desc.host << " (" << desc.host_id.substr(0, 8) << ") from "
                       << options_.host << " (" << options_.host_id.substr(0, 8) << "): "
                       << ch.status().message() << "; trying the next transport";
      reasons.push_back(absl::StrCat(b->name(), ": ", ch.status().message()));
    }
    MutexLock lock(&e.mu);
    e.desc = desc;
    ++e.generation;
    e.channel = channel;
    e.alternates.clear();
    e.fallbacks = reasons;
    if (chosen == nullptr) {
      return absl::UnavailableError(absl::StrCat("no transport reaches segment ", segment, ": ",
                                                 absl::StrJoin(reasons, "; ")));
    }
    e.backend = chosen;
    e.transport = chosen->name();
    return Prepared{desc, channel, chosen, e.transport};
  }

  void Run(Task& t) {
    if (absl::Now() >= t.deadline || t.batch->sealed()) {
      // The caller stopped waiting: its buffers must not be touched now.
      for (Slice* s : t.slices) s->status = absl::DeadlineExceededError("transfer queued past its deadline");
    } else {
      t.channel->Post(t.slices, t.deadline);
    }
    uint64_t read = 0, written = 0, failed = 0;
    for (Slice* s : t.slices) {
      if (!s->status.ok()) {
        ++failed;
      } else if (s->op == Op::kRead) {
        read += s->length;
      } else {
        written += s->length;
      }
    }
    bytes_read_.fetch_add(read, std::memory_order_relaxed);
    bytes_written_.fetch_add(written, std::memory_order_relaxed);
    failed_.fetch_add(failed, std::memory_order_relaxed);
    if (!t.channel->healthy()) {
      std::shared_ptr<PeerEntry> e = Entry(t.segment);
      MutexLock lock(&e->mu);
      if (e->channel == t.channel) e->channel.reset();  // re-prepare on next use
      for (auto& [name, ch] : e->alternates) {
        if (ch == t.channel) ch.reset();
      }
    }
    t.batch->Complete(t.slices);
  }

  EngineOptions options_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<Backend*> order_;
  std::unique_ptr<internal::WorkQueue> queue_;

  std::shared_mutex served_mu_;
  std::atomic<uint64_t> epoch_{0};  // the newest master epoch seen (ObserveEpoch, AdmitWrite)
  std::map<char*, std::unique_ptr<LocalBuffer>> buffers_;  // guarded by served_mu_
  std::map<std::string, ServedSegment> served_;            // guarded by served_mu_
  // Ranges (start, length) whose backends are registering or unregistering
  // them outside served_mu_; guarded by served_mu_.
  std::map<char*, uint64_t> in_flux_;
  // (buffer id, backend) pairs where the backend could not register the
  // buffer; guarded by served_mu_.
  absl::flat_hash_set<std::pair<uint64_t, Backend*>> refused_;
  uint64_t next_buffer_id_ = 1;
  uint32_t next_segment_index_ = 0;

  Mutex peers_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<PeerEntry>> peers_ ABSL_GUARDED_BY(peers_mu_);

  std::atomic<uint64_t> requests_{0}, failed_{0}, bytes_read_{0}, bytes_written_{0};
};

}  // namespace

absl::StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(EngineOptions options) {
  auto e = std::make_unique<Engine>(std::move(options));
  RETURN_IF_ERROR(e->Init());
  return std::unique_ptr<TransferEngine>(std::move(e));
}

}  // namespace tierkv::transport
