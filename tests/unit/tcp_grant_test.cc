// Data grants (--auth token on a daemon): a segment served under grants
// moves bytes only for a grant naming it, over tcp and shm; raw frames
// need a challenge and a proof; each tcp frame needs an extent grant
// covering it; mapping (shm) needs a grant that allows it; and the crypto.
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "absl/strings/str_join.h"
#include "base/auth.h"
#include "base/extent_grant.h"
#include "base/net/socket.h"
#include "httplib.h"
#include "tests/support/status_matchers.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "transport/tcp/connection.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

using ::tierkv::testing::StatusIs;

// PERMISSION_DENIED with `text` in its message.
MATCHER_P(DeniedSaying, text, "") {
  *result_listener << arg;
  return absl::IsPermissionDenied(arg) && arg.message().find(text) != absl::string_view::npos;
}
using net::Dial;
using net::ReadFull;
using net::WriteFull;

// A server engine whose segments need data grants, two segments ("a",
// "b"); grants are made here from its keys, as the master makes them.
class DataGrantTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kLen = 1 << 20;
  void SetUp() override {
    metadata_ = NewInMemoryMetadata();
    EngineOptions o{.metadata = metadata_, .transports = {"tcp", "shm"}};
    o.data_grants = true;
    server_ = std::move(*TransferEngine::Create(o));
    for (auto* r : {&a_, &b_}) {
      *r = std::move(*SharedRegion::Create(kLen, {}));
      std::memset((*r)->data(), 0x5a, kLen);
      ASSERT_OK(server_->RegisterMemory((*r)->data(), kLen, "cpu:0", (*r)->fd()));
    }
    ASSERT_OK(server_->ServeSegment("a", {a_->data()}));
    ASSERT_OK(server_->ServeSegment("b", {b_->data()}));
    for (const char* name : {"a", "b"}) {
      ASSERT_OK_AND_ASSIGN(SegmentDescriptor d, SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey(name))));
      EXPECT_TRUE(d.auth);
      desc_[name] = d;
      ASSERT_OK_AND_ASSIGN(key_[name], server_->SegmentDataKey(name));
      EXPECT_EQ(key_[name].size(), auth::kDataKeyBytes);
    }
    EXPECT_NE(key_["a"], key_["b"]);
  }
  // `map`: the kind the master gives a caller of the segment owner's tenant.
  DataGrant Grant(const std::string& key, absl::Duration ttl = absl::Minutes(1), bool map = false) {
    DataGrant g;
    g.grant = auth::NewGrant(absl::Now() + ttl);
    g.session_key = map ? auth::MapSessionKey(key, g.grant) : auth::GrantSessionKey(key, g.grant);
    return g;
  }
  // The master's extent grant for [offset, offset + length) of `segment`.
  std::string Extent(const std::string& segment, uint64_t offset, uint64_t length, uint8_t ops,
                     absl::Duration ttl = absl::Minutes(1)) {
    return auth::ExtentMac(key_[segment]).Sign({offset, length, absl::ToUnixMillis(absl::Now() + ttl), ops});
  }
  std::unique_ptr<TransferEngine> Client(std::vector<std::string> transports,
                                         std::function<absl::StatusOr<DataGrant>(const std::string&, bool, absl::Time)> grants) {
    EngineOptions o{.metadata = metadata_, .transports = std::move(transports)};
    o.grants = std::move(grants);
    return std::move(*TransferEngine::Create(o));
  }
  Connection Dialed() {
    auto fd = Dial("127.0.0.1:" + std::to_string(server_->port()), absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(fd.ok()) << fd.status();
    return Connection(std::move(*fd), "server");
  }
  bool Untouched(const SharedRegion& r) {
    for (uint64_t i = 0; i < kLen; ++i) {
      if (static_cast<uint8_t>(r.data()[i]) != 0x5a) return false;
    }
    return true;
  }

  std::shared_ptr<MetadataClient> metadata_;
  std::unique_ptr<TransferEngine> server_;
  std::unique_ptr<SharedRegion> a_, b_;
  std::map<std::string, SegmentDescriptor> desc_;
  std::map<std::string, std::string> key_;
};

TEST_F(DataGrantTest, AGrantForTheSegmentMovesBytesOverTcpAndShm) {
  EXPECT_TRUE(desc_["a"].extent_grants);
  // shm maps the whole segment: only a grant that allows mapping sets it
  // up; a plain one moves the same bytes over tcp, each frame with its
  // extent grant.
  for (bool map : {false, true}) {
    for (std::vector<std::string> transports :
         {std::vector<std::string>{"tcp"}, std::vector<std::string>{"shm", "tcp"}}) {
      int asked = 0;
      auto client = Client(transports, [&](const std::string& segment, bool, absl::Time) {
        ++asked;
        return Grant(key_[segment], absl::Minutes(1), map);
      });
      std::vector<char> out(4096, 'w'), in(4096, 0);
      Request w{Op::kWrite, out.data(), "a", 8192, out.size()};
      const std::string wg = Extent("a", 8192, 4096, auth::kExtentWrite);
      w.grant = wg;
      ASSERT_OK(client->Transfer({w})[0]) << transports[0];
      Request r{Op::kRead, in.data(), "a", 8192, in.size()};
      const std::string rg = Extent("a", 8192, 4096, auth::kExtentRead);
      r.grant = rg;
      ASSERT_OK(client->Transfer({r})[0]) << transports[0];
      EXPECT_EQ(in, out);
      PeerInfo info = client->Describe("a");
      const std::string want = map || transports.size() == 1 ? transports[0] : "tcp";
      EXPECT_EQ(info.transport, want) << absl::StrJoin(info.fallbacks, "; ");
      if (want != transports[0]) {
        EXPECT_NE(absl::StrJoin(info.fallbacks, "; ").find("mapping this segment's memory needs"), std::string::npos)
            << absl::StrJoin(info.fallbacks, "; ");
      }
      EXPECT_GE(asked, 1);
    }
  }
}

TEST_F(DataGrantTest, EachTcpFrameNeedsAnExtentGrantCoveringItForItsOp) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  const SegmentDescriptor& a = desc_["a"];
  Connection c = Dialed();
  ASSERT_OK(c.Authenticate(a.segment_index, a.segment_id, Grant(key_["a"]), deadline));
  std::vector<char> buf(64, 'x');
  // One frame on the admitted connection; the connection stays open after
  // a refusal (a grant that ran out is an ordinary event).
  auto frame = [&](Op op, uint64_t offset, absl::string_view grant) {
    Slice s{};
    s.op = op;
    s.local = buf.data();
    s.remote_offset = offset;
    s.length = buf.size();
    s.set_grant(grant);
    Slice* p = &s;
    c.RunBatch(a.segment_index, a.segment_id, absl::MakeSpan(&p, 1), deadline);
    EXPECT_FALSE(c.broken()) << s.status;
    return s.status;
  };
  const std::string read = Extent("a", 4096, 4096, auth::kExtentRead);
  const std::string write = Extent("a", 4096, 4096, auth::kExtentWrite);
  EXPECT_THAT(frame(Op::kRead, 4096, ""), DeniedSaying("needs an extent grant"));
  EXPECT_OK(frame(Op::kRead, 4096 + 100, read));
  EXPECT_THAT(frame(Op::kRead, 0, read), DeniedSaying("covers"));
  EXPECT_THAT(frame(Op::kRead, 8192 - 32, read), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(frame(Op::kWrite, 4096, read), DeniedSaying("reads only"));
  EXPECT_THAT(frame(Op::kWrite, 4096, Extent("a", 4096, 4096, auth::kExtentWrite, -absl::Seconds(1))),
              DeniedSaying("expired"));
  EXPECT_THAT(frame(Op::kWrite, 4096, auth::ExtentMac(key_["b"]).Sign({4096, 4096, absl::ToUnixMillis(deadline), 3})),
              DeniedSaying("this segment's key"));
  // A grant for one extent, its length stretched to the whole segment.
  std::string stretched = write;
  stretched[8 + 2] = 0x10;  // length 4096 -> 1 MiB + 4096
  EXPECT_THAT(frame(Op::kWrite, 0, stretched), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_TRUE(Untouched(*a_));
  std::fill(buf.begin(), buf.end(), 'x');  // the reads above filled it with the region's bytes
  EXPECT_OK(frame(Op::kWrite, 4096 + 64, write));
  EXPECT_EQ(a_->data()[4096 + 64], 'x');
  EXPECT_EQ(static_cast<uint8_t>(a_->data()[4096 + 63]), 0x5a);

  // Small writes go as one vectored frame, each range with its own grant:
  // one range outside its grant refuses the whole frame, and nothing of it
  // lands; each under its own, they all do.
  std::vector<Slice> v(3);
  std::vector<Slice*> ptrs;
  for (size_t i = 0; i < v.size(); ++i) {
    v[i].op = Op::kWrite;
    v[i].local = buf.data();
    v[i].length = 16;
    v[i].remote_offset = i < 2 ? 6000 + 100 * i : 12000;
    v[i].set_grant(write);
    ptrs.push_back(&v[i]);
  }
  c.RunBatch(a.segment_index, a.segment_id, absl::MakeSpan(ptrs), deadline);
  for (const Slice& s : v) EXPECT_THAT(s.status, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(static_cast<uint8_t>(a_->data()[6000]), 0x5a);
  v[2].set_grant(Extent("a", 12000, 16, auth::kExtentWrite));
  for (Slice& s : v) s.status = absl::OkStatus();
  c.RunBatch(a.segment_index, a.segment_id, absl::MakeSpan(ptrs), deadline);
  for (const Slice& s : v) EXPECT_OK(s.status);
  EXPECT_EQ(a_->data()[6000], 'x');
  EXPECT_EQ(a_->data()[6100], 'x');
  EXPECT_EQ(a_->data()[12000], 'x');

  // A connection admitted by a plain grant sets up no mapping.
  absl::StatusOr<std::string> shm =
      c.Handshake("shm", absl::StrCat(R"({"segment_index":)", a.segment_index, R"(,"segment_id":)", a.segment_id, "}"),
                  deadline, a.segment_index, a.segment_id);
  EXPECT_THAT(shm.status(), DeniedSaying("mapping"));
  EXPECT_TRUE(Untouched(*b_));
}

TEST_F(DataGrantTest, NoGrantAGrantForAnotherSegmentOrAnExpiredOneIsRefusedAndTouchesNothing) {
  std::vector<char> out(4096, 'w');
  auto none = Client({"tcp"}, nullptr);
  absl::Status st = none->Transfer({{Op::kWrite, out.data(), "a", 0, out.size()}}, absl::Seconds(5))[0];
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_NE(st.message().find("needs a data grant"), std::string::npos) << st;
  // The session key of segment b replayed on segment a, renewed the same:
  // the daemon refuses both, and the transfer fails UNAVAILABLE (as while
  // a restarted daemon's key has not reached the master), saying why.
  auto other = Client({"tcp"}, [&](const std::string&, bool, absl::Time) { return Grant(key_["b"]); });
  st = other->Transfer({{Op::kWrite, out.data(), "a", 0, out.size()}}, absl::Seconds(5))[0];
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_NE(st.message().find("refused the master's data grant"), std::string::npos) << st;
  EXPECT_NE(st.message().find("does not match this segment's key"), std::string::npos) << st;
  auto expired = Client({"shm", "tcp"}, [&](const std::string& s, bool, absl::Time) { return Grant(key_[s], -absl::Seconds(1)); });
  st = expired->Transfer({{Op::kWrite, out.data(), "a", 0, out.size()}}, absl::Seconds(5))[0];
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_NE(st.message().find("expired"), std::string::npos) << st;
  // A grant that cannot be had keeps its status.
  auto denied = Client({"tcp"}, [&](const std::string&, bool, absl::Time) -> absl::StatusOr<DataGrant> {
    return absl::PermissionDeniedError("no client role");
  });
  st = denied->Transfer({{Op::kWrite, out.data(), "a", 0, out.size()}}, absl::Seconds(5))[0];
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_TRUE(Untouched(*a_));
  EXPECT_TRUE(Untouched(*b_));
}

TEST_F(DataGrantTest, ARefusedCachedGrantIsRenewedOnce) {
  // The first grant is for the segment's previous key (its daemon restarted).
  // Each fetch is given the transfer's deadline, so a slow master cannot
  // hold a transfer past it.
  std::vector<bool> renews;
  std::vector<absl::Time> deadlines;
  auto client = Client({"tcp"}, [&](const std::string& s, bool renew, absl::Time deadline) {
    renews.push_back(renew);
    deadlines.push_back(deadline);
    return Grant(renew ? key_[s] : std::string(auth::kDataKeyBytes, 'k'));
  });
  std::vector<char> out(4096, 'w');
  const absl::Time before = absl::Now();
  Request w{Op::kWrite, out.data(), "b", 0, out.size()};
  const std::string grant = Extent("b", 0, out.size(), auth::kExtentWrite);
  w.grant = grant;
  ASSERT_OK(client->Transfer({w}, absl::Seconds(3))[0]);
  EXPECT_EQ(renews, (std::vector<bool>{false, true}));
  for (absl::Time d : deadlines) {
    EXPECT_GT(d, before);
    EXPECT_LE(d, absl::Now() + absl::Seconds(3));
  }
}

TEST_F(DataGrantTest, RawFramesNeedAChallengeAndAProofForTheNamedSegment) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  const SegmentDescriptor& a = desc_["a"];
  const SegmentDescriptor& b = desc_["b"];
  {
    // A handshake (how shm and rdma set up) before any grant.
    Connection c = Dialed();
    absl::StatusOr<std::string> r =
        c.Handshake("shm", absl::StrCat(R"({"segment_index":)", a.segment_index, R"(,"segment_id":)", a.segment_id, "}"),
                    deadline, a.segment_index, a.segment_id);
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kUnauthenticated));
    EXPECT_NE(r.status().message().find("CHALLENGE and AUTH first"), std::string::npos) << r.status();
  }
  {
    // Admitted for a: reads of a pass, frames naming b are refused.
    Connection c = Dialed();
    ASSERT_OK(c.Authenticate(a.segment_index, a.segment_id, Grant(key_["a"]), deadline));
    Slice ok{};
    std::vector<char> buf(64);
    ok.op = Op::kRead;
    ok.local = buf.data();
    ok.remote_offset = 0;
    ok.length = buf.size();
    ok.set_grant(Extent("a", 0, buf.size(), auth::kExtentRead));
    Slice* p = &ok;
    c.RunBatch(a.segment_index, a.segment_id, absl::MakeSpan(&p, 1), deadline);
    EXPECT_OK(ok.status);
    EXPECT_EQ(buf[0], 0x5a);
    Slice other = ok;
    other.status = absl::OkStatus();
    p = &other;
    c.RunBatch(b.segment_index, b.segment_id, absl::MakeSpan(&p, 1), deadline);
    EXPECT_THAT(other.status, StatusIs(absl::StatusCode::kUnauthenticated));
    EXPECT_NE(other.status.message().find("data grant is for segment #"), std::string::npos) << other.status;
  }
  {
    // An AUTH without a CHALLENGE: refused, and the connection closed.
    DataGrant g = Grant(key_["a"]);
    RequestHeader h;
    h.op = WireOp::kAuth;
    h.segment = a.segment_index;
    h.segment_id = a.segment_id;
    h.id = 1;
    std::string body = g.grant + std::string(auth::kProofBytes, 'p');
    h.length = body.size();
    uint8_t head[kRequestSize];
    EncodeRequest(h, head);
    auto fd = Dial("127.0.0.1:" + std::to_string(server_->port()), deadline);
    ASSERT_OK(fd.status());
    ASSERT_OK(WriteFull(fd->get(), head, sizeof head, deadline));
    ASSERT_OK(WriteFull(fd->get(), body.data(), body.size(), deadline));
    uint8_t reply[kReplySize];
    ASSERT_OK(ReadFull(fd->get(), reply, sizeof reply, deadline));
    ASSERT_OK_AND_ASSIGN(ReplyHeader rh, DecodeReply(reply, sizeof reply));
    EXPECT_EQ(rh.status, WireStatus::kUnauthenticated);
    std::string why(rh.length, '\0');
    ASSERT_OK(ReadFull(fd->get(), why.data(), why.size(), deadline));
    EXPECT_NE(why.find("no challenge was asked first"), std::string::npos) << why;
    char more;
    EXPECT_FALSE(ReadFull(fd->get(), &more, 1, deadline).ok());  // closed
  }
  {
    // Admitted for a (to map it), a handshake whose target is b: refused,
    // and closed.
    Connection c = Dialed();
    ASSERT_OK(c.Authenticate(a.segment_index, a.segment_id, Grant(key_["a"], absl::Minutes(1), true), deadline));
    absl::StatusOr<std::string> r =
        c.Handshake("shm", absl::StrCat(R"({"segment_index":)", b.segment_index, R"(,"segment_id":)", b.segment_id, "}"),
                    deadline, a.segment_index, a.segment_id);
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kUnauthenticated));
    EXPECT_NE(r.status().message().find("needs a data grant for it"), std::string::npos) << r.status();
    EXPECT_THAT(c.Handshake("shm", "{}", deadline, a.segment_index, a.segment_id),
                StatusIs(absl::StatusCode::kUnavailable));  // the server closed it
  }
  {
    // A session key for a, shown for b's segment: refused.
    Connection c = Dialed();
    absl::Status st = c.Authenticate(b.segment_index, b.segment_id, Grant(key_["a"]), deadline);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnauthenticated));
    EXPECT_TRUE(c.broken());
  }
  EXPECT_TRUE(Untouched(*b_));
}

TEST(DataGrantCryptoTest, ProofsBindTheKeyTheNonceAndTheSegment) {
  const std::string key = auth::RandomBytes(auth::kDataKeyBytes), nonce = auth::RandomBytes(auth::kNonceBytes);
  const absl::Time now = absl::Now();
  const std::string grant = auth::NewGrant(now + absl::Minutes(1));
  EXPECT_EQ(grant.size(), auth::kGrantBytes);
  EXPECT_EQ(absl::ToUnixMillis(auth::GrantExpiry(grant)), absl::ToUnixMillis(now + absl::Minutes(1)));
  const std::string proof = auth::GrantProof(auth::GrantSessionKey(key, grant), nonce, 3, 77);
  EXPECT_OK(auth::CheckGrant(key, grant, proof, nonce, 3, 77, now));
  EXPECT_THAT(auth::CheckGrant(key, grant, proof, auth::RandomBytes(auth::kNonceBytes), 3, 77, now),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(auth::CheckGrant(key, grant, proof, nonce, 4, 77, now), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(auth::CheckGrant(key, grant, proof, nonce, 3, 78, now), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(auth::CheckGrant(auth::RandomBytes(auth::kDataKeyBytes), grant, proof, nonce, 3, 77, now),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(auth::CheckGrant(key, grant, proof, nonce, 3, 77, now + absl::Minutes(2)),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(auth::CheckGrant(key, grant.substr(1), proof, nonce, 3, 77, now),
              StatusIs(absl::StatusCode::kUnauthenticated));
  // A mapping grant's proof passes as one; a plain one's does not.
  bool may_map = true;
  EXPECT_OK(auth::CheckGrant(key, grant, proof, nonce, 3, 77, now, &may_map));
  EXPECT_FALSE(may_map);
  const std::string map_proof = auth::GrantProof(auth::MapSessionKey(key, grant), nonce, 3, 77);
  EXPECT_OK(auth::CheckGrant(key, grant, map_proof, nonce, 3, 77, now, &may_map));
  EXPECT_TRUE(may_map);
  EXPECT_NE(auth::MapSessionKey(key, grant), auth::GrantSessionKey(key, grant));
  EXPECT_FALSE(auth::SameSecret("abc", "abd"));
  EXPECT_TRUE(auth::SameSecret("abc", "abc"));
  EXPECT_FALSE(auth::SameSecret("abc", "abcd"));
}

}  // namespace
}  // namespace tierkv::transport::tcp

namespace tierkv::auth {
namespace {

// The keys behind tier orders: a grant holder's session key signs stages
// only, the master's order key (made from the data key by another label)
// offloads; a stage item's leave covers its key, extent and expiry, each
// of which changed refuses it.
TEST(TierOrderKeysTest, OnlyTheMastersKeyOrdersAndALeaveFitsOneObject) {
  const std::string data_key(32, 'k');
  const std::string grant = NewGrant(absl::Now() + absl::Minutes(1));
  EXPECT_NE(OrderSessionKey(data_key, grant), GrantSessionKey(data_key, grant));
  httplib::Request req;
  req.path = "/tier/offload";
  req.body = "orders";
  auto sign = [&](const std::string& session_key) {
    req.headers.clear();
    for (auto& [name, value] : SignTierRequest(grant, session_key, req.path, req.body, absl::Now())) {
      req.headers.emplace(name, value);
    }
  };
  sign(GrantSessionKey(data_key, grant));
  EXPECT_OK(CheckTierRequest(data_key, req, absl::Now(), TierSigner::kGrantHolder));
  EXPECT_FALSE(CheckTierRequest(data_key, req, absl::Now(), TierSigner::kMaster).ok());
  sign(OrderSessionKey(data_key, grant));
  EXPECT_OK(CheckTierRequest(data_key, req, absl::Now(), TierSigner::kMaster));

  const int64_t expiry = absl::ToUnixMillis(absl::Now() + absl::Seconds(5));
  const std::string leave = StageProof(data_key, std::string("a\0page", 6), 4096, 65536, expiry);
  EXPECT_OK(CheckStageProof(data_key, std::string("a\0page", 6), 4096, 65536, expiry, leave, absl::Now()));
  EXPECT_FALSE(CheckStageProof(data_key, std::string("b\0page", 6), 4096, 65536, expiry, leave, absl::Now()).ok());
  EXPECT_FALSE(CheckStageProof(data_key, std::string("a\0page", 6), 0, 65536, expiry, leave, absl::Now()).ok());
  EXPECT_FALSE(CheckStageProof(data_key, std::string("a\0page", 6), 4096, 4096, expiry, leave, absl::Now()).ok());
  EXPECT_FALSE(CheckStageProof(data_key, std::string("a\0page", 6), 4096, 65536, expiry + 1, leave, absl::Now()).ok());
  EXPECT_FALSE(CheckStageProof(std::string(32, 'o'), std::string("a\0page", 6), 4096, 65536, expiry, leave, absl::Now()).ok());
  EXPECT_FALSE(CheckStageProof(data_key, std::string("a\0page", 6), 4096, 65536, expiry, "", absl::Now()).ok());
  // From its expiry on a leave stages nothing: the extent may be another's.
  EXPECT_FALSE(CheckStageProof(data_key, std::string("a\0page", 6), 4096, 65536, expiry, leave,
                               absl::FromUnixMillis(expiry)).ok());
}

// Extent grants: every field is under the tag, so no change to one passes;
// coverage is checked without overflow at the top of the offset space.
TEST(ExtentGrantTest, AGrantCoversItsExtentForItsOpsUntilItsExpiryAndNothingElse) {
  const std::string data_key(32, 'k');
  ExtentMac mac(data_key);
  ASSERT_TRUE(mac.ok());
  const absl::Time now = absl::Now();
  const int64_t expiry = absl::ToUnixMillis(now + absl::Seconds(5));
  const std::string g = mac.Sign({1 << 20, 65536, expiry, kExtentRead});
  ASSERT_EQ(g.size(), kExtentGrantBytes);
  EXPECT_OK(mac.Check(g, kExtentRead, 1 << 20, 65536, now));
  EXPECT_OK(mac.Check(g, kExtentRead, (1 << 20) + 65535, 1, now));
  EXPECT_OK(mac.Check(g, kExtentRead, (1 << 20) + 65536, 0, now));
  EXPECT_FALSE(mac.Check(g, kExtentRead, (1 << 20) - 1, 1, now).ok());
  EXPECT_FALSE(mac.Check(g, kExtentRead, (1 << 20) + 1, 65536, now).ok());
  EXPECT_FALSE(mac.Check(g, kExtentRead, (1 << 20) + 8, UINT64_MAX - 4, now).ok());
  EXPECT_FALSE(mac.Check(g, kExtentWrite, 1 << 20, 16, now).ok());
  EXPECT_FALSE(mac.Check(g, kExtentRead, 1 << 20, 16, absl::FromUnixMillis(expiry)).ok());
  EXPECT_FALSE(ExtentMac(std::string(32, 'o')).Check(g, kExtentRead, 1 << 20, 16, now).ok());
  // Each byte of the fields and the tag, changed, is refused.
  for (size_t i = 0; i < g.size(); ++i) {
    std::string bad = g;
    bad[i] ^= 0x01;
    ExtentGrantFields f;
    if (DecodeExtentGrant(bad, &f) && f.ops == kExtentWrite) continue;  // refused for its op below anyway
    EXPECT_FALSE(mac.Check(bad, kExtentRead, 1 << 20, 16, now).ok()) << "byte " << i;
  }
  EXPECT_FALSE(mac.Check(g.substr(1), kExtentRead, 1 << 20, 16, now).ok());
  // A grant at the top of the offset space covers only itself.
  const std::string top = mac.Sign({UINT64_MAX - 100, 100, expiry, kExtentRead | kExtentWrite});
  EXPECT_OK(mac.Check(top, kExtentWrite, UINT64_MAX - 50, 50, now));
  EXPECT_FALSE(mac.Check(top, kExtentWrite, UINT64_MAX - 50, 51, now).ok());
}

}  // namespace
}  // namespace tierkv::auth
