// The get path's SSD staging (client/internal/ssd_stage.h): asks each
// daemon holding a staging replica to fill it from its SSD tier.
#include "client/internal/ssd_stage.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace tierkv::client::internal {

std::vector<absl::Status> StageSsdHits(const v1::GetReplicasResponse& resp, const std::vector<std::string>& keys,
                                       absl::Duration timeout, GrantCache* grants,
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
      // The master's leave for this stage, where the daemon needs one.
      if (r < resp.stage_proofs_size()) item->set_proof(resp.stage_proofs(r));
      if (i < resp.lease_expiry_unix_ms_size()) item->set_expiry_unix_ms(resp.lease_expiry_unix_ms(i));
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

}  // namespace tierkv::client::internal
