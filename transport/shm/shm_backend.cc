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
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "config/base/status.h"
#include "nlohmann/json.hpp"
#include "transport/internal/builtin.h"
#include "transport/internal/json_fields.h"
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

// The serving side's answer: its pid and the memfd of each shared buffer.
struct ShmAnswer {
  struct Buffer {
    uint64_t index;
    int64_t fd;
    uint64_t length;
  };
  int64_t pid = 0;
  std::vector<Buffer> buffers;
};

absl::StatusOr<ShmAnswer> ParseAnswer(const std::string& text) {
  json a = json::parse(text, nullptr, false);
  if (a.is_discarded() || !a.is_object()) return absl::InvalidArgumentError("not a JSON object");
  ShmAnswer out;
  RETURN_IF_ERROR(IntField(a, "pid", 1, INT32_MAX, &out.pid));
  auto bufs = a.find("buffers");
  if (bufs == a.end() || !bufs->is_array() || bufs->size() > 4096) {
    return absl::InvalidArgumentError("field 'buffers' must be an array of at most 4096");
  }
  for (const json& b : *bufs) {
    ShmAnswer::Buffer buf;
    RETURN_IF_ERROR(UintField(b, "index", UINT32_MAX, &buf.index));
    RETURN_IF_ERROR(IntField(b, "fd", 0, INT32_MAX, &buf.fd));
    RETURN_IF_ERROR(UintField(b, "length", UINT64_MAX, &buf.length));
    out.buffers.push_back(buf);
  }
  return out;
}

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
    std::string peer;
    if (req.is_discarded() || !StringField(req, "host_id", &peer).ok()) {
      return absl::InvalidArgumentError("shm handshake needs a host_id");
    }
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
    json req{{"host_id", ctx.local_host_id},
             {"segment_index", remote.segment_index},
             {"segment_id", remote.segment_id}};
    absl::StatusOr<std::string> answer = ctx.handshake(remote.control, "shm", req.dump(), ctx.deadline);
    if (!answer.ok()) return absl::UnavailableError(answer.status().message());
    absl::StatusOr<ShmAnswer> a = ParseAnswer(*answer);
    if (!a.ok()) return absl::UnavailableError(absl::StrCat("malformed shm handshake answer: ", a.status().message()));
    std::vector<Mapping> maps;
    auto undo = [&] {
      for (const Mapping& m : maps) munmap(m.addr, m.length);
    };
    for (const ShmAnswer::Buffer& b : a->buffers) {
      if (b.index >= remote.buffers.size()) continue;
      const BufferDescriptor& bd = remote.buffers[b.index];
      uint64_t length = b.length;
      if (length != bd.length || length == 0) continue;
      std::string path = absl::StrCat("/proc/", a->pid, "/fd/", b.fd);
      // O_NOCTTY and the regular-file check: the answer names the fd, and
      // only a memfd (a regular shmem file) is ever meant.
      int fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
      if (fd < 0) {
        undo();
        return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", strerror(errno)));
      }
      struct stat st {};
      if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < length) {
        close(fd);
        undo();
        return absl::UnavailableError(absl::StrCat(path, " is not a shared buffer of ", length, " bytes"));
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
