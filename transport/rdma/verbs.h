// The few verbs the rdma backend uses, behind an interface: RealVerbs()
// calls libibverbs (ibverbs.cc); FakeFabric (fake_verbs.h) simulates NICs
// in-process, so the backend's logic (handshake, slicing, striping, retry,
// pausing, error paths) runs in tests on machines without RDMA hardware.
//
// The model is libibverbs' own, reduced: a Device is one opened port with
// its protection domain and one completion queue; memory is registered
// per device (lkey for local use, rkey for peers); reliable-connected
// queue pairs are created per device, connected to one remote QP through
// addresses exchanged out of band, and take signaled one-sided RDMA READ
// and WRITE work requests whose completions arrive on the device's CQ.
//
// Thread-safety: Device and QueuePair methods may be called from several
// threads (libibverbs locks its queues); Poll is called by one thread per
// device.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierkv::transport::rdma {

using Gid = std::array<uint8_t, 16>;

struct PortInfo {
  std::string device;  // "mlx5_0"
  int port = 1;
  bool active = false;
  int numa_node = -1;  // from sysfs; -1 when unknown
  std::string pci;     // PCI address, for GPU affinity ("0000:3b:00.0"); may be empty
  uint16_t lid = 0;    // InfiniBand; 0 on RoCE
  Gid gid{};           // the GID used for RoCE (all zero on InfiniBand)
  int gid_index = 0;
  int mtu = 4096;      // active MTU in bytes
};

struct MemoryKeys {
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

// What a peer needs to connect its QP to ours.
struct QpAddress {
  uint32_t qp_num = 0;
  uint16_t lid = 0;
  Gid gid{};
  uint32_t psn = 0;
  int mtu = 4096;
};

enum class WcStatus {
  kSuccess,
  kRemoteAccess,   // rkey or range refused by the remote NIC
  kTransport,      // retries exceeded: the peer or the path is gone
  kFlushed,        // the QP went to error before this request ran
  kLocal,          // local protection or length error
};

struct Completion {
  uint64_t wr_id = 0;
  WcStatus status = WcStatus::kSuccess;
  std::string detail;  // the verbs status text
};

struct WorkRequest {
  uint64_t wr_id = 0;
  bool write = false;  // RDMA WRITE (else READ)
  char* local = nullptr;
  uint32_t lkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t length = 0;
};

class QueuePair {
 public:
  virtual ~QueuePair() = default;
  virtual QpAddress address() const = 0;
  // RESET/INIT -> RTR -> RTS against `remote`.
  virtual absl::Status Connect(const QpAddress& remote) = 0;
  // A signaled work request; its completion arrives on the device's CQ.
  virtual absl::Status Post(const WorkRequest& wr) = 0;
  // Moves the QP to the error state: outstanding requests complete kFlushed.
  virtual void Fail() = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const PortInfo& port() const = 0;
  virtual absl::StatusOr<MemoryKeys> Register(char* addr, uint64_t length) = 0;
  virtual void Deregister(char* addr) = 0;
  virtual absl::StatusOr<std::unique_ptr<QueuePair>> CreateQueuePair(int max_outstanding) = 0;
  // Up to `max` completions; waits up to `timeout` for the first.
  virtual int Poll(Completion* out, int max, absl::Duration timeout) = 0;
};

class Verbs {
 public:
  virtual ~Verbs() = default;
  // Every port of every device, active or not.
  virtual std::vector<PortInfo> Ports() = 0;
  virtual absl::StatusOr<std::unique_ptr<Device>> Open(const PortInfo& port) = 0;
};

// libibverbs. Ports() is empty where ibv_get_device_list finds nothing.
std::shared_ptr<Verbs> RealVerbs();

// The NUMA node of the PCI device at `pci` (or of `ib_device` through
// /sys/class/infiniband), -1 when unreadable.
int NumaNodeOf(const std::string& ib_device);

}  // namespace tierkv::transport::rdma
