#include "master/master.h"

#include <set>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/auth.h"
#include "base/log.h"
#include "base/status.h"
#include "httplib.h"
#include "master/tenants.h"
#include "proto/master.pb.h"

namespace tierkv::master {
namespace {

constexpr char kSegmentPrefix[] = "s/";
constexpr char kMetadataPrefix[] = "m/";
constexpr char kMetadataOwnerPrefix[] = "mw/";  // metadata key -> the name of the caller that wrote it
constexpr char kTenantPrefix[] = "t/";           // tenant -> "<quota bytes> <guaranteed bytes>"

// A daemon's SSD tier address, which the master and readers dial: empty
// (no tier) or one NewHttpClient takes.
absl::Status CheckTierAddress(const std::string& segment, const std::string& tier_http) {
  if (tier_http.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> url = auth::HttpEndpointUrl(tier_http);
  if (url.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("segment ", segment, ": its SSD tier's ", url.status().message()));
}

// The evictor's offload orders, POSTed to the daemon's /tier/offload
// (store/daemon.h). Every failure is a per-order status: the index then
// evicts those objects, which is a miss later, never wrong bytes.
// `data_key`: the daemon's, which signs the order (a daemon running
// --auth token refuses an unsigned one); empty: unsigned.
std::vector<absl::Status> OffloadOverHttp(const std::string& tier_http, const std::vector<TierOrder>& orders,
                                          absl::Duration timeout, const std::string& data_key,
                                          absl::Duration grant_ttl, const auth::TlsFiles& tls) {
  v1::TierMoveRequest req;
  for (const TierOrder& o : orders) {
    v1::TierMoveItem* item = req.add_items();
    item->set_key(o.key);
    item->set_offset(o.offset);
    item->set_length(o.length);
  }
  // A daemon serving HTTPS advertises its tier as https://host:port.
  absl::StatusOr<std::unique_ptr<httplib::Client>> cli =
      auth::NewHttpClient(tier_http, {tls.ca, "", ""}, std::max(timeout, absl::Milliseconds(1)));
  if (!cli.ok()) return std::vector<absl::Status>(orders.size(), Annotate(cli.status(), "offload"));
  const std::string body = req.SerializeAsString();
  httplib::Headers headers;
  if (!data_key.empty()) {
    const std::string grant = auth::NewGrant(absl::Now() + grant_ttl);
    // Signed with the master's own key for the grant, which no grant holder
    // can make: only the master orders offloads.
    for (auto& [name, value] : auth::SignTierRequest(grant, auth::OrderSessionKey(data_key, grant), "/tier/offload",
                                                     body, absl::Now())) {
      headers.emplace(name, value);
    }
  }
  httplib::Result res = (*cli)->Post("/tier/offload", headers, body, "application/x-protobuf");
  v1::TierMoveResponse resp;
  absl::Status failed;
  if (!res) {
    failed = absl::UnavailableError(absl::StrCat("offload to ", tier_http, ": ", httplib::to_string(res.error())));
  } else if (res->status != 200 || !resp.ParseFromString(res->body)) {
    failed = absl::UnavailableError(absl::StrCat("offload to ", tier_http, ": HTTP ", res->status));
  }
  std::vector<absl::Status> out(orders.size(), failed);
  if (!failed.ok()) return out;
  for (size_t i = 0; i < out.size(); ++i) {
    if (i >= static_cast<size_t>(resp.status_size())) {
      out[i] = absl::UnavailableError(absl::StrCat("offload to ", tier_http, ": no answer for the order"));
    } else if (resp.status(static_cast<int>(i)).code() != 0) {
      out[i] = absl::Status(static_cast<absl::StatusCode>(resp.status(static_cast<int>(i)).code()),
                            resp.status(static_cast<int>(i)).message());
    }
  }
  return out;
}

std::string EncodeSegment(const SegmentSpec& spec) {
  v1::SegmentRecord rec;
  v1::Segment* s = rec.mutable_segment();
  s->set_name(spec.name);
  s->set_host(spec.host);
  s->set_capacity(spec.capacity);
  s->set_incarnation(spec.incarnation);
  s->set_endpoint(spec.endpoint);
  s->set_tier_http(spec.tier_http);
  s->set_ssd_id(spec.ssd_id);
  // Persisted, so a restarted master grants for recovered segments at once.
  s->set_data_key(spec.data_key);
  // Persisted (and so copied to standbys), so no one can take a segment
  // over while its daemon is away across a restart or failover.
  rec.set_owner(spec.owner);
  rec.set_owner_tenant(spec.owner_tenant);
  return rec.SerializeAsString();
}

}  // namespace

Master::Master(MasterOptions options, std::unique_ptr<IndexStore> store, Clock* clock)
    : options_(options), clock_(clock), store_(std::move(store)) {
  IndexOptions index_options = options_.index;
  if (!index_options.offload) {
    index_options.offload = [this](const std::string& tier_http, const std::vector<TierOrder>& orders,
                                   absl::Duration timeout) {
      return OffloadOverHttp(tier_http, orders, timeout, registry_.DataKeyOfTier(tier_http), options_.data_grant_ttl,
                             options_.tls);
    };
  }
  if (!options_.kv_events.endpoint.empty()) {
    kv_events_ = std::make_unique<KvEventPublisher>(options_.kv_events, &metrics_);
    index_options.listener = kv_events_.get();
  }
  index_ = std::make_unique<ObjectIndex>(index_options, &registry_, store_.get(), clock_);
  queries_ = std::make_unique<QueryStats>(&metrics_, options_.queries);
  RegisterMetrics();
}

absl::StatusOr<std::unique_ptr<Master>> Master::Create(MasterOptions options,
                                                       std::unique_ptr<IndexStore> store,
                                                       Clock* clock) {
  std::unique_ptr<Master> m(new Master(options, std::move(store), clock));
  if (m->kv_events_ != nullptr) {
    // Batch 0 of the epoch, ahead of the recovered objects' BlockStored:
    // a consumer starts over.
    m->kv_events_->OnAllCleared();
    RETURN_IF_ERROR(m->kv_events_->Start());
  }
  RETURN_IF_ERROR(m->Recover());
  return m;
}

absl::Status Master::Recover() {
  uint64_t segments = 0;
  std::vector<Mutation> stale;
  RETURN_IF_ERROR(store_->Scan(kSegmentPrefix, [&](absl::string_view k, absl::string_view v) {
    v1::SegmentRecord rec;
    if (!rec.ParseFromArray(v.data(), static_cast<int>(v.size())) ||
        rec.segment().name().empty() || rec.segment().capacity() == 0) {
      TKV_LOG(WARNING) << "dropping an unreadable segment record";
      stale.push_back({std::string(k), "", true});
      return true;
    }
    const v1::Segment& s = rec.segment();
    SegmentSpec spec{s.name(), s.host(), s.capacity(), s.incarnation(), s.endpoint()};
    spec.ssd_id = s.ssd_id();
    spec.data_key = s.data_key();
    spec.owner = rec.owner();
    spec.owner_tenant = rec.owner_tenant();
    registry_.Recover(spec, clock_->Now());
    ++segments;
    return true;
  }));
  RETURN_IF_ERROR(store_->Scan(kTenantPrefix, [&](absl::string_view k, absl::string_view v) {
    std::vector<absl::string_view> words = absl::StrSplit(v, ' ');
    TenantLimits limits;
    if (words.size() != 2 || !absl::SimpleAtoi(words[0], &limits.quota_bytes) ||
        !absl::SimpleAtoi(words[1], &limits.guaranteed_bytes)) {
      TKV_LOG(WARNING) << "dropping an unreadable tenant record";
      stale.push_back({std::string(k), "", true});
      return true;
    }
    index_->tenants().SetLimits(k.substr(sizeof(kTenantPrefix) - 1), limits);
    return true;
  }));
  RETURN_IF_ERROR(store_->Write(stale));
  ASSIGN_OR_RETURN(uint64_t objects, index_->Recover());
  if (segments > 0 || objects > 0) {
    TKV_LOG(INFO) << "recovered " << segments << " segments (awaiting re-mount) and " << objects
                  << " objects";
  }
  RETURN_IF_ERROR(index_->CheckInvariants());
  return absl::OkStatus();
}

void Master::DropSegmentIds(const std::vector<uint32_t>& ids, absl::string_view why, bool expected,
                            const absl::flat_hash_map<uint32_t, uint32_t>& keep_ssd) {
  if (ids.empty()) return;
  membership_.fetch_add(1, std::memory_order_acq_rel);
  uint64_t dropped = index_->DropSegments(ids, keep_ssd);
  segments_dropped_->Increment(static_cast<double>(ids.size()));
  // An unmount is an operator's (or a daemon's) choice; a lost segment is news.
  if (expected) {
    TKV_LOG(INFO) << ids.size() << " segment(s) left (" << why << "); " << dropped << " objects dropped with them";
  } else {
    TKV_LOG(WARNING) << ids.size() << " segment(s) left (" << why << "); " << dropped
                     << " objects dropped with them";
  }
}

std::vector<absl::Status> Master::Mount(const std::vector<SegmentSpec>& segments, const SegmentActor& actor) {
  std::vector<absl::Status> out;
  for (const SegmentSpec& spec : segments) {
    if (absl::Status tier = CheckTierAddress(spec.name, spec.tier_http); !tier.ok()) {
      out.push_back(tier);
      continue;
    }
    bool restored = false, same_ssd = false;
    std::optional<uint32_t> replaced;
    std::string owner, owner_tenant;
    absl::StatusOr<uint32_t> id = registry_.Mount(spec, clock_->Now(), &restored, &replaced, options_.segment_ttl,
                                                  &same_ssd, actor, &owner, &owner_tenant);
    if (!id.ok()) {
      out.push_back(id.status());
      continue;
    }
    if (replaced) {
      absl::flat_hash_map<uint32_t, uint32_t> keep;
      if (same_ssd) keep[*replaced] = *id;
      DropSegmentIds({*replaced},
                     absl::StrCat(spec.name, " re-mounted as a new incarnation",
                                  same_ssd ? " (its SSD replicas kept, awaiting its listing)" : ""),
                     false, keep);
    }
    SegmentSpec owned = spec;
    owned.owner = owner;
    owned.owner_tenant = owner_tenant;
    absl::Status st = store_->Write({{absl::StrCat(kSegmentPrefix, spec.name), EncodeSegment(owned), false}});
    if (!st.ok()) TKV_LOG(ERROR) << "persisting segment " << spec.name << ": " << st;
    TKV_LOG(INFO) << (restored ? "re-mounted " : "mounted ") << spec.name << " ("
                  << spec.capacity << " bytes, host " << spec.host << ")";
    if (!spec.data_key.empty() && !options_.callers_authenticated) {
      TKV_LOG(WARNING) << "segment " << spec.name << " needs data grants, but this master runs --auth none and "
                       << "grants them to anyone who asks: run the master with --auth token";
    }
    out.push_back(absl::OkStatus());
  }
  return out;
}

std::vector<absl::Status> Master::Unmount(const std::vector<std::string>& names, bool keep_ssd,
                                          const SegmentActor& actor) {
  std::vector<absl::Status> out;
  for (const std::string& name : names) {
    if (absl::Status may = registry_.MayChange(name, actor); !may.ok()) {
      out.push_back(may);
      continue;
    }
    if (keep_ssd && options_.ssd_grace > absl::ZeroDuration() && registry_.MakeDormant(name, clock_->Now(), actor)) {
      uint32_t id = *registry_.IdOf(name);
      DropSegmentIds({id}, absl::StrCat(name, " stopped to restart (its SSD replicas kept)"), true, {{id, id}});
      out.push_back(absl::OkStatus());
      continue;
    }
    absl::StatusOr<uint32_t> id = registry_.Unmount(name, actor);
    if (!id.ok()) {
      out.push_back(id.status());
      continue;
    }
    (void)store_->Write({{absl::StrCat(kSegmentPrefix, name), "", true}});
    DropSegmentIds({*id}, absl::StrCat(name, " unmounted"), /*expected=*/true);
    out.push_back(absl::OkStatus());
  }
  return out;
}

HeartbeatResult Master::Heartbeat(const std::vector<SegmentSpec>& segments,
                                  const std::string& client_id, const SegmentActor& actor) {
  HeartbeatResult out;
  out.ttl = options_.segment_ttl;
  absl::Time now = clock_->Now();
  for (const SegmentSpec& s : segments) {
    if (!registry_.Heartbeat(s.name, s.incarnation, now, actor)) {
      out.remount.push_back(s.name);
    } else if (CheckTierAddress(s.name, s.tier_http).ok()) {
      // Its mount checked the address it gave then; one changed since to
      // something unusable leaves the tier as it was.
      registry_.UpdateTier(s);
    }
  }
  if (!client_id.empty()) {
    MutexLock lock(&clients_mu_);
    clients_[client_id] = now;
  }
  return out;
}

void Master::Tick() {
  absl::Time now = clock_->Now();
  std::vector<uint32_t> dormant;
  std::vector<uint32_t> gone = registry_.Expire(now, options_.segment_ttl, options_.ssd_grace, &dormant);
  if (!dormant.empty()) {
    absl::flat_hash_map<uint32_t, uint32_t> keep;
    for (uint32_t id : dormant) keep[id] = id;
    DropSegmentIds(dormant, "heartbeats stopped; SSD replicas kept for --ssd-grace", false, keep);
  }
  if (!gone.empty()) {
    // Their names are no longer known to the registry; drop persisted
    // records that no live segment carries.
    std::vector<Mutation> removals;
    absl::flat_hash_set<std::string> live;
    for (const SegmentSnapshot& s : registry_.Snapshot()) live.insert(s.spec.name);
    (void)store_->Scan(kSegmentPrefix, [&](absl::string_view k, absl::string_view) {
      if (!live.contains(k.substr(2))) removals.push_back({std::string(k), "", true});
      return true;
    });
    (void)store_->Write(removals);
    DropSegmentIds(gone, "heartbeats stopped", false);
  }
  index_->Tick();
  MutexLock lock(&clients_mu_);
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (now - it->second > options_.segment_ttl) {
      clients_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<SsdRecordsResult> Master::SyncSsd(const SsdRecords& in, const SegmentActor& actor) {
  RETURN_IF_ERROR(CheckTierAddress(in.segment, in.tier_http));
  RETURN_IF_ERROR(registry_.MayChange(in.segment, actor));
  std::optional<uint32_t> id = registry_.LiveId(in.segment, in.incarnation);
  if (!id) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment ", in.segment, " is not mounted with incarnation ", in.incarnation));
  }
  SsdRecordsResult out;
  if (!in.gone.empty()) out.dropped += index_->DropSsd(*id, in.gone);
  if (!in.present.empty() || in.complete) {
    std::vector<bool> ok = index_->ConfirmSsd(*id, in.present, &out.dropped);
    absl::flat_hash_set<std::string> confirmed;
    bool repeat = false;
    {
      MutexLock lock(&ssd_mu_);
      SsdListing& l = listings_[in.segment];
      if (l.id != *id || l.listing != in.listing) l = SsdListing{*id, in.listing, false, {}};
      // A batch of a listing already taken, sent again (its answer was
      // lost): sweeping again with nothing confirmed would drop it all.
      repeat = l.done;
      for (size_t i = 0; i < ok.size() && !repeat; ++i) {
        if (ok[i]) {
          l.confirmed.insert(in.present[i].first);
          ++out.confirmed;
        } else {
          out.unknown.push_back(in.present[i].first);
        }
      }
      if (in.complete && !repeat) {
        confirmed = std::move(l.confirmed);
        l.confirmed.clear();
        l.done = true;
      }
    }
    if (in.complete && !repeat) {
      // The listing holds every record the tier had when it was taken,
      // and no offload reached the segment since its mount (TierFor waits
      // for this): a replica it does not name has no record.
      out.dropped += index_->DropSsdExcept(*id, confirmed);
      registry_.MarkSsdSynced(*id, in.tier_http, in.ssd_capacity, in.ssd_used);
      TKV_LOG(INFO) << "segment " << in.segment << ": SSD listing in, " << confirmed.size()
                    << " records confirmed, " << out.dropped << " replicas dropped";
    }
  }
  ssd_confirmed_->Increment(static_cast<double>(out.confirmed));
  ssd_dropped_->Increment(static_cast<double>(out.dropped));
  return out;
}

std::vector<PutStartOut> Master::PutStart(std::vector<PutItem> items, const std::string& client,
                                          const std::string& tenant) {
  // Concurrent PutStarts may overshoot a cap by a batch: caps on runaway
  // writers, not exact quotas.
  const std::string counted_as = ClientKey(tenant, client);
  auto refuse = [&](absl::Status why) {
    pending_refused_->Increment(static_cast<double>(items.size()));
    return std::vector<PutStartOut>(items.size(), PutStartOut{std::move(why), {}});
  };
  // Without authentication every caller is the default tenant: a tenant
  // cap would be a new cluster-wide cap, so it applies only with tenants.
  const uint64_t client_cap = options_.max_pending_per_client;
  const uint64_t tenant_cap = options_.callers_authenticated ? options_.max_pending_per_tenant : 0;
  const ObjectIndex::PendingCounts pending =
      client_cap > 0 || tenant_cap > 0 ? index_->Pending(counted_as) : ObjectIndex::PendingCounts{};
  if (const uint64_t cap = client_cap; cap > 0) {
    const uint64_t held = pending.client;
    if (held + items.size() > cap) {
      return refuse(absl::ResourceExhaustedError(
          absl::StrCat("client ", client, " has ", held, " puts in flight; ", items.size(),
                       " more would pass the cap of ", cap, " (--max-pending-per-client)")));
    }
  }
  if (const uint64_t cap = tenant_cap; cap > 0) {
    const uint64_t held = pending.tenant;
    if (held + items.size() > cap) {
      return refuse(absl::ResourceExhaustedError(
          absl::StrCat("tenant ", TenantName(tenant), " has ", held, " puts in flight; ", items.size(),
                       " more would pass the cap of ", cap, " (--max-pending-per-tenant)")));
    }
  }
  for (PutItem& it : items) it.client = counted_as;
  return index_->PutStart(items);
}

absl::Status Master::Readiness() const {
  RETURN_IF_ERROR(Serving());
  size_t live = 0, recovering = 0;
  for (const SegmentSnapshot& s : registry_.Snapshot()) (s.recovering ? recovering : live)++;
  if (live > 0) return absl::OkStatus();
  if (recovering > 0) {
    return absl::UnavailableError(absl::StrCat("no segment mounted: ", recovering,
                                               " recovered from persistence, awaiting re-mount"));
  }
  return absl::UnavailableError("no segment mounted");
}

uint64_t Master::clients_seen() const {
  MutexLock lock(&clients_mu_);
  return clients_.size();
}

absl::StatusOr<std::string> Master::GetMetadata(const std::string& key) {
  return store_->Get(absl::StrCat(kMetadataPrefix, key));
}

namespace {
// OK when `writer` may change a key owned by `owner` (empty: none).
absl::Status MayWriteMetadata(const std::string& key, const absl::StatusOr<std::string>& owner,
                              const std::string& writer, bool admin) {
  if (admin || writer.empty() || !owner.ok() || owner->empty() || *owner == writer) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("metadata key '", key, "' belongs to '", *owner, "', not to '", writer, "'"));
}
}  // namespace

absl::Status Master::PutMetadata(const std::string& key, const std::string& value, const std::string& writer,
                                 bool admin) {
  const std::string owner_key = absl::StrCat(kMetadataOwnerPrefix, key);
  MutexLock lock(&metadata_mu_);
  absl::StatusOr<std::string> owner = store_->Get(owner_key);
  if (!owner.ok() && !absl::IsNotFound(owner.status())) return owner.status();
  RETURN_IF_ERROR(MayWriteMetadata(key, owner, writer, admin));
  std::vector<Mutation> batch{{absl::StrCat(kMetadataPrefix, key), value, false}};
  // An admin's write leaves the owner as it was; a named writer claims an unowned key.
  if (!writer.empty() && !admin && !owner.ok()) batch.push_back({owner_key, writer, false});
  return store_->Write(batch);
}

absl::Status Master::DeleteMetadata(const std::string& key, const std::string& writer, bool admin) {
  std::string k = absl::StrCat(kMetadataPrefix, key);
  const std::string owner_key = absl::StrCat(kMetadataOwnerPrefix, key);
  MutexLock lock(&metadata_mu_);
  ASSIGN_OR_RETURN(std::string unused, store_->Get(k));
  (void)unused;
  absl::StatusOr<std::string> owner = store_->Get(owner_key);
  if (!owner.ok() && !absl::IsNotFound(owner.status())) return owner.status();
  RETURN_IF_ERROR(MayWriteMetadata(key, owner, writer, admin));
  return store_->Write({{k, "", true}, {owner_key, "", true}});
}

absl::Status Master::SetTenantLimits(const std::string& name, TenantLimits limits) {
  const std::string tenant = name == kDefaultTenantName ? std::string() : name;
  if (!tenant.empty()) RETURN_IF_ERROR(auth::ValidateTenant(tenant));
  if (limits.quota_bytes != 0 && limits.guaranteed_bytes > limits.quota_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tenant ", name, ": guaranteed bytes (", limits.guaranteed_bytes,
                                                   ") exceed the quota (", limits.quota_bytes, ")"));
  }
  const std::string key = absl::StrCat(kTenantPrefix, tenant);
  const bool clear = limits.quota_bytes == 0 && limits.guaranteed_bytes == 0;
  RETURN_IF_ERROR(store_->Write({{key, clear ? "" : absl::StrCat(limits.quota_bytes, " ", limits.guaranteed_bytes), clear}}));
  index_->tenants().SetLimits(tenant, limits);
  TKV_LOG(INFO) << "tenant " << TenantName(tenant) << ": quota " << limits.quota_bytes << " bytes, guaranteed "
                << limits.guaranteed_bytes << " bytes";
  return absl::OkStatus();
}

absl::StatusOr<DataGrantOut> Master::GrantData(const std::string& segment, const std::string& tenant) {
  std::string owner_tenant;
  std::optional<std::string> key = registry_.DataKeyOf(segment, &owner_tenant);
  if (!key) return absl::NotFoundError(absl::StrCat("segment ", segment, " is not mounted"));
  DataGrantOut out;
  if (key->empty()) return out;
  // The wall clock: daemons check the expiry against their own.
  out.grant = auth::NewGrant(absl::Now() + options_.data_grant_ttl);
  // Mapping reaches every extent of the segment, other tenants' values
  // included: only the owner's own tenant may (docs/security.md).
  out.session_key = tenant == owner_tenant ? auth::MapSessionKey(*key, out.grant)
                                           : auth::GrantSessionKey(*key, out.grant);
  return out;
}

std::shared_ptr<const auth::ExtentMac> Master::ExtentSigner(uint32_t segment_id) {
  std::optional<std::string> key = registry_.DataKeyOfId(segment_id);
  if (!key || key->empty()) return nullptr;
  MutexLock lock(&signers_mu_);
  auto it = signers_.find(*key);
  if (it != signers_.end()) return it->second;
  // Keys of segments long gone are dropped wholesale; live ones come back
  // on their next use.
  if (signers_.size() >= 4096) signers_.clear();
  auto mac = std::make_shared<const auth::ExtentMac>(*key);
  signers_.emplace(*key, mac);
  return mac;
}

absl::Status Master::Flush() { return store_->Flush(); }

void Master::RegisterMetrics() {
  segments_dropped_ = &metrics::BuildCounter()
                           .Name("tierkv_master_segments_dropped_total")
                           .Help("Segments unmounted by the master (missed heartbeats, re-mounts)")
                           .Register(metrics_)
                           .Add({});
  pending_refused_ = &metrics::BuildCounter()
                          .Name("tierkv_master_puts_refused_total")
                          .Help("PutStart items refused because their client had too many puts in flight")
                          .Register(metrics_)
                          .Add({});
  auto& ssd_records = metrics::BuildCounter()
                          .Name("tierkv_master_ssd_records_total")
                          .Help("SSD records daemons listed after a mount (confirmed) and SSD replicas the master dropped for missing records (dropped)")
                          .Register(metrics_);
  ssd_confirmed_ = &ssd_records.Add({{"outcome", "confirmed"}});
  ssd_dropped_ = &ssd_records.Add({{"outcome", "dropped"}});
  auto& objects = metrics::BuildGauge().Name("tierkv_master_objects").Help("Objects in the index by state").Register(metrics_);
  auto& evictions = metrics::BuildCounter().Name("tierkv_master_evictions_total").Help("Objects evicted").Register(metrics_);
  auto& evicted_bytes = metrics::BuildCounter().Name("tierkv_master_evicted_bytes_total").Help("Bytes evicted").Register(metrics_);
  auto& evictor_passes = metrics::BuildCounter().Name("tierkv_master_evictor_passes_total").Help("Passes of the background evictor above the high watermark").Register(metrics_);
  auto& leases = metrics::BuildGauge().Name("tierkv_master_leased_objects").Help("Objects under a read lease").Register(metrics_);
  auto& released = metrics::BuildCounter().Name("tierkv_master_leases_released_total").Help("Counted read leases (under memory pressure, or staged from SSD) their readers gave back before expiry").Register(metrics_);
  auto& pinned = metrics::BuildGauge().Name("tierkv_master_pinned_objects").Help("Pinned objects, soft or hard").Register(metrics_);
  auto& groups = metrics::BuildGauge().Name("tierkv_master_groups").Help("Groups in the index").Register(metrics_);
  auto& memory = metrics::BuildGauge().Name("tierkv_master_index_memory_bytes").Help("Approximate memory held by the object index").Register(metrics_);
  auto& used = metrics::BuildGauge().Name("tierkv_segment_used_bytes").Help("Bytes allocated per segment").Register(metrics_);
  auto& capacity = metrics::BuildGauge().Name("tierkv_segment_capacity_bytes").Help("Bytes lent per segment").Register(metrics_);
  auto& clients = metrics::BuildGauge().Name("tierkv_master_clients").Help("Clients heard from within the TTL").Register(metrics_);
  auto& ssd_used = metrics::BuildGauge().Name("tierkv_segment_ssd_used_bytes").Help("Bytes on the SSD tier of each segment's daemon, as its heartbeat reports").Register(metrics_);
  auto& ssd_capacity = metrics::BuildGauge().Name("tierkv_segment_ssd_capacity_bytes").Help("SSD tier capacity of each segment's daemon (0: none or down)").Register(metrics_);
  auto& tier_moves = metrics::BuildCounter().Name("tierkv_master_ssd_moves_total").Help("Objects moved by the SSD tier, by kind (offloaded, offload_failed, staged; stage_no_room: reads of SSD replicas that missed for want of DRAM to stage them)").Register(metrics_);
  auto& tenant_used = metrics::BuildGauge().Name("tierkv_tenant_used_bytes").Help("DRAM bytes each tenant's objects hold (size x DRAM replicas)").Register(metrics_);
  auto& tenant_quota = metrics::BuildGauge().Name("tierkv_tenant_quota_bytes").Help("Each tenant's quota (0: none)").Register(metrics_);
  auto& tenant_guaranteed = metrics::BuildGauge().Name("tierkv_tenant_guaranteed_bytes").Help("Bytes of each tenant that other tenants' puts never evict").Register(metrics_);
  auto& tenant_rejected = metrics::BuildCounter().Name("tierkv_tenant_puts_rejected_total").Help("Puts refused RESOURCE_EXHAUSTED for the tenant's quota").Register(metrics_);
  auto& tenant_evicted = metrics::BuildCounter().Name("tierkv_tenant_quota_evicted_bytes_total").Help("Bytes of a tenant's own objects evicted to fit its puts under its quota").Register(metrics_);
  auto& reserved = metrics::BuildGauge().Name("tierkv_master_reservations").Help("Values reserved by read sessions (counted leases), over every client").Register(metrics_);
  auto& reserved_refused = metrics::BuildCounter().Name("tierkv_master_reservations_refused_total").Help("Keys of read-session starts refused because their client held --max-reservations-per-client").Register(metrics_);
  auto& shortfalls = metrics::BuildCounter().Name("tierkv_master_lookup_shortfalls_total").Help("Reads that found less than their read session's start promised, as clients report them (the goal is 0)").Register(metrics_);
  metrics_.AddCollectHook([this, &reserved, &reserved_refused, &shortfalls] {
    const Reservations::Totals t = reservations_.totals(absl::ToUnixMillis(clock_->Now()));
    reserved.Add({}).Set(static_cast<double>(t.held));
    auto catch_up = [](metrics::Counter& c, uint64_t v) {
      if (static_cast<double>(v) > c.Value()) c.Increment(static_cast<double>(v) - c.Value());
    };
    catch_up(reserved_refused.Add({}), t.refused);
    catch_up(shortfalls.Add({}), t.shortfalls);
  });
  metrics_.AddCollectHook([this, &tenant_used, &tenant_quota, &tenant_guaranteed, &tenant_rejected, &tenant_evicted] {
    auto catch_up = [](metrics::Counter& c, uint64_t v) {
      if (static_cast<double>(v) > c.Value()) c.Increment(static_cast<double>(v) - c.Value());
    };
    for (const TenantUsage& t : Tenants()) {
      const metrics::Labels l{{"tenant", std::string(TenantName(t.tenant))}};
      tenant_used.Add(l).Set(static_cast<double>(t.used_bytes));
      tenant_quota.Add(l).Set(static_cast<double>(t.limits.quota_bytes));
      tenant_guaranteed.Add(l).Set(static_cast<double>(t.limits.guaranteed_bytes));
      catch_up(tenant_rejected.Add(l), t.puts_rejected);
      catch_up(tenant_evicted.Add(l), t.evicted_for_quota);
    }
  });
  metrics_.AddCollectHook([this, &objects, &evictions, &evicted_bytes, &evictor_passes, &leases, &pinned, &groups,
                           &memory, &used, &capacity, &clients, &ssd_used, &ssd_capacity, &tier_moves, &released] {
    IndexStats st = index_->Stats();
    objects.Add({{"state", "complete"}}).Set(static_cast<double>(st.objects));
    objects.Add({{"state", "pending"}}).Set(static_cast<double>(st.pending));
    // The index counts; the counters catch up to it (never backwards).
    auto catch_up = [](metrics::Counter& c, uint64_t v) {
      if (static_cast<double>(v) > c.Value()) c.Increment(static_cast<double>(v) - c.Value());
    };
    catch_up(evictions.Add({}), st.evictions);
    catch_up(evicted_bytes.Add({}), st.evicted_bytes);
    catch_up(tier_moves.Add({{"kind", "offloaded"}}), st.offloaded);
    catch_up(tier_moves.Add({{"kind", "offload_failed"}}), st.offload_failed);
    catch_up(tier_moves.Add({{"kind", "staged"}}), st.staged);
    catch_up(tier_moves.Add({{"kind", "stage_no_room"}}), st.stage_no_room);
    catch_up(evictor_passes.Add({}), st.evictor_passes);
    catch_up(released.Add({}), st.leases_released);
    leases.Add({}).Set(static_cast<double>(st.leased));
    pinned.Add({}).Set(static_cast<double>(st.pinned));
    groups.Add({}).Set(static_cast<double>(st.groups));
    memory.Add({}).Set(static_cast<double>(st.memory_bytes));
    clients.Add({}).Set(static_cast<double>(clients_seen()));
    // Per-segment gauges: set the live segments', drop departed ones'.
    std::set<metrics::Labels> live;
    for (const SegmentSnapshot& s : registry_.Snapshot()) {
      metrics::Labels l{{"segment", s.spec.name}, {"host", s.spec.host}};
      used.Add(l).Set(static_cast<double>(s.used));
      capacity.Add(l).Set(static_cast<double>(s.spec.capacity));
      ssd_used.Add(l).Set(static_cast<double>(s.spec.ssd_used));
      ssd_capacity.Add(l).Set(static_cast<double>(s.spec.ssd_capacity));
      live.insert(std::move(l));
    }
    for (const prometheus::MetricFamily& f : used.Collect()) {
      for (const prometheus::ClientMetric& m : f.metric) {
        metrics::Labels l;
        for (const prometheus::ClientMetric::Label& label : m.label) l[label.name] = label.value;
        if (live.contains(l)) continue;
        metrics::RemoveLabels(used, l);
        metrics::RemoveLabels(capacity, l);
        metrics::RemoveLabels(ssd_used, l);
        metrics::RemoveLabels(ssd_capacity, l);
      }
    }
  });
}

}  // namespace tierkv::master
