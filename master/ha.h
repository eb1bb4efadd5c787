// HaNode: a master in a high-availability group (--etcd); docs/ha.md.
//
// Every master of a --cluster-id holds an etcd lease, renewed every
// sixth of its TTL, and publishes where its copy of the store stands
// under /tierkv/<cluster>/members/<advertise>. The leader is the master
// that created /tierkv/<cluster>/leader (a transaction on "does not
// exist", bound to its lease); its epoch is that key's create revision.
//
// A standby copies the leader's store (StandbyCopier) and serves no call:
// it holds the RPC port and answers every call on it, direct or gRPC,
// UNAVAILABLE "not the leader", naming the leader it follows (a caller
// with several masters goes on to the next at once); its HTTP port serves
// /v1/ha (its role, epoch, leader and copy) and the probes. The RPC
// listener is handed to the server it starts when elected, so the port
// stays open across the promotion. With TLS (--tls-cert) both ports
// serve TLS, and the RPC port is closed and bound again by the leader's
// server when elected (a TLS port has no direct lane, so nothing is
// handed over).
// When the leader key is gone it campaigns, but only with a complete copy
// (or in a cluster that never had a leader) and when no live member has
// published a copy further along; a member waits a round after the key
// went, so the others' last positions are in. A leader about to
// acknowledge a write no standby has (no standby, or none answering:
// ReplicationLog's degraded mode) first puts /tierkv/<cluster>/ahead = its
// address, and deletes it once a standby has caught up (only while it is
// still the mark that put made, by its etcd mod revision; after a mark call
// etcd did not answer, the mark is made again before the next such write);
// while it is there only that master may lead next, and only from a
// complete copy, so a standby never takes over without writes that were
// acknowledged. A standby that finds the leader key naming itself deletes
// it and campaigns. The winner records /tierkv/<cluster>/initialized (or
// gives up the takeover) before it serves, then opens a
// MasterServer on its copy, which is the restart path: segments come back
// RECOVERING until their daemons re-mount with the same incarnation. It
// serves only while its lease is surely alive: until the send time of the
// last answered keepalive plus the TTL etcd gave, less a third of the TTL.
// A leader whose gate closed refuses every call but keeps its key while
// it waits for etcd (a raft election among etcd's members leaves
// keepalives unanswered for a second or more): a keepalive answered for
// the same lease proves the key never expired, and the gate opens again at
// the same epoch. A leader whose lease expired, whose key is gone, or
// that etcd has not answered for a TTL past the lease's end shuts its
// server and rejoins as a standby, whose copy the new leader's snapshot
// replaces.
//
// Thread-safe.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "config/master_config.h"
#include "proto/etcd_client.h"
#include "master/replication.h"
#include "master/server.h"

namespace tierkv::master {

class StandbyFront;

class HaNode {
 public:
  // Checks the flags, opens the store and starts campaigning or copying;
  // does not wait for etcd. INVALID_ARGUMENT for bad --etcd/--advertise,
  // store errors as OpenRocksDbStore gives them.
  static absl::StatusOr<std::unique_ptr<HaNode>> Start(const MasterConfig& config, Clock* clock = Clock::Real());
  ~HaNode();

  // Stops serving (a leader deletes its key, so a standby takes over at
  // once) and stops copying. Idempotent.
  void Stop();
  // Re-reads --token-file on the serving server, if any.
  absl::Status ReloadAuth();

  struct View {
    std::string role;  // leader | standby
    uint64_t epoch = 0;
    std::string leader;
    int rpc_port = 0;       // the server's while leader, else 0
    int http_port = 0;
  };
  View view();
  // The leader's /v1/ha answer (JSON).
  std::string StatusJson();

 private:
  explicit HaNode(const MasterConfig& config, Clock* clock);
  void LeaseLoop();
  void RoleLoop();
  // One round of each role.
  void LeaderRound();
  void StandbyRound();
  bool Eligible(const ReplPosition& mine);
  // `had_copy`: the campaign counted on a complete copy.
  void Promote(int64_t epoch, int64_t lease, bool had_copy);
  void Depose(absl::string_view why);
  absl::Status OpenStandby();
  // Binds the ports and answers on them as a standby (no-op with TLS);
  // logs and leaves it for the next round when a port is busy.
  void OpenFront();
  std::string Key(absl::string_view name) const;

  const MasterConfig config_;
  Clock* const clock_;
  const std::string self_;
  const absl::Duration ttl_;
  std::unique_ptr<EtcdClient> etcd_;
  ServingGate gate_;

  Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t leader_lease_ ABSL_GUARDED_BY(mu_) = 0;  // the leader key's, while leader
  // Until when the lease is surely alive (steady clock).
  std::chrono::steady_clock::time_point lease_until_ ABSL_GUARDED_BY(mu_);
  bool leader_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::string leader_address_ ABSL_GUARDED_BY(mu_);
  int rpc_port_ ABSL_GUARDED_BY(mu_) = 0;
  int http_port_ ABSL_GUARDED_BY(mu_) = 0;
  // A standby's copy as of its last round (for /v1/ha, read off the role
  // thread).
  ReplPosition copy_ ABSL_GUARDED_BY(mu_);
  // Batches the copier took from replication streams (the rest were pulled).
  uint64_t copy_streamed_ ABSL_GUARDED_BY(mu_) = 0;

  // Owned by the role thread (and Stop, once it has joined).
  std::unique_ptr<IndexStore> store_;  // a standby's; the server holds it while leader
  std::unique_ptr<StandbyCopier> copier_;
  std::unique_ptr<ReplicationLog> log_;
  std::unique_ptr<MasterServer> server_;
  std::unique_ptr<StandbyFront> front_;  // while a standby
  absl::Time leader_gone_since_ = absl::InfiniteFuture();
  absl::Time last_key_check_ = absl::InfinitePast();
  bool said_no_copy_ = false;
  bool said_ahead_ = false;
  bool said_no_front_ = false;
  // The mod revision of the "ahead" mark naming this master that its last
  // campaign counted on (Eligible), or 0: the log of its term starts marked.
  int64_t own_ahead_revision_ = 0;
  // A leader whose gate closed, waiting for etcd to confirm its lease.
  bool holding_ = false;
  std::chrono::steady_clock::time_point held_since_;

  std::thread lease_thread_;
  std::thread role_thread_;
};

}  // namespace tierkv::master
