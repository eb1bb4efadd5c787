// The shm backend: same-host peers map the serving process's memfd-backed
// buffers and a transfer is a memcpy.
//
// The mapping is handed over only after a handshake on the control channel
// in which the serving side checks that the peer has its host id; the
// answer names the serving pid and memfd numbers, which the peer opens
// through /proc/<pid>/fd (allowed only to the same user or root), maps,
// and closes. Buffers that are not memfd-backed are not offered.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "transport/internal/builtin.h"
#include "transport/memory.h"

namespace tierkv::transport {
namespace internal {
namespace {

using json = nlohmann::json;

struct Mapping {
  uint64_t offset;  // within the segment
  uint64_t length;
  char* addr;
};

class ShmChannel final : public PeerChannel {
 public:
  explicit ShmChannel(std::vector<Mapping> maps) : maps_(std::move(maps)) {}
  ~ShmChannel() override {
    for (const Mapping& m : maps_) munmap(m.addr, m.length);
  }

  void Post(absl::Span<Slice* const> slices, absl::Time deadline) override {
    for (Slice* s : slices) {
      if (absl::Now() > deadline) {
        s->status = absl::DeadlineExceededError("shm transfer passed its deadline");
        continue;
      }
      const Mapping* m = FindRange(maps_, s->remote_offset, s->length);
      if (m == nullptr) {
        s->status = absl::OutOfRangeError(absl::StrCat("range [", s->remote_offset, ", +", s->length,
                                                       ") is not inside a shared buffer"));
        continue;
      }
      char* remote = m->addr + (s->remote_offset - m->offset);
      if (s->op == Op::kRead) {
        std::memcpy(s->local, remote, s->length);
      } else {
        std::memcpy(remote, s->local, s->length);
      }
      s->status = absl::OkStatus();
    }
  }
  bool healthy() const override { return true; }

 private:
  std::vector<Mapping> maps_;
};

class ShmBackend final : public Backend {
 public:
  std::string name() const override { return "shm"; }
  Capabilities capabilities() const override { return {.rank = 100, .same_host_only = true}; }
  absl::Status Start(ServedMemory*) override { return absl::OkStatus(); }
  void Stop() override {}
  std::string endpoint() const override { return LocalHostId(); }

  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer& b) override {
    if (b.memfd < 0) return absl::FailedPreconditionError("buffer is not memfd-backed");
    if (b.location.kind != Location::kCpu) return absl::FailedPreconditionError("not host memory");
    return std::string("memfd");
  }
  void UnregisterBuffer(const LocalBuffer&) override {}

  absl::StatusOr<std::string> ServeHandshake(const std::string& request,
                                             const LocalBuffer* const* buffers,
                                             size_t count) override {
    json req = json::parse(request, nullptr, false);
    if (req.is_discarded() || !req.is_object() || !req.contains("host_id") || !req["host_id"].is_string()) {
      return absl::InvalidArgumentError("shm handshake needs a host_id");
    }
    std::string peer = req["host_id"].get<std::string>();
    if (peer != LocalHostId()) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm refused: peer host id ", peer.substr(0, 36), " is not this host's"));
    }
    json out;
    out["pid"] = getpid();
    out["buffers"] = json::array();
    for (size_t i = 0; i < count; ++i) {
      if (buffers[i]->memfd < 0) continue;
      out["buffers"].push_back({{"index", i}, {"fd", buffers[i]->memfd}, {"length", buffers[i]->length}});
    }
    return out.dump();
  }

  absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor& remote,
                                                       const PrepareContext& ctx) override {
    auto it = remote.transports.find("shm");
    if (it == remote.transports.end()) {
      return absl::UnavailableError(absl::StrCat("segment ", remote.name, " offers no shm"));
    }
    if (remote.host_id != ctx.local_host_id) {
      return absl::UnavailableError(absl::StrCat("segment ", remote.name, " is on host ", remote.host,
                                                 ", not this one"));
    }
    json req{{"host_id", ctx.local_host_id}, {"segment_index", remote.segment_index}};
    absl::StatusOr<std::string> answer = ctx.handshake(remote.control, "shm", req.dump(), ctx.deadline);
    if (!answer.ok()) return absl::UnavailableError(answer.status().message());
    json a = json::parse(*answer, nullptr, false);
    if (a.is_discarded() || !a.contains("pid") || !a.contains("buffers") || !a["buffers"].is_array()) {
      return absl::UnavailableError("malformed shm handshake answer");
    }
    int pid = a["pid"].get<int>();
    std::vector<Mapping> maps;
    auto undo = [&] {
      for (const Mapping& m : maps) munmap(m.addr, m.length);
    };
    for (const json& b : a["buffers"]) {
      size_t index = b.value("index", size_t{0});
      if (index >= remote.buffers.size()) continue;
      const BufferDescriptor& bd = remote.buffers[index];
      uint64_t length = b.value("length", uint64_t{0});
      if (length != bd.length) continue;
      std::string path = absl::StrCat("/proc/", pid, "/fd/", b.value("fd", -1));
      int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) {
        undo();
        return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", strerror(errno)));
      }
      void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
      close(fd);
      if (p == MAP_FAILED) {
        undo();
        return absl::UnavailableError(absl::StrCat("cannot map ", path, ": ", strerror(errno)));
      }
      maps.push_back({bd.offset, length, static_cast<char*>(p)});
    }
    if (maps.empty()) return absl::UnavailableError(absl::StrCat("segment ", remote.name, " shares no buffer"));
    return std::unique_ptr<PeerChannel>(new ShmChannel(std::move(maps)));
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewShmBackend(const BackendOptions&) {
  return std::unique_ptr<Backend>(new ShmBackend());
}

}  // namespace internal
}  // namespace tierkv::transport
