// Private to client/. GrantCache: the data grants this client holds for
// daemons that run --auth token, one per segment.
//
// A connection needs a grant only to open, so one is reused until half its
// life is gone rather than asked of the master for every transfer. An
// empty grant (the segment's daemon needs none) is remembered too, and
// asked again a minute on, since its daemon may restart with --auth token.
//
//   GrantCache grants(master);
//   ASSIGN_OR_RETURN(transport::DataGrant g, grants.Get(segment, false, deadline));
//   ... the daemon refuses g (it restarted with a new key) ...
//   ASSIGN_OR_RETURN(g, grants.Get(segment, /*renew=*/true, deadline));
//
// Thread-safe.
#pragma once

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "client/master_client.h"
#include "transport/engine.h"

namespace tierkv::client::internal {

class GrantCache {
 public:
  // `master` is not owned and must outlive the cache.
  explicit GrantCache(MasterClient* master) : master_(master) {}

  // The grant for `segment`: the cached one while it is fresh, else a new
  // one from the master (MasterClient::GrantData's errors; blocks on that
  // RPC, bounded by `deadline`). `renew`: the daemon refused the cached
  // grant (it restarted with a new key), so the master is asked whatever
  // the cache holds.
  absl::StatusOr<transport::DataGrant> Get(const std::string& segment, bool renew,
                                           absl::Time deadline = absl::InfiniteFuture());

 private:
  struct Entry {
    transport::DataGrant grant;
    absl::Time renew_at;
  };
  MasterClient* const master_;
  Mutex mu_;
  absl::flat_hash_map<std::string, Entry> grants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierkv::client::internal
