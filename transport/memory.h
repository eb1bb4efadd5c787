// SharedRegion: host memory that other processes on the same host can map
// (the shm transport), lent by store daemons and by clients.
//
// Creation is honest about the memory it promises: a size this host (or
// this process's cgroup) cannot back with RAM is refused at once with the
// figures (transport/host_memory.h), instead of a mapping that succeeds
// in microseconds and meets the OOM killer when it fills. The check and
// the sizing of the memfd happen under a host-wide lock, so daemons
// started together see each other's promises.
//
// Pages are still faulted in lazily by default (a 180 GB region is ready
// in milliseconds). `prefault` touches every page at creation with several
// threads on disjoint ranges (MADV_POPULATE_WRITE where the kernel has it,
// else one write per page), so the cost is one pass at memory bandwidth and
// later first touches cost nothing; `mlock` then locks the pages in RAM.
// `numa_node` binds the pages to one node before anything touches them.
//
//   ASSIGN_OR_RETURN(auto region, SharedRegion::Create(180'000'000'000, {.prefault = true}));
//   engine.RegisterMemory(region->data(), region->size(), region->location(), region->fd());
//
// Owns the memfd and the mapping; thread-safe after creation.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tierkv::transport {

struct SharedRegionOptions {
  bool prefault = false;      // fault every page in at creation, in parallel
  bool hugepages = false;     // back with 2 MiB pages (MFD_HUGETLB); needs reserved hugepages
  bool mlock = false;         // lock the pages in RAM (prefaults first)
  int numa_node = -1;         // bind the pages to this node; -1: the kernel's default (local)
  int prefault_threads = 0;   // 0: one per CPU this thread may run on
  // Refuse sizes this host cannot back (see above). Off only for tests of
  // what happens without the check.
  bool check_available = true;
};

class SharedRegion {
 public:
  // RESOURCE_EXHAUSTED when the memory cannot be had: more than the host
  // or cgroup can back (the message gives the figures), too few hugepages,
  // or a prefault the kernel could not complete. FAILED_PRECONDITION when
  // mlock is refused (the message names RLIMIT_MEMLOCK and its value).
  // INVALID_ARGUMENT for a size of 0 or a NUMA node the kernel refuses.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(uint64_t size,
                                                              SharedRegionOptions options);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // The node the memory is on: the bound node; else, for a prefaulted
  // region, where most of its pages landed; else the node of the creating
  // thread's CPU (where the kernel's local policy will put first touches
  // from that node).
  int numa_node() const { return numa_node_; }
  // "cpu:<numa_node>", the transfer engine's location string.
  std::string location() const;
  bool locked() const { return locked_; }

 private:
  SharedRegion(char* data, uint64_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  char* data_;
  uint64_t size_;
  int fd_;
  int numa_node_ = 0;
  bool locked_ = false;
};

// Faults every page of [data, data+size) in for writing with `threads`
// threads on disjoint ranges (0: one per CPU this thread may run on).
// `page` is the mapping's page size. RESOURCE_EXHAUSTED when the kernel
// cannot back a page.
absl::Status Prefault(char* data, uint64_t size, uint64_t page, int threads);

// This machine's identity for same-host checks: the kernel's boot id
// (shared by every process and network namespace on one kernel).
std::string LocalHostId();

}  // namespace tierkv::transport
