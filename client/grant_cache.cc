// GrantCache (client/internal/grant_cache.h): data grants, reused until
// half their life is gone.
#include "client/internal/grant_cache.h"

#include "base/auth.h"
#include "base/status.h"

namespace tierkv::client::internal {

absl::StatusOr<transport::DataGrant> GrantCache::Get(const std::string& segment, bool renew, absl::Time deadline) {
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

}  // namespace tierkv::client::internal
