#include "client/client.h"

#include <unistd.h>

#include <array>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/lender.h"
#include "config/base/crc32c.h"
#include "config/base/failpoint.h"
#include "config/base/status.h"

namespace tierkv::client {
namespace {

using transport::Op;
using transport::Request;

// The 8 bytes stored after every value: CRC32C of the value, then a magic.
constexpr uint32_t kTrailerMagic = 0x3156'4b54;  // "TKV1"
constexpr uint64_t kTrailer = 8;
using Trailer = std::array<char, kTrailer>;

Trailer MakeTrailer(absl::string_view value) {
  Trailer t;
  uint32_t crc = Crc32c(value.data(), value.size());
  std::memcpy(t.data(), &crc, 4);
  std::memcpy(t.data() + 4, &kTrailerMagic, 4);
  return t;
}

absl::Status CheckTrailer(const Trailer& t, absl::Span<const char> value, const std::string& key,
                          bool verify) {
  uint32_t crc, magic;
  std::memcpy(&crc, t.data(), 4);
  std::memcpy(&magic, t.data() + 4, 4);
  if (magic != kTrailerMagic) return absl::DataLossError(absl::StrCat(key, ": value trailer is corrupt"));
  if (verify && crc != Crc32c(value.data(), value.size())) {
    return absl::DataLossError(absl::StrCat(key, ": checksum mismatch"));
  }
  return absl::OkStatus();
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

uint64_t StoredSize(uint64_t value_size) { return value_size + kTrailer; }

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  std::unique_ptr<Client> c(new Client());
  if (options.client_id.empty()) options.client_id = RandomId().substr(0, 12);
  if (options.host.empty()) options.host = LocalHostName();
  c->options_ = options;
  ASSIGN_OR_RETURN(c->master_, MasterClient::Create(options.master, {options.rpc_timeout, 64 << 20, options.client_id}));
  transport::EngineOptions eo;
  if (options.metadata_client) {
    eo.metadata = options.metadata_client;
  } else {
    ASSIGN_OR_RETURN(std::unique_ptr<transport::MetadataClient> m,
                     transport::NewHttpMetadata(options.metadata, options.rpc_timeout));
    eo.metadata = std::move(m);
  }
  eo.transports = options.transports;
  eo.backend.listen = options.listen;
  eo.backend.connections = options.connections;
  eo.backend.rdma_devices = options.rdma_devices;
  eo.workers = options.workers;
  eo.host = options.host;
  eo.default_timeout = options.transfer_timeout;
  ASSIGN_OR_RETURN(c->engine_, transport::TransferEngine::Create(eo));
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
  const size_t n = items.size();
  std::vector<absl::Status> out(n);
  if (n == 0) return out;
  v1::PutStartRequest req;
  req.set_client_id(options_.client_id);
  for (const PutItem& it : items) {
    v1::PutStartItem* p = req.add_items();
    p->set_key(it.key);
    p->set_size(StoredSize(it.value.size()));
    p->set_replicas(std::max(1, options.replicas));
    p->set_preferred_segment(options.preferred_segment);
    p->set_group(it.group);
    p->set_soft_pin(options.soft_pin);
    p->set_parent_key(it.parent_key);
  }
  absl::StatusOr<v1::PutStartResponse> started = master_->PutStart(req);
  if (!started.ok()) {
    for (auto& s : out) s = started.status();
    return out;
  }

  // A writer dying here holds extents that nothing will ever commit.
  (void)TIERKV_FAILPOINT("client.put.after_start");

  // Values go out first; their checksums are computed while they travel,
  // and the trailers follow in a second batch.
  std::vector<Trailer> trailers(n);
  std::vector<Request> values, tails;
  std::vector<size_t> value_owner, tail_owner;
  std::vector<bool> began(n, false);
  for (size_t i = 0; i < n; ++i) {
    const v1::PutStartResult& r = started->results(static_cast<int>(i));
    out[i] = FromItem(r.status());
    if (!out[i].ok()) continue;
    began[i] = true;
    const uint64_t vsize = items[i].value.size();
    for (const v1::Extent& e : r.replicas()) {
      if (vsize > 0) {
        values.push_back({Op::kWrite, const_cast<char*>(items[i].value.data()), e.segment(), e.offset(), vsize});
        value_owner.push_back(i);
      }
      tails.push_back({Op::kWrite, trailers[i].data(), e.segment(), e.offset() + vsize, kTrailer});
      tail_owner.push_back(i);
    }
  }
  std::shared_ptr<transport::Batch> value_batch = engine_->Submit(std::move(values), options_.transfer_timeout);
  for (size_t i = 0; i < n; ++i) {
    if (began[i]) trailers[i] = MakeTrailer(items[i].value);
  }
  std::vector<absl::Status> tail_status = engine_->Transfer(std::move(tails), options_.transfer_timeout);
  value_batch->Wait(absl::Now() + options_.transfer_timeout + absl::Seconds(5));
  auto record = [&](const std::vector<absl::Status>& statuses, const std::vector<size_t>& owner) {
    for (size_t k = 0; k < statuses.size(); ++k) {
      size_t i = owner[k];
      if (!statuses[k].ok() && out[i].ok()) out[i] = Annotate(statuses[k], absl::StrCat("writing ", items[i].key));
    }
  };
  record(value_batch->statuses(), value_owner);
  record(tail_status, tail_owner);
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
  // checked to be large enough), trying replicas in turn.
  static void Read(Client* c, const std::vector<std::string>& keys, const v1::GetReplicasResponse& resp,
                   const std::vector<char*>& outs, std::vector<absl::Status>* status,
                   absl::Duration timeout) {
    if (timeout <= absl::ZeroDuration()) timeout = c->options_.transfer_timeout;
    const absl::Time deadline = absl::Now() + timeout;
    const size_t n = keys.size();
    std::vector<size_t> first(n);  // index of each key's first replica
    for (size_t i = 0, at = 0; i < n; ++i) {
      first[i] = at;
      at += resp.replica_counts(static_cast<int>(i));
    }
    std::vector<Trailer> trailers(n);
    std::vector<bool> pending(n);
    for (size_t i = 0; i < n; ++i) pending[i] = (*status)[i].ok();
    for (uint32_t attempt = 0;; ++attempt) {
      std::vector<Request> requests;
      std::vector<size_t> owner;
      for (size_t i = 0; i < n; ++i) {
        if (!pending[i]) continue;
        if (attempt >= resp.replica_counts(static_cast<int>(i))) {
          pending[i] = false;  // replicas exhausted; status holds the last error
          continue;
        }
        size_t r = first[i] + attempt;
        const std::string& seg = resp.segments(static_cast<int>(resp.replica_segments(static_cast<int>(r))));
        uint64_t off = resp.replica_offsets(static_cast<int>(r));
        uint64_t vsize = resp.sizes(static_cast<int>(i)) - kTrailer;
        if (vsize > 0) {
          requests.push_back({Op::kRead, outs[i], seg, off, vsize});
          owner.push_back(i);
        }
        requests.push_back({Op::kRead, trailers[i].data(), seg, off + vsize, kTrailer});
        owner.push_back(i);
      }
      if (requests.empty()) return;
      // Submit in a few chunks and check each chunk's checksums while the
      // later ones are still on the wire.
      constexpr size_t kChunks = 4;
      size_t per = std::max<size_t>(2, (requests.size() / kChunks + 1) & ~size_t{1});
      std::vector<std::pair<size_t, std::shared_ptr<transport::Batch>>> chunks;
      for (size_t at = 0; at < requests.size();) {
        size_t end = std::min(requests.size(), at + per);
        while (end < requests.size() && owner[end] == owner[end - 1]) ++end;  // keep a key's requests together
        absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) left = absl::Milliseconds(1);
        chunks.emplace_back(at, c->engine_->Submit({requests.begin() + at, requests.begin() + end}, left));
        at = end;
      }
      std::vector<absl::Status> round(n);
      for (auto& [at, batch] : chunks) {
        batch->Wait(deadline + absl::Seconds(5));
        const std::vector<absl::Status>& got = batch->statuses();
        for (size_t k = 0; k < got.size(); ++k) {
          if (!got[k].ok() && round[owner[at + k]].ok()) round[owner[at + k]] = got[k];
        }
        size_t end = at + got.size();
        for (size_t k = at; k < end; ++k) {
          size_t i = owner[k];
          if (k + 1 < end && owner[k + 1] == i) continue;  // check once, at the key's last request
          if (!pending[i]) continue;
          absl::Status st = round[i];
          if (st.ok()) {
            uint64_t vsize = resp.sizes(static_cast<int>(i)) - kTrailer;
            st = CheckTrailer(trailers[i], {outs[i], vsize}, keys[i], c->options_.verify_checksums);
          }
          (*status)[i] = st.ok() ? st : Annotate(st, absl::StrCat("reading ", keys[i]));
          if (st.ok() || !Retryable(st)) pending[i] = false;
        }
      }
    }
  }

  // Per-key status after GetReplicas: NOT_FOUND for misses, DATA_LOSS for
  // impossible sizes.
  static std::vector<absl::Status> Found(const std::vector<std::string>& keys,
                                         const v1::GetReplicasResponse& resp) {
    std::vector<absl::Status> st(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      uint64_t size = resp.sizes(static_cast<int>(i));
      if (size == 0) {
        st[i] = absl::NotFoundError(keys[i]);
      } else if (size < kTrailer) {
        st[i] = absl::DataLossError(absl::StrCat(keys[i], ": stored size ", size, " is too small"));
      }
    }
    return st;
  }
};

std::vector<absl::StatusOr<size_t>> Client::Fetch(const std::vector<std::string>& keys, absl::Duration timeout,
                                                  const std::function<char*(size_t, uint64_t)>& place) {
  std::vector<absl::StatusOr<size_t>> result(keys.size());
  if (keys.empty()) return result;
  absl::StatusOr<v1::GetReplicasResponse> resp = master_->GetReplicas(keys);
  if (!resp.ok()) {
    for (auto& r : result) r = resp.status();
    return result;
  }
  std::vector<absl::Status> st = Impl::Found(keys, *resp);
  std::vector<char*> ptrs(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!st[i].ok()) continue;
    uint64_t vsize = resp->sizes(static_cast<int>(i)) - kTrailer;
    ptrs[i] = place(i, vsize);
    if (ptrs[i] == nullptr && vsize > 0) {
      st[i] = absl::InvalidArgumentError(absl::StrCat(keys[i], ": the buffer cannot hold ", vsize, " bytes"));
    }
  }
  Impl::Read(this, keys, *resp, ptrs, &st, timeout);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (st[i].ok()) {
      result[i] = resp->sizes(static_cast<int>(i)) - kTrailer;
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
  return Fetch(keys, timeout, [&](size_t i, uint64_t size) -> char* {
    return size <= outs[i].size() ? outs[i].data() : nullptr;
  });
}

std::vector<absl::StatusOr<std::string>> Client::BatchGet(const std::vector<std::string>& keys) {
  std::vector<std::string> values(keys.size());
  std::vector<absl::StatusOr<size_t>> got = Fetch(keys, absl::ZeroDuration(), [&](size_t i, uint64_t size) {
    values[i].resize(size);
    return values[i].data();
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
  ASSIGN_OR_RETURN(v1::KeysResponse r, master_->Remove({key}, force));
  return FromItem(r.status(0));
}

}  // namespace tierkv::client
