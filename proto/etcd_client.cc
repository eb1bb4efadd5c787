#include "proto/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"
#include "base/status.h"
#include "proto/etcd.grpc.pb.h"

namespace tierkv {

namespace pb = etcdserverpb;

struct EtcdClient::Member {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::KV::Stub> kv;
  std::unique_ptr<pb::Lease::Stub> lease;
};

namespace {

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what, absl::string_view member) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("etcd ", member, " ", what, ": ", s.error_message()));
}

void SetDeadline(grpc::ClientContext* ctx, absl::Time deadline) { ctx->set_deadline(absl::ToChronoTime(deadline)); }

}  // namespace

std::vector<std::string> EtcdClient::SplitEndpoints(const std::string& list) {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    e = absl::StripAsciiWhitespace(e);
    absl::ConsumePrefix(&e, "http://");  // etcd's own flags spell members as URLs
    out.emplace_back(e);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(const std::vector<std::string>& endpoints,
                                                               absl::Duration call_timeout) {
  if (endpoints.empty()) return absl::InvalidArgumentError("etcd: no endpoints");
  for (const std::string& e : endpoints) {
    const size_t colon = e.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == e.size()) {
      return absl::InvalidArgumentError(absl::StrCat("etcd endpoint '", e, "' is not host:port"));
    }
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(endpoints, call_timeout));
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, absl::Duration call_timeout)
    : endpoints_(std::move(endpoints)), call_timeout_(call_timeout) {
  for (const std::string& e : endpoints_) {
    auto m = std::make_unique<Member>();
    m->address = e;
    grpc::ChannelArguments args;
    // A member that comes back is dialled again within a second.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // No HTTP/2 keepalive pings: etcd allows none between calls and none
    // more often than every 5 s (--grpc-keepalive-min-time), and answers
    // more with GOAWAY "too_many_pings", dropping the calls in flight. A
    // member that stopped answering (SIGSTOP keeps its socket open) is
    // found by the calls' deadlines instead, and tried last after that.
    m->channel = grpc::CreateCustomChannel(e, grpc::InsecureChannelCredentials(), args);
    m->kv = pb::KV::NewStub(m->channel);
    m->lease = pb::Lease::NewStub(m->channel);
    members_.push_back(std::move(m));
  }
}

EtcdClient::~EtcdClient() = default;

template <class Fn>
absl::Status EtcdClient::Run(const char* what, Fn attempt) {
  const absl::Time deadline = absl::Now() + call_timeout_;
  size_t first;
  {
    MutexLock lock(&mu_);
    first = preferred_;
  }
  absl::Status last;
  // Each member gets an equal share of the budget, so one that hangs
  // leaves time for the others.
  const size_t n = members_.size();
  for (size_t i = 0; i < n; ++i) {
    const size_t idx = (first + i) % n;
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    const absl::Time attempt_deadline = now + (deadline - now) / static_cast<int64_t>(n - i);
    last = attempt(*members_[idx], attempt_deadline);
    MutexLock lock(&mu_);
    if (last.ok() || (!absl::IsUnavailable(last) && !absl::IsDeadlineExceeded(last))) {
      preferred_ = idx;
      return last;
    }
    // The next call starts with the next member, so one that hangs costs
    // its share of one call, not of every call until another answers.
    if (preferred_ == idx) preferred_ = (idx + 1) % n;
  }
  if (last.ok()) last = absl::DeadlineExceededError(absl::StrCat("etcd ", what, ": no member answered in time"));
  return last;
}

absl::StatusOr<EtcdKey> EtcdClient::Get(const std::string& key) {
  pb::RangeResponse resp;
  RETURN_IF_ERROR(Run("get", [&](Member& m, absl::Time deadline) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    pb::RangeRequest req;
    req.set_key(key);
    return FromGrpc(m.kv->Range(&ctx, req, &resp), "get", m.address);
  }));
  if (resp.kvs_size() == 0) return absl::NotFoundError(absl::StrCat("etcd: no key ", key));
  const pb::KeyValue& kv = resp.kvs(0);
  return EtcdKey{kv.value(), kv.create_revision(), kv.mod_revision(), kv.lease()};
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> EtcdClient::List(const std::string& prefix) {
  pb::RangeResponse resp;
  RETURN_IF_ERROR(Run("list", [&](Member& m, absl::Time deadline) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    pb::RangeRequest req;
    req.set_key(prefix);
    // The range end of a prefix: its last byte plus one (prefixes here are
    // printable, so no byte overflows).
    std::string end = prefix;
    end.back() = static_cast<char>(end.back() + 1);
    req.set_range_end(end);
    return FromGrpc(m.kv->Range(&ctx, req, &resp), "list", m.address);
  }));
  std::vector<std::pair<std::string, std::string>> out;
  for (const pb::KeyValue& kv : resp.kvs()) out.emplace_back(kv.key(), kv.value());
  return out;
}

absl::StatusOr<EtcdCreate> EtcdClient::CreateIfAbsent(const std::string& key, const std::string& value,
                                                      int64_t lease) {
  pb::TxnResponse resp;
  RETURN_IF_ERROR(Run("create", [&](Member& m, absl::Time deadline) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    pb::TxnRequest req;
    pb::Compare* c = req.add_compare();
    c->set_result(pb::Compare::EQUAL);
    c->set_target(pb::Compare::CREATE);
    c->set_key(key);
    c->set_create_revision(0);  // the key does not exist
    pb::PutRequest* put = req.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(value);
    put->set_lease(lease);
    req.add_success()->mutable_request_range()->set_key(key);
    req.add_failure()->mutable_request_range()->set_key(key);
    return FromGrpc(m.kv->Txn(&ctx, req, &resp), "create", m.address);
  }));
  EtcdCreate out;
  out.created = resp.succeeded();
  for (const pb::ResponseOp& op : resp.responses()) {
    if (op.has_response_range() && op.response_range().kvs_size() > 0) {
      const pb::KeyValue& kv = op.response_range().kvs(0);
      out.key = {kv.value(), kv.create_revision(), kv.mod_revision(), kv.lease()};
      return out;
    }
  }
  // The holder's key expired between the compare and the read.
  return absl::UnavailableError(absl::StrCat("etcd: ", key, " changed while it was being created; try again"));
}

absl::Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  return PutRevision(key, value, lease).status();
}

absl::StatusOr<int64_t> EtcdClient::PutRevision(const std::string& key, const std::string& value, int64_t lease) {
  pb::PutResponse resp;
  RETURN_IF_ERROR(Run("put", [&](Member& m, absl::Time deadline) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    pb::PutRequest req;
    req.set_key(key);
    req.set_value(value);
    req.set_lease(lease);
    return FromGrpc(m.kv->Put(&ctx, req, &resp), "put", m.address);
  }));
  // A put is one revision of its own: the header's is the key's mod revision.
  return resp.header().revision();
}

absl::Status EtcdClient::DeleteIf(const std::string& key, const std::function<void(pb::Compare*)>& condition) {
  return Run("delete", [&](Member& m, absl::Time deadline) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    pb::TxnRequest req;
    pb::Compare* c = req.add_compare();
    c->set_result(pb::Compare::EQUAL);
    c->set_key(key);
    condition(c);
    req.add_success()->mutable_request_delete_range()->set_key(key);
    pb::TxnResponse resp;
    return FromGrpc(m.kv->Txn(&ctx, req, &resp), "delete", m.address);
  });
}

absl::Status EtcdClient::DeleteIfCreatedAt(const std::string& key, int64_t create_revision) {
  return DeleteIf(key, [&](pb::Compare* c) {
    c->set_target(pb::Compare::CREATE);
    c->set_create_revision(create_revision);
  });
}

absl::Status EtcdClient::DeleteIfModifiedAt(const std::string& key, int64_t mod_revision) {
  return DeleteIf(key, [&](pb::Compare* c) {
    c->set_target(pb::Compare::MOD);
    c->set_mod_revision(mod_revision);
  });
}

absl::Status EtcdClient::DeleteIfValue(const std::string& key, const std::string& value) {
  return DeleteIf(key, [&](pb::Compare* c) {
    c->set_target(pb::Compare::VALUE);
    c->set_value(value);
  });
}

absl::StatusOr<EtcdLease> EtcdClient::Grant(absl::Duration ttl) {
  pb::LeaseGrantResponse resp;
  RETURN_IF_ERROR(Run("lease grant", [&](Member& m, absl::Time deadline) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    pb::LeaseGrantRequest req;
    req.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(ttl)));
    return FromGrpc(m.lease->LeaseGrant(&ctx, req, &resp), "lease grant", m.address);
  }));
  if (!resp.error().empty()) return absl::UnavailableError(absl::StrCat("etcd lease grant: ", resp.error()));
  return EtcdLease{resp.id(), absl::Seconds(resp.ttl())};
}

absl::StatusOr<EtcdLease> EtcdClient::KeepAlive(int64_t lease) {
  pb::LeaseKeepAliveResponse resp;
  RETURN_IF_ERROR(Run("lease keepalive", [&](Member& m, absl::Time deadline) {
    // One request and its answer on a stream of their own, under the
    // call's deadline: a member that never answers cannot hold this
    // thread past it.
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    auto stream = m.lease->LeaseKeepAlive(&ctx);
    pb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    if (!stream->Write(req) || !stream->Read(&resp)) {
      ctx.TryCancel();
      grpc::Status s = stream->Finish();
      return FromGrpc(s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream closed without an answer") : s,
                      "lease keepalive", m.address);
    }
    stream->WritesDone();
    ctx.TryCancel();  // the answer is in; the stream's end is not worth waiting for
    (void)stream->Finish();
    return absl::OkStatus();
  }));
  if (resp.ttl() <= 0) return absl::NotFoundError(absl::StrCat("etcd: lease ", lease, " has expired"));
  return EtcdLease{resp.id(), absl::Seconds(resp.ttl())};
}

absl::Status EtcdClient::Revoke(int64_t lease) {
  return Run("lease revoke", [&](Member& m, absl::Time deadline) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    pb::LeaseRevokeRequest req;
    req.set_id(lease);
    pb::LeaseRevokeResponse resp;
    absl::Status s = FromGrpc(m.lease->LeaseRevoke(&ctx, req, &resp), "lease revoke", m.address);
    return absl::IsNotFound(s) ? absl::OkStatus() : s;  // already gone
  });
}

std::string EtcdClusterKey(absl::string_view cluster, absl::string_view name) {
  return absl::StrCat("/tierkv/", cluster, "/", name);
}

bool IsEtcdMasterAddress(absl::string_view address) { return absl::StartsWith(address, "etcd://"); }

absl::StatusOr<std::vector<std::string>> ResolveEtcdMasters(absl::string_view address, absl::Duration timeout) {
  absl::string_view rest = address;
  if (!absl::ConsumePrefix(&rest, "etcd://")) {
    return absl::InvalidArgumentError(absl::StrCat("master address '", address, "' is not etcd://h:p[,h:p]/<cluster>"));
  }
  const size_t slash = rest.find('/');
  const absl::string_view cluster = slash == absl::string_view::npos ? "" : rest.substr(slash + 1);
  if (slash == 0 || cluster.empty() || absl::StrContains(cluster, "/")) {
    return absl::InvalidArgumentError(
        absl::StrCat("master address '", address, "' is not etcd://h:p[,h:p]/<cluster> (one cluster id)"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> etcd,
                   EtcdClient::Create(EtcdClient::SplitEndpoints(std::string(rest.substr(0, slash))), timeout));
  // A cluster between leaders (a failover, a start) has one again within
  // seconds: wait for it as long as `timeout` allows.
  const absl::Time deadline = absl::Now() + timeout;
  const std::string prefix = EtcdClusterKey(cluster, "members/");
  for (;;) {
    std::vector<std::string> masters;
    absl::StatusOr<EtcdKey> leader = etcd->Get(EtcdClusterKey(cluster, "leader"));
    if (leader.ok() && !leader->value.empty()) {
      masters.push_back(leader->value);
    } else if (!leader.ok() && !absl::IsNotFound(leader.status())) {
      return leader.status();
    }
    ASSIGN_OR_RETURN(auto members, etcd->List(prefix));
    for (const auto& [key, value] : members) {
      // etcd answers a range with keys inside it; one outside (a broken
      // proxy) is skipped rather than cut.
      if (!absl::StartsWith(key, prefix)) continue;
      std::string m = key.substr(prefix.size());
      if (!m.empty() && std::find(masters.begin(), masters.end(), m) == masters.end()) masters.push_back(std::move(m));
    }
    if (!masters.empty() && leader.ok()) return masters;
    if (absl::Now() + absl::Milliseconds(100) >= deadline) {
      if (masters.empty()) {
        return absl::NotFoundError(absl::StrCat("no master of cluster '", cluster, "' is registered in etcd at ",
                                                rest.substr(0, slash)));
      }
      return absl::UnavailableError(absl::StrCat("cluster '", cluster, "' has no leader (masters registered: ",
                                                 absl::StrJoin(masters, ","), ")"));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

}  // namespace tierkv
