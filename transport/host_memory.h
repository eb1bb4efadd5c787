// HostMemory: how much RAM this process can still be given, so a segment
// that cannot be backed is refused when it is created instead of meeting
// the OOM killer the day it fills.
//
// A memfd segment is not charged to the kernel's overcommit accounting
// when it is created (tmpfs charges pages as they are touched), so the
// check is ours: the size must fit in the smallest of
//   - MemAvailable (/proc/meminfo), less what other tierkv segments on this
//     host have been promised but not yet touched (their memfds' size minus
//     their allocated blocks, found through /proc/<pid>/fd);
//   - the room left under this process's cgroup memory limit (v2
//     memory.max or v1 memory.limit_in_bytes, every ancestor), less the
//     same promises;
//   - CommitLimit - Committed_AS when vm.overcommit_memory is 2 (strict).
// Hugepage-backed segments are checked by the kernel itself (hugetlbfs
// reserves its pages at mmap), not here.
//
// Processes in another PID namespace, or another user's when this one may
// not read their /proc/<pid>/fd, are invisible to the promise scan; callers
// that need a guarantee prefault (the pages are then really taken).
//
//   ASSIGN_OR_RETURN(HostMemory host, HostMemory::Read());
//   RETURN_IF_ERROR(host.CheckFits(size));   // RESOURCE_EXHAUSTED with the figures
//
// Reading is a scan of /proc; thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tierkv::transport {

// The memfd name every SharedRegion carries (so the promise scan finds
// them); hugepage regions use kSegmentMemfdName + "-huge".
inline constexpr char kSegmentMemfdName[] = "tierkv-segment";

// /proc/meminfo as name -> bytes ("MemAvailable" -> 24117248000); lines
// without a number are skipped.
std::map<std::string, uint64_t> ParseMeminfo(absl::string_view text);

// Bytes promised but not yet backed by the tierkv segments whose memfds
// process `pid` holds open (each memfd counted once per call).
uint64_t PromisedBytesOfProcess(pid_t pid);

struct HostMemory {
  uint64_t mem_available = 0;
  int overcommit_mode = 0;            // vm.overcommit_memory
  uint64_t commit_room = 0;           // CommitLimit - Committed_AS (mode 2 only)
  std::optional<uint64_t> cgroup_room;  // under the tightest cgroup limit, if any
  std::string cgroup_limit_file;      // where that limit was read
  uint64_t promised = 0;              // to tierkv segments on this host, untouched

  // Reads /proc and the cgroup files.
  static absl::StatusOr<HostMemory> Read();

  // OK when `size` more bytes fit; RESOURCE_EXHAUSTED whose one-line
  // message gives the size, the binding limit and the figures behind it.
  absl::Status CheckFits(uint64_t size) const;
};

}  // namespace tierkv::transport
