// The tcp server's grant checks: a connection's admission by a data grant
// (CHALLENGE, AUTH), and each frame's extent grant (base/extent_grant.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/auth.h"
#include "base/status.h"
#include "transport/tcp/server.h"

namespace tierkv::transport::tcp {

size_t Server::HeadSize(const Conn* c) {
  // A header of the wrong magic is refused as it is, without waiting for
  // more bytes than it has.
  if (c->head_got < kRequestSize || (c->head[5] & kHasGrant) == 0) return kRequestSize;
  const uint32_t magic = static_cast<uint32_t>(c->head[0]) | static_cast<uint32_t>(c->head[1]) << 8 |
                         static_cast<uint32_t>(c->head[2]) << 16 | static_cast<uint32_t>(c->head[3]) << 24;
  const bool grant = magic == kRequestMagic;
  return grant ? kRequestSize + kGrantBlockBytes : kRequestSize;
}

std::optional<Server::Step> Server::RefuseUnadmitted(Conn* c) {
  const RequestHeader& h = c->req;
  if (h.op == WireOp::kPing || !served_->DataGrantsRequired()) return std::nullopt;
  // Unadmitted, or naming another segment than the one admitted: refused
  // without a byte written, and the connection closes.
  const bool same = c->admitted.has_value() &&
                    (h.op == WireOp::kHandshake || *c->admitted == std::make_pair(h.segment, h.segment_id));
  // A grant is good until its expiry, for each frame, not only at AUTH.
  const bool current = absl::Now() < c->admitted_until;
  if (same && current) return std::nullopt;
  absl::Status refused = absl::UnauthenticatedError(
      !c->admitted ? std::string("this daemon needs a data grant (--auth token): CHALLENGE and AUTH first")
      : !same      ? absl::StrCat("this connection's data grant is for segment #", c->admitted->first, ", not #",
                                  h.segment)
                   : absl::StrCat("this connection's data grant expired at ", absl::FormatTime(c->admitted_until)));
  // A small payload is drained first, so the refusal reaches the peer
  // instead of being lost to the reset that unread bytes cause; a large
  // one is not worth a peer without a grant.
  if (h.op != WireOp::kRead && h.length <= kMaxHandshake) return StartBody(c, Sink::kDrain, refused, true);
  return StartReply(c, refused, {}, true);
}

Server::Step Server::FinishAuth(Conn* c) {
  const RequestHeader& h = c->req;
  // A nonce answers one AUTH: a second try on the connection needs a new challenge.
  const std::string nonce = std::move(c->nonce);
  c->nonce.clear();
  absl::StatusOr<std::string> key = served_->DataKey(h.segment, h.segment_id);
  // A segment gone from here is a stale descriptor, as for READ: the
  // client re-reads it and the connection stays.
  if (!key.ok()) return StartReply(c, key.status(), {});
  const absl::string_view body(c->body);
  bool may_map = false;
  absl::Status ok = auth::CheckGrant(*key, body.substr(0, auth::kGrantBytes), body.substr(auth::kGrantBytes), nonce,
                                     h.segment, h.segment_id, absl::Now(), &may_map);
  if (!ok.ok()) return StartReply(c, ok, {}, true);
  c->admitted = std::make_pair(h.segment, h.segment_id);
  c->admitted_until = auth::GrantExpiry(body.substr(0, auth::kGrantBytes));
  c->admit_by = absl::InfiniteFuture();
  c->may_map = may_map;
  // One key per connection (it serves one segment): a frame's check is
  // then a block cipher's two blocks, with no key set up per frame.
  c->extent_mac = std::make_shared<const auth::ExtentMac>(*key);
  return StartReply(c, absl::OkStatus(), {});
}

absl::Status Server::ExtentAdmitted(Conn* c, absl::Span<const WireRange> ranges,
                                    absl::Span<const absl::string_view> grants) const {
  c->grant_until = absl::InfiniteFuture();
  if (!served_->DataGrantsRequired()) return absl::OkStatus();
  const RequestHeader& h = c->req;
  const bool per_range = (h.flags & kRangeGrants) != 0 && grants.size() == ranges.size();
  if ((!per_range && (h.flags & kHasGrant) == 0) || c->extent_mac == nullptr) {
    return absl::PermissionDeniedError(
        "this daemon needs an extent grant from the master in every frame (a client older than the daemon?)");
  }
  const uint8_t op = h.op == WireOp::kRead || h.op == WireOp::kReadV ? auth::kExtentRead : auth::kExtentWrite;
  const absl::Time now = absl::Now();
  const absl::string_view header_grant(reinterpret_cast<const char*>(c->head + kRequestSize), kGrantBlockBytes);
  absl::string_view last;
  auth::ExtentGrantFields fields;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const absl::string_view grant = per_range ? grants[i] : header_grant;
    // Ranges under one grant (a frame's, or a value's pieces) verify once.
    if (i == 0 || grant != last) {
      absl::StatusOr<auth::ExtentGrantFields> verified = c->extent_mac->Verify(grant, op, now);
      if (!verified.ok()) return verified.status();
      fields = *verified;
      last = grant;
      c->grant_until = std::min(c->grant_until, absl::FromUnixMillis(fields.expiry_unix_ms));
    }
    RETURN_IF_ERROR(auth::GrantCovers(fields, ranges[i].offset, ranges[i].length));
  }
  return absl::OkStatus();
}

absl::Status Server::MapAdmitted(const Conn* c) const {
  if (!served_->DataGrantsRequired() || c->may_map) return absl::OkStatus();
  // shm, rdma and cuda reach the whole segment without a frame per access,
  // so no extent grant can bound them: the master allows them only to a
  // caller of the tenant the segment belongs to (docs/security.md).
  return absl::PermissionDeniedError(
      "mapping this segment's memory needs a data grant that allows it (the master gives one only to the "
      "segment owner's tenant); use tcp");
}

}  // namespace tierkv::transport::tcp
