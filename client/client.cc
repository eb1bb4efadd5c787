#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/internal/replica_cache.h"
#include "client/internal/trailer_arena.h"
#include "client/lender.h"
#include "base/auth.h"
#include "base/crc32c.h"
#include "proto/etcd_client.h"
#include "base/failpoint.h"
#include "base/mutex.h"
#include "base/status.h"
#include "httplib.h"

namespace tierkv::client {

namespace internal {
// Data grants for daemons that run --auth token, one per segment, reused
// until half their life is gone (a connection needs one only to open). An
// empty grant (the segment's daemon needs none) is remembered too.
class GrantCache {
 public:
  explicit GrantCache(MasterClient* master) : master_(master) {}
  // `renew`: the daemon refused the cached grant (it restarted with a new key).
  absl::StatusOr<transport::DataGrant> Get(const std::string& segment, bool renew,
                                           absl::Time deadline = absl::InfiniteFuture()) {
    const absl::Time now = absl::Now();
    if (!renew) {
      MutexLock lock(&mu_);
      auto it = grants_.find(segment);
      if (it != grants_.end() && now < it->second.renew_at) return it->second.grant;
    }
    ASSIGN_OR_RETURN(v1::DataGrant g, master_->GrantData(segment, deadline));
    // An empty grant is asked again a minute on: its daemon may restart with --auth token.
    const absl::Time renew_at =
        g.grant().empty() ? now + absl::Minutes(1) : now + (auth::GrantExpiry(g.grant()) - now) / 2;
    Entry e{{g.grant(), g.session_key()}, renew_at};
    MutexLock lock(&mu_);
    grants_[segment] = e;
    return e.grant;
  }

 private:
  struct Entry {
    transport::DataGrant grant;
    absl::Time renew_at;
  };
  MasterClient* const master_;
  Mutex mu_;
  absl::flat_hash_map<std::string, Entry> grants_ ABSL_GUARDED_BY(mu_);
};
}  // namespace internal

namespace {

using transport::Op;
using transport::Request;

// The trailer stored after every value binds it to its key and put
// (client/internal/trailer_arena.h). Trailers live in the client's
// registered TrailerArena, so every transport (rdma included) can move them.
using internal::CheckTrailer;
using internal::EncodeTrailer;
using internal::KeyCrc;
using internal::TrailerSize;

// The replicas a GetReplicas answer marks as staging extents are filled
// from their daemon's SSD tier (POST /tier/stage, one request per daemon)
// before anyone reads them; they are then read like any replica, trailer
// and checksum included. Per asked key: OK, or NOT_FOUND saying why its
// value could not be staged (the record was dropped, the tier is down):
// a miss, as an eviction would have been.
std::vector<absl::Status> StageSsdHits(const v1::GetReplicasResponse& resp, const std::vector<std::string>& keys,
                                       absl::Duration timeout, internal::GrantCache* grants,
                                       const auth::TlsFiles& tls) {
  std::vector<absl::Status> out(keys.size());
  if (resp.replica_stage_size() == 0) return out;
  struct Batch {
    v1::TierMoveRequest req;
    std::vector<size_t> keys;
  };
  absl::flat_hash_map<uint32_t, Batch> by_segment;
  for (int i = 0, r = 0; i < resp.sizes_size() && static_cast<size_t>(i) < keys.size(); ++i) {
    const int count = i < resp.replica_counts_size() ? static_cast<int>(resp.replica_counts(i)) : 0;
    // Bounded by the lists as well as the count, which a broken master may overstate.
    const int listed =
        std::min({resp.replica_stage_size(), resp.replica_segments_size(), resp.replica_offsets_size()});
    for (int k = 0; k < count && r < listed; ++k, ++r) {
      if (!resp.replica_stage(r)) continue;
      Batch& b = by_segment[resp.replica_segments(r)];
      v1::TierMoveItem* item = b.req.add_items();
      // The daemon knows the record by the master's key: in a tenant, the
      // tenant's prefix and ours.
      item->set_key(resp.stage_key_prefix().empty() ? keys[i] : absl::StrCat(resp.stage_key_prefix(), keys[i]));
      item->set_offset(resp.replica_offsets(r));
      item->set_length(resp.sizes(i));
      b.keys.push_back(static_cast<size_t>(i));
    }
  }
  // A stage must end inside the read lease: past it the copy may be
  // evicted and its extent reused.
  for (int i = 0; i < resp.sizes_size() && resp.now_unix_ms() > 0; ++i) {
    if (i < resp.lease_expiry_unix_ms_size() && resp.lease_expiry_unix_ms(i) > 0) {
      timeout = std::min(timeout, absl::Milliseconds(resp.lease_expiry_unix_ms(i) - resp.now_unix_ms()));
    }
  }
  const auto us = std::chrono::microseconds(std::max<int64_t>(absl::ToInt64Microseconds(timeout), 1000));
  const absl::Time start = absl::Now();
  for (const auto& [segment, b] : by_segment) {
    auto endpoint = resp.stage_endpoints().find(segment);
    absl::Status failed;
    v1::TierMoveResponse answer;
    if (endpoint == resp.stage_endpoints().end() || endpoint->second.empty()) {
      failed = absl::UnavailableError("its daemon has no SSD tier now");
    } else {
      // A daemon serving HTTPS advertises https://host:port.
      absl::StatusOr<std::unique_ptr<httplib::Client>> cli =
          auth::NewHttpClient(endpoint->second, tls, absl::FromChrono(us));
      // What is left of the lease bounds the daemon's writes into our
      // extents, measured from here so no clocks need agree.
      const int64_t within = std::max<int64_t>(0, absl::ToInt64Milliseconds(timeout - (absl::Now() - start)));
      httplib::Headers headers{{"X-Tierkv-Stage-Within-Ms", absl::StrCat(within)}};
      const std::string body = b.req.SerializeAsString();
      // A daemon running --auth token wants the order signed with a grant for its segment.
      if (segment < static_cast<uint32_t>(resp.segments_size())) {
        absl::StatusOr<transport::DataGrant> g =
            grants->Get(resp.segments(static_cast<int>(segment)), false, absl::Now() + timeout);
        if (g.ok() && !g->grant.empty()) {
          for (auto& [name, value] : auth::SignTierRequest(g->grant, g->session_key, "/tier/stage", body, absl::Now())) {
            headers.emplace(name, value);
          }
        }
      }
      if (!cli.ok()) {
        failed = cli.status();
      } else if (httplib::Result res = (*cli)->Post("/tier/stage", headers, body, "application/x-protobuf"); !res) {
        failed = absl::UnavailableError(absl::StrCat(endpoint->second, ": ", httplib::to_string(res.error())));
      } else if (res->status != 200 || !answer.ParseFromString(res->body)) {
        failed = absl::UnavailableError(absl::StrCat(endpoint->second, ": HTTP ", res->status));
      }
    }
    for (size_t k = 0; k < b.keys.size(); ++k) {
      absl::Status st = failed;
      if (st.ok() && k >= static_cast<size_t>(answer.status_size())) {
        st = absl::UnavailableError("no answer for it");
      } else if (st.ok() && answer.status(static_cast<int>(k)).code() != 0) {
        const v1::ItemStatus& got = answer.status(static_cast<int>(k));
        st = absl::Status(static_cast<absl::StatusCode>(got.code()), got.message());
      }
      if (!st.ok()) {
        out[b.keys[k]] = absl::NotFoundError(absl::StrCat(keys[b.keys[k]], ": staging from SSD: ", st.message()));
      }
    }
  }
  return out;
}

// Past a transfer's deadline, how long a Wait allows for its last
// completions (the engine ends every task by its deadline).
constexpr absl::Duration kCompletionGrace = absl::Seconds(5);

// The bytes of a put item, in order: its parts, or its one value.
absl::Span<const absl::string_view> Parts(const PutItem& it) {
  return it.parts.empty() ? absl::MakeConstSpan(&it.value, 1) : absl::MakeConstSpan(it.parts);
}

uint64_t ValueSize(const PutItem& it) {
  uint64_t n = 0;
  for (absl::string_view p : Parts(it)) n += p.size();
  return n;
}

void MakeTrailer(const std::string& key, absl::Span<const absl::string_view> parts, uint64_t put_id, char* t) {
  uint32_t crc = KeyCrc(key);
  for (absl::string_view p : parts) crc = Crc32cExtend(crc, p.data(), p.size());
  EncodeTrailer(crc, put_id, t);
}

// The one non-empty part of a put item, or null when it has none or several.
const absl::string_view* OnePart(const PutItem& it) {
  const absl::string_view* one = nullptr;
  for (const absl::string_view& p : Parts(it)) {
    if (p.empty()) continue;
    if (one != nullptr) return nullptr;
    one = &p;
  }
  return one;
}

// Worth trying another replica after this transfer error.
bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsNotFound(s) ||
         absl::IsOutOfRange(s) || absl::IsDataLoss(s);
}

std::string LocalHostName() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

}  // namespace

uint64_t StoredSize(uint64_t value_size) { return value_size + internal::kTrailerBytes; }

uint64_t ValueSizeOf(uint64_t stored_size, uint64_t put_id) {
  const uint64_t t = TrailerSize(put_id);
  return stored_size > t ? stored_size - t : 0;
}

absl::StatusOr<std::string> DiscoverMetadata(const std::string& master, absl::Duration timeout,
                                             const std::string& token, const auth::TlsFiles& tls) {
  MasterClientOptions mo;
  mo.rpc_timeout = timeout;
  mo.token = token;
  mo.tls = tls;
  ASSIGN_OR_RETURN(std::unique_ptr<MasterClient> m, MasterClient::Create(master, mo));
  ASSIGN_OR_RETURN(v1::StatsResponse stats, m->Stats());
  if (stats.http_port() == 0) return absl::NotFoundError(absl::StrCat("master ", master, " reports no HTTP port"));
  std::vector<std::string> urls;
  for (absl::string_view one : m->masters()) {
    std::string url = absl::StrCat(stats.http_tls() ? "https://" : "http://", one.substr(0, one.rfind(':')), ":",
                                   stats.http_port());
    // Masters sharing a host (tests, a rolling move) would give one URL twice.
    if (std::find(urls.begin(), urls.end(), url) == urls.end()) urls.push_back(std::move(url));
  }
  return absl::StrJoin(urls, ",");
}

absl::StatusOr<std::string> MetadataUrl(const std::string& metadata, const std::string& master,
                                        absl::Duration timeout, const std::string& token, const auth::TlsFiles& tls) {
  if (!metadata.empty()) return metadata;
  if (IsEtcdMasterAddress(master) || absl::StrContains(master, ',')) {
    return DiscoverMetadata(master, timeout, token, tls);
  }
  const size_t colon = master.rfind(':');
  // A gRPC target URI ("dns:///h:p") names no host to guess a URL from.
  if (colon == std::string::npos || colon == 0 || absl::StrContains(master, '/')) {
    return absl::InvalidArgumentError(
        absl::StrCat("master address '", master, "' is not host:port: give the metadata URL"));
  }
  return absl::StrCat(tls.enabled() ? "https://" : "http://", master.substr(0, colon), ":8080");
}

transport::MetadataRefresh MetadataRefresher(const std::string& metadata, const std::string& master,
                                             absl::Duration timeout, const std::string& token,
                                             const auth::TlsFiles& tls) {
  if (!metadata.empty() || !(IsEtcdMasterAddress(master) || absl::StrContains(master, ','))) return nullptr;
  return [master, timeout, token, tls] { return DiscoverMetadata(master, timeout, token, tls); };
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  std::unique_ptr<Client> c(new Client());
  if (options.client_id.empty()) options.client_id = RandomId().substr(0, 12);
  if (options.host.empty()) options.host = LocalHostName();
  // A spin past a millisecond is no longer cheaper than a wake-up.
  options.reply_spin = std::clamp(options.reply_spin, absl::ZeroDuration(), absl::Milliseconds(1));
  if (options.token.empty()) {
    ASSIGN_OR_RETURN(options.token, auth::ReadTokenFile(options.token_file));
  }
  c->options_ = options;
  MasterClientOptions mo;
  mo.token = options.token;
  mo.tls = options.tls;
  mo.rpc_timeout = options.rpc_timeout;
  mo.client_id = options.client_id;
  mo.reply_spin = options.reply_spin;
  ASSIGN_OR_RETURN(c->master_, MasterClient::Create(options.master, mo));
  transport::EngineOptions eo;
  c->grants_ = std::make_shared<internal::GrantCache>(c->master_.get());
  eo.grants = [cache = c->grants_](const std::string& segment, bool renew,
                                   absl::Time deadline) -> absl::StatusOr<transport::DataGrant> {
    ASSIGN_OR_RETURN(transport::DataGrant g, cache->Get(segment, renew, deadline));
    if (g.grant.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("the master holds no data key for segment ", segment,
                                                        " (its daemon restarted without --auth token?)"));
    }
    return g;
  };
  if (options.metadata_client) {
    eo.metadata = options.metadata_client;
  } else {
    ASSIGN_OR_RETURN(options.metadata,
                     MetadataUrl(options.metadata, options.master, options.rpc_timeout, options.token, options.tls));
    ASSIGN_OR_RETURN(std::unique_ptr<transport::MetadataClient> m,
                     transport::NewHttpMetadata(options.metadata, options.rpc_timeout, options.token, options.tls,
                                                MetadataRefresher(c->options_.metadata, options.master,
                                                                  options.rpc_timeout, options.token, options.tls)));
    c->options_.metadata = options.metadata;
    eo.metadata = std::move(m);
  }
  eo.transports = options.transports;
  eo.backend.listen = options.listen;
  eo.backend.connections = options.connections;
  eo.backend.reply_spin = options.reply_spin;
  eo.backend.rdma_devices = options.rdma_devices;
  eo.backend.tls = options.tls;  // its CA verifies daemons serving --data-tls
  // A segment this process lends, in a cluster whose callers authenticate,
  // takes data grants as a daemon's does: whoever reaches this process's
  // port needs the master's word for it.
  eo.data_grants = options.lend_size > 0 && (!options.token.empty() || !options.tls.cert.empty());
  eo.workers = options.workers;
  eo.host = options.host;
  eo.default_timeout = options.transfer_timeout;
  ASSIGN_OR_RETURN(c->engine_, transport::TransferEngine::Create(eo));
  c->trailers_ = std::make_unique<internal::TrailerArena>(c->engine_.get());
  MasterClient* master = c->master_.get();
  c->replicas_ = std::make_unique<internal::ReplicaCache>(
      options.replica_cache, options.replica_cache_hold,
      [master](const std::string& key, uint64_t token, int64_t expiry_ms) { master->ReleaseLease(key, token, expiry_ms); },
      options.replica_cache_fresh);
  if (options.lend_size > 0) {
    LenderOptions lo;
    lo.name = options.lend_name.empty() ? absl::StrCat("client-", options.client_id) : options.lend_name;
    lo.host = options.host;
    lo.size = options.lend_size;
    lo.wait_for_mount = true;
    ASSIGN_OR_RETURN(c->lender_, SegmentLender::Start(lo, c->engine_.get(), c->master_.get()));
  }
  return c;
}

Client::~Client() {
  if (lender_) lender_->Stop();
  lender_.reset();
  trailers_.reset();
  engine_.reset();
}

std::string Client::local_segment() const { return lender_ ? lender_->name() : ""; }
bool Client::local_segment_mounted() const { return lender_ && lender_->mounted(); }

absl::Status Client::RegisterMemory(void* addr, size_t length) {
  return engine_->RegisterMemory(addr, length, "cpu:0");
}
absl::Status Client::UnregisterMemory(void* addr) { return engine_->UnregisterMemory(addr); }

absl::Status Client::Put(const std::string& key, absl::string_view value, const PutOptions& options) {
  return BatchPut({{key, value, "", ""}}, options)[0];
}

std::vector<absl::Status> Client::BatchPut(const std::vector<PutItem>& items, const PutOptions& options) {
  std::vector<absl::Status> out(items.size());
  std::vector<size_t> todo(items.size());
  for (size_t i = 0; i < todo.size(); ++i) todo[i] = i;
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  absl::Duration backoff = absl::Milliseconds(50);
  bool put_again = false;  // after a failover: once
  while (!todo.empty()) {
    std::vector<PutItem> some;
    for (size_t i : todo) some.push_back(items[i]);
    uint64_t granted = 0;
    bool unanswered = false;
    std::vector<absl::Status> got = PutOnce(some, options, &granted, &unanswered);
    // A leader replaced between the grant and the commit: the new one holds
    // no pending put (PutEnd: NOT_FOUND), its daemons refuse the old
    // epoch's writes (FAILED_PRECONDITION), or the commit found no leader
    // in time (UNAVAILABLE). Nothing of the put is visible, and the new
    // leader grants it afresh. A single master keeps epoch 0. Or the
    // PutStart itself went unanswered (its master died holding it): a grant
    // it made died with it, since pending puts are not persisted, and a
    // master that lives on refuses the second PutStart as a put in
    // progress, which fails the put as the first answer would have.
    // Only one that failed within the call timeout is tried again, so a put
    // waits at most about twice that when no master answers at all.
    const bool failed_over =
        !put_again && ((granted != 0 && master_->epoch() > granted) || (unanswered && absl::Now() < deadline));
    std::vector<size_t> next;
    bool waiting = false;
    for (size_t k = 0; k < todo.size(); ++k) {
      const absl::Status& s = got[k];
      // A group is never put again in part: its members fail whole, as they would.
      const bool alone = items[todo[k]].group.empty();
      const bool remount = alone && absl::IsUnavailable(s) && absl::StrContains(s.message(), kAwaitingRemount);
      const bool lost = failed_over && alone &&
                        (absl::IsNotFound(s) || absl::IsFailedPrecondition(s) || absl::IsUnavailable(s));
      if ((remount && absl::Now() + backoff < deadline) || lost) {
        next.push_back(todo[k]);
        waiting |= remount;
      }
      out[todo[k]] = std::move(got[k]);
    }
    put_again |= failed_over && !next.empty();
    if (waiting) {
      std::this_thread::sleep_for(absl::ToChronoMilliseconds(backoff));
      backoff = std::min(backoff * 2, absl::Milliseconds(200));
    }
    todo = std::move(next);
  }
  return out;
}

std::vector<absl::Status> Client::PutOnce(const std::vector<PutItem>& items, const PutOptions& options,
                                          uint64_t* epoch, bool* unanswered) {
  const size_t n = items.size();
  std::vector<absl::Status> out(n);
  if (n == 0) return out;
  // One registered trailer per item, the same bytes for every replica.
  absl::StatusOr<internal::TrailerBlock> trailers = trailers_->Acquire(n);
  if (!trailers.ok()) {
    for (auto& s : out) s = Annotate(trailers.status(), "registering trailer memory");
    return out;
  }
  v1::PutStartRequest req;
  req.set_client_id(options_.client_id);
  req.set_put_ids(true);
  for (const PutItem& it : items) {
    v1::PutStartItem* p = req.add_items();
    p->set_key(it.key);
    p->set_size(StoredSize(ValueSize(it)));
    p->set_replicas(std::max(1, options.replicas));
    p->set_preferred_segment(options.preferred_segment);
    p->set_group(it.group);
    p->set_soft_pin(options.soft_pin);
    p->set_hard_pin(options.hard_pin);
    p->set_parent_key(it.parent_key);
  }
  absl::StatusOr<v1::PutStartResponse> started = master_->PutStart(req);
  if (!started.ok()) {
    *unanswered = absl::IsUnavailable(started.status());
    for (auto& s : out) s = started.status();
    return out;
  }
  *epoch = started->epoch();

  // A writer dying here holds extents that nothing will ever commit.
  (void)TIERKV_FAILPOINT("client.put.after_start");

  // Values go out first and the trailers follow in a second batch. Where
  // the first replica's transport checksums as it copies (shm), that write
  // brings the CRC back and the trailer waits for it: one pass over the
  // value instead of two. Elsewhere the checksum is computed here while the
  // values travel, and its trailer need not wait for them.
  std::vector<Request> values, tails;
  std::vector<size_t> value_owner, tail_owner;
  std::vector<bool> began(n, false), fused(n, false);
  std::vector<uint64_t> put_ids(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const v1::PutStartResult& r = started->results(static_cast<int>(i));
    out[i] = FromItem(r.status());
    if (!out[i].ok()) continue;
    began[i] = true;
    put_ids[i] = r.put_id();
    if (put_ids[i] == 0) {
      // Without one the trailer could not be told from another put's.
      out[i] = absl::FailedPreconditionError(
          absl::StrCat(items[i].key, ": the master gave no put id (it predates them); upgrade the master"));
      continue;
    }
    const absl::string_view* one = OnePart(items[i]);
    uint64_t vsize = 0;
    for (const v1::Extent& e : r.replicas()) {
      vsize = 0;
      transport::CopyCrc* crc = nullptr;
      if (one != nullptr && !fused[i] && engine_->ChecksumsCopies(e.segment(), one->size())) {
        fused[i] = true;
        crc = trailers->crc(i);
        crc->value = KeyCrc(items[i].key);  // the copy extends it over the value
      }
      for (absl::string_view part : Parts(items[i])) {
        if (part.empty()) continue;
        values.push_back(
            {Op::kWrite, const_cast<char*>(part.data()), e.segment(), e.offset() + vsize, part.size(), crc,
             started->epoch()});
        value_owner.push_back(i);
        vsize += part.size();
      }
      tails.push_back({Op::kWrite, trailers->slot(i), e.segment(), e.offset() + vsize, internal::kTrailerBytes,
                       nullptr, started->epoch()});
      tail_owner.push_back(i);
    }
  }
  // A fused item's trailer, once its value has landed: the CRC its copy
  // worked out, or (another route took it) one computed here.
  auto finish_fused = [&](size_t i) {
    const transport::CopyCrc* crc = trailers->crc(i);
    if (crc->set) {
      EncodeTrailer(crc->value, put_ids[i], trailers->slot(i));
    } else {
      MakeTrailer(items[i].key, Parts(items[i]), put_ids[i], trailers->slot(i));
    }
  };
  const absl::Time wait_until = absl::Now() + options_.transfer_timeout + kCompletionGrace;
  std::shared_ptr<transport::Batch> value_batch, tail_batch;
  std::shared_ptr<transport::Batch> early_tail_batch;  // the fused path's unfused trailers
  std::vector<size_t> early_tail_owner;
  if (std::find(fused.begin(), fused.end(), true) != fused.end()) {
    // Checksummed by the copies (shm): this thread moves a share of the
    // values instead of waking a worker for it. Unfused items' trailers
    // go out as soon as they are computed; a fused one waits for its value
    // to land OK (only then is the CRC its copy left there complete).
    value_batch = engine_->SubmitHere(std::move(values), options_.transfer_timeout);
    trailers->Hold(value_batch);  // it writes the block's CRC slots
    std::vector<Request> early, late;
    std::vector<size_t> late_owner;
    for (size_t k = 0; k < tails.size(); ++k) {
      if (fused[tail_owner[k]]) continue;
      early.push_back(tails[k]);
      early_tail_owner.push_back(tail_owner[k]);
    }
    for (size_t i = 0; i < n; ++i) {
      if (began[i] && out[i].ok() && !fused[i]) MakeTrailer(items[i].key, Parts(items[i]), put_ids[i], trailers->slot(i));
    }
    if (!early.empty()) {
      early_tail_batch = engine_->Submit(std::move(early), options_.transfer_timeout);
      trailers->Hold(early_tail_batch);
    }
    (void)value_batch->Wait(wait_until);
    std::vector<bool> landed(n, true);
    const std::vector<absl::Status> wrote = value_batch->statuses();
    for (size_t k = 0; k < value_owner.size(); ++k) {
      if (k >= wrote.size() || !wrote[k].ok()) landed[value_owner[k]] = false;
    }
    for (size_t i = 0; i < n; ++i) {
      if (fused[i] && landed[i]) finish_fused(i);
    }
    for (size_t k = 0; k < tails.size(); ++k) {
      // A value that did not land fails its put (recorded below); its
      // trailer is not written.
      if (!fused[tail_owner[k]] || !landed[tail_owner[k]]) continue;
      late.push_back(tails[k]);
      late_owner.push_back(tail_owner[k]);
    }
    tails = std::move(late);
    tail_owner = std::move(late_owner);
    tail_batch = engine_->SubmitHere(std::move(tails), options_.transfer_timeout);
    trailers->Hold(tail_batch);
  } else if (n == 1) {
    // A single put: its checksum first, then value and trailer in one
    // batch moved by this thread (no hand-off, one round of the wire).
    if (began[0] && out[0].ok()) MakeTrailer(items[0].key, Parts(items[0]), put_ids[0], trailers->slot(0));
    values.insert(values.end(), tails.begin(), tails.end());
    std::shared_ptr<transport::Batch> both = engine_->SubmitHere(std::move(values), options_.transfer_timeout);
    trailers->Hold(both);
    (void)both->Wait(wait_until);
    std::vector<absl::Status> statuses = both->statuses();
    for (size_t k = 0; k < statuses.size(); ++k) {
      if (!statuses[k].ok() && out[0].ok()) {
        out[0] = Annotate(statuses[k], absl::StrCat("writing ", items[0].key));
      }
    }
  } else {
    value_batch = engine_->Submit(std::move(values), options_.transfer_timeout);
    for (size_t i = 0; i < n; ++i) {
      if (began[i] && out[i].ok()) MakeTrailer(items[i].key, Parts(items[i]), put_ids[i], trailers->slot(i));
    }
    tail_batch = engine_->Submit(std::move(tails), options_.transfer_timeout);
    trailers->Hold(tail_batch);
  }
  // A put commits only when every value and trailer write finished OK. A
  // Wait that runs out seals its batch, so unfinished writes read
  // DEADLINE_EXCEEDED below and their keys are revoked.
  auto record = [&](const transport::Batch& batch, const std::vector<size_t>& owner) {
    std::vector<absl::Status> statuses = batch.statuses();
    for (size_t k = 0; k < owner.size(); ++k) {
      size_t i = owner[k];
      absl::Status st = k < statuses.size() ? statuses[k] : absl::InternalError("missing transfer status");
      if (!st.ok() && out[i].ok()) out[i] = Annotate(st, absl::StrCat("writing ", items[i].key));
    }
  };
  if (value_batch) {
    (void)value_batch->Wait(wait_until);
    (void)tail_batch->Wait(wait_until);
    record(*value_batch, value_owner);
    record(*tail_batch, tail_owner);
  }
  if (early_tail_batch) {
    (void)early_tail_batch->Wait(wait_until);
    record(*early_tail_batch, early_tail_owner);
  }
  // A group with a failed member is given up whole.
  absl::flat_hash_set<std::string> failed_groups;
  for (size_t i = 0; i < n; ++i) {
    if (!items[i].group.empty() && !out[i].ok()) failed_groups.insert(items[i].group);
  }
  std::vector<std::string> commit, revoke;
  std::vector<size_t> commit_idx;
  for (size_t i = 0; i < n; ++i) {
    if (!began[i]) continue;
    if (out[i].ok() && failed_groups.contains(items[i].group)) {
      out[i] = absl::AbortedError(absl::StrCat(items[i].key, ": another member of group ",
                                               items[i].group, " failed"));
    }
    if (out[i].ok()) {
      commit.push_back(items[i].key);
      commit_idx.push_back(i);
    } else {
      revoke.push_back(items[i].key);
    }
  }
  // A writer dying here (between its data and its commit) must leave
  // nothing visible; the tests kill it at this point.
  (void)TIERKV_FAILPOINT("client.put.before_end");
  if (!commit.empty()) {
    // A key put anew (after a removal elsewhere) is no longer where it was.
    for (const std::string& k : commit) replicas_->Erase(k);
    absl::StatusOr<v1::KeysResponse> ended = master_->PutEnd(commit);
    for (size_t k = 0; k < commit.size(); ++k) {
      absl::Status s = ended.ok() ? FromItem(ended->status(static_cast<int>(k))) : ended.status();
      if (!s.ok()) {
        out[commit_idx[k]] = s;
        revoke.push_back(commit[k]);
      }
    }
  }
  // Best effort: the master also reclaims puts that are never committed.
  if (!revoke.empty()) (void)master_->PutRevoke(revoke);
  return out;
}

absl::StatusOr<std::string> Client::Get(const std::string& key) {
  return std::move(BatchGet(std::vector<std::string>{key})[0]);
}

absl::StatusOr<size_t> Client::Get(const std::string& key, absl::Span<char> out) {
  return std::move(BatchGet({key}, {out})[0]);
}

struct Client::Impl {
  // Reads the values GetReplicas described into `outs` (each already
  // checked to be large enough), trying replicas in turn. Key i's read
  // must finish before lease_end[i]; one that does not is a miss.
  static void Read(Client* c, const std::vector<std::string>& keys, const std::vector<internal::Located>& where,
                   const std::vector<Pieces>& outs, std::vector<absl::Status>* status, absl::Duration timeout) {
    if (timeout <= absl::ZeroDuration()) timeout = c->options_.transfer_timeout;
    const absl::Time deadline = absl::Now() + timeout;
    const size_t n = keys.size();
    std::vector<bool> pending(n);
    for (size_t i = 0; i < n; ++i) pending[i] = (*status)[i].ok();
    absl::StatusOr<internal::TrailerBlock> trailers = c->trailers_->Acquire(n);
    if (!trailers.ok()) {
      for (size_t i = 0; i < n; ++i) {
        if (pending[i]) (*status)[i] = Annotate(trailers.status(), "registering trailer memory");
      }
      return;
    }
    // Past its lease the extent may hold another put's bytes: a miss.
    auto lease_over = [&](size_t i) {
      if (absl::Now() < where[i].lease_end) return false;
      (*status)[i] = absl::NotFoundError(absl::StrCat(keys[i], ": the read did not finish inside its lease"));
      pending[i] = false;
      return true;
    };
    for (uint32_t attempt = 0;; ++attempt) {
      std::vector<Request> requests;
      std::vector<size_t> owner;
      for (size_t i = 0; i < n; ++i) {
        if (!pending[i] || lease_over(i)) continue;
        if (attempt >= where[i].replicas.size()) {
          pending[i] = false;  // replicas exhausted; status holds the last error
          continue;
        }
        const std::string& seg = where[i].replicas[attempt].first;
        uint64_t off = where[i].replicas[attempt].second;
        uint64_t vsize = 0;
        // A copy that checksums extends the key's CRC (none for a trailer without a put id).
        if (attempt == 0) trailers->crc(i)->value = where[i].put_id != 0 ? KeyCrc(keys[i]) : 0;
        for (absl::Span<char> piece : outs[i]) {
          if (piece.empty()) continue;
          requests.push_back({Op::kRead, piece.data(), seg, off + vsize, piece.size(),
                              // Only the first attempt's: a late transfer of a failed one may still write it.
                              attempt == 0 && outs[i].size() == 1 ? trailers->crc(i) : nullptr});
          owner.push_back(i);
          vsize += piece.size();
        }
        requests.push_back({Op::kRead, trailers->slot(i), seg, off + vsize, TrailerSize(where[i].put_id)});
        owner.push_back(i);
      }
      if (requests.empty()) return;
      // Submit in a few chunks and check each chunk's checksums while the
      // later ones are still on the wire.
      constexpr size_t kChunks = 4;
      size_t per = std::max<size_t>(2, (requests.size() / kChunks + 1) & ~size_t{1});
      struct Chunk {
        size_t at;
        absl::Time deadline;  // the caller's, or the earliest lease in it
        std::shared_ptr<transport::Batch> batch;
      };
      std::vector<Chunk> chunks;
      for (size_t at = 0; at < requests.size();) {
        size_t end = std::min(requests.size(), at + per);
        while (end < requests.size() && owner[end] == owner[end - 1]) ++end;  // keep a key's requests together
        absl::Time until = deadline;
        for (size_t k = at; k < end; ++k) until = std::min(until, where[owner[k]].lease_end);
        absl::Duration left = until - absl::Now();
        if (left <= absl::ZeroDuration()) left = absl::Milliseconds(1);
        std::vector<Request> part(requests.begin() + at, requests.begin() + end);
        // The last chunk is moved by this thread (its checksums are checked
        // next anyway); a single get is all last chunk: no thread hop.
        chunks.push_back({at, until,
                          end == requests.size() ? c->engine_->SubmitHere(std::move(part), left)
                                                 : c->engine_->Submit(std::move(part), left)});
        trailers->Hold(chunks.back().batch);
        at = end;
      }
      std::vector<absl::Status> round(n);
      for (const Chunk& chunk : chunks) {
        // A Wait that runs out seals the batch: what did not finish reads
        // DEADLINE_EXCEEDED.
        (void)chunk.batch->Wait(chunk.deadline + kCompletionGrace);
        const std::vector<absl::Status> got = chunk.batch->statuses();
        for (size_t k = 0; k < got.size(); ++k) {
          if (!got[k].ok() && round[owner[chunk.at + k]].ok()) round[owner[chunk.at + k]] = got[k];
        }
        size_t end = chunk.at + got.size();
        for (size_t k = chunk.at; k < end; ++k) {
          size_t i = owner[k];
          if (k + 1 < end && owner[k + 1] == i) continue;  // check once, at the key's last request
          if (!pending[i] || lease_over(i)) continue;
          absl::Status st = round[i];
          if (st.ok()) {
            st = CheckTrailer(trailers->slot(i), where[i].put_id, keys[i], outs[i], c->options_.verify_checksums,
                              attempt == 0 ? *trailers->crc(i) : transport::CopyCrc{});
          }
          (*status)[i] = st.ok() ? st : Annotate(st, absl::StrCat("reading ", keys[i]));
          if (st.ok() || !Retryable(st)) pending[i] = false;
        }
      }
    }
  }

  // Where each key's value sits and when its read lease ends on this
  // process's clock, less a margin for clock drift and the last bytes' way
  // back. `asked` is when the GetReplicas call started: the lease began no
  // earlier.
  static std::vector<internal::Located> Locate(const v1::GetReplicasResponse& resp, absl::Time asked) {
    std::vector<internal::Located> out(resp.sizes_size());
    for (int i = 0, r = 0; i < resp.sizes_size(); ++i) {
      internal::Located& w = out[i];
      w.stored_size = resp.sizes(i);
      w.put_id = i < resp.put_ids_size() ? resp.put_ids(i) : 0;
      const int64_t expiry = i < resp.lease_expiry_unix_ms_size() ? resp.lease_expiry_unix_ms(i) : 0;
      // The master's clock beside its lease measures the lease's length;
      // without it (an older master) the expiry is read on our clock.
      // An expiry already past is a lease over (and is not subtracted, so
      // no value a master sends can overflow).
      const int64_t now_ms = resp.now_unix_ms();
      absl::Time until = now_ms > 0 ? asked + absl::Milliseconds(expiry > now_ms ? expiry - now_ms : 0)
                                    : absl::FromUnixMillis(expiry);
      absl::Duration margin = std::min(absl::Milliseconds(500), std::max(until - asked, absl::ZeroDuration()) / 10);
      w.lease_end = until - margin;
      if (i < resp.lease_tokens_size()) {
        w.lease_token = resp.lease_tokens(i);
        w.lease_expiry_ms = expiry;
      }
      const int count = i < resp.replica_counts_size() ? static_cast<int>(resp.replica_counts(i)) : 0;
      for (int k = 0; k < count && r < resp.replica_offsets_size() && r < resp.replica_segments_size(); ++k, ++r) {
        const uint32_t seg = resp.replica_segments(r);
        if (seg >= static_cast<uint32_t>(resp.segments_size())) continue;  // malformed: not a replica
        w.replicas.emplace_back(resp.segments(static_cast<int>(seg)), resp.replica_offsets(r));
      }
    }
    return out;
  }

  // Per-key status before reading: NOT_FOUND for misses, DATA_LOSS for
  // impossible sizes.
  static absl::Status Found(const std::string& key, const internal::Located& where) {
    if (where.stored_size == 0) return absl::NotFoundError(key);
    if (where.stored_size < TrailerSize(where.put_id)) {
      return absl::DataLossError(absl::StrCat(key, ": stored size ", where.stored_size, " is too small"));
    }
    return absl::OkStatus();
  }
};

std::vector<absl::StatusOr<size_t>> Client::Fetch(const std::vector<std::string>& keys, absl::Duration timeout,
                                                  const std::function<bool(size_t, uint64_t, Pieces*)>& place) {
  const size_t n = keys.size();
  std::vector<absl::StatusOr<size_t>> result(n);
  if (n == 0) return result;
  std::vector<internal::Located> where(n);
  std::vector<absl::Status> st(n);
  // Keys whose lease this client still holds are read where they were;
  // the others are asked of the master.
  std::vector<size_t> ask;
  absl::Time now = absl::Now();
  replicas_->ReleaseEnded(now);  // their give-backs go with this call's lookup
  for (size_t i = 0; i < n; ++i) {
    std::optional<internal::Located> hit = replicas_->Lookup(keys[i], now);
    if (hit) {
      where[i] = std::move(*hit);
    } else {
      ask.push_back(i);
    }
  }
  const uint64_t generation = replicas_->generation();
  auto ask_master = [&](const std::vector<size_t>& which) {
    std::vector<std::string> asked_keys;
    for (size_t i : which) asked_keys.push_back(keys[i]);
    const absl::Time asked = absl::Now();
    absl::StatusOr<v1::GetReplicasResponse> resp = master_->GetReplicas(asked_keys);
    std::vector<internal::Located> got;
    std::vector<absl::Status> staged;
    if (resp.ok()) {
      replicas_->Heard(asked, resp->epoch(), resp->membership());
      got = Impl::Locate(*resp, asked);
      staged = StageSsdHits(*resp, asked_keys, timeout > absl::ZeroDuration() ? timeout : options_.transfer_timeout,
                            grants_.get(), options_.tls);
    }
    for (size_t k = 0; k < which.size(); ++k) {
      const size_t i = which[k];
      if (!resp.ok()) {
        st[i] = resp.status();
      } else if (k >= got.size()) {
        st[i] = absl::InternalError(absl::StrCat(keys[i], ": the master's answer has no entry for it"));
      } else if (!staged[k].ok()) {
        st[i] = staged[k];
      } else {
        where[i] = std::move(got[k]);
        st[i] = absl::OkStatus();
      }
    }
  };
  if (!ask.empty()) ask_master(ask);

  std::vector<Pieces> pieces(n);
  auto read = [&](const std::vector<size_t>& which) {
    std::vector<std::string> rk;
    std::vector<internal::Located> rw;
    std::vector<Pieces> rp;
    std::vector<absl::Status> rs;
    for (size_t i : which) {
      if (st[i].ok()) st[i] = Impl::Found(keys[i], where[i]);
      if (st[i].ok()) {
        const uint64_t vsize = where[i].stored_size - TrailerSize(where[i].put_id);
        pieces[i].clear();
        if (!place(i, vsize, &pieces[i])) {
          st[i] = absl::InvalidArgumentError(absl::StrCat(keys[i], ": the buffer cannot hold ", vsize, " bytes"));
        }
      }
      rk.push_back(keys[i]);
      rw.push_back(where[i]);
      rp.push_back(pieces[i]);
      rs.push_back(st[i]);
    }
    Impl::Read(this, rk, rw, rp, &rs, timeout);
    for (size_t k = 0; k < which.size(); ++k) st[which[k]] = std::move(rs[k]);
  };
  std::vector<size_t> all(n);
  for (size_t i = 0; i < n; ++i) all[i] = i;
  read(all);
  // A remembered location that did not give the value (its daemon died,
  // the lease ran out, the bytes did not verify) is forgotten and the key
  // asked of the master once more.
  std::vector<size_t> again;
  for (size_t i = 0; i < n; ++i) {
    if (!where[i].cached) continue;
    if (!st[i].ok()) {
      replicas_->Erase(keys[i], !absl::IsDeadlineExceeded(st[i]) && !absl::IsUnavailable(st[i]));
      if (!absl::IsInvalidArgument(st[i])) again.push_back(i);
    }
  }
  if (!again.empty()) {
    ask_master(again);
    read(again);
  }
  for (size_t i = 0; i < n; ++i) {
    if (where[i].lease_token != 0) {
      // A counted read gives its lease back unless a transfer or stage may
      // still be moving bytes (timed out, or its peer did not answer); one
      // that read OK goes to the cache, which gives it back when it lets go.
      if (st[i].ok()) {
        replicas_->Insert(keys[i], where[i], generation);
      } else if (!absl::IsDeadlineExceeded(st[i]) && !absl::IsUnavailable(st[i])) {
        master_->ReleaseLease(keys[i], where[i].lease_token, where[i].lease_expiry_ms);
      }
    } else if (st[i].ok() && !where[i].cached) {
      replicas_->Insert(keys[i], where[i], generation);
    } else if (st[i].ok()) {
      master_->NoteCachedRead(keys[i]);  // the master was not asked: it hears on the next call
    }
    if (st[i].ok()) {
      result[i] = where[i].stored_size - TrailerSize(where[i].put_id);
    } else {
      result[i] = st[i];
    }
  }
  return result;
}

std::vector<absl::StatusOr<size_t>> Client::BatchGet(const std::vector<std::string>& keys,
                                                     const std::vector<absl::Span<char>>& outs,
                                                     absl::Duration timeout) {
  if (outs.size() != keys.size()) {
    return std::vector<absl::StatusOr<size_t>>(
        keys.size(), absl::InvalidArgumentError("one output buffer per key is needed"));
  }
  return Fetch(keys, timeout, [&](size_t i, uint64_t size, Pieces* to) {
    if (size > outs[i].size()) return false;
    to->push_back(outs[i].subspan(0, size));
    return true;
  });
}

std::vector<absl::StatusOr<size_t>> Client::BatchGetScatter(const std::vector<std::string>& keys,
                                                            const std::vector<std::vector<absl::Span<char>>>& outs,
                                                            absl::Duration timeout) {
  if (outs.size() != keys.size()) {
    return std::vector<absl::StatusOr<size_t>>(
        keys.size(), absl::InvalidArgumentError("one list of output buffers per key is needed"));
  }
  return Fetch(keys, timeout, [&](size_t i, uint64_t size, Pieces* to) {
    for (absl::Span<char> out : outs[i]) {
      if (size == 0) break;
      const uint64_t take = std::min<uint64_t>(size, out.size());
      to->push_back(out.subspan(0, take));
      size -= take;
    }
    return size == 0;
  });
}

std::vector<absl::StatusOr<std::string>> Client::BatchGet(const std::vector<std::string>& keys) {
  std::vector<std::string> values(keys.size());
  std::vector<absl::StatusOr<size_t>> got =
      Fetch(keys, absl::ZeroDuration(), [&](size_t i, uint64_t size, Pieces* to) {
        // The size is the master's word: one this process cannot hold
        // fails the key, not the caller.
        try {
          values[i].resize(size);
        } catch (const std::exception&) {
          return false;
        }
        to->push_back(absl::MakeSpan(values[i]));
        return true;
      });
  std::vector<absl::StatusOr<std::string>> result(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (got[i].ok()) {
      result[i] = std::move(values[i]);
    } else {
      result[i] = got[i].status();
    }
  }
  return result;
}

absl::StatusOr<bool> Client::Exists(const std::string& key) {
  ASSIGN_OR_RETURN(std::vector<bool> v, master_->Exists({key}));
  return v[0];
}

absl::StatusOr<std::vector<bool>> Client::BatchExists(const std::vector<std::string>& keys) {
  return master_->Exists(keys);
}

absl::StatusOr<size_t> Client::PrefixMatch(const std::vector<std::string>& keys) {
  ASSIGN_OR_RETURN(uint32_t n, master_->PrefixMatch(keys));
  return static_cast<size_t>(n);
}

absl::Status Client::Remove(const std::string& key, bool force) {
  // Forgotten after the master answers (whatever it answered), so a Get
  // that raced the removal cannot put the key back in the cache.
  absl::StatusOr<v1::KeysResponse> r = master_->Remove({key}, force);
  replicas_->Invalidate(key);
  if (!r.ok()) return r.status();
  return FromItem(r->status(0));
}

absl::StatusOr<uint64_t> Client::RemoveAll(bool force) {
  absl::StatusOr<uint64_t> n = master_->RemoveAll(force);
  replicas_->Clear();
  return n;
}

}  // namespace tierkv::client
