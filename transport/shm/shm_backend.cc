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
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "config/base/mutex.h"
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
    if (!healthy()) {
      for (Slice* s : slices) {
        s->status = absl::UnavailableError("shm peer has restarted or stopped serving this memory");
      }
      return;
    }
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
    // A read that raced with the peer's exit may hold bytes of memory no
    // longer served: the caller must not take them as the peer's.
    if (!healthy()) {
      for (Slice* s : slices) {
        if (s->status.ok()) s->status = absl::UnavailableError("shm peer went away during the transfer");
      }
    }
  }
  bool healthy() const override { return incarnation_->current(); }

 private:
  std::vector<Mapping> maps_;
  std::unique_ptr<Incarnation> incarnation_;
};

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
  Capabilities capabilities() const override { return {.rank = 100, .same_host_only = true}; }
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
    json req{{"host_id", ctx.local_host_id}, {"segment_index", remote.segment_index}};
    absl::StatusOr<std::string> answer = ctx.handshake(remote.control, "shm", req.dump(), ctx.deadline);
    if (!answer.ok()) return absl::UnavailableError(answer.status().message());
    json a = json::parse(*answer, nullptr, false);
    if (a.is_discarded() || !a.contains("pid") || !a.contains("buffers") || !a["buffers"].is_array()) {
      return absl::UnavailableError("malformed shm handshake answer");
    }
    int pid = a["pid"].get<int>();
    // Tie the channel to this incarnation of the server before mapping
    // anything: a pidfd first (so a pid reused later cannot pass for it),
    // then the beacon page.
    int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    const uint64_t* beacon = nullptr;
    {
      std::string path = absl::StrCat("/proc/", pid, "/fd/", a.value("beacon_fd", -1));
      int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
      void* p = fd < 0 ? MAP_FAILED : mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
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
      tokens.emplace_back(b.value("slot", size_t{0}) % kBeaconSlots, b.value("token", uint64_t{0}));
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
