#include "master/grpc_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "master/direct_lane.h"
#include "master/rpc_handlers.h"

namespace tierkv::master {
namespace {

using rpc::MethodStats;

// The names of the caller's verified client certificate: its subject
// alternative names (DNS, URI, IP), then its common name.
std::vector<std::string> PeerCertificateNames(const grpc::ServerContext& ctx) {
  std::vector<std::string> names;
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return names;
  for (const char* property : {"x509_subject_alternative_name", "x509_common_name"}) {
    for (const grpc::string_ref& v : auth->FindPropertyValues(property)) names.emplace_back(v.data(), v.size());
  }
  return names;
}

// A call with more items than this, or of a method marked slow, runs on the
// slow lane instead of its poller, so a long batch never holds the queue it
// came in on (and the lookups behind it).
constexpr int kInlineItems = 1024;

// A few threads for handlers too long to run on a poller: RemoveAll and
// UnmountSegment walk the index, big batches take milliseconds.
class SlowLane {
 public:
  explicit SlowLane(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~SlowLane() { Stop(); }
  void Post(std::function<void()> fn) {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(fn));
    cv_.Signal();
  }
  // Joins the threads once the queue is empty. Idempotent.
  void Stop() {
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
      cv_.SignalAll();
    }
    for (std::thread& t : threads_) t.join();
  }

 private:
  void Loop() {
    MutexLock lock(&mu_);
    while (true) {
      if (!queue_.empty()) {
        std::function<void()> fn = std::move(queue_.front());
        queue_.pop_front();
        mu_.Unlock();
        fn();
        mu_.Lock();
        continue;
      }
      if (stopping_) return;
      cv_.WaitFor(&mu_, std::chrono::milliseconds(100));
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// What every call shares: the limits, the slow lane, and the count of
// handlers running, which Stop waits to reach zero before it shuts the
// queues, since an operation started on a shut-down queue aborts gRPC.
struct ServiceState {
  ServiceLimits limits;
  const auth::Authenticator* auth = nullptr;  // null: every caller is admitted
  SlowLane slow{2};
  std::atomic<bool> draining{false};
  std::atomic<int> in_flight{0};
};

// One call of one method in flight on one queue: waits for a request,
// answers it (inline, or on the slow lane), then frees itself. Each Proceed
// first arms the next call of its method, so a method always has one
// waiting per queue.
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
  using Handler = void (*)(Master*, grpc::ServerContext*, const rpc::Caller& caller, const Req&, Resp*);
  using ItemsFn = int (*)(const Req&);

  struct Method {
    using CallType = Call;
    const char* name;
    RequestFn request;
    Handler handler;
    ItemsFn items;
    MethodStats stats;
    bool slow = false;  // always on the slow lane
    uint32_t roles = auth::kClient;  // a caller needs one of these (admin has all)
  };

  static void Arm(v1::Master::AsyncService* service, grpc::ServerCompletionQueue* cq,
                  const Method* method, Master* master, ServiceState* state) {
    new Call(service, cq, method, master, state);
  }

  void Proceed(bool ok) override {
    if (!ok || answered_) {
      if (on_slow_lane_) {
        // The slow lane's thread may still be returning from Finish; its
        // unlock orders its last touch of this call before the delete (and
        // shows TSan the order gRPC's own hand-off keeps out of its sight).
        MutexLock lock(&finish_mu_);
      }
      delete this;  // finished, or the queue is going away
      return;
    }
    // Counted before draining is read, so Stop either sees this handler or
    // this handler sees Stop (both are sequentially consistent).
    state_->in_flight.fetch_add(1);
    if (state_->draining.load()) {
      ServiceState* state = state_;
      delete this;  // the server is shut down: this call is cancelled
      state->in_flight.fetch_sub(1);
      return;
    }
    Arm(service_, cq_, method_, master_, state_);
    const MethodStats& st = method_->stats;
    st.calls->Increment();
    const int items = method_->items(req_);
    answered_ = true;
    if (state_->auth != nullptr && state_->auth->enabled()) {
      // The one check every gRPC call passes; the direct lane checks its
      // connections' first frame the same way.
      absl::StatusOr<auth::Identity> id = AuthorizeGrpcCall(*state_->auth, ctx_, method_->roles, method_->name);
      if (!id.ok()) {
        st.errors->Increment();
        Refuse(ToGrpcStatus(id.status()));
        return;
      }
      caller_.actor = SegmentActor{std::move(id->name), (id->roles & auth::kAdmin) != 0, id->tenant};
      caller_.tenant = std::move(id->tenant);
    }
    if (static_cast<size_t>(items) > state_->limits.max_batch) {
      st.errors->Increment();
      Refuse(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat(method_->name, ": ", items, " items exceeds the batch limit of ",
                                       state_->limits.max_batch)));
      return;
    }
    // A call that waited past its deadline has been given up on (and
    // perhaps retried): allocating or removing for it would only do harm.
    if (ctx_.deadline() < std::chrono::system_clock::now()) {
      st.errors->Increment();
      Refuse(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat(method_->name, ": the deadline passed before the master reached it")));
      return;
    }
    if (absl::Status serving = master_->Serving(); !serving.ok()) {
      st.errors->Increment();
      Refuse(grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(serving.message())));
      return;
    }
    st.items->Increment(items);
    if (method_->slow || items > kInlineItems) {
      on_slow_lane_ = true;
      state_->slow.Post([this] {
        MutexLock lock(&finish_mu_);
        Answer();
      });
    } else {
      Answer();
    }
  }

 private:
  Call(v1::Master::AsyncService* service, grpc::ServerCompletionQueue* cq, const Method* method,
       Master* master, ServiceState* state)
      : service_(service), cq_(cq), method_(method), master_(master), state_(state), responder_(&ctx_) {
    (service_->*method_->request)(&ctx_, &req_, &responder_, cq_, cq_, this);
  }

  void Answer() {
    ServiceState* state = state_;  // `this` may be gone once Finish is queued
    absl::Time start = absl::Now();
    method_->handler(master_, &ctx_, caller_, req_, &resp_);
    method_->stats.latency->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    // A lease that lapsed while the handler ran (a stalled process): what
    // it found may be stale, so the caller hears nothing of it, unless etcd
    // confirms the lease before the call's deadline.
    if (absl::Status serving = master_->ServingBy(absl::FromChrono(ctx_.deadline())); !serving.ok()) {
      method_->stats.errors->Increment();
      responder_.FinishWithError(grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(serving.message())), this);
    } else {
      responder_.Finish(resp_, grpc::Status::OK, this);
    }
    state->in_flight.fetch_sub(1);
  }

  void Refuse(const grpc::Status& status) {
    ServiceState* state = state_;
    responder_.FinishWithError(status, this);
    state->in_flight.fetch_sub(1);
  }

  v1::Master::AsyncService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  const Method* const method_;
  Master* const master_;
  ServiceState* const state_;
  grpc::ServerContext ctx_;
  rpc::Caller caller_;  // from its credential (the default: unauthenticated)
  Req req_;
  Resp resp_;
  grpc::ServerAsyncResponseWriter<Resp> responder_;
  bool answered_ = false;
  bool on_slow_lane_ = false;  // set before the hand-off, read by the poller after
  Mutex finish_mu_;            // held by the slow lane across the handler and Finish
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
  Impl(Master* master, rpc::RpcMetrics* rpc_metrics, ServiceLimits limits, int threads,
       const auth::Authenticator* authenticator)
      : master_(master), threads_(std::max(1, threads)) {
    state_.limits = limits;
    state_.auth = authenticator;
    auto stats = [rpc_metrics](const char* m) { return rpc_metrics->For(m); };
    mount_ = MakeMethod<v1::MountSegmentRequest, v1::MountSegmentResponse>(
        "MountSegment", &S::RequestMountSegment,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::MountSegment(m, req, c.actor, resp); },
        [](const auto& req) { return req.segments_size(); });
    unmount_ = MakeMethod<v1::UnmountSegmentRequest, v1::UnmountSegmentResponse>(
        "UnmountSegment", &S::RequestUnmountSegment,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::UnmountSegment(m, req, c.actor, resp); },
        [](const auto& req) { return req.names_size(); });
    heartbeat_ = MakeMethod<v1::HeartbeatRequest, v1::HeartbeatResponse>(
        "Heartbeat", &S::RequestHeartbeat,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::Heartbeat(m, req, c.actor, resp); },
        [](const auto& req) { return req.segments_size(); });
    put_start_ = MakeMethod<v1::PutStartRequest, v1::PutStartResponse>(
        "PutStart", &S::RequestPutStart,
        [](Master* m, grpc::ServerContext* ctx, const rpc::Caller& c, const auto& req, auto* resp) {
          rpc::PutStart(m, req, req.client_id().empty() ? GrpcPeerName(ctx->peer()) : req.client_id(), c.tenant, resp);
        },
        [](const auto& req) { return req.items_size(); });
    put_end_ = MakeMethod<v1::KeysRequest, v1::KeysResponse>(
        "PutEnd", &S::RequestPutEnd,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::PutEnd(m, req, c.tenant, resp); },
        [](const auto& req) { return req.keys_size(); });
    put_revoke_ = MakeMethod<v1::KeysRequest, v1::KeysResponse>(
        "PutRevoke", &S::RequestPutRevoke,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::PutRevoke(m, req, c.tenant, resp); },
        [](const auto& req) { return req.keys_size(); });
    get_ = MakeMethod<v1::KeysRequest, v1::GetReplicasResponse>(
        "GetReplicas", &S::RequestGetReplicas,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::GetReplicas(m, req, c.tenant, resp); },
        [](const auto& req) { return req.keys_size(); });
    exists_ = MakeMethod<v1::KeysRequest, v1::ExistsResponse>(
        "Exists", &S::RequestExists,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::Exists(m, req, c.tenant, resp); },
        [](const auto& req) { return req.keys_size(); });
    prefix_ = MakeMethod<v1::KeysRequest, v1::PrefixMatchResponse>(
        "PrefixMatch", &S::RequestPrefixMatch,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::PrefixMatch(m, req, c.tenant, resp); },
        [](const auto& req) { return req.keys_size(); });
    remove_ = MakeMethod<v1::RemoveRequest, v1::KeysResponse>(
        "Remove", &S::RequestRemove,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::Remove(m, req, c.tenant, resp); },
        [](const auto& req) { return req.keys_size(); });
    remove_all_ = MakeMethod<v1::RemoveAllRequest, v1::RemoveAllResponse>(
        "RemoveAll", &S::RequestRemoveAll,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::RemoveAll(m, req, c.tenant, resp); },
        [](const auto&) { return 0; });
    stats_ = MakeMethod<v1::StatsRequest, v1::StatsResponse>(
        "Stats", &S::RequestStats,
        [](Master* m, grpc::ServerContext*, const rpc::Caller&, const auto& req, auto* resp) { rpc::Stats(m, req, resp); },
        [](const auto&) { return 0; });
    ssd_sync_ = MakeMethod<v1::SsdRecordsRequest, v1::SsdRecordsResponse>(
        "SyncSsdRecords", &S::RequestSyncSsdRecords,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::SyncSsdRecords(m, req, c.actor, resp); },
        [](const auto& req) { return req.present_size() + req.gone_size(); });
    grant_ = MakeMethod<v1::GrantDataRequest, v1::GrantDataResponse>(
        "GrantData", &S::RequestGrantData,
        [](Master* m, grpc::ServerContext*, const rpc::Caller& c, const auto& req, auto* resp) { rpc::GrantData(m, req, c.tenant, resp); },
        [](const auto& req) { return req.segments_size(); });
    grant_.stats = stats("GrantData");
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
    ssd_sync_.stats = stats("SyncSsdRecords");
    mount_.roles = auth::kDaemon;
    unmount_.roles = auth::kDaemon;
    heartbeat_.roles = auth::kDaemon;
    ssd_sync_.roles = auth::kDaemon;
    remove_all_.roles = auth::kAdmin;
    unmount_.slow = true;
    ssd_sync_.slow = true;  // a complete listing walks the index
    remove_all_.slow = true;
  }

  // Queue 0 serves only the daemons' heartbeats and mounts, so no burst of
  // client requests can delay a heartbeat past the segment TTL (which would
  // drop the segment and every object on it); the others serve the rest.
  void Register(grpc::ServerBuilder* builder) {
    builder->RegisterService(&service_);
    for (int i = 0; i < threads_ + 1; ++i) cqs_.push_back(builder->AddCompletionQueue());
  }

  void Start() {
    for (size_t i = 0; i < cqs_.size(); ++i) {
      grpc::ServerCompletionQueue* q = cqs_[i].get();
      if (i == 0) {
        Arm(q, mount_);
        Arm(q, heartbeat_);
      } else {
        Arm(q, unmount_);
        Arm(q, ssd_sync_);
        ArmData(q);
      }
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
    // Handlers still running (the server's Shutdown cancels calls at its
    // deadline but does not wait for them) must finish before the queues go.
    state_.draining.store(true);
    while (state_.in_flight.load() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    state_.slow.Stop();
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
  void ArmData(grpc::ServerCompletionQueue* q) {
    Arm(q, put_start_);
    Arm(q, put_end_);
    Arm(q, put_revoke_);
    Arm(q, get_);
    Arm(q, exists_);
    Arm(q, prefix_);
    Arm(q, remove_);
    Arm(q, remove_all_);
    Arm(q, stats_);
    Arm(q, grant_);
  }

  template <class M>
  void Arm(grpc::ServerCompletionQueue* q, const M& method) {
    M::CallType::Arm(&service_, q, &method, master_, &state_);
  }

  Master* const master_;
  const int threads_;
  ServiceState state_;
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
  Call<v1::SsdRecordsRequest, v1::SsdRecordsResponse>::Method ssd_sync_;
  Call<v1::GrantDataRequest, v1::GrantDataResponse>::Method grant_;
};

MasterRpcService::MasterRpcService(Master* master, rpc::RpcMetrics* metrics, ServiceLimits limits,
                                   int threads, const auth::Authenticator* auth)
    : impl_(std::make_unique<Impl>(master, metrics, limits, threads, auth)) {}
MasterRpcService::~MasterRpcService() { Stop(); }
void MasterRpcService::Register(grpc::ServerBuilder* builder) { impl_->Register(builder); }
void MasterRpcService::Start() { impl_->Start(); }
void MasterRpcService::Stop() { impl_->Stop(); }

grpc::Status ToGrpcStatus(const absl::Status& s) {
  return s.ok() ? grpc::Status::OK : grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::StatusOr<auth::Identity> AuthorizeGrpcCall(const auth::Authenticator& auth, const grpc::ServerContext& ctx,
                                                 uint32_t roles, absl::string_view what) {
  auth::Credentials caller;
  if (auth.certificates()) {
    // gRPC verified the certificate against --tls-ca in the handshake.
    caller.certificate = PeerCertificateNames(ctx);
  } else {
    auto md = ctx.client_metadata().find(auth::kAuthorizationHeader);
    if (md != ctx.client_metadata().end()) {
      caller.token = std::string(auth::BearerToken(absl::string_view(md->second.data(), md->second.size())));
    }
  }
  return auth.Authorize(caller, roles, what);
}

}  // namespace tierkv::master
