// SharedRegion: host memory that other processes on the same host can map
// (the shm transport) and that is only backed by RAM as it is touched.
//
// A store daemon lends its segment from one of these: creating a 180 GB
// region takes microseconds, because the pages are reserved, not faulted
// in, unless `prefault` asks for it (then creation costs a pass over the
// memory but later first touches cost nothing).
//
//   ASSIGN_OR_RETURN(auto region, SharedRegion::Create(180'000'000'000, {}));
//   engine.RegisterMemory(region->data(), region->size(), "cpu:0", region->fd());
//
// Owns the memfd and the mapping; thread-safe after creation.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace tierkv::transport {

struct SharedRegionOptions {
  bool prefault = false;   // fault every page in at creation (MAP_POPULATE)
  bool hugepages = false;  // back with 2 MiB pages (MFD_HUGETLB); needs reserved hugepages
};

class SharedRegion {
 public:
  // RESOURCE_EXHAUSTED when the kernel refuses the size or the hugepages.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(uint64_t size,
                                                              SharedRegionOptions options);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  SharedRegion(char* data, uint64_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  char* data_;
  uint64_t size_;
  int fd_;
};

// This machine's identity for same-host checks: the kernel's boot id
// (shared by every process and network namespace on one kernel).
std::string LocalHostId();

}  // namespace tierkv::transport
