// The gRPC face of the master: converts wire messages to the master's
// types and back, enforces request limits, and records per-RPC metrics.
//
// Limits: a request with more than `max_batch` items is refused whole with
// RESOURCE_EXHAUSTED; per-item problems (bad keys, sizes) come back as that
// item's status, so one bad key never fails a batch.
//
// Threads: the service polls its own completion queues, one thread per
// queue, and runs each handler inline on the thread that took the request
// off the wire: no hand-off between a poller and a handler pool, which on
// a lookup costs more than the lookup (docs/performance.md). One more queue
// serves only Heartbeat and MountSegment, so client load never delays a
// daemon's heartbeat past its TTL. Long handlers (RemoveAll,
// UnmountSegment, batches of more than 1024 items) run on two slow-lane
// threads instead of a poller. A call whose deadline passed while it
// waited is answered DEADLINE_EXCEEDED without running.
//
// Auth: with an Authenticator that is enabled, every call needs a bearer
// token ("authorization" metadata) whose caller has the method's role:
// daemon for MountSegment, UnmountSegment, Heartbeat and SyncSsdRecords,
// admin for RemoveAll, client for the rest (admin may call anything). The
// role is not enough to change a segment: those four calls change only
// segments the caller's identity mounted (SegmentActor), so no
// memory-lending client can unmount, take over or wipe another's.
// Refused calls are UNAUTHENTICATED or PERMISSION_DENIED, counted as the
// method's errors, and never reach a handler.
//
// Stop waits for running handlers before it shuts the queues, so a
// shutdown during a long RemoveAll finishes it rather than aborting.
//
//   rpc::RpcMetrics metrics(master);
//   MasterRpcService rpc(master, &metrics, limits, /*threads=*/1);
//   grpc::ServerBuilder builder;
//   rpc.Register(&builder);
//   auto server = builder.BuildAndStart();
//   rpc.Start();
//   ...
//   server->Shutdown();
//   rpc.Stop();
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "base/auth.h"
#include "master/master.h"
#include "master/rpc_handlers.h"
#include "proto/master.grpc.pb.h"

namespace tierkv::master {

// The gRPC status with absl's code and message (the codes are the same).
grpc::Status ToGrpcStatus(const absl::Status& s);

// Who made a gRPC call: its verified client certificate (under mtls) or
// its bearer token, authorized for one of `roles` (admin always passes).
absl::StatusOr<auth::Identity> AuthorizeGrpcCall(const auth::Authenticator& auth, const grpc::ServerContext& ctx,
                                                 uint32_t roles, absl::string_view what);

struct ServiceLimits {
  size_t max_batch = 65536;
};

class MasterRpcService {
 public:
  // `master`, `metrics` and `auth` must outlive it; `threads` >= 1 request
  // queues (plus the heartbeat queue), each with a thread. A null `auth`
  // admits every caller.
  MasterRpcService(Master* master, rpc::RpcMetrics* metrics, ServiceLimits limits, int threads,
                   const auth::Authenticator* auth = nullptr);
  // Stops (if Start ran and Stop did not).
  ~MasterRpcService();
  MasterRpcService(const MasterRpcService&) = delete;
  MasterRpcService& operator=(const MasterRpcService&) = delete;

  // Registers the service and adds its completion queues; before
  // BuildAndStart.
  void Register(grpc::ServerBuilder* builder);
  // Starts the threads; after BuildAndStart succeeded.
  void Start();
  // Shuts the queues down and joins the threads; after the server's
  // Shutdown. Idempotent.
  void Stop();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierkv::master
