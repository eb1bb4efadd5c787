// FakeFabric: RDMA NICs simulated in one process, for testing the rdma
// backend where no hardware exists. Every device of every engine in the
// process sits on the one fabric; a one-sided READ/WRITE is a memcpy
// between registered regions, checked the way a NIC checks it (the lkey
// must cover the local range on the posting device, the rkey must belong
// to the remote QP's device and cover the remote range). Faults are
// injected per device:
//
//   fabric->FailCompletions("mlx5_0", 5);   // the next 5 WRs there fail (transport error)
//   fabric->BreakQueuePairs("mlx5_0");      // every QP on it drops to the error state
//   fabric->KillDeviceAfter("mlx5_1", 20);  // after 20 more WRs the NIC is dead for good
//
// A failed WR moves its QP to the error state, and later WRs on that QP
// complete kFlushed, as with real verbs. Thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "transport/rdma/verbs.h"

namespace tierkv::transport::rdma {

class FakeFabric : public Verbs, public std::enable_shared_from_this<FakeFabric> {
 public:
  // Devices every engine on this fabric sees, with their NUMA nodes.
  static std::shared_ptr<FakeFabric> Create(std::vector<PortInfo> ports);

  std::vector<PortInfo> Ports() override;
  absl::StatusOr<std::unique_ptr<Device>> Open(const PortInfo& port) override;

  void FailCompletions(const std::string& device, int count);
  void BreakQueuePairs(const std::string& device);
  void KillDeviceAfter(const std::string& device, int work_requests);
  void Revive(const std::string& device);

  // Work requests posted on `device` (by any engine) and QPs created there.
  uint64_t posted(const std::string& device);
  uint64_t queue_pairs_created(const std::string& device);

 private:
  friend class FakeDevice;
  friend class FakeQueuePair;
  struct Region {
    char* addr;
    uint64_t length;
    std::string device;
    uint32_t lkey, rkey;
  };
  struct DeviceState {
    int fail_next = 0;
    int kill_after = -1;  // -1: alive, counting down when >= 0
    bool dead = false;
    uint64_t break_epoch = 0;  // QPs created before the last break are broken
    uint64_t posted = 0;
    uint64_t qps = 0;
  };
  struct QpState;
  explicit FakeFabric(std::vector<PortInfo> ports) : ports_(std::move(ports)) {}

  Mutex mu_;
  std::vector<PortInfo> ports_;
  std::map<std::string, DeviceState> devices_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, Region> by_rkey_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, std::shared_ptr<QpState>> qps_ ABSL_GUARDED_BY(mu_);
  uint32_t next_key_ ABSL_GUARDED_BY(mu_) = 0x100;
  uint32_t next_qp_ ABSL_GUARDED_BY(mu_) = 0x10;
};

}  // namespace tierkv::transport::rdma
