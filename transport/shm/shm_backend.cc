// The shm backend: same-host peers map the serving process's memfd-backed
// buffers and a transfer is a memcpy.
//
// The mapping is handed over only after a handshake on the control channel
// in which the serving side checks that the peer has its host id; the
// answer names the serving pid and memfd numbers, which the peer opens
// through /proc/<pid>/fd (allowed only to the same user or root), maps,
// and closes. Buffers that are not memfd-backed are not offered.
//
// A mapping outlives the process that served it (the peer's mapping keeps
// the memfd alive), so a channel must notice when what it maps is no
// longer served: otherwise, after a daemon restart, a long-lived client
// would keep writing into the dead daemon's memory and be told OK. Each
// channel is tied to its server's incarnation two ways, both checked
// before every use: a pidfd of the serving process (readable once it
// exits), and a token per buffer in a one-page "beacon" memfd the server
// shares read-only; the server changes a buffer's token when the buffer
// is registered again or unregistered, and clears every token when the
// backend stops.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "base/mutex.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/buffer_claim.h"
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

// Token slots in the beacon page; a slot's token is 0 while unused.
constexpr size_t kBeaconSlots = 4096 / sizeof(uint64_t);

// The serving process still runs the incarnation this channel mapped:
// its pidfd is not readable (it has not exited) and every mapped buffer
// still carries the token it had at the handshake.
class Incarnation {
 public:
  Incarnation(int pidfd, pid_t pid, const uint64_t* beacon, std::vector<std::pair<size_t, uint64_t>> tokens)
      : pidfd_(pidfd), pid_(pid), beacon_(beacon), tokens_(std::move(tokens)) {}
  ~Incarnation() {
    if (pidfd_ >= 0) close(pidfd_);
    if (beacon_ != nullptr) munmap(const_cast<uint64_t*>(beacon_), 4096);
  }
  void set_tokens(std::vector<std::pair<size_t, uint64_t>> tokens) { tokens_ = std::move(tokens); }
  bool current() const {
    for (const auto& [slot, token] : tokens_) {
      if (__atomic_load_n(&beacon_[slot], __ATOMIC_ACQUIRE) != token) return false;
    }
    if (pidfd_ >= 0) {
      pollfd p{pidfd_, POLLIN, 0};
      return poll(&p, 1, 0) == 0;
    }
    return kill(pid_, 0) == 0 || errno == EPERM;  // no pidfd: at least the pid is alive
  }

 private:
  int pidfd_;
  pid_t pid_;
  const uint64_t* beacon_;
  std::vector<std::pair<size_t, uint64_t>> tokens_;
};

class ShmChannel final : public PeerChannel {
 public:
  ShmChannel(std::vector<Mapping> maps, std::unique_ptr<Incarnation> incarnation)
      : maps_(std::move(maps)), incarnation_(std::move(incarnation)) {}
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
      // Held while copying, so a caller whose Wait ran out finds its
      // buffers untouched once Wait returns (buffer_claim.h).
      ClaimHold hold(CurrentTaskClaim());
      if (!hold.held()) {
        s->status = absl::DeadlineExceededError("the caller stopped waiting before this shm copy");
        continue;
      }
      char* remote = m->addr + (s->remote_offset - m->offset);
      char* to = s->op == Op::kRead ? s->local : remote;
      const char* from = s->op == Op::kRead ? remote : s->local;
      // A write lands in memory another process reads later, so a large
      // one streams around this core's cache (CopyOut); a read lands in
      // the caller's buffer, which it reads next.
      const bool out = s->op == Op::kWrite;
      if (s->crc != nullptr) {
        const uint32_t seed = s->crc->value;
        s->crc->value = out ? Crc32cCopyOut(seed, to, from, s->length) : Crc32cCopy(seed, to, from, s->length);
        s->crc->set = true;
      } else if (out) {
        CopyOut(to, from, s->length);
      } else {
        std::memcpy(to, from, s->length);
      }
      s->status = absl::OkStatus();
    }
    // One check after the copies covers a peer gone before or during them:
    // a write into memory no longer served, or a read of it, is not OK.
    if (!healthy()) {
      for (Slice* s : slices) {
        if (s->status.ok()) s->status = absl::UnavailableError("shm peer has restarted or stopped serving this memory");
      }
    }
  }
  bool healthy() const override { return incarnation_->current(); }

 private:
  std::vector<Mapping> maps_;
  std::unique_ptr<Incarnation> incarnation_;
};

// The serving side's answer: its pid, its beacon's memfd, and the memfd
// and beacon slot and token of each shared buffer.
struct ShmAnswer {
  struct Buffer {
    uint64_t index;
    int64_t fd;
    uint64_t length;
    uint64_t slot;
    uint64_t token;
  };
  int64_t pid = 0;
  int64_t beacon_fd = -1;
  std::vector<Buffer> buffers;
};

absl::StatusOr<ShmAnswer> ParseAnswer(const std::string& text) {
  json a = json::parse(text, nullptr, false);
  if (a.is_discarded() || !a.is_object()) return absl::InvalidArgumentError("not a JSON object");
  ShmAnswer out;
  RETURN_IF_ERROR(IntField(a, "pid", 1, INT32_MAX, &out.pid));
  RETURN_IF_ERROR(IntField(a, "beacon_fd", 0, INT32_MAX, &out.beacon_fd));
  auto bufs = a.find("buffers");
  if (bufs == a.end() || !bufs->is_array() || bufs->size() > 4096) {
    return absl::InvalidArgumentError("field 'buffers' must be an array of at most 4096");
  }
  for (const json& b : *bufs) {
    ShmAnswer::Buffer buf;
    RETURN_IF_ERROR(UintField(b, "index", UINT32_MAX, &buf.index));
    RETURN_IF_ERROR(IntField(b, "fd", 0, INT32_MAX, &buf.fd));
    RETURN_IF_ERROR(UintField(b, "length", UINT64_MAX, &buf.length));
    RETURN_IF_ERROR(UintField(b, "slot", kBeaconSlots - 1, &buf.slot));
    RETURN_IF_ERROR(UintField(b, "token", UINT64_MAX, &buf.token));
    out.buffers.push_back(buf);
  }
  return out;
}

class ShmBackend final : public Backend {
 public:
  ShmBackend() {
    beacon_fd_ = memfd_create("tierkv-shm-beacon", MFD_CLOEXEC);
    if (beacon_fd_ >= 0 && ftruncate(beacon_fd_, 4096) == 0) {
      void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, beacon_fd_, 0);
      if (p != MAP_FAILED) beacon_ = static_cast<uint64_t*>(p);
    }
  }
  ~ShmBackend() override {
    Stop();
    if (beacon_ != nullptr) munmap(beacon_, 4096);
    if (beacon_fd_ >= 0) close(beacon_fd_);
  }
  std::string name() const override { return "shm"; }
  Capabilities capabilities() const override { return {.rank = 100, .same_host_only = true, .checksums_copies = true, .bounded_post = true, .keyed_buffers = true}; }
  absl::Status Start(ServedMemory*) override { return absl::OkStatus(); }
  // Every channel mapping this process's buffers sees it stop.
  void Stop() override {
    MutexLock lock(&mu_);
    for (auto& [id, slot] : slots_) SetToken(slot, 0);
    slots_.clear();
  }
  std::string endpoint() const override { return LocalHostId(); }

  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer& b) override {
    if (b.memfd < 0) return absl::FailedPreconditionError("buffer is not memfd-backed");
    if (b.location.kind != Location::kCpu) return absl::FailedPreconditionError("not host memory");
    if (beacon_ == nullptr) return absl::UnavailableError("shm beacon could not be created");
    MutexLock lock(&mu_);
    auto it = slots_.find(b.id);
    if (it == slots_.end()) {
      std::vector<bool> used(kBeaconSlots, false);
      for (const auto& [id, slot] : slots_) used[slot] = true;
      size_t free = 0;
      while (free < kBeaconSlots && used[free]) ++free;
      if (free == kBeaconSlots) return absl::ResourceExhaustedError("every shm beacon slot is in use");
      it = slots_.emplace(b.id, free).first;
    }
    // A new token each time: channels from an earlier registration (an
    // earlier segment served from this buffer) stop being healthy.
    SetToken(it->second, NewToken());
    return std::string("memfd");
  }
  void UnregisterBuffer(const LocalBuffer& b) override {
    MutexLock lock(&mu_);
    auto it = slots_.find(b.id);
    if (it == slots_.end()) return;
    SetToken(it->second, 0);
    slots_.erase(it);
  }

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
    out["beacon_fd"] = beacon_fd_;
    out["buffers"] = json::array();
    MutexLock lock(&mu_);
    for (size_t i = 0; i < count; ++i) {
      auto slot = slots_.find(buffers[i]->id);
      if (buffers[i]->memfd < 0 || slot == slots_.end()) continue;
      out["buffers"].push_back({{"index", i},
                                {"fd", buffers[i]->memfd},
                                {"length", buffers[i]->length},
                                {"slot", slot->second},
                                {"token", Token(slot->second)}});
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
    const int pid = static_cast<int>(a->pid);
    // Tie the channel to this incarnation of the server before mapping
    // anything: a pidfd first (so a pid reused later cannot pass for it),
    // then the beacon page.
    int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    const uint64_t* beacon = nullptr;
    {
      std::string path = absl::StrCat("/proc/", pid, "/fd/", a->beacon_fd);
      int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
      struct stat st {};
      const bool page = fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= 4096;
      void* p = page ? mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
      if (fd >= 0) close(fd);
      if (p == MAP_FAILED) {
        if (pidfd >= 0) close(pidfd);
        return absl::UnavailableError(absl::StrCat("cannot map the shm beacon ", path, ": ", strerror(errno)));
      }
      beacon = static_cast<const uint64_t*>(p);
    }
    std::vector<std::pair<size_t, uint64_t>> tokens;
    auto incarnation = std::make_unique<Incarnation>(pidfd, pid, beacon, std::vector<std::pair<size_t, uint64_t>>{});
    std::vector<Mapping> maps;
    auto undo = [&] {
      for (const Mapping& m : maps) munmap(m.addr, m.length);
    };
    for (const ShmAnswer::Buffer& b : a->buffers) {
      if (b.index >= remote.buffers.size()) continue;
      const BufferDescriptor& bd = remote.buffers[b.index];
      uint64_t length = b.length;
      if (length != bd.length || length == 0) continue;
      std::string path = absl::StrCat("/proc/", pid, "/fd/", b.fd);
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
      tokens.emplace_back(b.slot, b.token);
    }
    if (maps.empty()) return absl::UnavailableError(absl::StrCat("segment ", remote.name, " shares no buffer"));
    incarnation->set_tokens(std::move(tokens));
    if (!incarnation->current()) {
      undo();
      return absl::UnavailableError(absl::StrCat("segment ", remote.name, " changed while being mapped"));
    }
    return std::unique_ptr<PeerChannel>(new ShmChannel(std::move(maps), std::move(incarnation)));
  }

 private:
  static uint64_t NewToken() {
    static std::atomic<uint64_t> counter{std::random_device{}() | 1};
    uint64_t t = counter.fetch_add(0x9e3779b97f4a7c15ull, std::memory_order_relaxed);
    return t == 0 ? 1 : t;
  }
  void SetToken(size_t slot, uint64_t token) {
    __atomic_store_n(&beacon_[slot], token, __ATOMIC_RELEASE);
  }
  uint64_t Token(size_t slot) const {
    return __atomic_load_n(&beacon_[slot], __ATOMIC_ACQUIRE);
  }

  int beacon_fd_ = -1;
  uint64_t* beacon_ = nullptr;  // one page of tokens, shared read-only with peers
  Mutex mu_;
  std::map<uint64_t, size_t> slots_ ABSL_GUARDED_BY(mu_);  // buffer id -> beacon slot
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewShmBackend(const BackendOptions&) {
  return std::unique_ptr<Backend>(new ShmBackend());
}

}  // namespace internal
}  // namespace tierkv::transport
