#include "client/master_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/auth.h"
#include "base/status.h"
#include "proto/channel_credentials.h"
#include "proto/etcd_client.h"

namespace tierkv::client {

absl::Status FromItem(const v1::ItemStatus& s) {
  if (s.code() == 0) return absl::OkStatus();
  if (s.code() < 0 || s.code() > 16) return absl::UnknownError(s.message());
  return absl::Status(static_cast<absl::StatusCode>(s.code()), s.message());
}

absl::StatusOr<std::unique_ptr<MasterClient>> MasterClient::Create(const std::string& address,
                                                                   MasterClientOptions options) {
  std::vector<std::string> addresses;
  if (IsEtcdMasterAddress(address)) {
    ASSIGN_OR_RETURN(addresses, ResolveEtcdMasters(address, options.rpc_timeout));
  } else if (address.find('/') != std::string::npos) {
    // A gRPC target URI ("dns:///h:p,...") is one address, commas and all.
    addresses.push_back(address);
  } else {
    for (absl::string_view a : absl::StrSplit(address, ',', absl::SkipWhitespace())) {
      addresses.emplace_back(absl::StripAsciiWhitespace(a));
    }
  }
  if (addresses.empty()) addresses.emplace_back();
  if (addresses.size() > kMaxMasters) {
    return absl::InvalidArgumentError(
        absl::StrCat("master address '", address, "' names ", addresses.size(), " masters; at most ", kMaxMasters));
  }
  for (const std::string& a : addresses) {
    size_t colon = a.rfind(':');
    if (a.empty() || colon == std::string::npos || colon + 1 == a.size()) {
      return absl::InvalidArgumentError(absl::StrCat("master address '", a, "' is not host:port"));
    }
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_size);
  args.SetMaxSendMessageSize(options.max_message_size);
  // Reconnect quickly after a master restart.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds, MasterChannelCredentials(options.tls, "master client"));
  if (options.tls.enabled()) options.direct = false;  // the direct lane would carry the token in the clear
  std::unique_ptr<MasterClient> client(new MasterClient(address, options, std::move(creds), std::move(args)));
  for (const std::string& a : addresses) (void)client->EndpointFor(a);
  return client;
}

std::unique_ptr<MasterClient::Endpoint> MasterClient::MakeEndpoint(const std::string& address) const {
  auto e = std::make_unique<Endpoint>();
  e->address = address;
  e->channel = grpc::CreateCustomChannel(address, creds_, args_);
  e->stub = v1::Master::NewStub(e->channel);
  // A gRPC target URI ("dns:///h:p", "unix:...") names nothing the lane can dial.
  if (options_.direct && address.find('/') == std::string::npos && address.rfind("unix:", 0) != 0) {
    e->direct = std::make_unique<internal::DirectChannel>(address, static_cast<uint32_t>(options_.max_message_size),
                                                          options_.reply_spin, options_.token);
  }
  return e;
}

std::optional<size_t> MasterClient::EndpointFor(const std::string& address) {
  MutexLock lock(&add_mu_);
  const size_t n = count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) {
    if (endpoints_[i]->address == address) return i;
  }
  if (n == kMaxMasters) return std::nullopt;
  endpoints_[n] = MakeEndpoint(address);
  count_.store(n + 1, std::memory_order_release);  // published whole
  return n;
}

void MasterClient::Reresolve() {
  if (!etcd_) return;
  MutexLock lock(&resolve_mu_);
  if (absl::Now() - resolved_ < absl::Seconds(1)) return;
  resolved_ = absl::Now();
  absl::StatusOr<std::vector<std::string>> found =
      ResolveEtcdMasters(address_, std::min(options_.rpc_timeout, absl::Seconds(1)));
  if (!found.ok()) return;  // etcd unreachable for now: the masters known stay
  for (const std::string& a : *found) (void)EndpointFor(a);
}

std::vector<std::string> MasterClient::masters() const {
  std::vector<std::string> out;
  const size_t n = count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) out.push_back(endpoints_[i]->address);
  return out;
}

MasterClient::MasterClient(std::string address, MasterClientOptions options,
                           std::shared_ptr<grpc::ChannelCredentials> creds, grpc::ChannelArguments args)
    : address_(std::move(address)),
      options_(options),
      etcd_(IsEtcdMasterAddress(address_)),
      creds_(std::move(creds)),
      args_(std::move(args)) {}

namespace {
// No direct id: the call always goes over gRPC.
constexpr auto kGrpcOnly = static_cast<direct::DirectMethod>(0);

// With several masters: how long a call waits for a connection to one
// before it tries the next.
constexpr absl::Duration kConnectBudget = absl::Milliseconds(500);

// A master that answered this refused the call without running it.
bool NotLeader(const absl::Status& s) {
  return absl::IsUnavailable(s) && absl::StrContains(s.message(), kNotLeader);
}

// The leader a standby's refusal names ("... the leader is h:p"), or "".
std::string NamedLeader(absl::string_view message) {
  const absl::string_view is(kLeaderIs);
  const size_t at = message.find(is);
  if (at == absl::string_view::npos) return "";
  absl::string_view rest = message.substr(at + is.size());
  return std::string(rest.substr(0, rest.find_first_of(" ;,)")));
}
}  // namespace

template <class Resp>
absl::Status MasterClient::Fresh(const Resp& resp) {
  if constexpr (requires { resp.epoch(); }) {
    const uint64_t e = resp.epoch();
    uint64_t seen = epoch_.load(std::memory_order_relaxed);
    if (e < seen) {
      // Not run anywhere that counts: taken as a refusal, so the call goes on to the next master.
      return absl::UnavailableError(
          absl::StrCat("answered at master epoch ", e, ", older than epoch ", seen, " seen before: ", kNotLeader));
    }
    while (e > seen && !epoch_.compare_exchange_weak(seen, e, std::memory_order_relaxed)) {
    }
  }
  return absl::OkStatus();
}

template <class Req, class Resp, class Call>
absl::Status MasterClient::Invoke(const char* method, direct::DirectMethod direct, const Req& req, Resp* resp,
                                  bool idempotent, Call call, absl::Time call_deadline) {
  absl::Time deadline = std::min(call_deadline, absl::Now() + options_.rpc_timeout);
  absl::Duration backoff = absl::Milliseconds(50);
  const Req* send = &req;
  Req stripped;
  size_t n = count_.load(std::memory_order_acquire);
  size_t at = current_.load(std::memory_order_relaxed) % n;
  // Calls follow a leader among several masters: those known, or those etcd
  // may name later (so one dead master is not waited for, as a lone one is).
  auto several = [&] { return n > 1 || etcd_; };
  size_t tried = 0;  // endpoints tried since the last backoff
  for (;;) {
    Endpoint& ep = *endpoints_[at];
    absl::Status st;
    bool sent = true;
    if (direct != kGrpcOnly && ep.direct != nullptr && ep.direct->usable()) {
      internal::DirectChannel::Result r = ep.direct->Call(direct, *send, resp, deadline);
      if (r.outcome == internal::DirectChannel::Outcome::kAnswered && r.status.ok()) r.status = Fresh(*resp);
      if (r.outcome == internal::DirectChannel::Outcome::kAnswered && r.status.ok()) {
        current_.store(at, std::memory_order_relaxed);
        return absl::OkStatus();
      }
      sent = r.outcome != internal::DirectChannel::Outcome::kNotSent;
      if (sent) st = absl::Status(r.status.code(), absl::StrCat("master ", ep.address, " ", method, ": ", r.status.message()));
    } else {
      sent = false;
    }
    if (!sent) {
      // Over gRPC: the lane is not there, or could not take this call.
      grpc::ClientContext ctx;
      // Queue the call while the channel (re)connects rather than failing at
      // once: a call that never left is safe to send even when not
      // idempotent. With several masters one without a connection gets
      // kConnectBudget to make one before the next is tried (a fail-fast
      // call would not make the channel dial again).
      const bool ready_before = ep.channel->GetState(false) == GRPC_CHANNEL_READY;
      // A master that was down a moment ago (a standby just elected) is
      // dialled now, not after the channel's reconnect backoff (up to 1 s).
      if (several() && !ready_before) grpc::experimental::ChannelResetConnectionBackoff(ep.channel.get());
      const absl::Time attempt_deadline =
          several() && !ready_before ? std::min(deadline, absl::Now() + kConnectBudget) : deadline;
      ctx.set_deadline(absl::ToChronoTime(attempt_deadline));
      // With several masters, a call on a connection that breaks (its
      // master died) fails at once rather than waiting out its deadline
      // for that master to come back: the next one may already lead.
      ctx.set_wait_for_ready(!several() || !ready_before);
      if (!options_.token.empty()) ctx.AddMetadata(auth::kAuthorizationHeader, absl::StrCat("Bearer ", options_.token));
      grpc::Status s = call(ep.stub.get(), &ctx, *send, resp);
      if (s.ok()) {
        if (absl::Status fresh = Fresh(*resp); !fresh.ok()) {
          s = grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(fresh.message()));
        }
      }
      if (s.ok()) {
        current_.store(at, std::memory_order_relaxed);
        return absl::OkStatus();
      }
      const bool connected = ep.channel->GetState(false) == GRPC_CHANNEL_READY;
      if (several() && !ready_before && !connected &&
          (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || s.error_code() == grpc::StatusCode::UNAVAILABLE)) {
        // No connection came up in its budget: the call never left.
        sent = false;
        st = absl::UnavailableError(
            absl::StrCat("master ", ep.address, " ", method, ": no connection (", s.error_message(), ")"));
      } else if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
          ep.channel->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
        // Most likely no connection came up before the deadline; the code
        // stays (a connection that broke may have carried the call).
        return absl::DeadlineExceededError(absl::StrCat(
            "master ", ep.address, " ", method, ": no connection before the deadline (nothing listening",
            options_.tls.enabled() ? ", or the TLS handshake failed: check --tls-ca, --tls-cert and the master's"
                                   : ", or the master serves TLS: give --tls-ca",
            ")"));
      } else {
        st = absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("master ", ep.address, " ", method, ": ", s.error_message()));
      }
    }
    // A standby names the leader: that one next, learned if it is new.
    std::optional<size_t> named;
    if (NotLeader(st)) {
      if (const std::string leader = NamedLeader(st.message()); !leader.empty() && leader != ep.address) {
        named = EndpointFor(leader);
        n = count_.load(std::memory_order_acquire);
      }
    }
    const bool elsewhere = several() && (!sent || NotLeader(st) || (idempotent && absl::IsUnavailable(st)));
    if (several() && (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st))) {
      // A master that stalled or dropped the call: the next call starts
      // with the next one, rather than waiting on this one again.
      size_t expected = at;
      current_.compare_exchange_strong(expected, (at + 1) % n, std::memory_order_relaxed);
    }
    if (!elsewhere && (!idempotent || !absl::IsUnavailable(st))) return st;
    if (absl::Now() + backoff >= deadline) return st;
    if (elsewhere && ++tried < n) {
      at = named.has_value() ? *named : (at + 1) % n;  // the next master, at once
    } else {
      // Every master tried (or the one there is): wait before going round
      // again, with any masters etcd has learned of since.
      tried = 0;
      Reresolve();
      n = count_.load(std::memory_order_acquire);
      if (elsewhere) at = named.has_value() ? *named : (at + 1) % n;
      std::this_thread::sleep_for(absl::ToChronoMilliseconds(backoff));
      // With several masters a new leader is found sooner (each round
      // costs one connection attempt per master).
      backoff = std::min(backoff * 2, several() ? absl::Milliseconds(200) : absl::Milliseconds(500));
    }
    if constexpr (requires { req.released_keys_size(); }) {
      if (send->released_keys_size() > 0 || send->cache_hit_keys_size() > 0) {
        // The master may have applied them already: a second give-back
        // would take another reader's count, and reads would count twice.
        // Unsent, leases just run out and reads go uncounted.
        stripped = req;
        stripped.clear_released_keys();
        stripped.clear_released_tokens();
        stripped.clear_released_expiry_unix_ms();
        stripped.clear_cache_hit_keys();
        send = &stripped;
      }
    }
  }
}

#define TIERKV_CALL(Method) \
  [](v1::Master::Stub* stub, grpc::ClientContext* c, const auto& r, auto* o) { return stub->Method(c, r, o); }

absl::Status MasterClient::Mount(const v1::Segment& segment) {
  v1::MountSegmentRequest req;
  *req.add_segments() = segment;
  v1::MountSegmentResponse resp;
  absl::Status s = Invoke("MountSegment", kGrpcOnly, req, &resp, true, TIERKV_CALL(MountSegment));
  if (!s.ok()) return s;
  if (resp.status_size() != 1) return absl::InternalError("malformed MountSegment reply");
  return FromItem(resp.status(0));
}

absl::Status MasterClient::Unmount(const std::string& name, bool keep_ssd) {
  v1::UnmountSegmentRequest req;
  req.add_names(name);
  req.set_keep_ssd(keep_ssd);
  v1::UnmountSegmentResponse resp;
  absl::Status s = Invoke("UnmountSegment", kGrpcOnly, req, &resp, true, TIERKV_CALL(UnmountSegment));
  if (!s.ok()) return s;
  if (resp.status_size() != 1) return absl::InternalError("malformed UnmountSegment reply");
  return FromItem(resp.status(0));
}

absl::StatusOr<v1::SsdRecordsResponse> MasterClient::SyncSsdRecords(const v1::SsdRecordsRequest& request) {
  v1::SsdRecordsResponse resp;
  // Idempotent: a listing batch sent twice confirms the same keys.
  RETURN_IF_ERROR(Invoke("SyncSsdRecords", kGrpcOnly, request, &resp, true, TIERKV_CALL(SyncSsdRecords)));
  return resp;
}

absl::StatusOr<std::vector<std::string>> MasterClient::Heartbeat(
    const std::vector<v1::Segment>& segments, const std::string& client_id) {
  v1::HeartbeatRequest req;
  for (const auto& s : segments) *req.add_segments() = s;
  req.set_client_id(client_id);
  v1::HeartbeatResponse resp;
  absl::Status s = Invoke("Heartbeat", kGrpcOnly, req, &resp, true, TIERKV_CALL(Heartbeat));
  if (!s.ok()) return s;
  return std::vector<std::string>(resp.remount().begin(), resp.remount().end());
}

void MasterClient::ReleaseLease(std::string key, uint64_t token, int64_t expiry_unix_ms) {
  if (token == 0) return;
  MutexLock lock(&release_mu_);
  // The oldest are nearest their expiry anyway: drop them first.
  if (releases_.size() >= kMaxQueuedReleases) releases_.pop_front();
  releases_.push_back({std::move(key), token, expiry_unix_ms});
}

void MasterClient::NoteShortfalls(uint32_t n) {
  MutexLock lock(&release_mu_);
  shortfalls_ = n > UINT32_MAX - shortfalls_ ? UINT32_MAX : shortfalls_ + n;
}

void MasterClient::NoteCachedRead(std::string key) {
  MutexLock lock(&release_mu_);
  if (cached_reads_.size() >= kMaxQueuedReleases) cached_reads_.pop_front();
  cached_reads_.push_back(std::move(key));
}

template <class Req>
void MasterClient::AttachReleases(Req* req) {
  std::vector<Release> out;
  {
    MutexLock lock(&release_mu_);
    req->set_shortfalls(std::exchange(shortfalls_, 0));
    const size_t reads = std::min(cached_reads_.size(), kMaxReleasesPerCall);
    if (reads > 0) {
      req->mutable_cache_hit_keys()->Reserve(static_cast<int>(reads));
      for (size_t i = 0; i < reads; ++i) req->add_cache_hit_keys(std::move(cached_reads_[i]));
      cached_reads_.erase(cached_reads_.begin(), cached_reads_.begin() + reads);
    }
    if (releases_.empty()) return;
    const size_t n = std::min(releases_.size(), kMaxReleasesPerCall);
    out.assign(std::make_move_iterator(releases_.begin()), std::make_move_iterator(releases_.begin() + n));
    releases_.erase(releases_.begin(), releases_.begin() + n);
  }
  req->mutable_released_keys()->Reserve(static_cast<int>(out.size()));
  for (Release& r : out) {
    req->add_released_keys(std::move(r.key));
    req->add_released_tokens(r.token);
    req->add_released_expiry_unix_ms(r.expiry_ms);
  }
}

absl::StatusOr<v1::PutStartResponse> MasterClient::PutStart(const v1::PutStartRequest& request) {
  v1::PutStartResponse resp;
  absl::Status s;
  bool queued;
  {
    MutexLock lock(&release_mu_);
    queued = !releases_.empty() || !cached_reads_.empty() || shortfalls_ > 0;
  }
  if ((request.client_id().empty() && !options_.client_id.empty()) || queued) {
    v1::PutStartRequest named = request;
    if (named.client_id().empty()) named.set_client_id(options_.client_id);
    AttachReleases(&named);
    s = Invoke("PutStart", direct::DirectMethod::kPutStart, named, &resp, false, TIERKV_CALL(PutStart));
  } else {
    s = Invoke("PutStart", direct::DirectMethod::kPutStart, request, &resp, false, TIERKV_CALL(PutStart));
  }
  if (!s.ok()) return s;
  if (resp.results_size() != request.items_size()) return absl::InternalError("malformed PutStart reply");
  return resp;
}

namespace {
v1::KeysRequest KeysOf(const std::vector<std::string>& keys, const std::string& client_id = "") {
  v1::KeysRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_client_id(client_id);
  return req;
}
}  // namespace

v1::KeysRequest MasterClient::KeysWithReleases(const std::vector<std::string>& keys) {
  v1::KeysRequest req = KeysOf(keys, options_.client_id);
  AttachReleases(&req);
  return req;
}

absl::StatusOr<v1::KeysResponse> MasterClient::PutEnd(const std::vector<std::string>& keys) {
  v1::KeysResponse resp;
  // A retried PutEnd is harmless: the master answers OK for a committed key.
  absl::Status s = Invoke("PutEnd", direct::DirectMethod::kPutEnd, KeysWithReleases(keys), &resp, true, TIERKV_CALL(PutEnd));
  if (!s.ok()) return s;
  if (resp.status_size() != static_cast<int>(keys.size())) return absl::InternalError("malformed PutEnd reply");
  return resp;
}

absl::StatusOr<v1::KeysResponse> MasterClient::PutRevoke(const std::vector<std::string>& keys) {
  v1::KeysResponse resp;
  absl::Status s = Invoke("PutRevoke", direct::DirectMethod::kPutRevoke, KeysWithReleases(keys), &resp, true, TIERKV_CALL(PutRevoke));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::GetReplicasResponse> MasterClient::GetReplicas(const std::vector<std::string>& keys,
                                                                  bool counted) {
  v1::GetReplicasResponse resp;
  v1::KeysRequest req = KeysWithReleases(keys);
  req.set_counted(counted);
  absl::Status s = Invoke("GetReplicas", direct::DirectMethod::kGetReplicas, req, &resp, true, TIERKV_CALL(GetReplicas));
  if (!s.ok()) return s;
  if (resp.sizes_size() != static_cast<int>(keys.size()) ||
      resp.replica_counts_size() != static_cast<int>(keys.size()) ||
      resp.lease_expiry_unix_ms_size() != static_cast<int>(keys.size())) {
    return absl::InternalError("malformed GetReplicas reply");
  }
  return resp;
}

absl::StatusOr<std::vector<bool>> MasterClient::Exists(const std::vector<std::string>& keys) {
  v1::ExistsResponse resp;
  absl::Status s = Invoke("Exists", direct::DirectMethod::kExists, KeysWithReleases(keys), &resp, true, TIERKV_CALL(Exists));
  if (!s.ok()) return s;
  if (resp.present_size() != static_cast<int>(keys.size())) return absl::InternalError("malformed Exists reply");
  return std::vector<bool>(resp.present().begin(), resp.present().end());
}

absl::Status MasterClient::FlushReleases() {
  {
    MutexLock lock(&release_mu_);
    if (releases_.empty() && shortfalls_ == 0) return absl::OkStatus();
  }
  return Exists({}).status();
}

absl::StatusOr<uint32_t> MasterClient::PrefixMatch(const std::vector<std::string>& keys) {
  v1::PrefixMatchResponse resp;
  absl::Status s = Invoke("PrefixMatch", direct::DirectMethod::kPrefixMatch, KeysWithReleases(keys), &resp, true, TIERKV_CALL(PrefixMatch));
  if (!s.ok()) return s;
  return std::min<uint32_t>(resp.matched(), static_cast<uint32_t>(keys.size()));
}

absl::StatusOr<v1::KeysResponse> MasterClient::Remove(const std::vector<std::string>& keys, bool force) {
  v1::RemoveRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_force(force);
  v1::KeysResponse resp;
  absl::Status s = Invoke("Remove", direct::DirectMethod::kRemove, req, &resp, false, TIERKV_CALL(Remove));
  if (!s.ok()) return s;
  if (resp.status_size() != static_cast<int>(keys.size())) return absl::InternalError("malformed Remove reply");
  return resp;
}

absl::StatusOr<uint64_t> MasterClient::RemoveAll(bool force) {
  v1::RemoveAllRequest req;
  req.set_force(force);
  v1::RemoveAllResponse resp;
  absl::Status s = Invoke("RemoveAll", kGrpcOnly, req, &resp, false, TIERKV_CALL(RemoveAll));
  if (!s.ok()) return s;
  return resp.removed();
}

absl::StatusOr<v1::StatsResponse> MasterClient::Stats() {
  v1::StatsResponse resp;
  absl::Status s = Invoke("Stats", direct::DirectMethod::kStats, v1::StatsRequest(), &resp, true, TIERKV_CALL(Stats));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::DataGrant> MasterClient::GrantData(const std::string& segment, absl::Time deadline) {
  v1::GrantDataRequest req;
  req.add_segments(segment);
  v1::GrantDataResponse resp;
  RETURN_IF_ERROR(Invoke("GrantData", kGrpcOnly, req, &resp, true, TIERKV_CALL(GrantData), deadline));
  if (resp.grants_size() != 1) return absl::InternalError("malformed GrantData reply");
  RETURN_IF_ERROR(FromItem(resp.grants(0).status()));
  return resp.grants(0);
}

}  // namespace tierkv::client
