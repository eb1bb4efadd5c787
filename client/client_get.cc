// Client's get path (client/client.h): Get, BatchGet and BatchGetScatter,
// all through Fetch, which takes each key's replicas from the replica
// cache or GetReplicas (staging SSD hits first), reads them inside their
// read leases trying replica after replica, checks trailers, and asks the
// master once more for a cached location that failed. Read sessions keep
// one GetReplicas answer and read ranges of its values (ReadRanges).
#include "client/client.h"

#include <algorithm>
#include <atomic>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "client/internal/completion_grace.h"
#include "client/internal/replica_cache.h"
#include "client/internal/ssd_stage.h"
#include "client/internal/trailer_arena.h"

namespace tierkv::client {

namespace {

using auth::kExtentGrantBytes;
using internal::kCompletionGrace;
using internal::StageSsdHits;
using transport::Op;
using transport::Request;

// The trailer stored after every value binds it to its key and put
// (client/internal/trailer_arena.h); a read checks it.
using internal::CheckTrailer;
using internal::KeyCrc;
using internal::TrailerSize;

// Whether key k of a GetReplicas answer awaits its daemons' re-mount.
bool Awaiting(const v1::GetReplicasResponse& resp, size_t k) {
  for (uint32_t a : resp.awaiting()) {
    if (a == k) return true;
  }
  return false;
}

// Worth trying another replica after this transfer error.
// (PERMISSION_DENIED: a daemon refused the replica's extent grant, one
// whose clock runs ahead, say; another daemon may take its own.)
bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsNotFound(s) ||
         absl::IsOutOfRange(s) || absl::IsDataLoss(s) || absl::IsPermissionDenied(s);
}

}  // namespace

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
          requests.back().grant = where[i].grant(attempt);
          owner.push_back(i);
          vsize += piece.size();
        }
        requests.push_back({Op::kRead, trailers->slot(i), seg, off + vsize, TrailerSize(where[i].put_id)});
        requests.back().grant = where[i].grant(attempt);
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
        const std::string& packed = resp.replica_grants();
        if ((static_cast<size_t>(r) + 1) * kExtentGrantBytes <= packed.size()) {
          // Aligned with w.replicas (a malformed replica above adds none).
          w.grants.resize((w.replicas.size() - 1) * kExtentGrantBytes, '\0');
          w.grants.append(packed, static_cast<size_t>(r) * kExtentGrantBytes, kExtentGrantBytes);
        }
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
      } else if (Awaiting(*resp, k)) {
        st[i] = absl::UnavailableError(absl::StrCat(keys[i], ": its copies are ", kAwaitingRemount));
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
  // Keys whose daemons a new master awaits are not lost: asked again until
  // they re-mount (a heartbeat, usually) or the call timeout has passed.
  const absl::Time give_up = absl::Now() + options_.rpc_timeout;
  for (absl::Duration backoff = absl::Milliseconds(50);;) {
    std::vector<size_t> waiting;
    for (size_t i : ask) {
      if (absl::IsUnavailable(st[i]) && absl::StrContains(st[i].message(), kAwaitingRemount)) waiting.push_back(i);
    }
    if (waiting.empty() || absl::Now() + backoff >= give_up) break;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
    ask_master(waiting);
  }

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
    // So is a location whose daemon refused the master's extent grant (one
    // whose clock runs ahead of the master's, say): a fresh one may pass.
    if (!where[i].cached && !where[i].replicas.empty() && absl::IsPermissionDenied(st[i])) {
      again.push_back(i);
      continue;
    }
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

struct ReadSession::State {
  std::vector<std::string> keys;
  std::vector<internal::Located> where;
  std::vector<absl::Status> status;  // per key: OK once located
  std::atomic<bool> ended{false};
};

ReadSession::ReadSession() : state_(std::make_unique<State>()) {}
ReadSession::~ReadSession() = default;
size_t ReadSession::size() const { return state_->keys.size(); }
const std::string& ReadSession::key(size_t i) const { return state_->keys.at(i); }

absl::StatusOr<uint64_t> ReadSession::value_size(size_t i) const {
  if (i >= size()) return absl::InvalidArgumentError(absl::StrCat("the session has no key ", i));
  if (!state_->status[i].ok()) return state_->status[i];
  return state_->where[i].stored_size - TrailerSize(state_->where[i].put_id);
}

absl::Time ReadSession::lease_end(size_t i) const {
  return i < size() && state_->status[i].ok() ? state_->where[i].lease_end : absl::InfinitePast();
}

std::unique_ptr<ReadSession> Client::StartReadSession(const std::vector<std::string>& keys) {
  std::unique_ptr<ReadSession> session(new ReadSession());
  ReadSession::State& s = *session->state_;
  const size_t n = keys.size();
  s.keys = keys;
  s.where.resize(n);
  s.status.resize(n);
  if (n == 0) return session;
  replicas_->ReleaseEnded(absl::Now());  // their give-backs go with this lookup
  const absl::Time asked = absl::Now();
  // Counted: ending the session gives every lease back at once.
  absl::StatusOr<v1::GetReplicasResponse> resp = master_->GetReplicas(keys, /*counted=*/true);
  if (!resp.ok()) {
    for (absl::Status& st : s.status) st = resp.status();
    return session;
  }
  replicas_->Heard(asked, resp->epoch(), resp->membership());
  std::vector<internal::Located> got = Impl::Locate(*resp, asked);
  std::vector<absl::Status> staged = StageSsdHits(*resp, keys, options_.transfer_timeout, grants_.get(), options_.tls);
  for (uint32_t i : resp->refused()) {
    if (i < n) {
      s.status[i] = absl::ResourceExhaustedError(absl::StrCat(
          keys[i], ": this client holds as many reservations as the master allows "
                   "(--max-reservations-per-client); end read sessions first"));
    }
  }
  for (uint32_t i : resp->awaiting()) {
    if (i < n) s.status[i] = absl::UnavailableError(absl::StrCat(keys[i], ": its copies are ", kAwaitingRemount));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!s.status[i].ok()) continue;  // refused, or awaiting its daemon
    if (i >= got.size()) {
      s.status[i] = absl::InternalError(absl::StrCat(keys[i], ": the master's answer has no entry for it"));
    } else if (!staged[i].ok()) {
      s.status[i] = staged[i];
    } else {
      s.where[i] = std::move(got[i]);
      s.status[i] = Impl::Found(keys[i], s.where[i]);
    }
  }
  return session;
}

void Client::EndReadSession(ReadSession& session) {
  ReadSession::State& s = *session.state_;
  if (s.ended.exchange(true)) return;
  bool gave = false;
  for (size_t i = 0; i < s.keys.size(); ++i) {
    const internal::Located& w = s.where[i];
    // A lease the master does not count (a key it saw too many readers of) simply runs out.
    if (s.status[i].ok() && w.lease_token != 0) {
      master_->ReleaseLease(s.keys[i], w.lease_token, w.lease_expiry_ms);
      gave = true;
    }
  }
  // The reservation ends now, not with this client's next call; a master
  // that cannot be reached ends it at the lease's expiry.
  if (gave) (void)master_->FlushReleases();
}

std::vector<absl::Status> Client::ReadRanges(const ReadSession& session, const std::vector<RangeRead>& reads,
                                             absl::Duration timeout) {
  const ReadSession::State& s = *session.state_;
  std::vector<absl::Status> out(reads.size());
  if (timeout <= absl::ZeroDuration()) timeout = options_.transfer_timeout;
  const absl::Time deadline = absl::Now() + timeout;
  auto lease_ended = [&](size_t key) {
    return absl::AbortedError(absl::StrCat(s.keys[key], ": the session's lease has ended; start a new session"));
  };
  // The keys with ranges to read, each with a trailer slot; per key, its reads.
  absl::flat_hash_map<size_t, size_t> slot_of;
  std::vector<size_t> touched;
  std::vector<std::vector<size_t>> reads_of;
  const absl::Time now = absl::Now();
  uint32_t lapsed = 0;  // ranges whose lease had ended before the call
  for (size_t r = 0; r < reads.size(); ++r) {
    const RangeRead& rr = reads[r];
    if (rr.key >= s.keys.size()) {
      out[r] = absl::InvalidArgumentError(absl::StrCat("range ", r, " names key ", rr.key, " of a session of ",
                                                       s.keys.size()));
      continue;
    }
    if (!s.status[rr.key].ok()) {
      out[r] = s.status[rr.key];
      continue;
    }
    const uint64_t vsize = s.where[rr.key].stored_size - TrailerSize(s.where[rr.key].put_id);
    if (rr.offset > vsize || rr.out.size() > vsize - rr.offset) {
      out[r] = absl::OutOfRangeError(absl::StrCat(s.keys[rr.key], ": bytes [", rr.offset, ", ",
                                                  rr.offset + rr.out.size(), ") lie outside its ", vsize,
                                                  "-byte value"));
      continue;
    }
    if (now >= s.where[rr.key].lease_end || s.ended.load()) {
      out[r] = lease_ended(rr.key);
      if (!s.ended.load()) ++lapsed;  // short of the promise, unless the caller ended it
      continue;
    }
    if (rr.out.empty()) continue;
    auto [it, inserted] = slot_of.try_emplace(rr.key, touched.size());
    if (inserted) {
      touched.push_back(rr.key);
      reads_of.emplace_back();
    }
    reads_of[it->second].push_back(r);
  }
  if (touched.empty()) {
    if (lapsed > 0) master_->NoteShortfalls(lapsed);
    return out;
  }
  absl::StatusOr<internal::TrailerBlock> trailers = trailers_->Acquire(touched.size());
  if (!trailers.ok()) {
    for (const auto& rs : reads_of) {
      for (size_t r : rs) out[r] = Annotate(trailers.status(), "registering trailer memory");
    }
    return out;
  }
  // Every range of a key goes to one replica, with the trailer after the
  // value; a key whose replica failed tries the next one with all its ranges.
  std::vector<size_t> pending(touched.size());
  for (size_t k = 0; k < touched.size(); ++k) pending[k] = k;
  for (uint32_t attempt = 0; !pending.empty(); ++attempt) {
    std::vector<Request> requests;
    std::vector<size_t> owner;  // the slot each request belongs to
    std::vector<size_t> sent;
    absl::Time until = deadline;
    for (size_t k : pending) {
      const size_t key = touched[k];
      const internal::Located& w = s.where[key];
      if (attempt >= w.replicas.size()) continue;  // exhausted: keeps the last error
      const auto& [seg, off] = w.replicas[attempt];
      for (size_t r : reads_of[k]) {
        requests.push_back({Op::kRead, reads[r].out.data(), seg, off + reads[r].offset, reads[r].out.size()});
        requests.back().grant = w.grant(attempt);
        owner.push_back(k);
      }
      const uint64_t vsize = w.stored_size - TrailerSize(w.put_id);
      requests.push_back({Op::kRead, trailers->slot(k), seg, off + vsize, TrailerSize(w.put_id)});
      requests.back().grant = w.grant(attempt);
      owner.push_back(k);
      sent.push_back(k);
      until = std::min(until, w.lease_end);
    }
    if (sent.empty()) break;
    absl::Duration left = std::max(until - absl::Now(), absl::Milliseconds(1));
    std::shared_ptr<transport::Batch> batch = engine_->SubmitHere(std::move(requests), left);
    trailers->Hold(batch);
    (void)batch->Wait(until + kCompletionGrace);
    const std::vector<absl::Status> got = batch->statuses();
    absl::flat_hash_map<size_t, absl::Status> failed;
    for (size_t q = 0; q < got.size() && q < owner.size(); ++q) {
      if (!got[q].ok()) failed.try_emplace(owner[q], got[q]);
    }
    std::vector<size_t> again;
    const absl::Time done = absl::Now();
    for (size_t k : sent) {
      const size_t key = touched[k];
      const internal::Located& w = s.where[key];
      absl::Status st;
      if (done >= w.lease_end) {
        st = lease_ended(key);  // what landed may be another put's bytes
      } else if (auto f = failed.find(k); f != failed.end()) {
        st = Annotate(f->second, absl::StrCat("reading ranges of ", s.keys[key]));
      } else {
        // The put id alone: a range is not the whole value the CRC covers.
        st = CheckTrailer(trailers->slot(k), w.put_id, s.keys[key], {}, false, transport::CopyCrc{});
      }
      for (size_t r : reads_of[k]) out[r] = st;
      if (!st.ok() && !absl::IsAborted(st) && Retryable(st)) again.push_back(k);
    }
    pending = std::move(again);
  }
  // Reads the start promised that found less (the lease ran out first, the
  // bytes were another put's, no replica answered): the master counts them.
  uint32_t short_keys = 0;
  for (size_t k = 0; k < touched.size(); ++k) {
    if (!out[reads_of[k].front()].ok()) ++short_keys;
  }
  if (short_keys + lapsed > 0) master_->NoteShortfalls(short_keys + lapsed);
  return out;
}

}  // namespace tierkv::client
