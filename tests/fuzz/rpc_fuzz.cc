// Every gRPC request message, as bytes off the wire: the first byte picks
// the method, the rest goes through ParseFromArray into the master's
// handlers (master/rpc_handlers.h), exactly what the gRPC service runs.
// One master lives across inputs, so sequences of calls build up state;
// its invariants must hold after every call.
#include <cstdint>
#include <string>

#include "master/rpc_handlers.h"
#include "google/protobuf/stubs/logging.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/master_fixture.h"

namespace {

using namespace tierkv;

template <class Req, class Resp, class Fn>
void Call(const uint8_t* data, size_t size, Fn fn) {
  Req req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;
  Resp resp;
  fn(req, &resp);
  std::string out;
  FUZZ_CHECK(resp.SerializeToString(&out));
}

}  // namespace

// Protobuf logs every string field that is not UTF-8; that is expected here.
const bool kQuietProtobuf = [] {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return true;
}();

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ManualClock clock;
  static master::Master* m = [] {
    master::Master* fresh = fuzz::NewFuzzMaster(&clock).release();
    fresh->index().tenants().SetLimits("fz", {64 << 10, 16 << 10});
    return fresh;
  }();
  if (size == 0) return 0;
  const uint8_t method = data[0] % 14;
  // Half the calls come from a tenant with a small quota, so namespacing
  // and quota charging see hostile bytes too.
  const std::string tenant = (data[0] / 14) % 2 == 1 ? "fz" : "";
  // Segment control comes from that tenant's named identity, so hostile
  // mounts, unmounts and heartbeats meet the ownership checks; the other
  // half act unauthenticated and may change any segment.
  const master::SegmentActor actor = tenant.empty() ? master::SegmentActor{} : master::SegmentActor{"fz-daemon", false};
  ++data;
  --size;
  namespace rpc = master::rpc;
  namespace v1 = tierkv::v1;
  const std::string client = "fuzz-peer";
  switch (method) {
    case 0: Call<v1::MountSegmentRequest, v1::MountSegmentResponse>(data, size, [&](auto& q, auto* r) { rpc::MountSegment(m, q, actor, r); }); break;
    case 1: Call<v1::UnmountSegmentRequest, v1::UnmountSegmentResponse>(data, size, [&](auto& q, auto* r) { rpc::UnmountSegment(m, q, actor, r); }); break;
    case 2: Call<v1::HeartbeatRequest, v1::HeartbeatResponse>(data, size, [&](auto& q, auto* r) { rpc::Heartbeat(m, q, actor, r); }); break;
    case 3: Call<v1::PutStartRequest, v1::PutStartResponse>(data, size, [&](auto& q, auto* r) { rpc::PutStart(m, q, q.client_id().empty() ? client : q.client_id(), tenant, r); }); break;
    case 4: Call<v1::KeysRequest, v1::KeysResponse>(data, size, [&](auto& q, auto* r) { rpc::PutEnd(m, q, tenant, r); }); break;
    case 5: Call<v1::KeysRequest, v1::KeysResponse>(data, size, [&](auto& q, auto* r) { rpc::PutRevoke(m, q, tenant, r); }); break;
    case 6: Call<v1::KeysRequest, v1::GetReplicasResponse>(data, size, [&](auto& q, auto* r) { rpc::GetReplicas(m, q, tenant, r); }); break;
    case 7: Call<v1::KeysRequest, v1::ExistsResponse>(data, size, [&](auto& q, auto* r) { rpc::Exists(m, q, tenant, r); }); break;
    case 8: Call<v1::KeysRequest, v1::PrefixMatchResponse>(data, size, [&](auto& q, auto* r) { rpc::PrefixMatch(m, q, tenant, r); }); break;
    case 9: Call<v1::RemoveRequest, v1::KeysResponse>(data, size, [&](auto& q, auto* r) { rpc::Remove(m, q, tenant, r); }); break;
    case 10: Call<v1::RemoveAllRequest, v1::RemoveAllResponse>(data, size, [&](auto& q, auto* r) { rpc::RemoveAll(m, q, tenant, r); }); break;
    case 11: Call<v1::StatsRequest, v1::StatsResponse>(data, size, [&](auto& q, auto* r) { rpc::Stats(m, q, r); }); break;
    case 12: clock.Advance(absl::Seconds(size % 64)); m->Tick(); break;
    case 13: {  // keep segments alive, or the fuzzer spends its time on an empty cluster
      m->Mount({{"seg-a", "host-a", 1 << 20, "inc-a", "tcp://127.0.0.1:1"},
                {"seg-b", "host-b", 1 << 20, "inc-b", "tcp://127.0.0.1:2"}});
      break;
    }
  }
  absl::Status inv = m->index().CheckInvariants();
  if (!inv.ok()) std::fprintf(stderr, "%s\n", inv.ToString().c_str());
  FUZZ_CHECK(inv.ok());
  return 0;
}
