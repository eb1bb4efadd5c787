#include "master/grpc_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "config/base/metrics.h"
#include "master/rpc_handlers.h"

namespace tierkv::master {
namespace {

// What each method's Proceed needs of the service.
struct MethodStats {
  metrics::Counter* calls;
  metrics::Counter* errors;
  metrics::Counter* items;
  metrics::Histogram* latency;
};

// One call of one method in flight on one queue: waits for a request,
// answers it inline, then frees itself. Each Proceed first arms the next
// call of its method, so a method always has one waiting per queue.
class CallBase {
 public:
  virtual ~CallBase() = default;
  // `ok` is false when the queue is shutting down.
  virtual void Proceed(bool ok) = 0;
};

template <class Req, class Resp>
class Call final : public CallBase {
 public:
  using RequestFn = void (v1::Master::AsyncService::*)(grpc::ServerContext*, Req*,
                                                        grpc::ServerAsyncResponseWriter<Resp>*,
                                                        grpc::CompletionQueue*,
                                                        grpc::ServerCompletionQueue*, void*);
  using Handler = void (*)(Master*, grpc::ServerContext*, const Req&, Resp*);
  using ItemsFn = int (*)(const Req&);

  struct Method {
    using CallType = Call;
    const char* name;
    RequestFn request;
    Handler handler;
    ItemsFn items;
    MethodStats stats;
  };

  static void Arm(v1::Master::AsyncService* service, grpc::ServerCompletionQueue* cq,
                  const Method* method, Master* master, const ServiceLimits* limits) {
    new Call(service, cq, method, master, limits);
  }

  void Proceed(bool ok) override {
    if (!ok || answered_) {
      delete this;  // finished, or the queue is going away
      return;
    }
    Arm(service_, cq_, method_, master_, limits_);
    const MethodStats& st = method_->stats;
    st.calls->Increment();
    const int items = method_->items(req_);
    answered_ = true;
    if (static_cast<size_t>(items) > limits_->max_batch) {
      st.errors->Increment();
      responder_.FinishWithError(
          grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                       absl::StrCat(method_->name, ": ", items, " items exceeds the batch limit of ",
                                    limits_->max_batch)),
          this);
      return;
    }
    st.items->Increment(items);
    absl::Time start = absl::Now();
    method_->handler(master_, &ctx_, req_, &resp_);
    st.latency->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    responder_.Finish(resp_, grpc::Status::OK, this);
  }

 private:
  Call(v1::Master::AsyncService* service, grpc::ServerCompletionQueue* cq, const Method* method,
       Master* master, const ServiceLimits* limits)
      : service_(service), cq_(cq), method_(method), master_(master), limits_(limits), responder_(&ctx_) {
    (service_->*method_->request)(&ctx_, &req_, &responder_, cq_, cq_, this);
  }

  v1::Master::AsyncService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  const Method* const method_;
  Master* const master_;
  const ServiceLimits* const limits_;
  grpc::ServerContext ctx_;
  Req req_;
  Resp resp_;
  grpc::ServerAsyncResponseWriter<Resp> responder_;
  bool answered_ = false;
};

// Binds a method's request function, handler and item count.
template <class Req, class Resp>
typename Call<Req, Resp>::Method MakeMethod(const char* name, typename Call<Req, Resp>::RequestFn request,
                                            typename Call<Req, Resp>::Handler handler,
                                            typename Call<Req, Resp>::ItemsFn items) {
  return {name, request, handler, items, {}};
}

using S = v1::Master::AsyncService;

}  // namespace

class MasterRpcService::Impl {
 public:
  Impl(Master* master, ServiceLimits limits, int threads)
      : master_(master), limits_(limits), threads_(std::max(1, threads)) {
    auto& calls = metrics::BuildCounter().Name("tierkv_master_rpc_total").Help("RPCs served").Register(master->metrics());
    auto& errors = metrics::BuildCounter().Name("tierkv_master_rpc_errors_total").Help("RPCs refused whole").Register(master->metrics());
    auto& items = metrics::BuildCounter().Name("tierkv_master_rpc_items_total").Help("Keys or segments carried by RPCs").Register(master->metrics());
    auto& latency = metrics::BuildHistogram().Name("tierkv_master_rpc_seconds").Help("RPC handling time").Register(master->metrics());
    auto stats = [&](const char* m) {
      metrics::Labels l{{"method", m}};
      return MethodStats{&calls.Add(l), &errors.Add(l), &items.Add(l),
                         &latency.Add(l, metrics::ExponentialBuckets(1e-6, 4, 12))};
    };
    mount_ = MakeMethod<v1::MountSegmentRequest, v1::MountSegmentResponse>(
        "MountSegment", &S::RequestMountSegment,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::MountSegment(m, req, resp); },
        [](const auto& req) { return req.segments_size(); });
    unmount_ = MakeMethod<v1::UnmountSegmentRequest, v1::UnmountSegmentResponse>(
        "UnmountSegment", &S::RequestUnmountSegment,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::UnmountSegment(m, req, resp); },
        [](const auto& req) { return req.names_size(); });
    heartbeat_ = MakeMethod<v1::HeartbeatRequest, v1::HeartbeatResponse>(
        "Heartbeat", &S::RequestHeartbeat,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::Heartbeat(m, req, resp); },
        [](const auto& req) { return req.segments_size(); });
    put_start_ = MakeMethod<v1::PutStartRequest, v1::PutStartResponse>(
        "PutStart", &S::RequestPutStart,
        [](Master* m, grpc::ServerContext* ctx, const auto& req, auto* resp) {
          rpc::PutStart(m, req, req.client_id().empty() ? ctx->peer() : req.client_id(), resp);
        },
        [](const auto& req) { return req.items_size(); });
    put_end_ = MakeMethod<v1::KeysRequest, v1::KeysResponse>(
        "PutEnd", &S::RequestPutEnd,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::PutEnd(m, req, resp); },
        [](const auto& req) { return req.keys_size(); });
    put_revoke_ = MakeMethod<v1::KeysRequest, v1::KeysResponse>(
        "PutRevoke", &S::RequestPutRevoke,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::PutRevoke(m, req, resp); },
        [](const auto& req) { return req.keys_size(); });
    get_ = MakeMethod<v1::KeysRequest, v1::GetReplicasResponse>(
        "GetReplicas", &S::RequestGetReplicas,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::GetReplicas(m, req, resp); },
        [](const auto& req) { return req.keys_size(); });
    exists_ = MakeMethod<v1::KeysRequest, v1::ExistsResponse>(
        "Exists", &S::RequestExists,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::Exists(m, req, resp); },
        [](const auto& req) { return req.keys_size(); });
    prefix_ = MakeMethod<v1::KeysRequest, v1::PrefixMatchResponse>(
        "PrefixMatch", &S::RequestPrefixMatch,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::PrefixMatch(m, req, resp); },
        [](const auto& req) { return req.keys_size(); });
    remove_ = MakeMethod<v1::RemoveRequest, v1::KeysResponse>(
        "Remove", &S::RequestRemove,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::Remove(m, req, resp); },
        [](const auto& req) { return req.keys_size(); });
    remove_all_ = MakeMethod<v1::RemoveAllRequest, v1::RemoveAllResponse>(
        "RemoveAll", &S::RequestRemoveAll,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::RemoveAll(m, req, resp); },
        [](const auto&) { return 0; });
    stats_ = MakeMethod<v1::StatsRequest, v1::StatsResponse>(
        "Stats", &S::RequestStats,
        [](Master* m, grpc::ServerContext*, const auto& req, auto* resp) { rpc::Stats(m, req, resp); },
        [](const auto&) { return 0; });
    mount_.stats = stats("MountSegment");
    unmount_.stats = stats("UnmountSegment");
    heartbeat_.stats = stats("Heartbeat");
    put_start_.stats = stats("PutStart");
    put_end_.stats = stats("PutEnd");
    put_revoke_.stats = stats("PutRevoke");
    get_.stats = stats("GetReplicas");
    exists_.stats = stats("Exists");
    prefix_.stats = stats("PrefixMatch");
    remove_.stats = stats("Remove");
    remove_all_.stats = stats("RemoveAll");
    stats_.stats = stats("Stats");
  }

  void Register(grpc::ServerBuilder* builder) {
    builder->RegisterService(&service_);
    for (int i = 0; i < threads_; ++i) cqs_.push_back(builder->AddCompletionQueue());
  }

  void Start() {
    for (auto& cq : cqs_) {
      grpc::ServerCompletionQueue* q = cq.get();
      Arm(q, mount_);
      Arm(q, unmount_);
      Arm(q, heartbeat_);
      Arm(q, put_start_);
      Arm(q, put_end_);
      Arm(q, put_revoke_);
      Arm(q, get_);
      Arm(q, exists_);
      Arm(q, prefix_);
      Arm(q, remove_);
      Arm(q, remove_all_);
      Arm(q, stats_);
      pollers_.emplace_back([q] {
        void* tag;
        bool ok;
        while (q->Next(&tag, &ok)) static_cast<CallBase*>(tag)->Proceed(ok);
      });
    }
    started_ = true;
  }

  void Stop() {
    if (stopped_) return;
    stopped_ = true;
    // Next returns false once a shut-down queue is drained; the waiting
    // calls come back with ok=false first and free themselves.
    for (auto& cq : cqs_) cq->Shutdown();
    for (std::thread& t : pollers_) t.join();
    if (!started_) {
      for (auto& cq : cqs_) {
        void* tag;
        bool ok;
        while (cq->Next(&tag, &ok)) static_cast<CallBase*>(tag)->Proceed(ok);
      }
    }
  }

 private:
  template <class M>
  void Arm(grpc::ServerCompletionQueue* q, const M& method) {
    M::CallType::Arm(&service_, q, &method, master_, &limits_);
  }

  Master* const master_;
  const ServiceLimits limits_;
  const int threads_;
  v1::Master::AsyncService service_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs_;
  std::vector<std::thread> pollers_;
  bool started_ = false;
  bool stopped_ = false;
  Call<v1::MountSegmentRequest, v1::MountSegmentResponse>::Method mount_;
  Call<v1::UnmountSegmentRequest, v1::UnmountSegmentResponse>::Method unmount_;
  Call<v1::HeartbeatRequest, v1::HeartbeatResponse>::Method heartbeat_;
  Call<v1::PutStartRequest, v1::PutStartResponse>::Method put_start_;
  Call<v1::KeysRequest, v1::KeysResponse>::Method put_end_;
  Call<v1::KeysRequest, v1::KeysResponse>::Method put_revoke_;
  Call<v1::KeysRequest, v1::GetReplicasResponse>::Method get_;
  Call<v1::KeysRequest, v1::ExistsResponse>::Method exists_;
  Call<v1::KeysRequest, v1::PrefixMatchResponse>::Method prefix_;
  Call<v1::RemoveRequest, v1::KeysResponse>::Method remove_;
  Call<v1::RemoveAllRequest, v1::RemoveAllResponse>::Method remove_all_;
  Call<v1::StatsRequest, v1::StatsResponse>::Method stats_;
};

MasterRpcService::MasterRpcService(Master* master, ServiceLimits limits, int threads)
    : impl_(std::make_unique<Impl>(master, limits, threads)) {}
MasterRpcService::~MasterRpcService() { Stop(); }
void MasterRpcService::Register(grpc::ServerBuilder* builder) { impl_->Register(builder); }
void MasterRpcService::Start() { impl_->Start(); }
void MasterRpcService::Stop() { impl_->Stop(); }

}  // namespace tierkv::master
