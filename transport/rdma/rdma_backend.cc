#include "transport/rdma/rdma_backend.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/internal/json_fields.h"

namespace tierkv::transport::rdma {
namespace {

using json = nlohmann::json;
using internal::StringField;
using internal::UintField;

std::string GidHex(const Gid& g) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : g) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

Gid GidFromHex(const std::string& s) {
  Gid g{};
  for (size_t i = 0; i < 16 && 2 * i + 1 < s.size(); ++i) {
    auto nib = [](char c) { return c >= 'a' ? c - 'a' + 10 : c - '0'; };
    g[i] = static_cast<uint8_t>(nib(s[2 * i]) << 4 | nib(s[2 * i + 1]));
  }
  return g;
}

json ToJson(const QpAddress& a) {
  return {{"qpn", a.qp_num}, {"lid", a.lid}, {"gid", GidHex(a.gid)}, {"psn", a.psn}, {"mtu", a.mtu}};
}

// A peer's QP address, from its handshake (so every field is checked for
// type and range: a wrong type would otherwise throw out of nlohmann).
absl::StatusOr<QpAddress> QpFromJson(const json& j) {
  uint64_t qpn = 0, psn = 0, lid = 0, mtu = 0;
  std::string gid;
  for (absl::Status s : {UintField(j, "qpn", UINT32_MAX, &qpn), UintField(j, "psn", UINT32_MAX, &psn),
                         UintField(j, "lid", UINT16_MAX, &lid, 0), UintField(j, "mtu", 4096, &mtu, 1024),
                         StringField(j, "gid", &gid, std::string())}) {
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("malformed QP address: ", s.message()));
  }
  QpAddress a;
  a.qp_num = static_cast<uint32_t>(qpn);
  a.psn = static_cast<uint32_t>(psn);
  a.lid = static_cast<uint16_t>(lid);
  a.mtu = static_cast<int>(mtu);
  a.gid = GidFromHex(gid);
  return a;
}

// One opened NIC port, its poller thread, and its health.
struct DeviceSlot {
  std::unique_ptr<Device> dev;
  std::thread poller;
  std::atomic<int> consecutive_failures{0};
  std::atomic<int64_t> paused_until_ms{0};
  bool Paused() const { return paused_until_ms.load() > absl::ToUnixMillis(absl::Now()); }
};

// The state of one Post, shared with the completions that report to it.
struct PostState {
  Mutex mu;
  CondVar cv;
  std::deque<std::pair<uint64_t, Completion>> done ABSL_GUARDED_BY(mu);  // chunk index, completion
};

// A work request in flight: where its completion goes.
struct InFlight {
  std::shared_ptr<PostState> post;
  uint64_t chunk;
};

// The remote side of a served buffer: its place in the segment, its
// address in the server's memory and its rkey on each server device.
struct RemoteBuffer {
  uint64_t offset;
  uint64_t length;
  uint64_t addr;
  std::map<std::string, uint32_t> rkeys;
};

// A registered local buffer: its lkey (and rkey) on each local device.
struct LocalRegion {
  char* addr;
  uint64_t length;
  int numa;
  std::vector<MemoryKeys> keys;  // by device index
};

class RdmaBackend;

// One QP between a local device and a remote device.
struct Lane {
  size_t device = 0;          // local device index
  std::string remote_device;  // the server NIC it is connected to
  Mutex mu;
  std::unique_ptr<QueuePair> qp ABSL_GUARDED_BY(mu);
  std::atomic<int> outstanding{0};
  std::atomic<bool> broken{false};
};

class RdmaChannel;

class RdmaBackend final : public Backend {
 public:
  RdmaBackend(BackendOptions options, std::shared_ptr<Verbs> verbs, RdmaOptions rdma)
      : options_(std::move(options)), verbs_(std::move(verbs)), rdma_(rdma) {}
  ~RdmaBackend() override { Stop(); }

  absl::Status Open() {
    std::vector<PortInfo> ports = verbs_->Ports();
    std::vector<std::string> wanted = options_.rdma_devices;
    for (const PortInfo& p : ports) {
      bool named = std::find(wanted.begin(), wanted.end(), p.device) != wanted.end();
      if (!wanted.empty() && !named) continue;
      if (!p.active) {
        if (named) TKV_LOG(WARNING) << "rdma: " << p.device << " port " << p.port << " is not active; skipped";
        continue;
      }
      absl::StatusOr<std::unique_ptr<Device>> d = verbs_->Open(p);
      if (!d.ok()) {
        TKV_LOG(WARNING) << "rdma: cannot open " << p.device << ": " << d.status().message();
        continue;
      }
      auto slot = std::make_unique<DeviceSlot>();
      slot->dev = std::move(*d);
      devices_.push_back(std::move(slot));
    }
    if (devices_.empty()) {
      return absl::UnavailableError(
          ports.empty() ? std::string("no RDMA device (ibv_get_device_list found none)")
                        : absl::StrCat("no usable RDMA device among ", ports.size(), " port(s)",
                                       wanted.empty() ? "" : absl::StrCat(" named ", absl::StrJoin(wanted, ","))));
    }
    for (size_t i = 0; i < devices_.size(); ++i) {
      devices_[i]->poller = std::thread([this, i] { PollLoop(i); });
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "rdma"; }
  Capabilities capabilities() const override { return {.rank = 50, .needs_registered_local = true, .keyed_buffers = true}; }
  absl::Status Start(ServedMemory*) override { return absl::OkStatus(); }

  void Stop() override {
    if (stopping_.exchange(true)) return;
    {
      MutexLock lock(&server_mu_);
      server_qps_.clear();
    }
    for (auto& d : devices_) {
      if (d->poller.joinable()) d->poller.join();
    }
    MutexLock lock(&regions_mu_);
    for (auto& [addr, r] : regions_) {
      for (auto& d : devices_) d->dev->Deregister(addr);
    }
    regions_.clear();
  }

  std::string endpoint() const override {
    std::vector<std::string> names;
    for (const auto& d : devices_) names.push_back(d->dev->port().device);
    return absl::StrJoin(names, ",");
  }

  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer& b) override {
    if (b.location.kind != Location::kCpu) {
      return absl::FailedPreconditionError("rdma registers host memory here; GPU memory needs the cuda target");
    }
    MutexLock lock(&regions_mu_);
    auto it = regions_.find(b.addr);
    if (it == regions_.end()) {
      LocalRegion r{b.addr, b.length, b.location.index, {}};
      for (size_t i = 0; i < devices_.size(); ++i) {
        absl::StatusOr<MemoryKeys> k = devices_[i]->dev->Register(b.addr, b.length);
        if (!k.ok()) {
          for (size_t j = 0; j < i; ++j) devices_[j]->dev->Deregister(b.addr);
          return k.status();
        }
        r.keys.push_back(*k);
      }
      it = regions_.emplace(b.addr, std::move(r)).first;
    }
    json key{{"addr", reinterpret_cast<uint64_t>(b.addr)}};
    for (size_t i = 0; i < devices_.size(); ++i) key["rkeys"][devices_[i]->dev->port().device] = it->second.keys[i].rkey;
    return key.dump();
  }

  void UnregisterBuffer(const LocalBuffer& b) override {
    MutexLock lock(&regions_mu_);
    if (regions_.erase(b.addr) == 0) return;
    for (auto& d : devices_) d->dev->Deregister(b.addr);
  }

  // The server half of the QP exchange: one QP per client QP, on device
  // i mod n, connected to it; the answer carries their addresses.
  absl::StatusOr<std::string> ServeHandshake(const std::string& request, const LocalBuffer* const*,
                                             size_t) override {
    if (stopping_.load()) return absl::UnavailableError("rdma is stopping here");
    json req = json::parse(request, nullptr, false);
    if (req.is_discarded() || !req.is_object() || !req.contains("qps") || !req["qps"].is_array() ||
        req["qps"].size() > 64) {
      return absl::InvalidArgumentError("rdma handshake needs 1-64 QP addresses");
    }
    uint64_t first = 0;
    if (absl::Status s = UintField(req, "first_device", UINT32_MAX, &first, 0); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("rdma handshake: ", s.message()));
    }
    json out;
    out["qps"] = json::array();
    std::vector<std::unique_ptr<QueuePair>> made;
    for (size_t i = 0; i < req["qps"].size(); ++i) {
      ASSIGN_OR_RETURN(QpAddress peer, QpFromJson(req["qps"][i]));
      DeviceSlot& d = *devices_[(first + i) % devices_.size()];
      ASSIGN_OR_RETURN(std::unique_ptr<QueuePair> qp, d.dev->CreateQueuePair(rdma_.max_outstanding));
      RETURN_IF_ERROR(qp->Connect(peer));
      json a = ToJson(qp->address());
      a["device"] = d.dev->port().device;
      out["qps"].push_back(a);
      made.push_back(std::move(qp));
    }
    MutexLock lock(&server_mu_);
    // Server QPs are passive; they live until the backend stops. Oldest go
    // first past the cap, so a reconnecting client cannot exhaust the NIC.
    for (auto& qp : made) server_qps_.push_back(std::move(qp));
    while (server_qps_.size() > kMaxServerQps) server_qps_.pop_front();
    return out.dump();
  }

  absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor& remote,
                                                       const PrepareContext& ctx) override;

  // --- used by channels

  size_t device_count() const { return devices_.size(); }
  DeviceSlot& device(size_t i) { return *devices_[i]; }
  const RdmaOptions& rdma() const { return rdma_; }

  // The local region holding [addr, addr+length), with its keys.
  absl::StatusOr<LocalRegion> FindLocal(const char* addr, uint64_t length) {
    MutexLock lock(&regions_mu_);
    auto it = regions_.upper_bound(const_cast<char*>(addr));
    if (it == regions_.begin()) return absl::FailedPreconditionError("local buffer is not registered for rdma");
    --it;
    const LocalRegion& r = it->second;
    if (addr < r.addr || !RangeWithin(static_cast<uint64_t>(addr - r.addr), length, r.length)) {
      return absl::FailedPreconditionError("local buffer is not registered for rdma");
    }
    return r;
  }

  uint64_t Track(std::shared_ptr<PostState> post, uint64_t chunk) {
    MutexLock lock(&inflight_mu_);
    uint64_t id = next_wr_++;
    inflight_[id] = {std::move(post), chunk};
    return id;
  }
  void Untrack(uint64_t wr_id) {
    MutexLock lock(&inflight_mu_);
    inflight_.erase(wr_id);
  }

  // A failed request on device `i`: counts toward pausing it.
  void DeviceFailed(size_t i, const std::string& why) {
    DeviceSlot& d = *devices_[i];
    if (d.consecutive_failures.fetch_add(1) + 1 >= rdma_.pause_after && !d.Paused()) {
      d.paused_until_ms.store(absl::ToUnixMillis(absl::Now() + rdma_.pause));
      TKV_LOG(WARNING) << "rdma: pausing " << d.dev->port().device << " for " << absl::FormatDuration(rdma_.pause)
                       << " after " << d.consecutive_failures.load() << " failed requests (last: " << why << ")";
    }
  }
  void DeviceOk(size_t i) { devices_[i]->consecutive_failures.store(0); }

 private:
  static constexpr size_t kMaxServerQps = 4096;

  void PollLoop(size_t i) {
    Completion batch[64];
    while (!stopping_.load()) {
      int n = devices_[i]->dev->Poll(batch, 64, absl::Milliseconds(50));
      for (int k = 0; k < n; ++k) {
        InFlight f;
        {
          MutexLock lock(&inflight_mu_);
          auto it = inflight_.find(batch[k].wr_id);
          if (it == inflight_.end()) continue;  // a server-side or abandoned request
          f = std::move(it->second);
          inflight_.erase(it);
        }
        MutexLock lock(&f.post->mu);
        f.post->done.emplace_back(f.chunk, std::move(batch[k]));
        f.post->cv.SignalAll();
      }
    }
  }

  const BackendOptions options_;
  std::shared_ptr<Verbs> verbs_;
  const RdmaOptions rdma_;
  std::vector<std::unique_ptr<DeviceSlot>> devices_;
  std::atomic<bool> stopping_{false};

  Mutex regions_mu_;
  std::map<char*, LocalRegion> regions_ ABSL_GUARDED_BY(regions_mu_);
  Mutex server_mu_;
  std::deque<std::unique_ptr<QueuePair>> server_qps_ ABSL_GUARDED_BY(server_mu_);
  Mutex inflight_mu_;
  absl::flat_hash_map<uint64_t, InFlight> inflight_ ABSL_GUARDED_BY(inflight_mu_);
  uint64_t next_wr_ ABSL_GUARDED_BY(inflight_mu_) = 1;
};

class RdmaChannel final : public PeerChannel {
 public:
  RdmaChannel(RdmaBackend* backend, SegmentDescriptor remote, PrepareContext ctx, std::vector<RemoteBuffer> buffers)
      : backend_(backend), remote_(std::move(remote)), ctx_(std::move(ctx)), buffers_(std::move(buffers)) {}

  ~RdmaChannel() override {
    for (auto& l : lanes_) {
      MutexLock lock(&l->mu);
      l->qp.reset();
    }
  }

  // Connects one QP per local device in one handshake.
  absl::Status ConnectAll() {
    for (size_t i = 0; i < backend_->device_count(); ++i) {
      auto lane = std::make_unique<Lane>();
      lane->device = i;
      lanes_.push_back(std::move(lane));
    }
    std::vector<Lane*> all;
    for (auto& l : lanes_) all.push_back(l.get());
    return Connect(all, absl::Now() + absl::Seconds(5));
  }

  void Post(absl::Span<Slice* const> slices, absl::Time deadline) override;

  bool healthy() const override {
    for (const auto& l : lanes_) {
      if (!l->broken.load()) return true;
    }
    return false;  // every QP failed to come back: let the engine re-prepare
  }

 private:
  struct Chunk {
    size_t slice;
    uint64_t offset;  // within the slice
    uint32_t length;
    int attempts = 0;
    std::vector<size_t> tried;  // lanes that failed it
  };

  // (Re)connects `lanes` with one handshake; a lane that cannot is broken.
  absl::Status Connect(const std::vector<Lane*>& lanes, absl::Time deadline) {
    json req{{"segment_index", remote_.segment_index}, {"segment_id", remote_.segment_id}, {"qps", json::array()}};
    std::vector<std::unique_ptr<QueuePair>> fresh;
    for (Lane* l : lanes) {
      absl::StatusOr<std::unique_ptr<QueuePair>> qp =
          backend_->device(l->device).dev->CreateQueuePair(backend_->rdma().max_outstanding);
      if (!qp.ok()) return qp.status();
      req["qps"].push_back(ToJson((*qp)->address()));
      fresh.push_back(std::move(*qp));
    }
    // Spread the reconnected lanes' partners the way the first handshake did.
    req["first_device"] = lanes.empty() ? 0 : lanes.front()->device;
    absl::StatusOr<std::string> answer = ctx_.handshake(remote_.control, "rdma", req.dump(), deadline);
    if (!answer.ok()) return absl::UnavailableError(absl::StrCat("rdma handshake with ", remote_.name, ": ", answer.status().message()));
    json a = json::parse(*answer, nullptr, false);
    if (a.is_discarded() || !a.contains("qps") || !a["qps"].is_array() || a["qps"].size() != lanes.size()) {
      return absl::UnavailableError(absl::StrCat("malformed rdma handshake answer from ", remote_.name));
    }
    for (size_t i = 0; i < lanes.size(); ++i) {
      absl::StatusOr<QpAddress> peer = QpFromJson(a["qps"][i]);
      if (!peer.ok()) return absl::UnavailableError(absl::StrCat("rdma handshake with ", remote_.name, ": ", peer.status().message()));
      std::string remote_device;
      if (absl::Status s = StringField(a["qps"][i], "device", &remote_device, std::string()); !s.ok()) {
        return absl::UnavailableError(absl::StrCat("rdma handshake with ", remote_.name, ": ", s.message()));
      }
      RETURN_IF_ERROR(fresh[i]->Connect(*peer));
      if (!buffers_.empty() && !buffers_[0].rkeys.contains(remote_device)) {
        return absl::UnavailableError(absl::StrCat("rdma: ", remote_.name, " paired an unknown device ", remote_device));
      }
      MutexLock lock(&lanes[i]->mu);
      lanes[i]->qp = std::move(fresh[i]);
      lanes[i]->remote_device = remote_device;
      lanes[i]->broken.store(false);
    }
    return absl::OkStatus();
  }

  // Lanes in the order a chunk of local NUMA node `numa` should try them:
  // healthy before paused, same node first, then round-robin.
  std::vector<size_t> Order(int numa, size_t rotate) {
    std::vector<size_t> order(lanes_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = (i + rotate) % order.size();
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const DeviceSlot& da = backend_->device(lanes_[a]->device);
      const DeviceSlot& db = backend_->device(lanes_[b]->device);
      bool pa = da.Paused(), pb = db.Paused();
      if (pa != pb) return !pa;
      bool na = da.dev->port().numa_node == numa, nb = db.dev->port().numa_node == numa;
      return na && !nb;
    });
    return order;
  }

  RdmaBackend* backend_;
  const SegmentDescriptor remote_;
  const PrepareContext ctx_;
  const std::vector<RemoteBuffer> buffers_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  Mutex reconnect_mu_;  // one reconnect at a time per channel
  std::atomic<size_t> rotate_{0};
};

void RdmaChannel::Post(absl::Span<Slice* const> slices, absl::Time deadline) {
  const RdmaOptions& opt = backend_->rdma();
  auto post = std::make_shared<PostState>();
  std::vector<Chunk> chunks;
  std::vector<LocalRegion> local(slices.size());
  std::vector<const RemoteBuffer*> remote(slices.size(), nullptr);
  std::vector<int> pending(slices.size(), 0);
  std::vector<std::string> failure(slices.size());
  for (size_t i = 0; i < slices.size(); ++i) {
    Slice* s = slices[i];
    s->status = absl::OkStatus();
    if (s->length == 0) continue;
    absl::StatusOr<LocalRegion> l = backend_->FindLocal(s->local, s->length);
    if (!l.ok()) {
      s->status = l.status();
      continue;
    }
    local[i] = *l;
    remote[i] = FindRange(buffers_, s->remote_offset, s->length);
    if (remote[i] == nullptr) {
      s->status = absl::OutOfRangeError(absl::StrCat("range [", s->remote_offset, ", +", s->length,
                                                     ") is outside every rdma buffer of ", remote_.name));
      continue;
    }
    for (uint64_t off = 0; off < s->length; off += opt.chunk) {
      chunks.push_back({i, off, static_cast<uint32_t>(std::min<uint64_t>(opt.chunk, s->length - off))});
      ++pending[i];
    }
  }
  std::deque<size_t> queue;
  for (size_t c = 0; c < chunks.size(); ++c) queue.push_back(c);
  std::vector<size_t> lane_of(chunks.size(), 0);
  // Lanes that failed to reconnect during this Post, and why.
  std::vector<bool> lane_dead(lanes_.size(), false);
  std::vector<std::string> lane_why(lanes_.size());
  std::vector<uint64_t> wr_of(chunks.size(), 0);
  int in_flight = 0;

  auto finish_chunk = [&](size_t c, const absl::Status& st) {
    size_t i = chunks[c].slice;
    if (!st.ok() && slices[i]->status.ok()) slices[i]->status = st;
    --pending[i];
  };

  // Issues queued chunks onto lanes with room; returns when none fits.
  auto issue = [&]() {
    size_t spins = queue.size();
    while (!queue.empty() && spins-- > 0) {
      size_t c = queue.front();
      queue.pop_front();
      Chunk& ch = chunks[c];
      if (!slices[ch.slice]->status.ok()) {  // its slice already failed: drop it
        --pending[ch.slice];
        continue;
      }
      bool placed = false;
      const std::vector<size_t> order = Order(local[ch.slice].numa, rotate_.fetch_add(1));
      const bool unpaused_left = std::any_of(order.begin(), order.end(), [&](size_t li) {
        return !backend_->device(lanes_[li]->device).Paused() && !lane_dead[li];
      });
      for (size_t li : order) {
        Lane& lane = *lanes_[li];
        if (std::find(ch.tried.begin(), ch.tried.end(), li) != ch.tried.end() && ch.tried.size() < lanes_.size()) {
          continue;  // retry elsewhere while somewhere else is left
        }
        if (backend_->device(lane.device).Paused() && unpaused_left) continue;
        if (lane_dead[li]) continue;
        if (lane.broken.load()) {
          // Torn down after an error: bring it back once it is idle.
          if (lane.outstanding.load() > 0) continue;
          MutexLock lock(&reconnect_mu_);
          if (lane.broken.load() && lane.outstanding.load() == 0) {
            absl::Status st = Connect({&lane}, std::min(deadline, absl::Now() + absl::Seconds(2)));
            if (!st.ok()) {
              backend_->DeviceFailed(lane.device, std::string(st.message()));
              // Not again in this Post: it would only fail the same way.
              lane_dead[li] = true;
              lane_why[li] = std::string(st.message());
              continue;
            }
            TKV_LOG(INFO) << "rdma: re-established a QP on " << backend_->device(lane.device).dev->port().device
                          << " to " << remote_.name;
          }
        }
        if (lane.outstanding.load() >= opt.max_outstanding) continue;
        auto rkey = remote[ch.slice]->rkeys.find(lane.remote_device);
        if (rkey == remote[ch.slice]->rkeys.end()) continue;
        const Slice* s = slices[ch.slice];
        WorkRequest wr;
        wr.write = s->op == Op::kWrite;
        wr.local = s->local + ch.offset;
        wr.lkey = local[ch.slice].keys[lane.device].lkey;
        wr.remote_addr = remote[ch.slice]->addr + (s->remote_offset - remote[ch.slice]->offset) + ch.offset;
        wr.rkey = rkey->second;
        wr.length = ch.length;
        wr.wr_id = backend_->Track(post, c);
        lane.outstanding.fetch_add(1);
        absl::Status st;
        {
          MutexLock lock(&lane.mu);
          st = lane.qp ? lane.qp->Post(wr) : absl::UnavailableError("QP torn down");
        }
        if (!st.ok()) {
          backend_->Untrack(wr.wr_id);
          lane.outstanding.fetch_sub(1);
          lane.broken.store(true);
          backend_->DeviceFailed(lane.device, std::string(st.message()));
          continue;
        }
        lane_of[c] = li;
        wr_of[c] = wr.wr_id;
        ++in_flight;
        placed = true;
        break;
      }
      if (placed) continue;
      if (std::all_of(lane_dead.begin(), lane_dead.end(), [](bool d) { return d; })) {
        std::vector<std::string> why;
        for (size_t li = 0; li < lanes_.size(); ++li) {
          why.push_back(absl::StrCat(backend_->device(lanes_[li]->device).dev->port().device, ": ", lane_why[li]));
        }
        finish_chunk(c, absl::UnavailableError(absl::StrCat("rdma cannot reach ", remote_.name, " (", remote_.host,
                                                            ") on any device: ", absl::StrJoin(why, "; "))));
        continue;
      }
      queue.push_back(c);
    }
  };

  auto handle = [&](size_t c, const Completion& comp) {
    --in_flight;
    Lane& lane = *lanes_[lane_of[c]];
    lane.outstanding.fetch_sub(1);
    Chunk& ch = chunks[c];
    if (comp.status == WcStatus::kSuccess) {
      backend_->DeviceOk(lane.device);
      finish_chunk(c, absl::OkStatus());
      return;
    }
    const std::string device = backend_->device(lane.device).dev->port().device;
    if (comp.status != WcStatus::kFlushed || !lane.broken.exchange(true)) {
      backend_->DeviceFailed(lane.device, comp.detail);
    }
    lane.broken.store(true);  // the QP is in error: it is rebuilt before reuse
    if (comp.status == WcStatus::kRemoteAccess || comp.status == WcStatus::kLocal) {
      // Another NIC would be refused the same way.
      finish_chunk(c, absl::OutOfRangeError(absl::StrCat("rdma ", comp.detail, " on ", device, " to ", remote_.name)));
      return;
    }
    if (comp.status != WcStatus::kFlushed) ++ch.attempts;
    ch.tried.push_back(lane_of[c]);
    if (ch.attempts > opt.retries) {
      finish_chunk(c, absl::UnavailableError(absl::StrCat(
                          "rdma ", slices[ch.slice]->op == Op::kWrite ? "write" : "read", " of ", ch.length,
                          " bytes to ", remote_.name, " (", remote_.host, ") failed on device ", device, " after ",
                          ch.attempts, " attempts: ", comp.detail)));
      return;
    }
    queue.push_back(c);
  };

  bool timed_out = false;
  while (!queue.empty() || in_flight > 0) {
    if (!timed_out && absl::Now() >= deadline) {
      timed_out = true;
      // Flush what is in flight: Post must not return while a NIC may
      // still write into the caller's memory.
      for (auto& l : lanes_) {
        if (l->outstanding.load() == 0) continue;
        MutexLock lock(&l->mu);
        if (l->qp) l->qp->Fail();
        l->broken.store(true);
      }
      while (!queue.empty()) {
        finish_chunk(queue.front(), absl::DeadlineExceededError(absl::StrCat("rdma transfer to ", remote_.name, " timed out")));
        queue.pop_front();
      }
    }
    if (!timed_out) issue();
    std::deque<std::pair<uint64_t, Completion>> got;
    {
      MutexLock lock(&post->mu);
      if (post->done.empty() && in_flight > 0) {
        // Bounded wait: a flush that never completes would mean a broken
        // driver; after a grace the slices fail and the requests are
        // abandoned (their completions are dropped by the pollers).
        absl::Time until = timed_out ? deadline + absl::Seconds(5) : std::min(deadline, absl::Now() + absl::Milliseconds(50));
        post->cv.WaitFor(&post->mu, absl::ToChronoMicroseconds(std::max(until - absl::Now(), absl::Microseconds(100))));
      }
      got.swap(post->done);
    }
    for (auto& [c, comp] : got) {
      if (timed_out && comp.status != WcStatus::kSuccess) {
        --in_flight;
        lanes_[lane_of[c]]->outstanding.fetch_sub(1);
        finish_chunk(c, absl::DeadlineExceededError(absl::StrCat("rdma transfer to ", remote_.name, " timed out")));
      } else {
        handle(c, comp);
      }
    }
    if (timed_out && in_flight > 0 && absl::Now() > deadline + absl::Seconds(5)) {
      for (size_t c = 0; c < chunks.size(); ++c) {
        if (wr_of[c] != 0) backend_->Untrack(wr_of[c]);
      }
      for (Slice* s : slices) {
        if (s->status.ok()) s->status = absl::DeadlineExceededError("rdma flush did not complete");
      }
      return;
    }
    if (queue.empty() && in_flight == 0) break;
    if (!timed_out && in_flight == 0 && !queue.empty()) {
      // Nothing could be issued: other Posts fill every lane, or broken
      // lanes wait for their last completions. Yield rather than spin.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  for (size_t i = 0; i < slices.size(); ++i) {
    if (pending[i] > 0 && slices[i]->status.ok()) {
      slices[i]->status = absl::DeadlineExceededError(absl::StrCat("rdma transfer to ", remote_.name, " timed out"));
    }
  }
}

absl::StatusOr<std::unique_ptr<PeerChannel>> RdmaBackend::Prepare(const SegmentDescriptor& remote,
                                                                  const PrepareContext& ctx) {
  if (!remote.transports.contains("rdma")) {
    return absl::UnavailableError(absl::StrCat("segment ", remote.name, " offers no rdma"));
  }
  std::vector<RemoteBuffer> buffers;
  for (const BufferDescriptor& b : remote.buffers) {
    auto k = b.keys.find("rdma");
    if (k == b.keys.end()) continue;
    json j = json::parse(k->second, nullptr, false);
    if (j.is_discarded() || !j.contains("addr") || !j["addr"].is_number_unsigned() || !j.contains("rkeys") ||
        !j["rkeys"].is_object()) {
      return absl::UnavailableError(absl::StrCat("segment ", remote.name, " has a malformed rdma key"));
    }
    RemoteBuffer rb{b.offset, b.length, j["addr"].get<uint64_t>(), {}};
    for (auto& [dev, rkey] : j["rkeys"].items()) {
      if (rkey.is_number_unsigned()) rb.rkeys[dev] = rkey.get<uint32_t>();
    }
    buffers.push_back(std::move(rb));
  }
  if (buffers.empty()) return absl::UnavailableError(absl::StrCat("segment ", remote.name, " has no rdma buffer"));
  auto ch = std::make_unique<RdmaChannel>(this, remote, ctx, std::move(buffers));
  RETURN_IF_ERROR(ch->ConnectAll());
  return std::unique_ptr<PeerChannel>(std::move(ch));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewRdmaBackend(const BackendOptions& options, std::shared_ptr<Verbs> verbs,
                                                        RdmaOptions rdma) {
  auto b = std::make_unique<RdmaBackend>(options, std::move(verbs), rdma);
  RETURN_IF_ERROR(b->Open());
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace tierkv::transport::rdma
