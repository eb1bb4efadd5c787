// SegmentLender: lends a block of this process's DRAM to the cluster as a
// segment. Used by store daemons (their whole job) and by clients that
// keep their own KV local (a prefill rank).
//
// Start creates the memory (a SharedRegion: refused at once when the host
// cannot back it; faulted in lazily unless prefault or mlock asks; bound
// to a NUMA node if one is named), registers it with the transfer engine
// at the node it is on ("cpu:<node>"), serves and publishes it, and starts a heartbeat thread
// that mounts it at the master, heartbeats every interval, and mounts it
// again whenever the master asks (after a master restart, or after the
// segment was dropped for missed heartbeats). mounted() is false before the
// first mount and while the master cannot be reached.
//
// Threads: one heartbeat thread. Thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "client/master_client.h"
#include "base/mutex.h"
#include "transport/engine.h"
#include "transport/memory.h"

namespace tierkv::client {

struct LenderOptions {
  std::string name;     // segment name, unique in the cluster
  std::string host;     // host identity for replica spreading
  uint64_t size = 0;
  bool prefault = false;
  int prefault_threads = 0;  // 0: one per CPU
  bool hugepages = false;
  bool mlock = false;
  int numa_node = -1;        // -1: wherever the kernel puts it
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // Block in Start until the first mount succeeds (or fails).
  bool wait_for_mount = false;
  // Fills the lending process's tier fields of the segment (tier_http,
  // ssd_capacity, ssd_used) before each mount and heartbeat; called on
  // the heartbeat thread. Empty: the segment has no tier.
  std::function<void(v1::Segment*)> describe_tier;
  // Called on the heartbeat thread after each successful mount (first and
  // re-mounts); must not block.
  std::function<void()> on_mounted;
  // Stop unmounts with keep_ssd (the lending daemon restarts with its SSD
  // tier; the master keeps that tier's replicas for its grace).
  bool keep_ssd_on_stop = false;
};

class SegmentLender {
 public:
  // `engine` and `master` must outlive the lender. Errors: the memory
  // cannot be had (RESOURCE_EXHAUSTED), mlock refused (FAILED_PRECONDITION),
  // a NUMA node the kernel refuses (INVALID_ARGUMENT), the name is taken
  // locally; with
  // wait_for_mount, the first mount's error.
  static absl::StatusOr<std::unique_ptr<SegmentLender>> Start(LenderOptions options,
                                                              transport::TransferEngine* engine,
                                                              MasterClient* master);
  ~SegmentLender();

  // Unmounts at the master (best effort), stops serving, joins the
  // heartbeat thread. Idempotent.
  void Stop();

  bool mounted() const { return mounted_.load(); }
  uint64_t mounts() const { return mounts_.load(); }
  uint64_t heartbeat_failures() const { return failures_.load(); }
  // Why the last mount or heartbeat failed ("" once one succeeds): what an
  // operator needs when a daemon never gets ready (a refused token, say).
  std::string last_error() const {
    MutexLock lock(&error_mu_);
    return last_error_;
  }
  const std::string& name() const { return options_.name; }
  const std::string& incarnation() const { return incarnation_; }
  char* data() const { return region_->data(); }
  uint64_t size() const { return region_->size(); }
  // Where the segment's memory is, as its descriptor says ("cpu:1").
  std::string location() const { return region_->location(); }

 private:
  SegmentLender(LenderOptions options, transport::TransferEngine* engine, MasterClient* master);
  absl::Status MountOnce();
  void Loop();
  v1::Segment Spec() const;

  const LenderOptions options_;
  transport::TransferEngine* const engine_;
  MasterClient* const master_;
  std::string incarnation_;
  std::unique_ptr<transport::SharedRegion> region_;
  std::atomic<bool> mounted_{false};
  std::atomic<uint64_t> mounts_{0}, failures_{0};
  Mutex mu_;
  CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  mutable Mutex error_mu_;
  std::string last_error_ ABSL_GUARDED_BY(error_mu_);
  std::thread thread_;
};

// 32 random hex characters.
std::string RandomId();

}  // namespace tierkv::client
