#include "transport/tcp/connection.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/status.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

// A WRITE payload this small goes out in one TLS record with its header
// (as net::TlsWriteVecFull gathers it).
constexpr uint64_t kTlsGather = (16 << 10) - kRequestSize;

// What the unfinished slices of a batch whose claim was revoked read.
absl::Status Abandoned(const std::string& endpoint) {
  return absl::DeadlineExceededError(
      absl::StrCat("transfer to ", endpoint, " abandoned: its caller stopped waiting; the connection is dropped"));
}

}  // namespace

absl::Status Connection::MoveTls(bool send, char* buf, size_t len, absl::Time deadline, BufferClaim* claim) {
  while (len > 0) {
    absl::StatusOr<net::IoStep> step;
    {
      ClaimHold hold(claim);
      if (!hold.held()) return absl::CancelledError("the caller stopped waiting");
      step = send ? net::TlsSendSome(ssl_.get(), buf, len) : net::TlsRecvSome(ssl_.get(), buf, len);
    }
    if (!step.ok()) return step.status();
    if (step->n > 0) {
      buf += step->n;
      len -= step->n;
      continue;
    }
    // Waited for outside the claim, so a revocation never waits on the peer.
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms < 0) return absl::DeadlineExceededError(send ? "write timed out" : "read timed out");
    pollfd p{fd_.get(), step->wait, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30))) < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("poll: ", strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status Connection::SendTlsWrite(const uint8_t* head, size_t head_len, const char* payload, uint64_t length,
                                      absl::Time deadline, BufferClaim* claim) {
  if (length <= kTlsGather) {
    std::string frame(reinterpret_cast<const char*>(head), head_len);
    {
      ClaimHold hold(claim);
      if (!hold.held()) return absl::CancelledError("the caller stopped waiting");
      frame.append(payload, length);
    }
    iovec iov{frame.data(), frame.size()};
    return net::TlsWriteVecFull(ssl_.get(), &iov, 1, deadline);
  }
  iovec iov{const_cast<uint8_t*>(head), head_len};
  RETURN_IF_ERROR(net::TlsWriteVecFull(ssl_.get(), &iov, 1, deadline));
  return MoveTls(/*send=*/true, const_cast<char*>(payload), length, deadline, claim);
}

void Connection::RunBatchTls(uint32_t segment, uint64_t segment_id, absl::Span<Slice* const> slices,
                             absl::Time deadline, BufferClaim* claim) {
  const size_t n = slices.size();
  size_t answered = 0;
  // A failed call leaves the stream mid-frame: every slice not yet
  // answered fails with it, and the connection is broken. CANCELLED is a
  // revoked claim: the caller has gone, not the peer.
  auto fail = [&](const char* what, const absl::Status& why) {
    if (absl::IsCancelled(why)) abandoned_ = true;
    const absl::Status st = absl::IsCancelled(why) ? Abandoned(endpoint_)
                                                   : absl::Status(why.code(), absl::StrCat(what, endpoint_, ": ", why.message()));
    for (size_t i = answered; i < n; ++i) slices[i]->status = st;
    broken_ = true;
  };
  // Windows of consecutive slices of one kind, in order: the requests of a
  // window are sent, then its replies read. A window of reads sends only
  // headers, and one of writes draws only small replies, so neither side
  // ever waits on the other with full buffers.
  while (answered < n) {
    const Op op = slices[answered]->op;
    size_t end = answered;
    uint64_t bytes = 0;
    while (end < n && slices[end]->op == op && end - answered < kTlsWindow &&
           (op == Op::kRead || end == answered || bytes + slices[end]->length <= kTlsWindowBytes)) {
      bytes += slices[end]->length;
      ++end;
    }
    const uint64_t first_id = next_id_;
    const size_t start = answered;
    for (size_t i = start; i < end; ++i) {
      Slice* s = slices[i];
      RequestHeader h;
      h.op = op == Op::kRead ? WireOp::kRead : WireOp::kWrite;
      h.segment = segment;
      h.segment_id = segment_id;
      h.id = next_id_++;
      h.offset = s->remote_offset;
      h.length = s->length;
      if (h.op == WireOp::kWrite) {
        h.flags |= kHasDeadline;
        h.deadline_ms32 = DeadlineMs32(deadline);
        h.epoch = s->epoch;
      }
      uint8_t head[kHeadMax];
      const size_t head_len = EncodeHead(h, s->grant(), head);
      absl::Status st;
      if (op == Op::kWrite && claim != nullptr) {
        st = SendTlsWrite(head, head_len, s->local, s->length, deadline, claim);
      } else {
        iovec iov[2] = {{head, head_len}, {s->local, op == Op::kWrite ? s->length : 0}};
        st = net::TlsWriteVecFull(ssl_.get(), iov, op == Op::kWrite ? 2 : 1, deadline);
      }
      if (!st.ok()) return fail("send to ", st);
    }
    for (size_t i = start; i < end; ++i) {
      Slice* s = slices[i];
      uint8_t reply[kReplySize];
      if (absl::Status st = net::TlsReadFull(ssl_.get(), reply, kReplySize, deadline); !st.ok()) {
        return fail("recv from ", st);
      }
      absl::StatusOr<ReplyHeader> h = DecodeReply(reply, kReplySize);
      const uint64_t want = op == Op::kRead ? s->length : 0;
      if (!h.ok() || h->id != first_id + (i - start) || (h->status == WireStatus::kOk && h->length != want) ||
          (h->status != WireStatus::kOk && h->length > kMaxErrorText)) {
        return fail("protocol error from ", absl::UnavailableError("unexpected reply"));
      }
      std::string text(h->status == WireStatus::kOk ? 0 : h->length, '\0');
      const bool into_local = h->status == WireStatus::kOk;
      absl::Status st = into_local && claim != nullptr
                            ? MoveTls(/*send=*/false, s->local, h->length, deadline, claim)
                            : net::TlsReadFull(ssl_.get(), into_local ? static_cast<void*>(s->local) : text.data(),
                                               h->length, deadline);
      if (!st.ok()) return fail("recv from ", st);
      s->status = ReplyToStatus(h->status, text);
      answered = i + 1;
    }
  }
}

void Connection::RunBatch(uint32_t segment, uint64_t segment_id, absl::Span<Slice* const> slices,
                          absl::Time deadline, BufferClaim* claim) {
  if (ssl_ != nullptr) return RunBatchTls(segment, segment_id, slices, deadline, claim);
  absl::InlinedVector<Frame, 4> frames;
  PlanFrames(slices, &frames);
  const size_t n = frames.size();
  // A single get or put fits inline: no allocation per batch.
  absl::InlinedVector<uint8_t, 4 * kHeadMax> heads(n * kHeadMax);
  std::vector<uint8_t> tables;  // the vectored frames' range tables, back to back
  // The socket stays blocking from its first batch on: non-blocking calls
  // pass MSG_DONTWAIT, so no batch pays two fcntl calls each way.
  if (!blocking_) {
    SetBlocking(true);
    blocking_ = true;
  }
  uint64_t first_id = next_id_;
  next_id_ += n;
  for (size_t i = 0; i < n; ++i) {
    Frame& f = frames[i];
    const Slice* s = slices[f.first];
    const bool write = s->op == Op::kWrite;
    RequestHeader h;
    h.op = write ? WireOp::kWrite : WireOp::kRead;
    h.segment = segment;
    h.segment_id = segment_id;
    h.id = first_id + i;
    h.offset = s->remote_offset;
    h.length = f.length;
    if (f.vectored) {
      h.op = write ? WireOp::kWriteV : WireOp::kReadV;
      h.offset = f.count;
      // Ranges under extent grants carry each its own: a batch of small
      // values, each in its extent, still goes as one frame.
      for (size_t k = 0; k < f.count; ++k) {
        if (!slices[f.first + k]->grant().empty()) h.flags |= kRangeGrants;
      }
      const size_t entry = RangeEntryBytes(h);
      f.table_len = f.count * entry;
      h.length = f.table_len + (write ? f.length : 0);
      f.table_at = tables.size();
      tables.resize(tables.size() + f.table_len);
      for (size_t k = 0; k < f.count; ++k) {
        const Slice* t = slices[f.first + k];
        uint8_t* at = &tables[f.table_at + k * entry];
        EncodeRange({t->remote_offset, t->length}, at);
        if (entry > kRangeBytes && t->grant().size() == kGrantBlockBytes) {
          std::memcpy(at + kRangeBytes, t->grant().data(), kGrantBlockBytes);
        }
      }
    }
    if (write) {
      h.flags |= kHasDeadline;
      h.deadline_ms32 = DeadlineMs32(deadline);
      h.epoch = s->epoch;
    }
    f.head_len = EncodeHead(h, f.vectored ? absl::string_view() : s->grant(), &heads[i * kHeadMax]);
    f.wire = f.head_len + f.table_len + (write ? f.length : 0);
  }

  // Send state: slice index, and bytes of (header + payload) already sent.
  size_t send_i = 0;
  uint64_t send_off = 0;
  // Receive state: slice index, reply header bytes, payload bytes.
  size_t recv_i = 0;
  uint8_t reply[kReplySize];
  size_t reply_got = 0;
  ReplyHeader current;
  uint64_t payload_got = 0;
  std::string error_text;

  auto fail_rest = [&](const absl::Status& why) {
    for (size_t i = recv_i; i < n; ++i) {
      for (size_t k = 0; k < frames[i].count; ++k) slices[frames[i].first + k]->status = why;
    }
    recv_i = n;
    broken_ = true;
  };
  auto abandon = [&] {
    fail_rest(Abandoned(endpoint_));
    abandoned_ = true;
  };

  bool blocking = false;  // switched on once every request is sent
  bool first = true;      // a fresh batch can start sending without a poll
  while (recv_i < n) {
    short events = POLLIN;
    if (send_i < n) events |= POLLOUT;
    pollfd p{fd_.get(), events, 0};
    int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms < 0) {
      fail_rest(absl::DeadlineExceededError(absl::StrCat("transfer to ", endpoint_, " timed out")));
      break;
    }
    if (send_i == n && !blocking) {
      // Only replies are left: blocking receives with MSG_WAITALL take a
      // whole payload per wake-up; the socket timeout keeps the deadline.
      ArmTimeout(deadline);
      blocking = true;
    }
    int r = blocking || first ? 1 : ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30)));
    if (blocking) p.revents = POLLIN;
    if (first && !blocking) p.revents = POLLOUT;
    first = false;
    if (r < 0 && errno != EINTR) {
      fail_rest(absl::UnavailableError(absl::StrCat("poll on ", endpoint_, ": ", strerror(errno))));
      return;
    }
    if (r <= 0) continue;
    if (p.revents & (POLLERR | POLLNVAL)) {
      fail_rest(absl::UnavailableError(absl::StrCat("connection to ", endpoint_, " failed")));
      return;
    }

    if ((p.revents & POLLOUT) && send_i < n) {
      // Gather the next frames' pieces (header, range table, WRITE data)
      // into one sendmsg, from where the last one stopped.
      iovec iov[kMaxIov];
      size_t cnt = 0;
      uint64_t skip = send_off;
      auto add = [&](void* data, uint64_t len) {
        if (cnt == kMaxIov || len == 0) return;
        if (skip >= len) {
          skip -= len;
          return;
        }
        iov[cnt++] = {static_cast<char*>(data) + skip, len - skip};
        skip = 0;
      };
      for (size_t i = send_i; i < n && cnt < kMaxIov; ++i) {
        const Frame& f = frames[i];
        add(&heads[i * kHeadMax], f.head_len);
        if (f.vectored) add(&tables[f.table_at], f.table_len);
        if (slices[f.first]->op == Op::kWrite) {
          for (size_t k = f.first; k < f.first + f.count && cnt < kMaxIov; ++k) {
            add(slices[k]->local, slices[k]->length);
          }
        }
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = cnt;
      ssize_t sent;
      int err;
      {
        // WRITE payloads are read from the caller's buffers, as far as the
        // socket takes them now.
        ClaimHold hold(claim);
        if (!hold.held()) return abandon();
        sent = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        err = errno;
      }
      if (sent < 0 && err != EAGAIN && err != EINTR) {
        fail_rest(absl::UnavailableError(absl::StrCat("send to ", endpoint_, ": ", strerror(err))));
        return;
      }
      uint64_t left = sent > 0 ? static_cast<uint64_t>(sent) : 0;
      while (left > 0 && send_i < n) {
        uint64_t rest = frames[send_i].wire - send_off;
        if (left >= rest) {
          left -= rest;
          ++send_i;
          send_off = 0;
        } else {
          send_off += left;
          left = 0;
        }
      }
    }

    if (p.revents & (POLLIN | POLLHUP)) {
      // Drain what is readable without blocking.
      for (;;) {
        if (recv_i >= n) break;
        // A blocking receive lasts up to the socket's timeout, and one cut
        // short by it returns what had come: the deadline is checked and
        // the timeout re-armed to what is left after every one, so a peer
        // that trickles bytes cannot hold this thread past the deadline.
        if (blocking) {
          if (absl::Now() >= deadline) {
            fail_rest(absl::DeadlineExceededError(absl::StrCat("transfer to ", endpoint_, " timed out")));
            break;
          }
          ArmTimeout(deadline);
        }
        const Frame& f = frames[recv_i];
        Slice* s = slices[f.first];
        ssize_t got;
        int flags = blocking ? MSG_WAITALL : MSG_DONTWAIT;
        // A reply's header, and a payload with little left of it, are spun
        // for (what has arrived is taken without sleeping); a large payload
        // still to come is slept for in one blocking receive, so a worker
        // does not spin through a long transfer. Never past the deadline.
        const bool small_rest = reply_got == kReplySize && current.length - payload_got <= kSpinPayload;
        const bool spun = blocking && reply_spin_ > absl::ZeroDuration() && (reply_got < kReplySize || small_rest) &&
                          net::SpinUntilReadable(fd_.get(), std::min(reply_spin_, deadline - absl::Now()));
        if (spun) flags = MSG_DONTWAIT;
        // A payload lands in the caller's buffers under the claim, and only
        // what has arrived: a receive blocked on the peer would hold the
        // claim, and the caller's Wait, for as long as the peer stalls.
        const bool into_local = reply_got == kReplySize && current.status == WireStatus::kOk;
        const bool claimed = into_local && claim != nullptr;
        if (claimed) flags = MSG_DONTWAIT;
        int err = 0;
        {
          ClaimHold hold(claimed ? claim : nullptr);
          if (!hold.held()) return abandon();
          if (reply_got < kReplySize) {
            got = ::recv(fd_.get(), reply + reply_got, kReplySize - reply_got, flags);
          } else if (into_local && f.count == 1) {
            got = ::recv(fd_.get(), s->local + payload_got, current.length - payload_got, flags);
          } else if (into_local) {
            iovec iov[kMaxIov];
            msghdr msg{};
            msg.msg_iov = iov;
            msg.msg_iovlen = ScatterRest(slices.subspan(f.first, f.count), payload_got, iov, kMaxIov);
            got = ::recvmsg(fd_.get(), &msg, flags);
          } else {
            char buf[kMaxErrorText];
            got = ::recv(fd_.get(), buf, current.length - payload_got, flags);
            if (got > 0) error_text.append(buf, got);
          }
          if (got < 0) err = errno;
        }
        if (got == 0) {
          fail_rest(absl::UnavailableError(absl::StrCat("connection to ", endpoint_, " closed")));
          return;
        }
        if (got < 0) {
          const bool again = err == EAGAIN || err == EWOULDBLOCK;
          if (claimed && blocking && again && !spun) {
            // Nothing there yet: wait for it outside the claim (the loop's
            // head checks the deadline).
            pollfd q{fd_.get(), POLLIN, 0};
            const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
            if (ms >= 0) (void)::poll(&q, 1, static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30)));
            continue;
          }
          if (err == EINTR || (spun && again && absl::Now() < deadline)) continue;
          if (spun && again) {
            fail_rest(absl::DeadlineExceededError(absl::StrCat("transfer to ", endpoint_, " timed out")));
            break;
          }
          if (blocking && again && absl::Now() < deadline) {
            // The socket's timeout (armed for an earlier, later deadline)
            // ran out first: re-arm it for this one.
            timeout_set_ = absl::ZeroDuration();
            ArmTimeout(deadline);
            continue;
          }
          if (blocking && again) {
            fail_rest(absl::DeadlineExceededError(absl::StrCat("transfer to ", endpoint_, " timed out")));
            break;
          }
          if (again) break;
          fail_rest(absl::UnavailableError(absl::StrCat("recv from ", endpoint_, ": ", strerror(err))));
          return;
        }
        if (reply_got < kReplySize) {
          reply_got += got;
          if (reply_got < kReplySize) continue;
          absl::StatusOr<ReplyHeader> h = DecodeReply(reply, kReplySize);
          if (h.ok() && h->status == WireStatus::kBusy && h->id == 0) {
            fail_rest(absl::UnavailableError(absl::StrCat(endpoint_, " refused the connection: at its connection cap")));
            return;
          }
          uint64_t want = s->op == Op::kRead ? f.length : 0;
          if (!h.ok() || h->id != first_id + recv_i ||
              (h->status == WireStatus::kOk && h->length != want) ||
              (h->status != WireStatus::kOk && h->length > kMaxErrorText)) {
            fail_rest(absl::UnavailableError(
                absl::StrCat("protocol error from ", endpoint_,
                             h.ok() ? ": unexpected reply" : absl::StrCat(": ", h.status().message()))));
            return;
          }
          current = *h;
          payload_got = 0;
          error_text.clear();
        } else {
          payload_got += got;
        }
        if (reply_got == kReplySize && payload_got == current.length) {
          const absl::Status st = ReplyToStatus(current.status, error_text);
          for (size_t k = f.first; k < f.first + f.count; ++k) slices[k]->status = st;
          ++recv_i;
          reply_got = 0;
          payload_got = 0;
        }
      }
    }
  }
}

void Connection::PlanFrames(absl::Span<Slice* const> slices, absl::InlinedVector<Frame, 4>* frames) {
  static_assert(kMaxVectorRanges <= kMaxRanges * kRangeBytes / (kRangeBytes + kGrantBlockBytes));
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice* s = slices[i];
    if (!frames->empty()) {
      Frame& f = frames->back();
      const Slice* head = slices[f.first];
      const Slice* last = slices[f.first + f.count - 1];
      // Adjacent reads share a wire request: a small read starting where
      // the previous read of the batch ends (a value's trailer) joins it,
      // and the reply is scattered back to both. Each request costs the
      // server a reply and the client a header and a receive: a seventh of
      // a 64 KiB read (docs/performance.md). They share the reply's status.
      // (Under one extent grant: the frame carries one.)
      if (!f.vectored && s->op == Op::kRead && s->length <= kJoinedRead && last->op == Op::kRead &&
          s->grant() == head->grant() &&
          last->remote_offset + last->length == s->remote_offset && f.length + s->length <= kMaxJoinedFrame &&
          f.count < kMaxJoined) {
        ++f.count;
        f.length += s->length;
        f.largest = std::max(f.largest, s->length);
        continue;
      }
      // Small slices anywhere in the segment share a vectored frame; writes
      // only under one epoch, which the header carries.
      const bool write = s->op == Op::kWrite;
      const uint64_t max_slice = write ? kVectorWriteSlice : kVectorSlice;
      const uint64_t max_frame = write ? kVectorWriteFrame : kVectorFrame;
      if (s->length <= max_slice && f.largest <= max_slice && s->op == head->op &&
          (!write || s->epoch == head->epoch) && f.length + s->length <= max_frame && f.count < kMaxVectorRanges) {
        f.vectored = true;
        ++f.count;
        f.length += s->length;
        f.largest = std::max(f.largest, s->length);
        continue;
      }
    }
    frames->push_back({.first = i, .count = 1, .length = s->length, .largest = s->length});
  }
}

size_t ScatterRest(absl::Span<Slice* const> joined, uint64_t received, iovec* iov, size_t max) {
  size_t cnt = 0;
  for (Slice* t : joined) {
    if (cnt == max) break;
    if (received >= t->length) {
      received -= t->length;
      continue;
    }
    iov[cnt++] = {t->local + received, t->length - received};
    received = 0;
  }
  return cnt;
}

void Connection::ArmTimeout(absl::Time deadline) {
  // Re-armed only when this deadline is nearer than the armed timeout
  // allows (by more than a little slack), or after the timeout ran out
  // early; batches with like deadlines share one setsockopt.
  constexpr absl::Duration kSlack = absl::Milliseconds(2);
  const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration()) + absl::Milliseconds(1);
  if (timeout_set_ != absl::ZeroDuration() && left + kSlack >= timeout_set_ && left <= timeout_set_ + absl::Seconds(1)) {
    return;
  }
  net::SetTimeouts(fd_.get(), left);
  timeout_set_ = left;
}

bool Connection::Stale() const {
  pollfd p{fd_.get(), POLLIN | POLLRDHUP, 0};
  return broken_ || (ssl_ != nullptr && net::TlsPending(ssl_.get())) || ::poll(&p, 1, 0) != 0;
}

void Connection::SetBlocking(bool on) {
  int flags = fcntl(fd_.get(), F_GETFL);
  fcntl(fd_.get(), F_SETFL, on ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK));
}

absl::StatusOr<std::string> Connection::Handshake(const std::string& transport,
                                                  const std::string& request, absl::Time deadline,
                                                  uint32_t segment, uint64_t segment_id) {
  RequestHeader h;
  h.op = WireOp::kHandshake;
  h.segment = segment;
  h.segment_id = segment_id;
  h.offset = transport.size();
  h.length = transport.size() + request.size();
  if (h.length > kMaxHandshake) return absl::InvalidArgumentError("handshake too large");
  return Exchange(h, transport + request, deadline, "handshake");
}

absl::Status Connection::Authenticate(uint32_t segment, uint64_t segment_id, const DataGrant& grant,
                                      absl::Time deadline) {
  RequestHeader c;
  c.op = WireOp::kChallenge;
  ASSIGN_OR_RETURN(std::string nonce, Exchange(c, "", deadline, "data grant challenge"));
  if (nonce.size() != auth::kNonceBytes) {
    broken_ = true;
    return absl::UnavailableError(absl::StrCat("data grant challenge from ", endpoint_, ": bad nonce"));
  }
  RequestHeader a;
  a.op = WireOp::kAuth;
  a.segment = segment;
  a.segment_id = segment_id;
  std::string body = grant.grant + auth::GrantProof(grant.session_key, nonce, segment, segment_id);
  a.length = body.size();
  absl::StatusOr<std::string> answer = Exchange(a, body, deadline, "data grant");
  if (!answer.ok() && absl::IsUnauthenticated(answer.status())) broken_ = true;  // the server closes
  if (answer.ok()) admitted_until_ = auth::GrantExpiry(grant.grant);
  return answer.status();
}

absl::StatusOr<std::string> Connection::Exchange(RequestHeader h, const std::string& body, absl::Time deadline,
                                                 const char* what) {
  h.id = next_id_++;
  h.length = body.size();
  uint8_t head[kRequestSize];
  EncodeRequest(h, head);
  iovec iov[2] = {{head, kRequestSize}, {const_cast<char*>(body.data()), body.size()}};
  const int count = body.empty() ? 1 : 2;
  absl::Status st = ssl_ != nullptr ? net::TlsWriteVecFull(ssl_.get(), iov, count, deadline)
                                    : net::WriteVecFull(fd_.get(), iov, count, deadline);
  uint8_t reply[kReplySize];
  if (st.ok()) {
    st = ssl_ != nullptr ? net::TlsReadFull(ssl_.get(), reply, kReplySize, deadline)
                         : net::ReadFull(fd_.get(), reply, kReplySize, deadline);
  }
  if (!st.ok()) {
    broken_ = true;
    return absl::UnavailableError(absl::StrCat(what, " with ", endpoint_, ": ", st.message()));
  }
  absl::StatusOr<ReplyHeader> r = DecodeReply(reply, kReplySize);
  if (!r.ok() || r->id != h.id || r->length > kMaxHandshake) {
    broken_ = true;
    return absl::UnavailableError(absl::StrCat(what, " with ", endpoint_, ": protocol error"));
  }
  std::string answer(r->length, '\0');
  if (absl::Status s = ssl_ != nullptr ? net::TlsReadFull(ssl_.get(), answer.data(), answer.size(), deadline)
                                        : net::ReadFull(fd_.get(), answer.data(), answer.size(), deadline);
      !s.ok()) {
    broken_ = true;
    return absl::UnavailableError(absl::StrCat(what, " with ", endpoint_, ": ", s.message()));
  }
  if (r->status != WireStatus::kOk) return ReplyToStatus(r->status, answer);
  return answer;
}

}  // namespace tierkv::transport::tcp
