// StoreDaemon: tierkv-store as an object. It lends a DRAM segment through
// a SegmentLender (allocate lazily, register, serve, mount, heartbeat,
// re-mount) and answers HTTP /ready, /health and /metrics.
//
// /ready is 200 only while the segment is mounted at the master: 503 before
// the first mount and while the master cannot be reached. The HTTP port
// opens only after the segment exists (reserved, and with --prefault or
// --mlock faulted in and locked), so a launcher gated on /ready never
// sees a daemon whose memory is still a promise.
//
// With --ssd-dir the daemon also keeps an SSD tier (store/ssd_tier.h): at
// start it reserves the file and scans its group blocks, so records a
// previous run left are found again. A tier that cannot be had for reasons
// of the disk (no room, an I/O error in the scan) or that fails later is
// reported, not fatal: the daemon serves its DRAM segment regardless, and
// /health and /metrics say why the tier is down.
//
// The tier's file is named by a random id kept in --ssd-dir, sent with
// every mount (Segment.ssd_id): a restarted daemon with the same file gets
// back the SSD replicas the master kept for it. After each mount it lists
// its records to the master (SyncSsdRecords, in batches, on its own
// thread) and erases the records the master names unknown; between
// listings it reports the records the tier drops on its own. A graceful
// Stop unmounts with keep_ssd, so a rolling restart keeps the cache.
//
// Threads: the transfer engine's (tcp server, workers), the lender's
// heartbeat thread, the SSD sync thread (with a tier), and cpp-httplib's
// pool for HTTP; prefault threads run
// inside Start. With --numa-node all of them are created pinned to that
// node's CPUs (the caller's own affinity is restored before Start
// returns). Stop() unmounts, stops serving and joins everything.
#pragma once

#include <atomic>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/lender.h"
#include "client/master_client.h"
#include "base/http_server.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "config/store_config.h"
#include "store/ssd_tier.h"
#include "transport/engine.h"


namespace tierkv::store {

// An object's bytes at `offset` of this daemon's DRAM segment (`length`
// bytes: the value and its trailer, as the master's extent says), moving
// between the segment and the SSD tier under `key`.
struct TierMove {
  std::string key;
  uint64_t offset = 0;
  uint64_t length = 0;
};

class StoreDaemon {
 public:
  // Starts serving at once; mounting happens in the background.
  // INVALID_ARGUMENT for unusable flags (bad master address, metadata URL,
  // transport name, a NUMA node this host lacks); RESOURCE_EXHAUSTED if the
  // memory cannot be had (more than the host or cgroup can back);
  // FAILED_PRECONDITION if --mlock is refused (RLIMIT_MEMLOCK); UNAVAILABLE
  // if a port cannot be bound. Messages name the flag.
  static absl::StatusOr<std::unique_ptr<StoreDaemon>> Start(const StoreConfig& config);
  ~StoreDaemon();

  int port() const { return engine_->port(); }
  int http_port() const { return http_port_; }
  // Mounted, and (with an SSD tier that works) the tier's records listed
  // to the master since that mount: until then the master sends no
  // offloads, so an eviction would drop what it could have kept.
  bool ready() const {
    return lender_->mounted() && (ssd_ == nullptr || ssd_->failed() ||
                                  listed_mount_.load(std::memory_order_acquire) == lender_->mounts());
  }
  const std::string& segment() const { return lender_->name(); }
  // The served segment's data key ("" without --auth): an embedding
  // process (a benchmark) that writes raw extents signs their extent
  // grants with it, as the master does.
  std::string SegmentDataKey() const { return engine_->SegmentDataKey(lender_->name()).value_or(""); }
  // Where the segment's memory is ("cpu:0"), as its descriptor says.
  std::string location() const { return lender_->location(); }
  // The SSD tier; null without --ssd-dir or when it could not be opened.
  SsdTier* ssd() const { return ssd_.get(); }
  // The daemon's halves of moving objects between its tiers. Offload
  // copies each extent of the segment to the SSD tier as a record of its
  // key (one batch); Stage reads each key's record back into the segment
  // at the extent given (one batch), where the normal transfer path serves
  // it, so an SSD hit is staged into registered memory and then read like
  // any replica. Per item: INVALID_ARGUMENT for an extent outside the
  // segment, OUT_OF_RANGE when a record does not fit its extent (Stage),
  // UNAVAILABLE without a working tier, and SsdTier's statuses otherwise.
  // The master orders offloads at eviction (POST /tier/offload) and a
  // reader stages an SSD hit into the staging extent the master gave it
  // (POST /tier/stage), each a v1::TierMoveRequest answered by a
  // v1::TierMoveResponse; the daemon's heartbeat names that HTTP address
  // and the tier's capacity and use (Segment.tier_http, ssd_*) once the
  // tier is up.
  std::vector<absl::Status> OffloadToSsd(const std::vector<TierMove>& moves);
  // `deadline`: Stage writes no extent after it (the reader's lease).
  std::vector<absl::StatusOr<uint64_t>> StageFromSsd(
      const std::vector<TierMove>& moves,
      std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max());
  // One line on the SSD tier: "off", "ok ..." or "failed: <why>".
  std::string SsdHealth() const;
  // The id naming the tier's file ("" without a working tier).
  const std::string& ssd_id() const { return ssd_id_; }
  // Complete SSD listings the master has taken since start.
  uint64_t ssd_listings() const { return listings_done_.load(); }
  void Stop();

 private:
  StoreDaemon() = default;
  void RegisterMetrics();
  void RegisterSsdMetrics();
  // Fills the segment's tier fields for the heartbeat (LenderOptions::describe_tier).
  void DescribeTier(v1::Segment* s) const;
  // Sets the tier's ssd_capacity and ssd_used on a Segment or a listing.
  template <class Message>
  void TierSize(Message* m) const;
  // Serves POST /tier/offload and /tier/stage.
  void ServeTierMove(const httplib::Request& req, httplib::Response& res, bool offload);
  // Opens --ssd-dir's tier. Errors only for what the operator must fix (a
  // directory that cannot be made or opened); a disk that fails leaves
  // ssd_ null and ssd_failure_ saying why.
  absl::Status OpenSsd(const StoreConfig& config);
  // The SSD sync thread: a listing after each mount, drops in between.
  void SyncLoop();
  // Sends every record in batches; false when the master did not take it all.
  bool SendListing();
  // False when it should be sent again (the master is unreachable).
  bool SendGone(const std::vector<std::string>& gone);
  void OnSsdDrop(const std::string& key);

  std::unique_ptr<client::MasterClient> master_;
  std::unique_ptr<transport::TransferEngine> engine_;
  std::unique_ptr<client::SegmentLender> lender_;
  bool ssd_configured_ = false;
  std::unique_ptr<SsdTier> ssd_;
  std::string ssd_failure_;  // why the tier could not be opened
  metrics::Registry metrics_;
  std::unique_ptr<HttpServer> http_;
  int http_port_ = 0;
  std::string tier_http_;              // set before tier_ready_
  std::atomic<bool> tier_ready_{false};  // the heartbeat may name the tier
  std::string ssd_id_;
  Mutex sync_mu_;
  CondVar sync_cv_;
  bool list_pending_ ABSL_GUARDED_BY(sync_mu_) = false;
  bool sync_stop_ ABSL_GUARDED_BY(sync_mu_) = false;
  std::vector<std::string> gone_ ABSL_GUARDED_BY(sync_mu_);
  uint64_t listing_seq_ = 0;  // sync thread only
  std::atomic<uint64_t> listings_done_{0};
  // The lender's mount count the last listing the master took was for:
  // ready() wants the latest mount's.
  std::atomic<uint64_t> listed_mount_{0};
  std::thread sync_thread_;
  bool stopped_ = false;
};

}  // namespace tierkv::store
