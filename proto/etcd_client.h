// EtcdClient: the few etcd v3 calls the masters' election needs, over
// etcd's gRPC API (proto/etcd.proto).
//
// Every call has a deadline (`call_timeout`, or the caller's sooner one),
// keepalives included, so a stalled member (SIGSTOP, a partition) costs one
// timeout, never a wedged thread. A call that times out or finds its member
// unavailable moves on to the next endpoint and is tried there within the
// same deadline; the endpoint that answered last is tried first next time,
// and one that failed is tried after the others.
//
//   auto etcd = EtcdClient::Create({"127.0.0.1:2379"});
//   auto lease = (*etcd)->Grant(absl::Seconds(3));
//   auto won = (*etcd)->CreateIfAbsent("/tierkv/c1/leader", "h:p", lease->id);
//
// Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace grpc {
class Channel;
}
namespace etcdserverpb {
class Compare;
}

namespace tierkv {

struct EtcdKey {
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

struct EtcdLease {
  int64_t id = 0;
  absl::Duration ttl;  // as granted (or left, from a keepalive)
};

// The outcome of CreateIfAbsent: whether this call created the key, and
// the key as it stands (ours, or the holder's).
struct EtcdCreate {
  bool created = false;
  EtcdKey key;
};

class EtcdClient {
 public:
  // `endpoints`: host:port of each member. INVALID_ARGUMENT when empty or
  // malformed. Connects lazily.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(const std::vector<std::string>& endpoints,
                                                            absl::Duration call_timeout = absl::Seconds(1));
  // "h:p,h:p" split into endpoints.
  static std::vector<std::string> SplitEndpoints(const std::string& list);
  ~EtcdClient();

  // NOT_FOUND when the key does not exist.
  absl::StatusOr<EtcdKey> Get(const std::string& key);
  // Every key under `prefix`, in key order: (key, value).
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> List(const std::string& prefix);
  // Creates `key` = `value` bound to `lease` only if the key does not
  // exist (a transaction on its create revision), else reads it.
  absl::StatusOr<EtcdCreate> CreateIfAbsent(const std::string& key, const std::string& value, int64_t lease);
  // Puts `key` = `value` bound to `lease` (0: none), unconditionally.
  absl::Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  // As Put, answering the key's mod revision after the put (the revision
  // etcd gave that write), for a later DeleteIfModifiedAt. An error means
  // the put may or may not have been applied.
  absl::StatusOr<int64_t> PutRevision(const std::string& key, const std::string& value, int64_t lease = 0);
  // Deletes `key` only while its create revision is `create_revision`
  // (so a deposed holder never deletes its successor's key). OK either way.
  absl::Status DeleteIfCreatedAt(const std::string& key, int64_t create_revision);
  // Deletes `key` only while it holds `value`. OK either way.
  absl::Status DeleteIfValue(const std::string& key, const std::string& value);
  // Deletes `key` only while its mod revision is `mod_revision`, that is,
  // while it is still what the put that answered that revision wrote: a
  // delete applied late never removes a later put of the key. OK either way.
  absl::Status DeleteIfModifiedAt(const std::string& key, int64_t mod_revision);

  absl::StatusOr<EtcdLease> Grant(absl::Duration ttl);
  // One keepalive, answered: the TTL left. NOT_FOUND when the lease is gone
  // (expired or revoked).
  absl::StatusOr<EtcdLease> KeepAlive(int64_t lease);
  absl::Status Revoke(int64_t lease);

  const std::vector<std::string>& endpoints() const { return endpoints_; }

 private:
  struct Member;
  EtcdClient(std::vector<std::string> endpoints, absl::Duration call_timeout);
  // Runs `attempt` against members, starting with the last that answered,
  // until one answers or the deadline passes. `attempt` gets the member and
  // its own deadline and returns OK, or a status; UNAVAILABLE and
  // DEADLINE_EXCEEDED move on to the next member.
  template <class Fn>
  absl::Status Run(const char* what, Fn attempt);
  // Deletes `key` in a transaction whose one comparison `condition` fills
  // in (its result is EQUAL, its key `key`).
  absl::Status DeleteIf(const std::string& key, const std::function<void(etcdserverpb::Compare*)>& condition);

  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<Member>> members_;
  const absl::Duration call_timeout_;
  Mutex mu_;
  size_t preferred_ ABSL_GUARDED_BY(mu_) = 0;
};

// A tierkv cluster's keys in etcd (docs/ha.md): "/tierkv/<cluster>/<name>";
// the leader's is "leader" (its value the leader's advertised address), a
// master's "members/<advertised address>".
std::string EtcdClusterKey(absl::string_view cluster, absl::string_view name);

// True for a master address of the form "etcd://h:p[,h:p]/<cluster>".
bool IsEtcdMasterAddress(absl::string_view address);
// The masters such an address names, as host:port: the leader first, then
// every other master registered (a standby's key lives as long as its
// process). Waits up to `timeout` for a leader. INVALID_ARGUMENT for a
// malformed address; UNAVAILABLE or DEADLINE_EXCEEDED when no member of
// etcd answers, UNAVAILABLE when masters are registered but none leads,
// NOT_FOUND when no master of the cluster is registered.
absl::StatusOr<std::vector<std::string>> ResolveEtcdMasters(absl::string_view address, absl::Duration timeout);

}  // namespace tierkv
