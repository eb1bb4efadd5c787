#include "transport/memory.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status.h"
#include "config/units.h"
#include "transport/host_memory.h"
#include "transport/numa.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace tierkv::transport {
namespace {

constexpr uint64_t kHugePage = 2ull << 20;

// Serialises "check what is free, then size a memfd" across the processes
// of this host, so two daemons starting together cannot both count the
// same free memory: once the memfd is sized, the next check sees it as
// promised.
class HostMemoryLock {
 public:
  HostMemoryLock() {
    for (const char* path : {"/dev/shm/tierkv-memory.lock", "/tmp/tierkv-memory.lock"}) {
      fd_ = open(path, O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd_ >= 0) break;
    }
    // Without a lock file the check still runs, only unserialised.
    if (fd_ >= 0) {
      while (flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~HostMemoryLock() {
    if (fd_ >= 0) close(fd_);  // releases the lock
  }

 private:
  int fd_ = -1;
};

int CpusAvailable() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// One thread's share: MADV_POPULATE_WRITE in 1 GiB steps (so a failure
// stops early), else a write-intent touch of every page. Returns 0 or the
// errno that stopped it.
int PopulateRange(char* begin, uint64_t len, uint64_t page) {
  constexpr uint64_t kStep = 1ull << 30;
  for (uint64_t off = 0; off < len;) {
    uint64_t n = std::min(kStep, len - off);
    if (madvise(begin + off, n, MADV_POPULATE_WRITE) == 0) {
      off += n;
      continue;
    }
    if (errno == EINTR || errno == EAGAIN) continue;
    if (errno != EINVAL) return errno;
    // A kernel without MADV_POPULATE_WRITE: one write fault per page that
    // keeps the byte's value.
    for (uint64_t p = off; p < len; p += page) {
      __atomic_fetch_or(reinterpret_cast<unsigned char*>(begin + p), 0, __ATOMIC_RELAXED);
    }
    return 0;
  }
  return 0;
}

absl::Status LockPages(char* data, uint64_t size) {
  if (mlock(data, size) == 0) return absl::OkStatus();
  int err = errno;
  struct rlimit rl {};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  std::string limit = rl.rlim_cur == RLIM_INFINITY ? "unlimited" : FormatSize(rl.rlim_cur);
  return absl::FailedPreconditionError(absl::StrCat(
      "mlock of ", FormatSize(size), " failed (", strerror(err), "): RLIMIT_MEMLOCK is ", limit,
      "; raise it (ulimit -l unlimited, LimitMEMLOCK=infinity in a systemd unit, "
      "--ulimit memlock=-1 for docker) or drop --mlock"));
}

}  // namespace

absl::Status Prefault(char* data, uint64_t size, uint64_t page, int threads) {
  if (threads <= 0) threads = CpusAvailable();
  // No thread gets less than 64 MiB: below that, starting it costs more
  // than it saves.
  threads = static_cast<int>(std::clamp<uint64_t>(size / (64ull << 20), 1, static_cast<uint64_t>(threads)));
  uint64_t share = (size / threads + page - 1) / page * page;
  std::vector<int> errs(threads, 0);
  std::vector<std::thread> workers;
  for (int i = 1; i < threads; ++i) {
    uint64_t begin = share * i;
    if (begin >= size) break;
    workers.emplace_back([&, i, begin] {
      errs[i] = PopulateRange(data + begin, std::min(share, size - begin), page);
    });
  }
  errs[0] = PopulateRange(data, std::min(share, size), page);
  for (std::thread& t : workers) t.join();
  for (int err : errs) {
    if (err != 0) {
      return absl::ResourceExhaustedError(absl::StrCat("prefaulting ", FormatSize(size),
                                                       ": the kernel could not back every page (",
                                                       strerror(err), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(uint64_t size,
                                                                   SharedRegionOptions options) {
  if (size == 0) return absl::InvalidArgumentError("shared region of 0 bytes");
  const uint64_t page = options.hugepages ? kHugePage : static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  int fd = -1;
  {
    HostMemoryLock lock;
    // Hugepages come from their own pool, which the kernel reserves at mmap.
    if (options.check_available && !options.hugepages) {
      ASSIGN_OR_RETURN(HostMemory host, HostMemory::Read());
      RETURN_IF_ERROR(host.CheckFits(size));
    }
    std::string name = options.hugepages ? absl::StrCat(kSegmentMemfdName, "-huge") : kSegmentMemfdName;
    fd = memfd_create(name.c_str(), MFD_CLOEXEC | (options.hugepages ? MFD_HUGETLB : 0u));
    if (fd < 0) return ErrnoToStatus(errno, "memfd_create");
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      int err = errno;
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("sizing a shared region of ", FormatSize(size), ": ", strerror(err)));
    }
  }
  // No MAP_NORESERVE: for hugepages this makes the kernel reserve the
  // pages now (or refuse), instead of SIGBUS at some later first touch.
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        "mapping a shared region of ", FormatSize(size), ": ", strerror(err),
        options.hugepages ? " (too few free 2 MiB hugepages? see HugePages_Free in /proc/meminfo)" : ""));
  }
  std::unique_ptr<SharedRegion> region(new SharedRegion(static_cast<char*>(p), size, fd));
  if (options.numa_node >= 0) {
    RETURN_IF_ERROR(BindMemory(p, size, options.numa_node));
    region->numa_node_ = options.numa_node;
  }
  const bool prefault = options.prefault || options.mlock;
  if (prefault) RETURN_IF_ERROR(Prefault(region->data_, size, page, options.prefault_threads));
  if (options.mlock) {
    RETURN_IF_ERROR(LockPages(region->data_, size));
    region->locked_ = true;
  }
  if (options.numa_node < 0) {
    std::optional<int> landed = prefault ? NodeOfMemory(p, size) : std::nullopt;
    region->numa_node_ = landed.value_or(CurrentNode());
  }
  return region;
}

std::string SharedRegion::location() const { return absl::StrCat("cpu:", numa_node_); }

SharedRegion::~SharedRegion() {
  munmap(data_, size_);
  close(fd_);
}

std::string LocalHostId() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string s;
    std::getline(in, s);
    if (s.empty()) {
      char host[256] = {};
      gethostname(host, sizeof host - 1);
      s = host;
    }
    return std::string(absl::StripAsciiWhitespace(s));
  }();
  return id;
}

}  // namespace tierkv::transport
