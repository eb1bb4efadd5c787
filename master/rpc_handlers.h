// The master's RPC semantics on wire messages, without gRPC: the gRPC
// service (grpc_service.cc) and the direct lane (direct_lane.cc) are shells
// that check limits, record metrics and call these; the fuzz targets call
// them directly with parsed bytes.
//
// Each handler fills `resp` from `req` and never fails whole: per-item
// problems come back as that item's status. PutStart's `client` names the
// caller for the per-client cap: the request's client_id, else the
// connection's peer. `tenant` is the caller's tenant, from its credential
// ("" for the default tenant): every key a request names is taken in its
// namespace (master/tenants.h), and statuses name keys as the caller does.
#pragma once

#include <string>

#include "base/metrics.h"
#include "master/master.h"
#include "proto/master.pb.h"

namespace tierkv::master::rpc {

// One method's series in the per-method RPC metrics.
struct MethodStats {
  metrics::Counter* calls;
  metrics::Counter* errors;
  metrics::Counter* items;
  metrics::Histogram* latency;
};

// The tierkv_master_rpc_* families, registered once per master, which
// both of its faces record into: a method's series count its calls over
// gRPC and direct alike.
class RpcMetrics {
 public:
  explicit RpcMetrics(Master* master);
  // The series labelled method=`name`; the same ones on every call.
  MethodStats For(const char* name);

 private:
  metrics::Family<metrics::Counter>& calls_;
  metrics::Family<metrics::Counter>& errors_;
  metrics::Family<metrics::Counter>& items_;
  metrics::Family<metrics::Histogram>& latency_;
};

// Who made a call, from its credential: its tenant ("" : the default
// tenant) and, for the segment-control calls, its identity.
struct Caller {
  std::string tenant;
  SegmentActor actor;  // the default: unauthenticated, may change any segment
};

// Segment control: `actor` may change only the segments it owns (an admin
// any), SegmentActor.
void MountSegment(Master* m, const v1::MountSegmentRequest& req, const SegmentActor& actor,
                  v1::MountSegmentResponse* resp);
void UnmountSegment(Master* m, const v1::UnmountSegmentRequest& req, const SegmentActor& actor,
                    v1::UnmountSegmentResponse* resp);
void Heartbeat(Master* m, const v1::HeartbeatRequest& req, const SegmentActor& actor, v1::HeartbeatResponse* resp);
void PutStart(Master* m, const v1::PutStartRequest& req, const std::string& client, const std::string& tenant,
              v1::PutStartResponse* resp);
void PutEnd(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::KeysResponse* resp);
void PutRevoke(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::KeysResponse* resp);
void GetReplicas(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::GetReplicasResponse* resp);
void Exists(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::ExistsResponse* resp);
void PrefixMatch(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::PrefixMatchResponse* resp);
void Remove(Master* m, const v1::RemoveRequest& req, const std::string& tenant, v1::KeysResponse* resp);
// An admin in a tenant removes that tenant's objects; one without, all.
void RemoveAll(Master* m, const v1::RemoveAllRequest& req, const std::string& tenant, v1::RemoveAllResponse* resp);
void Stats(Master* m, const v1::StatsRequest& req, v1::StatsResponse* resp);
void SyncSsdRecords(Master* m, const v1::SsdRecordsRequest& req, const SegmentActor& actor,
                    v1::SsdRecordsResponse* resp);
void GrantData(Master* m, const v1::GrantDataRequest& req, const std::string& tenant, v1::GrantDataResponse* resp);


}  // namespace tierkv::master::rpc
