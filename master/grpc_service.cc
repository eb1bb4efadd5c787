#include "master/grpc_service.h"

#include "absl/strings/str_cat.h"
#include "config/base/metrics.h"
#include "master/rpc_handlers.h"

namespace tierkv::master {
namespace {

class Service final : public v1::Master::CallbackService {
 public:
  Service(Master* master, ServiceLimits limits) : master_(master), limits_(limits) {
    auto& calls = metrics::BuildCounter().Name("tierkv_master_rpc_total").Help("RPCs served").Register(master->metrics());
    auto& errors = metrics::BuildCounter().Name("tierkv_master_rpc_errors_total").Help("RPCs refused whole").Register(master->metrics());
    auto& items = metrics::BuildCounter().Name("tierkv_master_rpc_items_total").Help("Keys or segments carried by RPCs").Register(master->metrics());
    auto& latency = metrics::BuildHistogram().Name("tierkv_master_rpc_seconds").Help("RPC handling time").Register(master->metrics());
    for (const char* m : {"MountSegment", "UnmountSegment", "Heartbeat", "PutStart", "PutEnd",
                          "PutRevoke", "GetReplicas", "Exists", "PrefixMatch", "Remove",
                          "RemoveAll", "Stats"}) {
      metrics::Labels l{{"method", m}};
      stats_[m] = {&calls.Add(l), &errors.Add(l), &items.Add(l),
                   &latency.Add(l, metrics::ExponentialBuckets(1e-6, 4, 12))};
    }
  }

  grpc::ServerUnaryReactor* MountSegment(grpc::CallbackServerContext* ctx, const v1::MountSegmentRequest* req,
                                  v1::MountSegmentResponse* resp) override {
    return Handle(ctx, "MountSegment", req->segments_size(), [&] { rpc::MountSegment(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* UnmountSegment(grpc::CallbackServerContext* ctx, const v1::UnmountSegmentRequest* req,
                                  v1::UnmountSegmentResponse* resp) override {
    return Handle(ctx, "UnmountSegment", req->names_size(), [&] { rpc::UnmountSegment(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                                  v1::HeartbeatResponse* resp) override {
    return Handle(ctx, "Heartbeat", req->segments_size(), [&] { rpc::Heartbeat(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* PutStart(grpc::CallbackServerContext* ctx, const v1::PutStartRequest* req,
                                  v1::PutStartResponse* resp) override {
    return Handle(ctx, "PutStart", req->items_size(), [&] {
      rpc::PutStart(master_, *req, req->client_id().empty() ? ctx->peer() : req->client_id(), resp);
    });
  }

  grpc::ServerUnaryReactor* PutEnd(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                                  v1::KeysResponse* resp) override {
    return Handle(ctx, "PutEnd", req->keys_size(), [&] { rpc::PutEnd(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* PutRevoke(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                                  v1::KeysResponse* resp) override {
    return Handle(ctx, "PutRevoke", req->keys_size(), [&] { rpc::PutRevoke(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* GetReplicas(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                                  v1::GetReplicasResponse* resp) override {
    return Handle(ctx, "GetReplicas", req->keys_size(), [&] { rpc::GetReplicas(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* Exists(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                                  v1::ExistsResponse* resp) override {
    return Handle(ctx, "Exists", req->keys_size(), [&] { rpc::Exists(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* PrefixMatch(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                                  v1::PrefixMatchResponse* resp) override {
    return Handle(ctx, "PrefixMatch", req->keys_size(), [&] { rpc::PrefixMatch(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* Remove(grpc::CallbackServerContext* ctx, const v1::RemoveRequest* req,
                                  v1::KeysResponse* resp) override {
    return Handle(ctx, "Remove", req->keys_size(), [&] { rpc::Remove(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* RemoveAll(grpc::CallbackServerContext* ctx, const v1::RemoveAllRequest* req,
                                  v1::RemoveAllResponse* resp) override {
    return Handle(ctx, "RemoveAll", 0, [&] { rpc::RemoveAll(master_, *req, resp); });
  }

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* req,
                                  v1::StatsResponse* resp) override {
    return Handle(ctx, "Stats", 0, [&] { rpc::Stats(master_, *req, resp); });
  }

 private:
  struct MethodStats {
    metrics::Counter* calls;
    metrics::Counter* errors;
    metrics::Counter* items;
    metrics::Histogram* latency;
  };

  // Runs the handler inline on gRPC's callback thread (no hand-off to a
  // thread pool: every handler is short and never waits on the network).
  template <class Fn>
  grpc::ServerUnaryReactor* Handle(grpc::CallbackServerContext* ctx, const char* method, int items,
                                   Fn fn) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    MethodStats& st = stats_.at(method);
    st.calls->Increment();
    if (static_cast<size_t>(items) > limits_.max_batch) {
      st.errors->Increment();
      reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                   absl::StrCat(method, ": ", items,
                                                " items exceeds the batch limit of ",
                                                limits_.max_batch)));
      return reactor;
    }
    st.items->Increment(items);
    absl::Time start = absl::Now();
    fn();
    st.latency->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  Master* const master_;
  const ServiceLimits limits_;
  absl::flat_hash_map<std::string, MethodStats> stats_;
};

}  // namespace

std::unique_ptr<grpc::Service> NewMasterService(Master* master, ServiceLimits limits) {
  return std::make_unique<Service>(master, limits);
}

}  // namespace tierkv::master
