// NUMA placement for lent memory, through the kernel's syscalls directly
// (mbind, move_pages, getcpu, sched_setaffinity; libnuma is not a
// dependency).
//
// The topology comes from sysfs (/sys/devices/system/node/node<N>/cpulist);
// a host without that directory (a kernel built without NUMA) has one node,
// 0, holding every CPU. The root is a parameter so tests describe a
// two-node host in a temporary directory.
//
//   ASSIGN_OR_RETURN(NumaTopology topo, NumaTopology::Load());
//   RETURN_IF_ERROR(topo.Check(node));               // "no such NUMA node"
//   RETURN_IF_ERROR(BindMemory(addr, len, node));      // before first touch
//   RETURN_IF_ERROR(PinThisThread(topo.cpus(node)));   // threads started later inherit it
//
// Everything here is thread-safe (no state beyond the loaded topology).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tierkv::transport {

// Parses the kernel's list format ("0-3,8-11", "5", "" for none) into
// ascending CPU (or node) numbers. INVALID_ARGUMENT for anything else.
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text);

class NumaTopology {
 public:
  // Reads `root` (normally /sys/devices/system/node). A missing root means
  // a single node 0 with every online CPU; an unreadable cpulist is an
  // error.
  static absl::StatusOr<NumaTopology> Load(const std::string& root = "/sys/devices/system/node");

  // OK when `node` exists; INVALID_ARGUMENT naming the nodes there are.
  absl::Status Check(int node) const;
  // The node's CPUs (empty for a memory-only node, or an unknown one).
  const std::vector<int>& cpus(int node) const;
  std::vector<int> nodes() const;
  // "0, 1" for messages.
  std::string NodeList() const;

 private:
  std::map<int, std::vector<int>> cpus_;
};

// Sets an MPOL_BIND policy on [addr, addr+len) so its pages are allocated
// on `node` when first touched (for a memfd mapping the policy is the
// shared object's). Must precede the first touch. A kernel without NUMA
// support accepts node 0 (the only one) and refuses others.
absl::Status BindMemory(void* addr, uint64_t len, int node);

// The node most of the present pages among `samples` evenly spaced pages
// of [addr, addr+len) live on; nullopt when none is present yet (or the
// kernel cannot say).
std::optional<int> NodeOfMemory(const void* addr, uint64_t len, int samples = 64);

// The node of the CPU this thread runs on now (0 without NUMA support).
int CurrentNode();

// Restricts the calling thread (and the threads it starts afterwards) to
// `cpus`; INVALID_ARGUMENT for an empty list. Returns the previous set so
// a caller can restore it.
absl::StatusOr<std::vector<int>> PinThisThread(const std::vector<int>& cpus);

}  // namespace tierkv::transport
