#include "master/grpc_service.h"

#include "absl/strings/str_cat.h"
#include "config/base/metrics.h"

namespace tierkv::master {
namespace {

void SetStatus(v1::ItemStatus* out, const absl::Status& s) {
  if (s.ok()) return;  // default ItemStatus is OK, and costs no bytes
  out->set_code(static_cast<int>(s.code()));
  out->set_message(std::string(s.message()));
}

// Sets a result's status submessage only when not OK: an absent status
// reads as OK and saves an allocation per key on both ends.
template <class Result>
void SetResultStatus(Result* out, const absl::Status& s) {
  if (!s.ok()) SetStatus(out->mutable_status(), s);
}

void SetExtent(v1::Extent* out, const ExtentOut& e) {
  out->set_segment(e.segment);
  out->set_offset(e.offset);
  out->set_length(e.length);
}

SegmentSpec FromProto(const v1::Segment& s) {
  return {s.name(), s.host(), s.capacity(), s.incarnation(), s.endpoint()};
}

std::vector<std::string> Keys(const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return {keys.begin(), keys.end()};
}

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
                   &latency.Add(l, metrics::Histogram::ExponentialBuckets(1e-6, 4, 12))};
    }
  }

  grpc::ServerUnaryReactor* MountSegment(grpc::CallbackServerContext* ctx, const v1::MountSegmentRequest* req,
                            v1::MountSegmentResponse* resp) override {
    return Handle(ctx, "MountSegment", req->segments_size(), [&] {
      std::vector<SegmentSpec> specs;
      for (const auto& s : req->segments()) specs.push_back(FromProto(s));
      for (const absl::Status& s : master_->Mount(specs)) SetStatus(resp->add_status(), s);
    });
  }

  grpc::ServerUnaryReactor* UnmountSegment(grpc::CallbackServerContext* ctx, const v1::UnmountSegmentRequest* req,
                              v1::UnmountSegmentResponse* resp) override {
    return Handle(ctx, "UnmountSegment", req->names_size(), [&] {
      for (const absl::Status& s : master_->Unmount(Keys(req->names()))) SetStatus(resp->add_status(), s);
    });
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    return Handle(ctx, "Heartbeat", req->segments_size(), [&] {
      std::vector<SegmentSpec> specs;
      for (const auto& s : req->segments()) specs.push_back(FromProto(s));
      HeartbeatResult r = master_->Heartbeat(specs, req->client_id());
      for (auto& name : r.remount) resp->add_remount(name);
      resp->set_ttl_ms(absl::ToInt64Milliseconds(r.ttl));
    });
  }

  grpc::ServerUnaryReactor* PutStart(grpc::CallbackServerContext* ctx, const v1::PutStartRequest* req,
                        v1::PutStartResponse* resp) override {
    return Handle(ctx, "PutStart", req->items_size(), [&] {
      std::vector<PutItem> items;
      items.reserve(req->items_size());
      for (const auto& it : req->items()) {
        items.push_back({it.key(), it.size(), static_cast<int>(std::min<uint32_t>(it.replicas(), 1u << 16)),
                         it.preferred_segment(), it.group(), it.soft_pin(), it.parent_key()});
      }
      for (const PutStartOut& r : master_->index().PutStart(items)) {
        v1::PutStartResult* out = resp->add_results();
        SetResultStatus(out, r.status);
        for (const ExtentOut& e : r.replicas) SetExtent(out->add_replicas(), e);
      }
    });
  }

  grpc::ServerUnaryReactor* PutEnd(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                      v1::KeysResponse* resp) override {
    return Handle(ctx, "PutEnd", req->keys_size(), [&] {
      for (const absl::Status& s : master_->index().PutEnd(Keys(req->keys()))) SetStatus(resp->add_status(), s);
    });
  }

  grpc::ServerUnaryReactor* PutRevoke(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                         v1::KeysResponse* resp) override {
    return Handle(ctx, "PutRevoke", req->keys_size(), [&] {
      for (const absl::Status& s : master_->index().PutRevoke(Keys(req->keys()))) SetStatus(resp->add_status(), s);
    });
  }

  grpc::ServerUnaryReactor* GetReplicas(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                           v1::GetReplicasResponse* resp) override {
    return Handle(ctx, "GetReplicas", req->keys_size(), [&] {
      std::vector<LookupOut> found = master_->index().GetReplicas(Keys(req->keys()), false);
      int n = static_cast<int>(found.size());
      resp->mutable_sizes()->Reserve(n);
      resp->mutable_lease_expiry_unix_ms()->Reserve(n);
      resp->mutable_replica_counts()->Reserve(n);
      // Segment ids -> positions in the response's segment table.
      absl::flat_hash_map<uint32_t, uint32_t> table;
      absl::flat_hash_map<uint32_t, std::string> names;
      for (const LookupOut& r : found) {
        uint32_t count = 0;
        if (r.status.ok()) {
          for (const ExtentOut& e : r.replicas) {
            auto [it, fresh] = table.try_emplace(e.segment_id, resp->segments_size());
            if (fresh) {
              if (names.empty()) names = master_->registry().LiveNames();
              auto name = names.find(e.segment_id);
              // The segment left since the lookup: drop this replica.
              if (name == names.end()) {
                table.erase(it);
                continue;
              }
              resp->add_segments(name->second);
            }
            resp->add_replica_segments(it->second);
            resp->add_replica_offsets(e.offset);
            ++count;
          }
        }
        resp->add_sizes(count > 0 ? r.size : 0);
        resp->add_lease_expiry_unix_ms(count > 0 ? absl::ToUnixMillis(r.lease_expiry) : 0);
        resp->add_replica_counts(count);
      }
    });
  }

  grpc::ServerUnaryReactor* Exists(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                      v1::ExistsResponse* resp) override {
    return Handle(ctx, "Exists", req->keys_size(), [&] {
      for (bool b : master_->index().Exists(Keys(req->keys()))) resp->add_present(b);
    });
  }

  grpc::ServerUnaryReactor* PrefixMatch(grpc::CallbackServerContext* ctx, const v1::KeysRequest* req,
                           v1::PrefixMatchResponse* resp) override {
    return Handle(ctx, "PrefixMatch", req->keys_size(), [&] {
      resp->set_matched(static_cast<uint32_t>(master_->index().PrefixMatch(Keys(req->keys()))));
    });
  }

  grpc::ServerUnaryReactor* Remove(grpc::CallbackServerContext* ctx, const v1::RemoveRequest* req,
                      v1::KeysResponse* resp) override {
    return Handle(ctx, "Remove", req->keys_size(), [&] {
      for (const absl::Status& s : master_->index().Remove(Keys(req->keys()), req->force())) {
        SetStatus(resp->add_status(), s);
      }
    });
  }

  grpc::ServerUnaryReactor* RemoveAll(grpc::CallbackServerContext* ctx, const v1::RemoveAllRequest* req,
                         v1::RemoveAllResponse* resp) override {
    return Handle(ctx, "RemoveAll", 0, [&] { resp->set_removed(master_->index().RemoveAll(req->force())); });
  }

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest*, v1::StatsResponse* resp) override {
    return Handle(ctx, "Stats", 0, [&] {
      IndexStats st = master_->index().Stats();
      resp->set_objects(st.objects);
      resp->set_pending(st.pending);
      resp->set_evictions(st.evictions);
      resp->set_groups(st.groups);
      resp->set_leased(st.leased);
      resp->set_pinned(st.pinned);
      resp->set_index_memory_bytes(st.memory_bytes);
      uint64_t used = 0, capacity = 0;
      for (const SegmentSnapshot& s : master_->registry().Snapshot()) {
        used += s.used;
        capacity += s.spec.capacity;
        v1::SegmentInfo* info = resp->add_segment_info();
        v1::Segment* seg = info->mutable_segment();
        seg->set_name(s.spec.name);
        seg->set_host(s.spec.host);
        seg->set_capacity(s.spec.capacity);
        seg->set_incarnation(s.spec.incarnation);
        seg->set_endpoint(s.spec.endpoint);
        info->set_used(s.used);
        info->set_state(s.recovering ? "recovering" : "live");
        info->set_last_heartbeat_unix_ms(absl::ToUnixMillis(s.last_heartbeat));
      }
      resp->set_used_bytes(used);
      resp->set_capacity_bytes(capacity);
      resp->set_segments(resp->segment_info_size());
    });
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
