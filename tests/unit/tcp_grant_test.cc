// Data grants (--auth token on a daemon): a segment served under grants
// moves bytes only for a grant naming it, over tcp and shm; raw frames
// need a challenge and a proof; and the proofs' crypto.
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "absl/strings/str_join.h"
#include "base/auth.h"
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
  DataGrant Grant(const std::string& key, absl::Duration ttl = absl::Minutes(1)) {
    DataGrant g;
    g.grant = auth::NewGrant(absl::Now() + ttl);
    g.session_key = auth::GrantSessionKey(key, g.grant);
    return g;
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
  for (std::vector<std::string> transports : {std::vector<std::string>{"tcp"}, std::vector<std::string>{"shm", "tcp"}}) {
    int asked = 0;
    auto client = Client(transports, [&](const std::string& segment, bool, absl::Time) {
      ++asked;
      return Grant(key_[segment]);
    });
    std::vector<char> out(4096, 'w'), in(4096, 0);
    ASSERT_OK(client->Transfer({{Op::kWrite, out.data(), "a", 8192, out.size()}})[0]) << transports[0];
    ASSERT_OK(client->Transfer({{Op::kRead, in.data(), "a", 8192, in.size()}})[0]) << transports[0];
    EXPECT_EQ(in, out);
    PeerInfo info = client->Describe("a");
    EXPECT_EQ(info.transport, transports[0]) << absl::StrJoin(info.fallbacks, "; ");
    EXPECT_GE(asked, 1);
  }
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
  ASSERT_OK(client->Transfer({{Op::kWrite, out.data(), "b", 0, out.size()}}, absl::Seconds(3))[0]);
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
    // Admitted for a, a handshake whose target is b: refused, and closed.
    Connection c = Dialed();
    ASSERT_OK(c.Authenticate(a.segment_index, a.segment_id, Grant(key_["a"]), deadline));
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

}  // namespace
}  // namespace tierkv::auth
