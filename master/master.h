// Master: the cluster's source of truth about where every KV block lives.
//
// It owns the segment registry, the object index, the metadata keyspace and
// the metrics, and applies liveness: Tick() unmounts segments whose
// heartbeats stopped, drops their objects, reclaims timed-out puts and
// evicts. It never carries data.
//
//   auto master = Master::Create(options, NewMemStore(), Clock::Real());
//   (*master)->Mount({{"node1:8800", "node1", 180_GB, "inc-1", "tcp://..."}});
//   auto placed = (*master)->index().PutStart({{"k", 4096}});
//
// Thread-safe. Threads are the caller's: MasterServer (master/server.h)
// runs the RPC and HTTP pools and a ticker that calls Tick().
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/container/flat_hash_map.h"
#include "base/auth.h"
#include "base/extent_grant.h"
#include "base/mutex.h"
#include "base/clock.h"
#include "base/metrics.h"
#include "master/kv_events.h"
#include "master/object_index.h"
#include "master/persistence.h"
#include "master/query_stats.h"
#include "master/reservations.h"
#include "master/replication.h"
#include "master/segment_registry.h"

namespace tierkv::master {

struct MasterOptions {
  IndexOptions index;
  absl::Duration segment_ttl = absl::Seconds(10);
  // Most puts one client may hold between PutStart and PutEnd/PutRevoke
  // (0: no cap), so one runaway writer cannot pin the cluster's memory.
  uint64_t max_pending_per_client = 65536;
  // Most puts all clients of one tenant may hold so (0: no cap): a client
  // id is the client's to choose, so the per-client cap alone is escaped
  // by rotating ids. Applied only with callers_authenticated (tenants).
  uint64_t max_pending_per_tenant = 1 << 20;
  // Most reservations (read sessions' counted leases) one client may hold
  // (0: no cap); see master/reservations.h.
  uint64_t max_reservations_per_client = 65536;
  // And all clients of one tenant (0: no cap), which rotating ids cannot escape.
  uint64_t max_reservations_per_tenant = 1 << 20;
  // What clients ask and find, and the bound on it (see QueryStats).
  QueryStatsOptions queries;
  // KV events for routers (master/kv_events.h); off while endpoint is empty.
  KvEventsOptions kv_events;
  // How long a segment whose daemon has an SSD tier keeps its SSD replicas
  // (not served) after the daemon stopped, for a restart with the same
  // tier to take them over. 0: they leave with the segment.
  absl::Duration ssd_grace = absl::Minutes(10);
  // How long a data grant admits new connections to a daemon that runs
  // --auth token (base/auth.h); connections it admitted stay.
  absl::Duration data_grant_ttl = absl::Minutes(10);
  // Whether the RPC servers check callers' tokens (--auth token): without,
  // a daemon's data grants protect nothing, which a mount then says.
  bool callers_authenticated = false;
  // The master's TLS files: its HTTP port serves TLS when they hold a
  // certificate (Stats then says so), and `ca` verifies daemons whose SSD
  // tier answers over HTTPS (the system's trust store without one).
  auth::TlsFiles tls;
  // With high availability (master/ha.h): calls are answered only while
  // the gate is open (this master holds the leader's lease), and /v1/ha
  // shows what ha_status returns (JSON). Null: a single master.
  const ServingGate* gate = nullptr;
  std::function<std::string()> ha_status;
  // This leader's epoch, in every answer that grants or mounts (0: single).
  uint64_t epoch = 0;
};

// A data grant and its session key; both empty for a segment whose daemon
// needs none.
struct DataGrantOut {
  std::string grant;
  std::string session_key;
};

// A batch of a daemon's SSD listing, or of the records its tier dropped
// (SsdRecordsRequest in proto/master.proto).
struct SsdRecords {
  std::string segment;
  std::string incarnation;
  uint64_t listing = 0;
  std::vector<std::pair<std::string, uint64_t>> present;
  bool complete = false;
  std::vector<std::string> gone;
  std::string tier_http;
  uint64_t ssd_capacity = 0;  // with tier_http, as in SegmentSpec
  uint64_t ssd_used = 0;
};
struct SsdRecordsResult {
  std::vector<std::string> unknown;  // records with no SSD replica here: the daemon erases them
  uint64_t confirmed = 0;
  uint64_t dropped = 0;
};

struct HeartbeatResult {
  std::vector<std::string> remount;
  absl::Duration ttl;
};

class Master {
 public:
  // Rebuilds the registry (segments come back RECOVERING) and the index
  // from `store`. Errors from reading the store are returned, and those of
  // binding the KV-event sockets when options.kv_events names an endpoint
  // (then AllBlocksCleared is published first and every recovered object
  // follows as BlockStored, so consumers of the new epoch see the index).
  static absl::StatusOr<std::unique_ptr<Master>> Create(MasterOptions options,
                                                        std::unique_ptr<IndexStore> store,
                                                        Clock* clock);

  // Per segment: OK, or INVALID_ARGUMENT. A re-mount with the segment's
  // incarnation keeps its objects; a new incarnation drops them, except
  // the SSD replicas when it names the same SSD tier (ssd_id): those are
  // kept, to be confirmed by the daemon's listing (SyncSsd).
  // `actor` is the caller (SegmentActor: a segment belongs to the identity
  // that mounted it); each of these four answers PERMISSION_DENIED for a
  // segment it may not change (a heartbeat: asks it to re-mount), and the
  // owner is persisted with the segment.
  std::vector<absl::Status> Mount(const std::vector<SegmentSpec>& segments, const SegmentActor& actor = {});
  // Per name: OK or NOT_FOUND. The segment's objects leave the index;
  // with keep_ssd (a daemon stopping to restart) its SSD replicas stay
  // for options.ssd_grace, unserved, and the segment turns dormant.
  std::vector<absl::Status> Unmount(const std::vector<std::string>& names, bool keep_ssd = false,
                                    const SegmentActor& actor = {});
  // A daemon's SSD listing or drops; FAILED_PRECONDITION when the segment
  // is not LIVE with that incarnation (mount first).
  absl::StatusOr<SsdRecordsResult> SyncSsd(const SsdRecords& records, const SegmentActor& actor = {});
  HeartbeatResult Heartbeat(const std::vector<SegmentSpec>& segments, const std::string& client_id,
                            const SegmentActor& actor = {});

  // The index's PutStart, with the caps on puts in flight: a PutStart
  // that would take `client` of `tenant` past max_pending_per_client, or
  // the tenant past max_pending_per_tenant, is refused whole,
  // RESOURCE_EXHAUSTED per item. Clients are counted within their tenant
  // (a client id is a name the caller chooses: another tenant's client of
  // the same name is another client). A put counts until its PutEnd or
  // PutRevoke, or until the put timeout reclaims it.
  std::vector<PutStartOut> PutStart(std::vector<PutItem> items, const std::string& client,
                                    const std::string& tenant = "");

  // OK when the master can serve puts and gets: persistence is loaded (a
  // Master exists only once Recover has finished, so this always holds
  // here) and at least one segment is LIVE. UNAVAILABLE otherwise, whose
  // message is the reason ("no segment mounted", or the recovered segments
  // still awaiting their daemons' re-mount). Cheap; for /ready.
  absl::Status Readiness() const;
  // OK while this master may answer as the leader (always, for a single
  // master); UNAVAILABLE naming kNotLeader otherwise. The RPC
  // shells check it before a handler runs and again before its reply goes.
  absl::Status Serving() const { return options_.gate == nullptr ? absl::OkStatus() : options_.gate->Check(); }
  // For an answer already decided: Serving(), or, while the gate is shut
  // with the leader waiting on etcd, OK once etcd confirms the lease before
  // `deadline` (the answer was the leader's all along).
  absl::Status ServingBy(absl::Time deadline) const {
    return options_.gate == nullptr ? absl::OkStatus() : options_.gate->AwaitOpen(deadline);
  }

  // Liveness and housekeeping; called periodically.
  void Tick();

  // The opaque metadata keyspace (the transfer engine's descriptors).
  // NOT_FOUND for a missing key. `writer` names the caller under --auth
  // token ("" without auth): a key written by a named caller is that
  // caller's, recorded beside it, and another named caller's put or delete
  // of it is PERMISSION_DENIED naming the owner unless `admin`; so one
  // daemon cannot redirect clients to itself by rewriting another's
  // descriptor. Keys written without a name have no owner.
  absl::StatusOr<std::string> GetMetadata(const std::string& key);
  absl::Status PutMetadata(const std::string& key, const std::string& value, const std::string& writer = "",
                           bool admin = false);
  absl::Status DeleteMetadata(const std::string& key, const std::string& writer = "", bool admin = false);

  // A data grant for `segment` to a caller of `tenant`; one that lets it
  // map the segment's memory when that is the tenant of the segment's
  // owner (auth::MapSessionKey). NOT_FOUND for a segment not mounted (or
  // dormant).
  absl::StatusOr<DataGrantOut> GrantData(const std::string& segment, const std::string& tenant = "");
  // Signs extent grants (base/extent_grant.h) for segment `segment_id`;
  // null when its daemon checks none (no data key) or the segment is gone.
  std::shared_ptr<const auth::ExtentMac> ExtentSigner(uint32_t segment_id);

  // A tenant's quota and guaranteed bytes (master/tenants.h; zeros clear
  // them), persisted and applied at once. `tenant` is a tenant's name or
  // kDefaultTenantName. INVALID_ARGUMENT for a bad name or a guarantee
  // above the quota; a quota below the tenant's use evicts nothing now,
  // its next puts make room.
  absl::Status SetTenantLimits(const std::string& tenant, TenantLimits limits);
  // Every tenant with limits or use.
  std::vector<TenantUsage> Tenants() const { return index_->tenants().Snapshot(); }

  // Makes everything written so far durable.
  absl::Status Flush();

  ObjectIndex& index() { return *index_; }
  // SSD replicas dropped because their daemon no longer had the record
  // (reported drops and listing sweeps).
  uint64_t ssd_replicas_dropped() const { return static_cast<uint64_t>(ssd_dropped_->Value()); }
  SegmentRegistry& registry() { return registry_; }
  metrics::Registry& metrics() { return metrics_; }
  // Pages each client asked about and found (PrefixMatch, Exists, GetReplicas).
  QueryStats& queries() { return *queries_; }
  // Reservations per client, and reads short of them.
  Reservations& reservations() { return reservations_; }
  // The KV-event publisher; null when options.kv_events.endpoint is empty.
  KvEventPublisher* kv_events() { return kv_events_.get(); }
  const MasterOptions& options() const { return options_; }
  Clock* clock() const { return clock_; }
  uint64_t clients_seen() const;
  // The port the master's HTTP server bound (0 until it has), reported by
  // Stats so clients told only the RPC address find the metadata server.
  void set_http_port(int port) { http_port_.store(port, std::memory_order_relaxed); }
  int http_port() const { return http_port_.load(std::memory_order_relaxed); }
  // Changes whenever segments leave (and differs between master starts):
  // GetReplicas answers carry it, so a client that remembers replicas
  // (its replica cache) forgets them once a segment they may name is gone.
  uint64_t membership() const { return membership_.load(std::memory_order_acquire); }

 private:
  Master(MasterOptions options, std::unique_ptr<IndexStore> store, Clock* clock);
  absl::Status Recover();
  void DropSegmentIds(const std::vector<uint32_t>& ids, absl::string_view why, bool expected,
                      const absl::flat_hash_map<uint32_t, uint32_t>& keep_ssd = {});
  void RegisterMetrics();

  const MasterOptions options_;
  Clock* const clock_;
  // ExtentSigner's, by data key (a key's AES schedule is set up once).
  Mutex signers_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const auth::ExtentMac>> signers_ ABSL_GUARDED_BY(signers_mu_);
  std::unique_ptr<IndexStore> store_;
  SegmentRegistry registry_;
  std::unique_ptr<ObjectIndex> index_;
  metrics::Registry metrics_;
  // Declared after metrics_ (its counters live there) and destroyed before
  // it; the index only calls it from requests and Tick, which have stopped
  // by the time a Master is destroyed.
  std::unique_ptr<KvEventPublisher> kv_events_;
  std::unique_ptr<QueryStats> queries_;
  // The tenant cap only with authentication (see PutStart).
  Reservations reservations_{options_.max_reservations_per_client,
                             options_.callers_authenticated ? options_.max_reservations_per_tenant : 0};
  metrics::Counter* segments_dropped_ = nullptr;
  // Drawn at each start, so a restarted master does not repeat its
  // predecessor's values; bumped before the index drops a segment's replicas.
  std::atomic<uint64_t> membership_{(uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()};
  mutable Mutex clients_mu_;
  absl::flat_hash_map<std::string, absl::Time> clients_ ABSL_GUARDED_BY(clients_mu_);
  metrics::Counter* pending_refused_ = nullptr;
  // SSD listings in progress, by segment name: the keys confirmed so far.
  struct SsdListing {
    uint32_t id = 0;
    uint64_t listing = 0;
    bool done = false;  // complete: later batches of it are repeats
    absl::flat_hash_set<std::string> confirmed;
  };
  Mutex ssd_mu_;
  absl::flat_hash_map<std::string, SsdListing> listings_ ABSL_GUARDED_BY(ssd_mu_);
  metrics::Counter* ssd_confirmed_ = nullptr;
  metrics::Counter* ssd_dropped_ = nullptr;
  // Serializes metadata writes, so an owner check and the write it guards
  // are one step.
  Mutex metadata_mu_;
  std::atomic<int> http_port_{0};
};

}  // namespace tierkv::master
