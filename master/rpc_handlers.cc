#include "master/rpc_handlers.h"

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_replace.h"
#include "base/auth.h"
#include "base/failpoint.h"

namespace tierkv::master::rpc {

RpcMetrics::RpcMetrics(Master* master)
    : calls_(metrics::BuildCounter().Name("tierkv_master_rpc_total").Help("RPCs served").Register(master->metrics())),
      errors_(metrics::BuildCounter().Name("tierkv_master_rpc_errors_total").Help("RPCs refused whole").Register(master->metrics())),
      items_(metrics::BuildCounter().Name("tierkv_master_rpc_items_total").Help("Keys or segments carried by RPCs").Register(master->metrics())),
      latency_(metrics::BuildHistogram().Name("tierkv_master_rpc_seconds").Help("RPC handling time").Register(master->metrics())) {}

MethodStats RpcMetrics::For(const char* name) {
  metrics::Labels l{{"method", name}};
  return {&calls_.Add(l), &errors_.Add(l), &items_.Add(l), &latency_.Add(l, metrics::ExponentialBuckets(1e-6, 4, 12))};
}

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
  return {s.name(), s.host(), s.capacity(), s.incarnation(), s.endpoint(), s.tier_http(), s.ssd_capacity(),
          s.ssd_used(), s.ssd_id(), s.data_key()};
}

std::vector<std::string> Keys(const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return {keys.begin(), keys.end()};
}

// The index keys of what a caller in `tenant` names.
std::vector<std::string> Keys(const google::protobuf::RepeatedPtrField<std::string>& keys, const std::string& tenant) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) out.push_back(TenantKey(tenant, k));
  return out;
}

// A status as its caller should read it: keys named as the tenant knows them.
absl::Status AsCallerSees(const absl::Status& s, const std::string& tenant) {
  if (s.ok() || tenant.empty()) return s;
  std::string prefix = tenant;
  prefix.push_back(kTenantSeparator);
  return absl::Status(s.code(), absl::StrReplaceAll(s.message(), {{prefix, ""}}));
}

// Fields set only for some entries of a reply (stage flags, stage proofs,
// lease tokens) are filled with `fill` up to `n` entries before the next
// one is added, so entry j stays aligned with the reply's j-th replica or key.
template <class Field, class V>
void PadTo(Field* field, int n, const V& fill) {
  while (field->size() < n) field->Add(V(fill));
}

// The extent grants of one reply (base/extent_grant.h): each segment's
// signer looked up once.
class ExtentGrants {
 public:
  ExtentGrants(Master* m, absl::Time expiry, uint8_t ops) : m_(m), expiry_(expiry), ops_(ops) {}
  // "" when the extent's daemon checks no grants.
  std::string For(const ExtentOut& e) {
    const auth::ExtentMac* mac = SignerOf(e);
    return mac == nullptr ? std::string() : mac->Sign({e.offset, e.length, absl::ToUnixMillis(expiry_), ops_});
  }
  // Appends replica `index`'s grant, good until `expiry`, to `packed` (48
  // bytes per replica, zeros for one whose daemon checks none; empty while
  // no replica has one).
  void AppendTo(const ExtentOut& e, absl::Time expiry, int index, std::string* packed) {
    const auth::ExtentMac* mac = SignerOf(e);
    if (mac == nullptr && packed->empty()) return;
    packed->resize(static_cast<size_t>(index + 1) * auth::kExtentGrantBytes, '\0');
    char* at = packed->data() + static_cast<size_t>(index) * auth::kExtentGrantBytes;
    if (mac != nullptr && !mac->SignInto({e.offset, e.length, absl::ToUnixMillis(expiry), ops_}, at)) {
      std::memset(at, 0, auth::kExtentGrantBytes);
    }
  }

 private:
  const auth::ExtentMac* SignerOf(const ExtentOut& e) {
    auto [it, fresh] = signers_.try_emplace(e.segment_id);
    if (fresh) it->second = m_->ExtentSigner(e.segment_id);
    return it->second.get();
  }

  Master* const m_;
  const absl::Time expiry_;
  const uint8_t ops_;
  absl::flat_hash_map<uint32_t, std::shared_ptr<const auth::ExtentMac>> signers_;
};

// The leases a request gives back, applied before its own work so a put
// or stage in the same call finds the DRAM they held; and the reads its
// client served from its replica cache since its last call, counted as
// reads (hit rates, eviction order) as if the master had been asked.
template <class Request>
void ApplyReleases(Master* m, const Request& req, const std::string& tenant) {
  if (req.cache_hit_keys_size() > 0) {
    std::vector<std::string> keys = Keys(req.cache_hit_keys(), tenant);
    std::vector<KeyHit> hits = m->index().NoteCachedReads(keys);
    m->queries().Record(ClientKey(tenant, req.client_id()), QueryStats::kGet, keys, hits, m->clock()->Now());
  }
  if (req.shortfalls() > 0) m->reservations().NoteShortfalls(req.shortfalls());
  const int n = std::min({req.released_keys_size(), req.released_tokens_size(), req.released_expiry_unix_ms_size()});
  if (n == 0) return;
  std::vector<LeaseRelease> releases;
  releases.reserve(n);
  for (int i = 0; i < n; ++i) {
    releases.push_back({TenantKey(tenant, req.released_keys(i)), req.released_tokens(i), req.released_expiry_unix_ms(i)});
  }
  const size_t applied = m->index().ReleaseLeases(releases);
  m->reservations().Give(ClientKey(tenant, req.client_id()), applied, absl::ToUnixMillis(m->clock()->Now()));
}

}  // namespace

void MountSegment(Master* m, const v1::MountSegmentRequest& req, const SegmentActor& actor,
                  v1::MountSegmentResponse* resp) {
  std::vector<SegmentSpec> specs;
  for (const auto& s : req.segments()) specs.push_back(FromProto(s));
  resp->set_epoch(m->options().epoch);
  for (const absl::Status& s : m->Mount(specs, actor)) SetStatus(resp->add_status(), s);
}

void UnmountSegment(Master* m, const v1::UnmountSegmentRequest& req, const SegmentActor& actor,
                    v1::UnmountSegmentResponse* resp) {
  for (const absl::Status& s : m->Unmount(Keys(req.names()), req.keep_ssd(), actor)) SetStatus(resp->add_status(), s);
}

void SyncSsdRecords(Master* m, const v1::SsdRecordsRequest& req, const SegmentActor& actor,
                    v1::SsdRecordsResponse* resp) {
  SsdRecords in;
  in.segment = req.segment();
  in.incarnation = req.incarnation();
  in.listing = req.listing();
  in.complete = req.complete();
  in.tier_http = req.tier_http();
  in.ssd_capacity = req.ssd_capacity();
  in.ssd_used = req.ssd_used();
  in.present.reserve(req.present_size());
  for (const v1::SsdRecord& r : req.present()) in.present.emplace_back(r.key(), r.size());
  in.gone = Keys(req.gone());
  absl::StatusOr<SsdRecordsResult> out = m->SyncSsd(in, actor);
  if (!out.ok()) {
    SetStatus(resp->mutable_status(), out.status());
    return;
  }
  for (std::string& k : out->unknown) resp->add_unknown(std::move(k));
  resp->set_confirmed(out->confirmed);
  resp->set_dropped(out->dropped);
}

void Heartbeat(Master* m, const v1::HeartbeatRequest& req, const SegmentActor& actor, v1::HeartbeatResponse* resp) {
  std::vector<SegmentSpec> specs;
  for (const auto& s : req.segments()) specs.push_back(FromProto(s));
  resp->set_epoch(m->options().epoch);
  HeartbeatResult r = m->Heartbeat(specs, req.client_id(), actor);
  for (auto& name : r.remount) resp->add_remount(name);
  resp->set_ttl_ms(absl::ToInt64Milliseconds(r.ttl));
}

void PutStart(Master* m, const v1::PutStartRequest& req, const std::string& client, const std::string& tenant,
              v1::PutStartResponse* resp) {
  resp->set_epoch(m->options().epoch);
  // sleep:<ms> holds the call here, before anything is granted, for the
  // tests of a master that dies with a PutStart in hand.
  (void)TIERKV_FAILPOINT("master.rpc.put_start");
  ApplyReleases(m, req, tenant);
  std::vector<PutItem> items;
  items.reserve(req.items_size());
  std::vector<absl::Status> refused(req.items_size());
  for (int i = 0; i < req.items_size(); ++i) {
    const auto& it = req.items(i);
    // Checked as the caller wrote it: a NUL would reach into a namespace.
    refused[i] = ValidateKey(it.key(), m->options().index.max_key_bytes);
    items.push_back({TenantKey(tenant, it.key()), it.size(), static_cast<int>(std::min<uint32_t>(it.replicas(), 1u << 16)),
                     it.preferred_segment(), it.group().empty() ? std::string() : TenantKey(tenant, it.group()),
                     it.soft_pin(), it.parent_key().empty() ? std::string() : TenantKey(tenant, it.parent_key())});
    items.back().hard_pin = it.hard_pin();
    items.back().put_id = req.put_ids();
    // Given no size, the index refuses it without placing or charging it.
    if (!refused[i].ok()) items.back().size = 0;
  }
  std::vector<PutStartOut> placed = m->PutStart(std::move(items), client, tenant);
  // The wall clock: daemons check grants against their own. A writer may
  // write its extents until its put times out (a grant does not yet end
  // with its put: docs/security.md, "Extent grants").
  ExtentGrants grants(m, absl::Now() + m->options().index.put_timeout, auth::kExtentWrite);
  for (size_t i = 0; i < placed.size(); ++i) {
    const PutStartOut& r = placed[i];
    v1::PutStartResult* out = resp->add_results();
    SetResultStatus(out, !refused[i].ok() ? refused[i] : AsCallerSees(r.status, tenant));
    for (const ExtentOut& e : r.replicas) {
      v1::Extent* x = out->add_replicas();
      SetExtent(x, e);
      if (r.status.ok()) {
        std::string grant = grants.For(e);
        if (!grant.empty()) x->set_grant(std::move(grant));
      }
    }
    if (r.status.ok()) out->set_put_id(r.put_id);
  }
}

void PutEnd(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::KeysResponse* resp) {
  resp->set_epoch(m->options().epoch);
  // sleep:<ms> makes this a long handler that holds no index lock (as a
  // huge batch's decoding would), for the tests of what waits behind it.
  (void)TIERKV_FAILPOINT("master.rpc.put_end");
  ApplyReleases(m, req, tenant);
  std::vector<std::string> keys = Keys(req.keys(), tenant);
  std::vector<absl::Status> done = m->index().PutEnd(keys);
  std::vector<std::string> stored;
  for (size_t i = 0; i < done.size(); ++i) {
    SetStatus(resp->add_status(), AsCallerSees(done[i], tenant));
    if (done[i].ok() && i < keys.size()) stored.push_back(std::move(keys[i]));
  }
  // "Ever stored", for the bound on the hit rate.
  m->queries().NoteStored(stored);
}

void PutRevoke(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::KeysResponse* resp) {
  resp->set_epoch(m->options().epoch);
  ApplyReleases(m, req, tenant);
  for (const absl::Status& s : m->index().PutRevoke(Keys(req.keys(), tenant))) {
    SetStatus(resp->add_status(), AsCallerSees(s, tenant));
  }
}

void GetReplicas(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::GetReplicasResponse* resp) {
  resp->set_epoch(m->options().epoch);
  ApplyReleases(m, req, tenant);
  std::vector<std::string> keys = Keys(req.keys(), tenant);
  std::vector<LookupOut> found;
  if (req.counted()) {
    // A read session's reservations, up to its client's cap; the keys past
    // it are refused whole rather than leased uncounted, which would pin
    // them for the whole lease with no way to give them back.
    const std::string client = ClientKey(tenant, req.client_id());
    const uint64_t room = m->reservations().Room(client, absl::ToUnixMillis(m->clock()->Now()));
    const size_t admit = static_cast<size_t>(std::min<uint64_t>(room, keys.size()));
    std::vector<std::string> admitted(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(admit));
    found = m->index().GetReplicas(admitted, false, true);
    uint64_t granted = 0;
    int64_t expiry_ms = 0;
    for (const LookupOut& r : found) {
      if (r.lease_token == 0) continue;
      ++granted;
      expiry_ms = std::max(expiry_ms, absl::ToUnixMillis(r.lease_expiry));
    }
    m->reservations().Take(client, granted, expiry_ms);
    if (admit < keys.size()) {
      m->reservations().NoteRefused(keys.size() - admit);
      found.resize(keys.size());
      for (size_t i = admit; i < keys.size(); ++i) {
        found[i].status = absl::ResourceExhaustedError("reservation cap");
        resp->add_refused(static_cast<uint32_t>(i));
      }
    }
  } else {
    found = m->index().GetReplicas(keys, false);
  }
  int n = static_cast<int>(found.size());
  resp->mutable_sizes()->Reserve(n);
  resp->mutable_lease_expiry_unix_ms()->Reserve(n);
  resp->mutable_replica_counts()->Reserve(n);
  // Segment ids -> positions in the response's segment table.
  absl::flat_hash_map<uint32_t, uint32_t> table;
  // Taken after the lookup (a snapshot, O(1)): only the ids the reply
  // names are resolved.
  const LiveSegments names = m->registry().LiveNames();
  for (size_t i = 0; i < found.size(); ++i) {
    if (absl::IsUnavailable(found[i].status)) resp->add_awaiting(static_cast<uint32_t>(i));
  }
  // Leases run on the master's clock, grants on the daemons' wall clocks:
  // each read's grant lasts what is left of its lease.
  const absl::Time lease_now = m->clock()->Now();
  const absl::Time wall_now = absl::Now();
  ExtentGrants grants(m, wall_now, auth::kExtentRead);
  for (size_t i = 0; i < found.size(); ++i) {
    const LookupOut& r = found[i];
    uint32_t count = 0;
    if (r.status.ok()) {
      for (const ExtentOut& e : r.replicas) {
        auto [it, fresh] = table.try_emplace(e.segment_id, resp->segments_size());
        if (fresh) {
          const std::string* name = names.Find(e.segment_id);
          // The segment left since the lookup: drop this replica.
          if (name == nullptr) {
            table.erase(it);
            continue;
          }
          resp->add_segments(*name);
        }
        resp->add_replica_segments(it->second);
        resp->add_replica_offsets(e.offset);
        // Only answers naming a daemon that checks grants carry them.
        if (!e.ssd) {
          grants.AppendTo(e, wall_now + (r.lease_expiry - lease_now), resp->replica_offsets_size() - 1,
                          resp->mutable_replica_grants());
        }
        if (e.stage) {
          // Only answers with an SSD hit carry the stage flags.
          PadTo(resp->mutable_replica_stage(), resp->replica_offsets_size() - 1, false);
          resp->add_replica_stage(true);
          if (!tenant.empty() && resp->stage_key_prefix().empty()) {
            resp->set_stage_key_prefix(TenantKey(tenant, ""));
          }
          auto& endpoints = *resp->mutable_stage_endpoints();
          if (endpoints.find(it->second) == endpoints.end()) {
            std::optional<std::string> tier = m->registry().TierFor(e.segment_id, 0);
            endpoints[it->second] = tier.value_or("");
          }
          // The daemon stages nothing without the master's leave for this
          // object, extent and lease (auth::StageProof).
          std::optional<std::string> data_key = m->registry().DataKeyOfId(e.segment_id);
          if (data_key.has_value() && !data_key->empty()) {
            PadTo(resp->mutable_stage_proofs(), resp->replica_offsets_size() - 1, std::string());
            resp->add_stage_proofs(auth::StageProof(*data_key, keys[i], e.offset, r.size, absl::ToUnixMillis(r.lease_expiry)));
          }
        }
        ++count;
      }
    }
    resp->add_sizes(count > 0 ? r.size : 0);
    resp->add_lease_expiry_unix_ms(count > 0 ? absl::ToUnixMillis(r.lease_expiry) : 0);
    resp->add_replica_counts(count);
    resp->add_put_ids(count > 0 ? r.put_id : 0);
    if (r.lease_token != 0 && count > 0) {
      // Only answers with a counted read carry tokens.
      const int at = resp->sizes_size() - 1;
      PadTo(resp->mutable_lease_tokens(), at, uint64_t{0});
      resp->add_lease_tokens(r.lease_token);
    }
  }
  if (!resp->replica_grants().empty()) {
    // The replicas after the last with a grant have none.
    resp->mutable_replica_grants()->resize(
        static_cast<size_t>(resp->replica_offsets_size()) * auth::kExtentGrantBytes, '\0');
  }
  // Read after the lookup: an answer that may reflect a drop names the
  // membership after it.
  resp->set_membership(m->membership());
  // Read after the leases were granted, so a client's view of what is left
  // errs short.
  resp->set_now_unix_ms(absl::ToUnixMillis(m->clock()->Now()));
  std::vector<KeyHit> hits(found.size());
  for (size_t i = 0; i < found.size(); ++i) {
    if (resp->sizes(static_cast<int>(i)) > 0) hits[i] = {true, found[i].size, found[i].idle_s};
  }
  m->queries().Record(ClientKey(tenant, req.client_id()), QueryStats::kGet, keys, hits, m->clock()->Now());
}

void Exists(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::ExistsResponse* resp) {
  ApplyReleases(m, req, tenant);
  std::vector<std::string> keys = Keys(req.keys(), tenant);
  std::vector<KeyHit> hits;
  for (bool b : m->index().Exists(keys, &hits)) resp->add_present(b);
  m->queries().Record(ClientKey(tenant, req.client_id()), QueryStats::kExists, keys, hits, m->clock()->Now());
}

void PrefixMatch(Master* m, const v1::KeysRequest& req, const std::string& tenant, v1::PrefixMatchResponse* resp) {
  ApplyReleases(m, req, tenant);
  std::vector<std::string> keys = Keys(req.keys(), tenant);
  std::vector<KeyHit> hits;
  const size_t matched = m->index().PrefixMatch(keys, &hits);
  resp->set_matched(static_cast<uint32_t>(matched));
  m->queries().Record(ClientKey(tenant, req.client_id()), QueryStats::kPrefix, keys, hits, m->clock()->Now());
}

void Remove(Master* m, const v1::RemoveRequest& req, const std::string& tenant, v1::KeysResponse* resp) {
  resp->set_epoch(m->options().epoch);
  for (const absl::Status& s : m->index().Remove(Keys(req.keys(), tenant), req.force())) {
    SetStatus(resp->add_status(), AsCallerSees(s, tenant));
  }
}

void Stats(Master* m, const v1::StatsRequest&, v1::StatsResponse* resp) {
  IndexStats st = m->index().Stats();
  resp->set_objects(st.objects);
  resp->set_pending(st.pending);
  resp->set_evictions(st.evictions);
  resp->set_groups(st.groups);
  resp->set_leased(st.leased);
  resp->set_pinned(st.pinned);
  resp->set_index_memory_bytes(st.memory_bytes);
  uint64_t used = 0, capacity = 0;
  for (const SegmentSnapshot& s : m->registry().Snapshot()) {
    used += s.used;
    capacity += s.spec.capacity;
    v1::SegmentInfo* info = resp->add_segment_info();
    v1::Segment* seg = info->mutable_segment();
    seg->set_name(s.spec.name);
    seg->set_host(s.spec.host);
    seg->set_capacity(s.spec.capacity);
    seg->set_incarnation(s.spec.incarnation);
    seg->set_endpoint(s.spec.endpoint);
    seg->set_tier_http(s.spec.tier_http);
    seg->set_ssd_capacity(s.spec.ssd_capacity);
    seg->set_ssd_used(s.spec.ssd_used);
    info->set_used(s.used);
    info->set_state(s.state());
    info->set_last_heartbeat_unix_ms(absl::ToUnixMillis(s.last_heartbeat));
  }
  resp->set_used_bytes(used);
  resp->set_capacity_bytes(capacity);
  resp->set_segments(resp->segment_info_size());
  resp->set_http_port(static_cast<uint32_t>(m->http_port()));
  resp->set_http_tls(!m->options().tls.cert.empty());
}

void RemoveAll(Master* m, const v1::RemoveAllRequest& req, const std::string& tenant, v1::RemoveAllResponse* resp) {
  resp->set_removed(m->index().RemoveAll(req.force(), tenant.empty() ? nullptr : &tenant));
}

void GrantData(Master* m, const v1::GrantDataRequest& req, const std::string& tenant, v1::GrantDataResponse* resp) {
  for (const std::string& name : req.segments()) {
    v1::DataGrant* g = resp->add_grants();
    absl::StatusOr<DataGrantOut> out = m->GrantData(name, tenant);
    if (!out.ok()) {
      SetStatus(g->mutable_status(), out.status());
      continue;
    }
    g->set_grant(std::move(out->grant));
    g->set_session_key(std::move(out->session_key));
  }
}

}  // namespace tierkv::master::rpc
