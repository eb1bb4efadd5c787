#include "transport/memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "config/base/status.h"

namespace tierkv::transport {

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(uint64_t size,
                                                                   SharedRegionOptions options) {
  if (size == 0) return absl::InvalidArgumentError("shared region of 0 bytes");
  unsigned flags = MFD_CLOEXEC;
  if (options.hugepages) flags |= MFD_HUGETLB;
  int fd = memfd_create("tierkv-segment", flags);
  if (fd < 0) return ErrnoToStatus(errno, "memfd_create");
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("sizing a shared region of ", size, " bytes: ", strerror(err)));
  }
  int mflags = MAP_SHARED | MAP_NORESERVE;
  if (options.prefault) mflags |= MAP_POPULATE;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, mflags, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("mapping a shared region of ", size, " bytes: ", strerror(err)));
  }
  return std::unique_ptr<SharedRegion>(new SharedRegion(static_cast<char*>(p), size, fd));
}

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
