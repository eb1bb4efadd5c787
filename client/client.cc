// Client (client/client.h): construction (options, the master client, the
// transfer engine, trailer arena, replica cache, data grants and a lent
// segment), shutdown, metadata URL discovery, and the calls that only ask
// the master (Exists, PrefixMatch, Remove). The put path is in
// client_put.cc, the get path in client_get.cc.
#include "client/client.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/auth.h"
#include "base/status.h"
#include "client/internal/grant_cache.h"
#include "client/internal/replica_cache.h"
#include "client/internal/trailer_arena.h"
#include "client/lender.h"
#include "proto/etcd_client.h"

namespace tierkv::client {

namespace {

using internal::TrailerSize;

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
