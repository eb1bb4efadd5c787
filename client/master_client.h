// MasterClient: the typed, deadline-bound client of the master, used by
// the client library, store daemons and tools.
//
// Puts, lookups, removes and stats travel on the master's direct lane
// (client/internal/direct_channel.h) when `direct` is on and the master
// has one; the rest, and every call the lane cannot carry (no connection,
// a master without it), go over gRPC, on the same host:port.
//
// Every call has a deadline (rpc_timeout). Idempotent calls (lookups,
// heartbeats, mounts, stats) are retried with backoff on UNAVAILABLE
// within that budget; puts and removes are not. Statuses come back as
// absl::Status with the master's address and the method in the message.
//
// Several masters (high availability, docs/ha.md): `address` may list
// them, "h1:p1,h2:p2". Calls go to the one that answered last. One that
// cannot be reached, or answers that it is not the leader, is left for the
// next in the list within the same deadline: every call when the call
// never reached a master or was refused unrun, idempotent calls on any
// UNAVAILABLE.
//
// Thread-safe.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/internal/direct_channel.h"
#include "base/auth.h"
#include "base/mutex.h"
#include "proto/direct_frame.h"
#include "proto/master.grpc.pb.h"

namespace tierkv::client {

struct MasterClientOptions {
  absl::Duration rpc_timeout = absl::Seconds(5);
  int max_message_size = 64 << 20;
  // Sent with puts so the master can cap this client's puts in flight.
  std::string client_id;
  // Use the master's direct lane where it has one (off: gRPC only).
  bool direct = true;
  // How long a direct call busy-polls for its reply before sleeping in the
  // kernel (see BackendOptions::reply_spin); 0 never spins.
  absl::Duration reply_spin = absl::Microseconds(50);
  // A bearer token for a master running --auth token (base/auth.h),
  // sent with every call; empty: none.
  std::string token;
  // TLS to a master serving gRPC with --tls-cert (base/auth.h):
  // `tls.ca` verifies it, tls.cert/tls.key are ours for one that requires
  // them. With TLS the direct lane is off (it is plain TCP). Empty: plain.
  auth::TlsFiles tls;
};

class MasterClient {
 public:
  // `address`: host:port, a list "h1:p1,h2:p2" of masters (the calls
  // follow the leader among them, docs/ha.md), a gRPC target URI, or
  // "etcd://h:p[,h:p]/<cluster>": the masters of that cluster as etcd
  // names them when this runs (the leader first). INVALID_ARGUMENT for an
  // address of none of these forms; for etcd://, UNAVAILABLE or NOT_FOUND
  // when etcd cannot say (ResolveEtcdMasters). Does not wait for a
  // master: the first call does.
  static absl::StatusOr<std::unique_ptr<MasterClient>> Create(const std::string& address,
                                                              MasterClientOptions options = {});

  absl::Status Mount(const v1::Segment& segment);
  // keep_ssd: the daemon stops to restart (UnmountSegmentRequest).
  absl::Status Unmount(const std::string& name, bool keep_ssd = false);
  // A daemon's SSD listing or drops; the reply's status is FAILED_PRECONDITION
  // when the segment must be mounted again first.
  absl::StatusOr<v1::SsdRecordsResponse> SyncSsdRecords(const v1::SsdRecordsRequest& request);
  // The segments the master wants mounted again.
  absl::StatusOr<std::vector<std::string>> Heartbeat(const std::vector<v1::Segment>& segments,
                                                     const std::string& client_id);
  absl::StatusOr<v1::PutStartResponse> PutStart(const v1::PutStartRequest& request);
  absl::StatusOr<v1::KeysResponse> PutEnd(const std::vector<std::string>& keys);
  absl::StatusOr<v1::KeysResponse> PutRevoke(const std::vector<std::string>& keys);
  // `counted`: KeysRequest.counted (every read comes with a lease token).
  absl::StatusOr<v1::GetReplicasResponse> GetReplicas(const std::vector<std::string>& keys, bool counted = false);
  // Sends the queued lease give-backs now (an Exists of no keys), for a
  // reader whose reservation must end at once; OK when none is queued.
  absl::Status FlushReleases();
  absl::StatusOr<std::vector<bool>> Exists(const std::vector<std::string>& keys);
  absl::StatusOr<uint32_t> PrefixMatch(const std::vector<std::string>& keys);
  absl::StatusOr<v1::KeysResponse> Remove(const std::vector<std::string>& keys, bool force);
  // How many objects were removed; leased ones stay unless `force`.
  absl::StatusOr<uint64_t> RemoveAll(bool force);
  absl::StatusOr<v1::StatsResponse> Stats();
  // A data grant for `segment`, whose daemon runs --auth token (empty
  // grant: it needs none); NOT_FOUND for a segment not mounted.
  absl::StatusOr<v1::DataGrant> GrantData(const std::string& segment,
                                          absl::Time deadline = absl::InfiniteFuture());

  // Queues a counted read lease to give back (GetReplicasResponse.lease_tokens:
  // the key, its token and the lease_expiry_unix_ms it came with). It rides
  // on this client's next PutStart, PutEnd, PutRevoke, GetReplicas, Exists
  // or PrefixMatch, so giving it back costs no call of its own; one the
  // master never gets simply runs out. At most kMaxQueuedReleases wait.
  void ReleaseLease(std::string key, uint64_t token, int64_t expiry_unix_ms);
  static constexpr size_t kMaxQueuedReleases = 65536;
  // At most this many ride on one request (the rest wait for the next), so
  // they keep it far under the master's message size limit.
  static constexpr size_t kMaxReleasesPerCall = 2048;
  // Queues a read this client served from its replica cache, so the
  // master counts it (hit rates, eviction order) as if asked. It rides on
  // the next call as releases do; at most kMaxQueuedReleases wait (the
  // oldest go uncounted), kMaxReleasesPerCall per call.
  void NoteCachedRead(std::string key);
  // Queues `n` reads a read session found short of what its start promised
  // (KeysRequest.shortfalls); they ride on the next call as releases do.
  void NoteShortfalls(uint32_t n);

  const std::string& address() const { return address_; }
  // The masters this client calls, host:port each: those its address
  // names (an etcd:// address resolved), then any learned since: a leader
  // a standby named in its refusal, or, with etcd://, a master registered
  // later (read again, at most once a second, when every master known
  // failed a call). At most kMaxMasters.
  static constexpr size_t kMaxMasters = 16;
  std::vector<std::string> masters() const;
  // The highest master epoch any answer carried (docs/ha.md; 0 from a
  // single master). An answer with a lower one (a deposed master's) is
  // taken as UNAVAILABLE, not leader, and the call goes on to the next
  // master.
  uint64_t epoch() const { return epoch_.load(std::memory_order_relaxed); }

 private:
  struct Release {
    std::string key;
    uint64_t token;
    int64_t expiry_ms;
  };
  // Moves the queued releases and cached reads into `req` (KeysRequest,
  // PutStartRequest).
  template <class Req>
  void AttachReleases(Req* req);
  v1::KeysRequest KeysWithReleases(const std::vector<std::string>& keys);

  // One master of the list.
  struct Endpoint {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Master::Stub> stub;
    std::unique_ptr<internal::DirectChannel> direct;  // null when options_.direct is off
  };
  MasterClient(std::string address, MasterClientOptions options, std::shared_ptr<grpc::ChannelCredentials> creds,
               grpc::ChannelArguments args);
  std::unique_ptr<Endpoint> MakeEndpoint(const std::string& address) const;
  // The endpoint of `address`, added when new and there is room; nullopt
  // when there is none.
  std::optional<size_t> EndpointFor(const std::string& address);
  // With an etcd:// address: the cluster's masters read again (at most once
  // a second), new ones added.
  void Reresolve();
  // `direct`: the method's direct id, or 0 for gRPC only.
  template <class Req, class Resp, class Call>
  // `deadline`: the call's, when sooner than rpc_timeout from now.
  absl::Status Invoke(const char* method, direct::DirectMethod direct, const Req& req, Resp* resp,
                      bool idempotent, Call call, absl::Time deadline = absl::InfiniteFuture());

  std::string address_;
  MasterClientOptions options_;
  const bool etcd_;  // address_ is etcd://: the masters may change
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  const grpc::ChannelArguments args_;
  // Calls read the first count_ endpoints without a lock: one is never
  // moved or removed once made; new ones are appended under add_mu_.
  std::array<std::unique_ptr<Endpoint>, kMaxMasters> endpoints_;
  std::atomic<size_t> count_{0};
  Mutex add_mu_;
  Mutex resolve_mu_;
  absl::Time resolved_ ABSL_GUARDED_BY(resolve_mu_) = absl::InfinitePast();
  std::atomic<size_t> current_{0};  // the endpoint that answered last
  std::atomic<uint64_t> epoch_{0};
  // OK for an answer whose epoch (if it has one) is not below epoch_,
  // which it raises; UNAVAILABLE naming kNotLeader otherwise.
  template <class Resp>
  absl::Status Fresh(const Resp& resp);
  Mutex release_mu_;
  std::deque<Release> releases_ ABSL_GUARDED_BY(release_mu_);
  std::deque<std::string> cached_reads_ ABSL_GUARDED_BY(release_mu_);
  uint32_t shortfalls_ ABSL_GUARDED_BY(release_mu_) = 0;
};

// An ItemStatus from the wire as an absl::Status.
absl::Status FromItem(const v1::ItemStatus& s);

}  // namespace tierkv::client
