// Client's put path (client/client.h): Put and BatchPut, which retries a
// put lost to a failover or refused while segments await re-mount, and
// PutOnce, one PutStart, the value and trailer writes to every replica,
// then PutEnd (or PutRevoke). Write sessions split the same steps over
// calls: the PutStart, range writes (each checksummed apart, the CRCs
// joined at the commit), then trailers and PutEnd.
#include "client/client.h"

#include <algorithm>
#include <map>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "base/failpoint.h"
#include "base/mutex.h"
#include "base/status.h"
#include "client/internal/completion_grace.h"
#include "client/internal/replica_cache.h"
#include "client/internal/trailer_arena.h"

namespace tierkv::client {

namespace {

using internal::kCompletionGrace;
using transport::Op;
using transport::Request;

// The trailer stored after every value binds it to its key and put
// (client/internal/trailer_arena.h). Trailers live in the client's
// registered TrailerArena, so every transport (rdma included) can move them.
using internal::EncodeTrailer;
using internal::KeyCrc;

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

// One item of a PutStart: `value_size` bytes of value under `key`.
void AddPutStartItem(const std::string& key, uint64_t value_size, const std::string& group,
                     const std::string& parent_key, const PutOptions& options, v1::PutStartRequest* req) {
  v1::PutStartItem* p = req->add_items();
  p->set_key(key);
  p->set_size(StoredSize(value_size));
  p->set_replicas(std::max(1, options.replicas));
  p->set_preferred_segment(options.preferred_segment);
  p->set_group(group);
  p->set_soft_pin(options.soft_pin);
  p->set_hard_pin(options.hard_pin);
  p->set_parent_key(parent_key);
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

}  // namespace

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
  for (const PutItem& it : items) AddPutStartItem(it.key, ValueSize(it), it.group, it.parent_key, options, &req);
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
             started->epoch(), e.grant()});
        value_owner.push_back(i);
        vsize += part.size();
      }
      tails.push_back({Op::kWrite, trailers->slot(i), e.segment(), e.offset() + vsize, internal::kTrailerBytes,
                       nullptr, started->epoch(), e.grant()});
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

struct WriteSession::State {
  struct Range {
    uint64_t size = 0;
    uint32_t crc = 0;  // Crc32c of the range's bytes, once written
    bool written = false;
  };
  struct Key {
    WriteItem item;
    absl::Status status;
    uint64_t put_id = 0;
    std::vector<std::pair<std::string, uint64_t>> replicas;  // (segment, offset)
    std::vector<std::string> grants;                         // each replica's extent grant ("" none)
    std::map<uint64_t, Range> ranges;  // by offset; written or being written
    bool closed = false;               // committed or revoked
  };
  uint64_t epoch = 0;
  mutable Mutex mu;
  std::vector<Key> keys ABSL_GUARDED_BY(mu);
};

namespace {

// The keys a commit or revoke names: `which`, or every key when empty.
std::vector<size_t> Named(absl::Span<const size_t> which, size_t n) {
  if (!which.empty()) return {which.begin(), which.end()};
  std::vector<size_t> all(n);
  for (size_t i = 0; i < n; ++i) all[i] = i;
  return all;
}

absl::Status Closed(const std::string& key) {
  return absl::FailedPreconditionError(absl::StrCat(key, ": its write session was committed or revoked"));
}

}  // namespace

WriteSession::WriteSession() : state_(std::make_unique<State>()) {}
WriteSession::~WriteSession() = default;

size_t WriteSession::size() const {
  MutexLock lock(&state_->mu);
  return state_->keys.size();
}

const std::string& WriteSession::key(size_t i) const {
  MutexLock lock(&state_->mu);
  return state_->keys.at(i).item.key;  // keys never change after the start
}

absl::Status WriteSession::status(size_t i) const {
  MutexLock lock(&state_->mu);
  if (i >= state_->keys.size()) return absl::InvalidArgumentError(absl::StrCat("the session has no key ", i));
  return state_->keys[i].status;
}

std::unique_ptr<WriteSession> Client::StartWriteSession(const std::vector<WriteItem>& items,
                                                        const PutOptions& options) {
  std::unique_ptr<WriteSession> session(new WriteSession());
  WriteSession::State& s = *session->state_;
  MutexLock lock(&s.mu);
  for (const WriteItem& it : items) s.keys.push_back({it});
  if (items.empty()) return session;
  v1::PutStartRequest req;
  req.set_client_id(options_.client_id);
  req.set_put_ids(true);
  for (const WriteItem& it : items) AddPutStartItem(it.key, it.size, it.group, it.parent_key, options, &req);
  absl::StatusOr<v1::PutStartResponse> started = master_->PutStart(req);
  if (!started.ok()) {
    for (auto& k : s.keys) k.status = started.status();
    return session;
  }
  s.epoch = started->epoch();
  for (size_t i = 0; i < s.keys.size(); ++i) {
    WriteSession::State::Key& k = s.keys[i];
    if (static_cast<int>(i) >= started->results_size()) {
      k.status = absl::InternalError(absl::StrCat(k.item.key, ": the master's answer has no entry for it"));
      continue;
    }
    const v1::PutStartResult& r = started->results(static_cast<int>(i));
    k.status = FromItem(r.status());
    if (!k.status.ok()) continue;
    k.put_id = r.put_id();
    for (const v1::Extent& e : r.replicas()) {
      k.replicas.emplace_back(e.segment(), e.offset());
      k.grants.push_back(e.grant());
    }
    if (k.put_id == 0) {
      k.status = absl::FailedPreconditionError(
          absl::StrCat(k.item.key, ": the master gave no put id (it predates them); upgrade the master"));
      (void)master_->PutRevoke({k.item.key});
    }
  }
  return session;
}

std::vector<absl::Status> Client::WriteRanges(WriteSession& session, const std::vector<RangeWrite>& writes,
                                              absl::Duration timeout) {
  WriteSession::State& s = *session.state_;
  std::vector<absl::Status> out(writes.size());
  if (timeout <= absl::ZeroDuration()) timeout = options_.transfer_timeout;
  std::vector<Request> requests;
  std::vector<size_t> owner;  // the write each request belongs to
  std::vector<size_t> sent;
  {
    MutexLock lock(&s.mu);
    for (size_t w = 0; w < writes.size(); ++w) {
      const RangeWrite& rw = writes[w];
      if (rw.key >= s.keys.size()) {
        out[w] = absl::InvalidArgumentError(absl::StrCat("range ", w, " names key ", rw.key, " of a session of ",
                                                         s.keys.size()));
        continue;
      }
      WriteSession::State::Key& k = s.keys[rw.key];
      if (k.closed) {
        out[w] = Closed(k.item.key);
        continue;
      }
      if (!k.status.ok()) {
        out[w] = k.status;
        continue;
      }
      const uint64_t end = rw.offset + rw.data.size();
      if (rw.offset > k.item.size || rw.data.size() > k.item.size - rw.offset) {
        out[w] = absl::OutOfRangeError(absl::StrCat(k.item.key, ": bytes [", rw.offset, ", ", end,
                                                    ") lie outside its ", k.item.size, "-byte value"));
        continue;
      }
      if (rw.data.empty()) continue;
      // Each byte is written once: the CRCs of the ranges join into the value's.
      auto next = k.ranges.lower_bound(rw.offset);
      const bool overlaps = (next != k.ranges.end() && next->first < end) ||
                            (next != k.ranges.begin() && std::prev(next)->first + std::prev(next)->second.size >
                                                             rw.offset);
      if (overlaps) {
        out[w] = absl::InvalidArgumentError(
            absl::StrCat(k.item.key, ": bytes [", rw.offset, ", ", end, ") overlap a range already written"));
        continue;
      }
      k.ranges.emplace(rw.offset, WriteSession::State::Range{rw.data.size(), 0, false});
      for (size_t j = 0; j < k.replicas.size(); ++j) {
        const auto& [seg, off] = k.replicas[j];
        requests.push_back({Op::kWrite, const_cast<char*>(rw.data.data()), seg, off + rw.offset, rw.data.size(),
                            nullptr, s.epoch, k.grants[j]});
        owner.push_back(w);
      }
      sent.push_back(w);
    }
  }
  if (sent.empty()) return out;
  std::shared_ptr<transport::Batch> batch = engine_->Submit(std::move(requests), timeout);
  // Checksummed here while the bytes travel.
  std::vector<uint32_t> crcs(writes.size());
  for (size_t w : sent) crcs[w] = Crc32c(writes[w].data.data(), writes[w].data.size());
  (void)batch->Wait(absl::Now() + timeout + kCompletionGrace);
  const std::vector<absl::Status> got = batch->statuses();
  for (size_t q = 0; q < owner.size(); ++q) {
    absl::Status st = q < got.size() ? got[q] : absl::InternalError("missing transfer status");
    if (!st.ok() && out[owner[q]].ok()) out[owner[q]] = st;
  }
  MutexLock lock(&s.mu);
  for (size_t w : sent) {
    WriteSession::State::Key& k = s.keys[writes[w].key];
    if (out[w].ok()) {
      WriteSession::State::Range& r = k.ranges[writes[w].offset];
      r.crc = crcs[w];
      r.written = true;
    } else {
      out[w] = Annotate(out[w], absl::StrCat("writing a range of ", k.item.key));
      if (k.status.ok()) k.status = out[w];  // some replica's bytes are unknown: never committed
    }
  }
  return out;
}

std::vector<absl::Status> Client::CommitWriteSession(WriteSession& session, absl::Span<const size_t> which) {
  WriteSession::State& s = *session.state_;
  MutexLock lock(&s.mu);
  const std::vector<size_t> named = Named(which, s.keys.size());
  std::vector<absl::Status> out(named.size());
  // The keys this commit takes: named, valid, open; each once.
  std::vector<size_t> take;
  for (size_t j = 0; j < named.size(); ++j) {
    const size_t i = named[j];
    if (i >= s.keys.size()) {
      out[j] = absl::InvalidArgumentError(absl::StrCat("the session has no key ", i));
    } else if (s.keys[i].closed) {
      out[j] = Closed(s.keys[i].item.key);
    } else {
      s.keys[i].closed = true;
      take.push_back(i);
    }
  }
  absl::StatusOr<internal::TrailerBlock> trailers = trailers_->Acquire(std::max<size_t>(take.size(), 1));
  for (size_t t = 0; t < take.size(); ++t) {
    WriteSession::State::Key& k = s.keys[take[t]];
    if (!k.status.ok()) continue;
    if (!trailers.ok()) {
      k.status = Annotate(trailers.status(), "registering trailer memory");
      continue;
    }
    // The value's CRC from its ranges', which must tile it exactly.
    uint32_t crc = KeyCrc(k.item.key);
    uint64_t at = 0;
    for (const auto& [offset, range] : k.ranges) {
      if (offset != at || !range.written) break;  // a gap, or a write still in flight
      crc = Crc32cCombine(crc, range.crc, range.size);
      at += range.size;
    }
    if (at != k.item.size) {
      k.status = absl::FailedPreconditionError(
          absl::StrCat(k.item.key, ": byte ", at, " of its ", k.item.size, "-byte value was not written (",
                       k.ranges.contains(at) ? "its write had not finished" : "no range covers it", ")"));
      continue;
    }
    EncodeTrailer(crc, k.put_id, trailers->slot(t));
  }
  // A group with a failed member is given up whole.
  absl::flat_hash_set<std::string> failed_groups;
  for (size_t i : take) {
    if (!s.keys[i].item.group.empty() && !s.keys[i].status.ok()) failed_groups.insert(s.keys[i].item.group);
  }
  std::vector<Request> tails;
  std::vector<size_t> tail_owner;
  for (size_t t = 0; t < take.size(); ++t) {
    WriteSession::State::Key& k = s.keys[take[t]];
    if (k.status.ok() && failed_groups.contains(k.item.group)) {
      k.status = absl::AbortedError(absl::StrCat(k.item.key, ": another member of group ", k.item.group, " failed"));
    }
    if (!k.status.ok()) continue;
    for (size_t j = 0; j < k.replicas.size(); ++j) {
      const auto& [seg, off] = k.replicas[j];
      tails.push_back({Op::kWrite, trailers->slot(t), seg, off + k.item.size, internal::kTrailerBytes, nullptr,
                       s.epoch, k.grants[j]});
      tail_owner.push_back(take[t]);
    }
  }
  if (!tails.empty()) {
    std::shared_ptr<transport::Batch> batch = engine_->SubmitHere(std::move(tails), options_.transfer_timeout);
    trailers->Hold(batch);
    (void)batch->Wait(absl::Now() + options_.transfer_timeout + kCompletionGrace);
    const std::vector<absl::Status> got = batch->statuses();
    for (size_t q = 0; q < tail_owner.size(); ++q) {
      absl::Status st = q < got.size() ? got[q] : absl::InternalError("missing transfer status");
      WriteSession::State::Key& k = s.keys[tail_owner[q]];
      if (!st.ok() && k.status.ok()) k.status = Annotate(st, absl::StrCat("writing the trailer of ", k.item.key));
    }
  }
  std::vector<std::string> commit, revoke;
  std::vector<size_t> commit_idx;
  for (size_t i : take) {
    if (s.keys[i].put_id == 0) continue;  // never granted
    if (s.keys[i].status.ok()) {
      commit.push_back(s.keys[i].item.key);
      commit_idx.push_back(i);
    } else {
      revoke.push_back(s.keys[i].item.key);
    }
  }
  if (!commit.empty()) {
    for (const std::string& k : commit) replicas_->Erase(k);
    absl::StatusOr<v1::KeysResponse> ended = master_->PutEnd(commit);
    for (size_t c = 0; c < commit.size(); ++c) {
      absl::Status st = ended.ok() ? FromItem(ended->status(static_cast<int>(c))) : ended.status();
      if (!st.ok()) {
        s.keys[commit_idx[c]].status = st;
        revoke.push_back(commit[c]);
      }
    }
  }
  // Best effort: the master also reclaims puts that are never committed.
  if (!revoke.empty()) (void)master_->PutRevoke(revoke);
  for (size_t j = 0; j < named.size(); ++j) {
    if (named[j] < s.keys.size() && out[j].ok()) out[j] = s.keys[named[j]].status;
  }
  return out;
}

void Client::RevokeWriteSession(WriteSession& session, absl::Span<const size_t> which) {
  WriteSession::State& s = *session.state_;
  MutexLock lock(&s.mu);
  std::vector<std::string> revoke;
  for (size_t i : Named(which, s.keys.size())) {
    if (i >= s.keys.size() || s.keys[i].closed) continue;
    WriteSession::State::Key& k = s.keys[i];
    k.closed = true;
    if (k.put_id != 0) revoke.push_back(k.item.key);
    if (k.status.ok()) k.status = absl::CancelledError(absl::StrCat(k.item.key, ": the write session was revoked"));
  }
  if (!revoke.empty()) (void)master_->PutRevoke(revoke);
}

}  // namespace tierkv::client
