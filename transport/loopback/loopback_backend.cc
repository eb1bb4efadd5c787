// The loopback backend: the in-process twin of a transport. Engines in one
// process find each other through a process-wide table keyed by endpoint;
// a transfer resolves the range through the serving engine's ServedMemory
// (the same checks a real server makes) and copies. Unit tests run the
// engine's logic through it with no sockets.
#include <atomic>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "transport/buffer_claim.h"
#include "transport/internal/builtin.h"

namespace tierkv::transport {
namespace internal {
namespace {

struct Table {
  Mutex mu;
  std::map<std::string, ServedMemory*> served ABSL_GUARDED_BY(mu);
};
Table& GetTable() {
  static Table* t = new Table();
  return *t;
}

class LoopbackChannel final : public PeerChannel {
 public:
  LoopbackChannel(std::string endpoint, uint32_t segment, uint64_t segment_id)
      : endpoint_(std::move(endpoint)), segment_(segment), segment_id_(segment_id) {}
  void Post(absl::Span<Slice* const> slices, absl::Time deadline) override {
    Table& t = GetTable();
    MutexLock lock(&t.mu);  // keeps the serving engine alive while copying
    auto it = t.served.find(endpoint_);
    for (Slice* s : slices) {
      if (it == t.served.end()) {
        s->status = absl::UnavailableError(absl::StrCat("loopback peer ", endpoint_, " is gone"));
        healthy_ = false;
        continue;
      }
      if (absl::Now() > deadline) {
        s->status = absl::DeadlineExceededError("loopback transfer passed its deadline");
        continue;
      }
      absl::StatusOr<ServedMemory::Pin> pin = it->second->Resolve(segment_, segment_id_, s->remote_offset, s->length);
      if (pin.ok() && s->op == Op::kWrite) {
        // Fenced as tcp writes are: the in-process stand-in for one.
        if (absl::Status admitted = it->second->AdmitWrite(s->epoch); !admitted.ok()) pin = admitted;
      }
      if (!pin.ok()) {
        s->status = pin.status();
        continue;
      }
      ClaimHold hold(CurrentTaskClaim());  // as shm: nothing lands after a timed-out Wait
      if (!hold.held()) {
        s->status = absl::DeadlineExceededError("the caller stopped waiting before this copy");
        continue;
      }
      if (s->op == Op::kRead) {
        std::memcpy(s->local, pin->addr, s->length);
      } else {
        std::memcpy(pin->addr, s->local, s->length);
      }
      s->status = absl::OkStatus();
    }
  }
  bool healthy() const override { return healthy_.load(); }

 private:
  std::string endpoint_;
  uint32_t segment_;
  uint64_t segment_id_;
  std::atomic<bool> healthy_{true};
};

class LoopbackBackend final : public Backend {
 public:
  LoopbackBackend() {
    static std::atomic<int> counter{0};
    endpoint_ = absl::StrCat("loopback-", getpid(), "-", counter.fetch_add(1));
  }
  ~LoopbackBackend() override { Stop(); }
  std::string name() const override { return "loopback"; }
  Capabilities capabilities() const override { return {.rank = 1}; }
  absl::Status Start(ServedMemory* served) override {
    Table& t = GetTable();
    MutexLock lock(&t.mu);
    t.served[endpoint_] = served;
    return absl::OkStatus();
  }
  void Stop() override {
    Table& t = GetTable();
    MutexLock lock(&t.mu);
    t.served.erase(endpoint_);
  }
  std::string endpoint() const override { return endpoint_; }
  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer&) override { return std::string(); }
  void UnregisterBuffer(const LocalBuffer&) override {}
  absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor& remote,
                                                       const PrepareContext&) override {
    auto it = remote.transports.find("loopback");
    if (it == remote.transports.end()) return absl::UnavailableError("no loopback endpoint");
    Table& t = GetTable();
    MutexLock lock(&t.mu);
    if (!t.served.contains(it->second)) {
      return absl::UnavailableError(absl::StrCat("loopback peer ", it->second, " is not in this process"));
    }
    return std::unique_ptr<PeerChannel>(new LoopbackChannel(it->second, remote.segment_index, remote.segment_id));
  }

 private:
  std::string endpoint_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewLoopbackBackend(const BackendOptions&) {
  return std::unique_ptr<Backend>(new LoopbackBackend());
}

}  // namespace internal
}  // namespace tierkv::transport
