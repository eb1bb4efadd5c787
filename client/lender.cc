#include "client/lender.h"

#include <random>

#include "absl/strings/str_format.h"
#include "base/failpoint.h"
#include "base/log.h"
#include "base/status.h"

namespace tierkv::client {

std::string RandomId() {
  std::random_device rd;
  std::mt19937_64 rng((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ absl::ToUnixNanos(absl::Now()));
  return absl::StrFormat("%016x%016x", rng(), rng());
}

SegmentLender::SegmentLender(LenderOptions options, transport::TransferEngine* engine,
                             MasterClient* master)
    : options_(std::move(options)), engine_(engine), master_(master), incarnation_(RandomId()) {}

absl::StatusOr<std::unique_ptr<SegmentLender>> SegmentLender::Start(
    LenderOptions options, transport::TransferEngine* engine, MasterClient* master) {
  if (options.name.empty()) return absl::InvalidArgumentError("a lent segment needs a name");
  std::unique_ptr<SegmentLender> l(new SegmentLender(std::move(options), engine, master));
  const LenderOptions& o = l->options_;
  ASSIGN_OR_RETURN(l->region_, transport::SharedRegion::Create(
                                   o.size, {.prefault = o.prefault,
                                            .hugepages = o.hugepages,
                                            .mlock = o.mlock,
                                            .numa_node = o.numa_node,
                                            .prefault_threads = o.prefault_threads}));
  RETURN_IF_ERROR(engine->RegisterMemory(l->region_->data(), l->region_->size(),
                                         l->region_->location(), l->region_->fd()));
  // A metadata server that is down now is retried by every mount.
  absl::Status served = engine->ServeSegment(l->options_.name, {l->region_->data()});
  if (!served.ok() && !absl::IsUnavailable(served)) return served;
  if (l->options_.wait_for_mount) RETURN_IF_ERROR(l->MountOnce());
  l->thread_ = std::thread([raw = l.get()] { raw->Loop(); });
  return l;
}

SegmentLender::~SegmentLender() { Stop(); }

v1::Segment SegmentLender::Spec() const {
  v1::Segment s;
  s.set_name(options_.name);
  s.set_host(options_.host);
  s.set_capacity(region_->size());
  s.set_incarnation(incarnation_);
  s.set_endpoint(absl::StrFormat("tcp port %d", engine_->port()));
  // The master issues data grants with it (a daemon running --auth token).
  if (absl::StatusOr<std::string> key = engine_->SegmentDataKey(options_.name); key.ok()) s.set_data_key(*key);
  if (options_.describe_tier) options_.describe_tier(&s);
  return s;
}

absl::Status SegmentLender::MountOnce() {
  // Publish first: a master restarted without persistence has lost the
  // descriptor, and peers must find it before they are sent here.
  absl::Status s = engine_->Publish(options_.name);
  if (s.ok()) s = master_->Mount(Spec());
  // From the mount on, a tcp write granted by an older master is refused.
  if (s.ok()) engine_->ObserveEpoch(master_->epoch());
  {
    MutexLock lock(&error_mu_);
    last_error_ = s.ok() ? "" : s.ToString();
  }
  if (s.ok()) {
    if (!mounted_.exchange(true)) {
      TKV_LOG(INFO) << "segment " << options_.name << " mounted at " << master_->address();
    }
    mounts_.fetch_add(1);
    if (options_.on_mounted) options_.on_mounted();
  }
  return s;
}

void SegmentLender::Loop() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.Unlock();
    if (!mounted_.load()) {
      absl::Status s = MountOnce();
      if (!s.ok()) {
        failures_.fetch_add(1);
        TKV_LOG(WARNING) << "mounting " << options_.name << ": " << s;
      }
    } else {
      absl::StatusOr<std::vector<std::string>> remount =
          TIERKV_FAILPOINT("store.heartbeat")
              ? absl::StatusOr<std::vector<std::string>>(absl::UnavailableError("failpoint store.heartbeat"))
              : master_->Heartbeat({Spec()}, options_.name);
      if (!remount.ok()) {
        failures_.fetch_add(1);
        {
          MutexLock lock(&error_mu_);
          last_error_ = remount.status().ToString();
        }
        if (mounted_.exchange(false)) {
          TKV_LOG(WARNING) << "master unreachable, segment " << options_.name
                           << " not ready: " << remount.status();
        }
      } else if (engine_->ObserveEpoch(master_->epoch()); !remount->empty()) {
        TKV_LOG(WARNING) << "master asked to mount " << options_.name << " again";
        mounted_.store(false);
        if (absl::Status s = MountOnce(); !s.ok()) failures_.fetch_add(1);
      }
    }
    mu_.Lock();
    if (stopping_) break;
    cv_.WaitFor(&mu_, absl::ToChronoMilliseconds(options_.heartbeat_interval));
  }
}

void SegmentLender::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.SignalAll();
  if (thread_.joinable()) thread_.join();
  if (mounted_.exchange(false)) {
    if (absl::Status s = master_->Unmount(options_.name, options_.keep_ssd_on_stop); !s.ok()) {
      TKV_LOG(WARNING) << "unmounting " << options_.name << ": " << s;
    }
  }
  if (region_) {
    (void)engine_->StopServing(options_.name);
    (void)engine_->UnregisterMemory(region_->data());
  }
}

}  // namespace tierkv::client
