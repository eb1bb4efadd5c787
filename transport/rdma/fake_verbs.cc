#include "transport/rdma/fake_verbs.h"

#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tierkv::transport::rdma {

struct FakeFabric::QpState {
  uint32_t qp_num = 0;
  std::string device;
  uint64_t epoch = 0;
  uint32_t remote_qp = 0;
  bool connected = false;
  bool error = false;
  class FakeDevice* owner = nullptr;
};

// One device's completion queue.
class FakeDevice final : public Device {
 public:
  FakeDevice(std::shared_ptr<FakeFabric> fabric, PortInfo port) : fabric_(std::move(fabric)), port_(std::move(port)) {}
  ~FakeDevice() override {
    MutexLock lock(&fabric_->mu_);
    for (auto it = fabric_->by_rkey_.begin(); it != fabric_->by_rkey_.end();) {
      if (it->second.device == port_.device && mine_.contains(it->first)) {
        it = fabric_->by_rkey_.erase(it);
      } else {
        ++it;
      }
    }
  }
  const PortInfo& port() const override { return port_; }

  absl::StatusOr<MemoryKeys> Register(char* addr, uint64_t length) override {
    MutexLock lock(&fabric_->mu_);
    if (fabric_->devices_[port_.device].dead) return absl::UnavailableError(port_.device + " is dead");
    uint32_t key = fabric_->next_key_++;
    fabric_->by_rkey_[key] = {addr, length, port_.device, key, key};
    mine_[key] = addr;
    return MemoryKeys{key, key};
  }

  void Deregister(char* addr) override {
    MutexLock lock(&fabric_->mu_);
    for (auto it = mine_.begin(); it != mine_.end();) {
      if (it->second == addr) {
        fabric_->by_rkey_.erase(it->first);
        it = mine_.erase(it);
      } else {
        ++it;
      }
    }
  }

  absl::StatusOr<std::unique_ptr<QueuePair>> CreateQueuePair(int max_outstanding) override;

  int Poll(Completion* out, int max, absl::Duration timeout) override {
    MutexLock lock(&cq_mu_);
    absl::Time deadline = absl::Now() + timeout;
    while (cq_.empty() && absl::Now() < deadline) {
      cv_.WaitFor(&cq_mu_, absl::ToChronoMicroseconds(deadline - absl::Now()));
    }
    int n = 0;
    while (n < max && !cq_.empty()) {
      out[n++] = std::move(cq_.front());
      cq_.pop_front();
    }
    return n;
  }

  void Deliver(Completion c) {
    MutexLock lock(&cq_mu_);
    cq_.push_back(std::move(c));
    cv_.Signal();
  }

 private:
  std::shared_ptr<FakeFabric> fabric_;
  PortInfo port_;
  std::map<uint32_t, char*> mine_ ABSL_GUARDED_BY(fabric_->mu_);
  Mutex cq_mu_;
  CondVar cv_;
  std::deque<Completion> cq_ ABSL_GUARDED_BY(cq_mu_);
};

class FakeQueuePair final : public QueuePair {
 public:
  FakeQueuePair(std::shared_ptr<FakeFabric> fabric, FakeDevice* device, std::shared_ptr<FakeFabric::QpState> st)
      : fabric_(std::move(fabric)), device_(device), st_(std::move(st)) {}
  ~FakeQueuePair() override {
    MutexLock lock(&fabric_->mu_);
    fabric_->qps_.erase(st_->qp_num);
  }

  QpAddress address() const override {
    QpAddress a;
    a.qp_num = st_->qp_num;
    a.psn = st_->qp_num * 7;
    a.mtu = device_->port().mtu;
    a.gid = device_->port().gid;
    return a;
  }

  absl::Status Connect(const QpAddress& remote) override {
    MutexLock lock(&fabric_->mu_);
    if (!fabric_->qps_.contains(remote.qp_num)) {
      return absl::UnavailableError(absl::StrCat("no QP ", remote.qp_num, " on the fabric"));
    }
    st_->remote_qp = remote.qp_num;
    st_->connected = true;
    return absl::OkStatus();
  }

  absl::Status Post(const WorkRequest& wr) override {
    Completion c{wr.wr_id, WcStatus::kSuccess, "success"};
    {
      MutexLock lock(&fabric_->mu_);
      auto& dev = fabric_->devices_[st_->device];
      ++dev.posted;
      if (!st_->connected) return absl::FailedPreconditionError("QP is not connected");
      if (dev.kill_after == 0) dev.dead = true;
      if (dev.kill_after > 0) --dev.kill_after;
      if (st_->epoch < dev.break_epoch) st_->error = true;
      auto remote = fabric_->qps_.find(st_->remote_qp);
      if (st_->error) {
        c.status = WcStatus::kFlushed;
        c.detail = "WR flushed error";
      } else if (dev.dead) {
        c.status = WcStatus::kTransport;
        c.detail = "transport retry counter exceeded";
      } else if (dev.fail_next > 0) {
        --dev.fail_next;
        c.status = WcStatus::kTransport;
        c.detail = "transport retry counter exceeded (injected)";
      } else if (remote == fabric_->qps_.end() || fabric_->devices_[remote->second->device].dead) {
        c.status = WcStatus::kTransport;
        c.detail = "transport retry counter exceeded (no remote QP)";
      } else {
        c.status = Execute(wr, remote->second->device);
        if (c.status != WcStatus::kSuccess) c.detail = "remote access error";
      }
      if (c.status != WcStatus::kSuccess) st_->error = true;
    }
    device_->Deliver(std::move(c));
    return absl::OkStatus();
  }

  void Fail() override {
    MutexLock lock(&fabric_->mu_);
    st_->error = true;
  }

 private:
  // The copy, with the checks a NIC makes.
  WcStatus Execute(const WorkRequest& wr, const std::string& remote_device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(fabric_->mu_) {
    auto local = fabric_->by_rkey_.find(wr.lkey);
    if (local == fabric_->by_rkey_.end() || local->second.device != st_->device || wr.local < local->second.addr ||
        !RangeOk(static_cast<uint64_t>(wr.local - local->second.addr), wr.length, local->second.length)) {
      return WcStatus::kLocal;
    }
    auto remote = fabric_->by_rkey_.find(wr.rkey);
    if (remote == fabric_->by_rkey_.end() || remote->second.device != remote_device) return WcStatus::kRemoteAccess;
    uint64_t base = reinterpret_cast<uint64_t>(remote->second.addr);
    if (wr.remote_addr < base || !RangeOk(wr.remote_addr - base, wr.length, remote->second.length)) {
      return WcStatus::kRemoteAccess;
    }
    char* target = reinterpret_cast<char*>(wr.remote_addr);
    if (wr.write) {
      std::memcpy(target, wr.local, wr.length);
    } else {
      std::memcpy(wr.local, target, wr.length);
    }
    return WcStatus::kSuccess;
  }
  static bool RangeOk(uint64_t offset, uint64_t length, uint64_t size) { return offset <= size && length <= size - offset; }

  std::shared_ptr<FakeFabric> fabric_;
  FakeDevice* device_;
  std::shared_ptr<FakeFabric::QpState> st_;
};

absl::StatusOr<std::unique_ptr<QueuePair>> FakeDevice::CreateQueuePair(int) {
  MutexLock lock(&fabric_->mu_);
  auto& dev = fabric_->devices_[port_.device];
  if (dev.dead) return absl::UnavailableError(port_.device + " is dead");
  auto st = std::make_shared<FakeFabric::QpState>();
  st->qp_num = fabric_->next_qp_++;
  st->device = port_.device;
  st->epoch = dev.break_epoch;
  st->owner = this;
  fabric_->qps_[st->qp_num] = st;
  ++dev.qps;
  return std::unique_ptr<QueuePair>(new FakeQueuePair(fabric_, this, st));
}

std::shared_ptr<FakeFabric> FakeFabric::Create(std::vector<PortInfo> ports) {
  return std::shared_ptr<FakeFabric>(new FakeFabric(std::move(ports)));
}

std::vector<PortInfo> FakeFabric::Ports() { return ports_; }

absl::StatusOr<std::unique_ptr<Device>> FakeFabric::Open(const PortInfo& port) {
  {
    MutexLock lock(&mu_);
    if (devices_[port.device].dead) return absl::UnavailableError(port.device + " is dead");
  }
  return std::unique_ptr<Device>(new FakeDevice(shared_from_this(), port));
}

void FakeFabric::FailCompletions(const std::string& device, int count) {
  MutexLock lock(&mu_);
  devices_[device].fail_next += count;
}

void FakeFabric::BreakQueuePairs(const std::string& device) {
  MutexLock lock(&mu_);
  ++devices_[device].break_epoch;
}

void FakeFabric::KillDeviceAfter(const std::string& device, int work_requests) {
  MutexLock lock(&mu_);
  devices_[device].kill_after = work_requests;
}

void FakeFabric::Revive(const std::string& device) {
  MutexLock lock(&mu_);
  auto& d = devices_[device];
  d.dead = false;
  d.kill_after = -1;
  d.fail_next = 0;
}

uint64_t FakeFabric::posted(const std::string& device) {
  MutexLock lock(&mu_);
  return devices_[device].posted;
}

uint64_t FakeFabric::queue_pairs_created(const std::string& device) {
  MutexLock lock(&mu_);
  return devices_[device].qps;
}

}  // namespace tierkv::transport::rdma
