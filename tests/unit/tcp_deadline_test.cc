// Deadlines on the tcp data path, both ends (issue #46, items 4 and 5).
//
// Client: a READ reply that stops halfway, its caller gives up (a Wait
// that times out) and reads another replica into the same buffer, then
// the rest arrives: not one byte of it may land in the caller's buffer
// (from Python that buffer may be freed by then). A reply trickled a byte
// at a time must not hold a transfer past its deadline either. The peer
// is a raw socket server written here, plain and TLS.
//
// Server: a WRITE payload that arrives past its frame's deadline, or past
// the connection's data grant, must not land in the served extent (the
// master may have given it to a later put), even though its header came
// in time.
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/auth.h"
#include "base/extent_grant.h"
#include "base/mutex.h"
#include "base/net/socket.h"
#include "base/net/tls.h"
#include "base/status.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tls_certs.h"
#include "tests/support/wait.h"
#include "transport/buffer_claim.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

using ::tierkv::testing::StaysFalse;
using ::tierkv::testing::StatusIs;
using ::tierkv::testing::WaitFor;

// How long the fake peer holds anything at most: far past every deadline
// below, so a broken client fails the test instead of hanging it.
constexpr absl::Duration kHoldBound = absl::Seconds(20);

TEST(BufferClaimTest, ARevocationWaitsForTheCopyInProgressAndRefusesLaterOnes) {
  BufferClaim claim;
  ASSERT_TRUE(claim.Acquire());
  std::atomic<bool> returned{false};
  std::thread revoker([&] {
    claim.Revoke();
    returned = true;
  });
  ASSERT_OK(WaitFor("the claim to be revoked", absl::Seconds(10), [&] { return claim.revoked(); }));
  EXPECT_FALSE(claim.Acquire());
  EXPECT_OK(StaysFalse("Revoke returned while a copy held the claim", absl::Milliseconds(50),
                       [&] { return returned.load(); }));
  claim.Release();
  ASSERT_OK(WaitFor("Revoke to return once the copy ended", absl::Seconds(10), [&] { return returned.load(); }));
  revoker.join();
  claim.Revoke();  // again: returns at once
  EXPECT_FALSE(ClaimHold(&claim).held());
  EXPECT_TRUE(ClaimHold(nullptr).held());
}

// A peer serving READ replies of a fixed pattern on its own raw sockets,
// plain or TLS, one thread per connection. `stall_first`: the first READ's
// reply stops after half its payload until the test releases the rest.
// `trickle`: every reply's payload goes a byte every 20 ms.
class FakePeer {
 public:
  static constexpr char kFirstHalf = 'A', kRest = 'R', kWhole = 'S';

  ~FakePeer() { Stop(); }

  absl::Status Start(SSL_CTX* tls, bool stall_first, bool trickle) {
    tls_ = tls;
    stall_first_ = stall_first;
    trickle_ = trickle;
    int port = 0;
    absl::StatusOr<net::Fd> l = net::Listen("127.0.0.1", 0, &port);
    if (!l.ok()) return l.status();
    listener_ = std::move(*l);
    port_ = port;
    acceptor_ = std::thread([this] { AcceptLoop(); });
    return absl::OkStatus();
  }
  void Stop() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    MutexLock lock(&mu_);
    for (auto& t : conns_) t.join();
    conns_.clear();
  }
  int port() const { return port_; }
  std::atomic<int> halves_sent{0};
  std::atomic<int> rests_sent{0};  // tried: the client may reset the connection at the first byte
  std::atomic<bool> release_rest{false};

 private:
  struct Io {
    net::Fd fd;
    net::SslPtr ssl;
    absl::Status Write(const void* data, size_t len) {
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      iovec iov{const_cast<void*>(data), len};
      return ssl ? net::TlsWriteVecFull(ssl.get(), &iov, 1, deadline) : net::WriteFull(fd.get(), data, len, deadline);
    }
    absl::Status Read(void* data, size_t len) {
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      return ssl ? net::TlsReadFull(ssl.get(), data, len, deadline) : net::ReadFull(fd.get(), data, len, deadline);
    }
  };

  // Waits up to 50 ms for `want` on `fd`: false if nothing came.
  static bool Ready(int fd, short want) {
    pollfd p{fd, want, 0};
    return ::poll(&p, 1, 50) > 0;
  }

  void AcceptLoop() {
    while (!stop_) {
      if (!Ready(listener_.get(), POLLIN)) continue;
      int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) continue;
      MutexLock lock(&mu_);
      conns_.emplace_back([this, fd] { Serve(net::Fd(fd)); });
    }
  }

  void Serve(net::Fd fd) {
    Io io{std::move(fd), nullptr};
    if (tls_ != nullptr) {
      absl::StatusOr<net::SslPtr> ssl = net::TlsServerSession(io.fd.get(), tls_);
      if (!ssl.ok()) return;
      io.ssl = *std::move(ssl);
      for (;;) {
        // The engine's reachability probe connects and closes: that ends here.
        absl::StatusOr<short> want = net::TlsAcceptSome(io.ssl.get());
        if (!want.ok() || stop_) return;
        if (*want == 0) break;
        (void)Ready(io.fd.get(), *want);
      }
    }
    while (!stop_) {
      if (!(io.ssl && net::TlsPending(io.ssl.get())) && !Ready(io.fd.get(), POLLIN)) continue;
      uint8_t head[kRequestSize];
      if (!io.Read(head, sizeof head).ok()) return;
      absl::StatusOr<RequestHeader> h = DecodeRequest(head, sizeof head);
      if (!h.ok() || h->op != WireOp::kRead) return;
      uint8_t reply[kReplySize];
      EncodeReply({WireStatus::kOk, h->id, h->length}, reply);
      if (!io.Write(reply, sizeof reply).ok()) return;
      const bool stall = stall_first_ && !stalled_once_.exchange(true);
      if (stall) {
        const std::string half(h->length / 2, kFirstHalf);
        if (!io.Write(half.data(), half.size()).ok()) return;
        ++halves_sent;
        if (!WaitFor("the test to release the rest", kHoldBound, [&] { return release_rest.load() || stop_.load(); })
                 .ok()) {
          return;
        }
        // Counted whether or not it all went: a client that drops the
        // connection at the first late byte resets the rest.
        const std::string rest(h->length - half.size(), kRest);
        const bool sent = io.Write(rest.data(), rest.size()).ok();
        ++rests_sent;
        if (!sent) return;
      } else if (trickle_) {
        const absl::Time until = absl::Now() + absl::Seconds(8);
        for (uint64_t i = 0; i < h->length && !stop_ && absl::Now() < until; ++i) {
          if (!io.Write(&kWhole, 1).ok()) return;
          // Kept: the pause between bytes is the fault being injected.
          absl::SleepFor(absl::Milliseconds(20));
        }
        return;
      } else {
        const std::string whole(h->length, kWhole);
        if (!io.Write(whole.data(), whole.size()).ok()) return;
      }
    }
  }

  SSL_CTX* tls_ = nullptr;
  bool stall_first_ = false;
  bool trickle_ = false;
  std::atomic<bool> stalled_once_{false};
  std::atomic<bool> stop_{false};
  net::Fd listener_;
  int port_ = 0;
  std::thread acceptor_;
  Mutex mu_;
  std::vector<std::thread> conns_ ABSL_GUARDED_BY(mu_);
};

// A client engine whose segment "stall" is the fake peer, and "good" a real
// engine's, both over tcp; the parameter says whether the fake peer speaks
// TLS.
class TcpDeadlineTest : public ::testing::TestWithParam<bool> {
 protected:
  static constexpr uint64_t kLen = 256 << 10;

  bool tls() const { return GetParam(); }

  void Start(bool stall_first, bool trickle) {
    metadata_ = NewInMemoryMetadata();
    SSL_CTX* ctx = nullptr;
    if (tls()) {
      absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts(testing::MakeTempDir("tierkv-tcp-deadline"));
      if (!certs.ok()) GTEST_SKIP() << certs.status();
      ca_ = certs->ca;
      ASSERT_OK_AND_ASSIGN(tls_ctx_, net::NewServerContext({"", certs->server_cert, certs->server_key}));
      tls_ssl_ctx_ = tls_ctx_->Current();
      ctx = tls_ssl_ctx_.get();
    }
    ASSERT_OK(peer_.Start(ctx, stall_first, trickle));
    SegmentDescriptor d;
    d.name = "stall";
    d.host = "127.0.0.1";
    d.host_id = "fake-peer-host";
    d.segment_index = 1;
    d.segment_id = 42;
    d.control = absl::StrCat("127.0.0.1:", peer_.port());
    d.transports["tcp"] = absl::StrCat(tls() ? net::kTlsScheme : "", "127.0.0.1:", peer_.port());
    d.buffers.push_back({.offset = 0, .length = 1 << 20, .location = "cpu:0"});
    ASSERT_OK(metadata_->Put(DescriptorKey("stall"), d.ToJson()));

    ASSERT_OK_AND_ASSIGN(good_region_, SharedRegion::Create(1 << 20, {}));
    std::memset(good_region_->data(), 'G', 1 << 20);
    ASSERT_OK_AND_ASSIGN(good_, TransferEngine::Create({.metadata = metadata_, .transports = {"tcp"}}));
    ASSERT_OK(good_->RegisterMemory(good_region_->data(), 1 << 20, "cpu:0"));
    ASSERT_OK(good_->ServeSegment("good", {good_region_->data()}));

    EngineOptions o{.metadata = metadata_, .transports = {"tcp"}};
    o.workers = 2;
    o.backend.tls.ca = ca_;
    ASSERT_OK_AND_ASSIGN(client_, TransferEngine::Create(o));
  }
  void TearDown() override {
    peer_.release_rest = true;
    client_.reset();  // its workers first: they may be reading from the peer
    peer_.Stop();
  }

  std::shared_ptr<MetadataClient> metadata_;
  FakePeer peer_;
  std::string ca_;
  std::unique_ptr<auth::ServerTlsContext> tls_ctx_;
  std::shared_ptr<SSL_CTX> tls_ssl_ctx_;
  std::unique_ptr<SharedRegion> good_region_;
  std::unique_ptr<TransferEngine> good_;
  std::unique_ptr<TransferEngine> client_;
};

// The client library's read path (client/client_get.cc): a replica whose
// read times out, then the next replica read into the same buffer.
TEST_P(TcpDeadlineTest, AReplyThatResumesAfterItsCallerGaveUpNeverWritesTheCallersBuffer) {
  ASSERT_NO_FATAL_FAILURE(Start(/*stall_first=*/true, /*trickle=*/false));
  if (IsSkipped()) return;
  std::vector<char> buf(kLen, 0);
  std::shared_ptr<Batch> batch = client_->Submit({{Op::kRead, buf.data(), "stall", 0, kLen}}, absl::Seconds(10));
  ASSERT_OK(WaitFor("the peer to send half the reply", absl::Seconds(10), [&] { return peer_.halves_sent.load() == 1; }));

  const absl::Time asked = absl::Now();
  EXPECT_FALSE(batch->Wait(asked + absl::Milliseconds(100)));
  // The revocation waits for a copy, never for the peer.
  EXPECT_LT(absl::Now() - asked, absl::Seconds(2));
  EXPECT_THAT(batch->statuses()[0], StatusIs(absl::StatusCode::kDeadlineExceeded));

  // The caller moves on: another replica into the same buffer.
  std::vector<absl::Status> st = client_->Transfer({{Op::kRead, buf.data(), "good", 0, kLen}}, absl::Seconds(10));
  ASSERT_OK(st[0]);
  ASSERT_EQ(std::string(buf.data(), kLen), std::string(kLen, 'G'));

  // Now the first peer's rest arrives, and the abandoned transfer ends.
  peer_.release_rest = true;
  ASSERT_OK(WaitFor("the peer to send the rest", absl::Seconds(10), [&] { return peer_.rests_sent.load() == 1; }));
  ASSERT_OK(WaitFor("the abandoned transfer to end", absl::Seconds(15), [&] { return batch->Done(); }));
  size_t late = 0;
  for (char c : buf) late += c != 'G';
  EXPECT_EQ(late, 0u) << "bytes written into the caller's buffer after its Wait returned";
  EXPECT_THAT(batch->statuses()[0], StatusIs(absl::StatusCode::kDeadlineExceeded));

  // The peer was only slow: the next read of it works, on a new connection.
  std::vector<char> again(4096, 0);
  st = client_->Transfer({{Op::kRead, again.data(), "stall", 0, again.size()}}, absl::Seconds(10));
  ASSERT_OK(st[0]);
  EXPECT_EQ(std::string(again.data(), again.size()), std::string(again.size(), FakePeer::kWhole));
}

TEST_P(TcpDeadlineTest, AReplyTrickledAByteAtATimeEndsATransferAtItsDeadline) {
  ASSERT_NO_FATAL_FAILURE(Start(/*stall_first=*/false, /*trickle=*/true));
  if (IsSkipped()) return;
  std::vector<char> buf(64 << 10, 0);
  // On the caller's thread (Transfer), then on a worker (Submit).
  absl::Time start = absl::Now();
  std::vector<absl::Status> st =
      client_->Transfer({{Op::kRead, buf.data(), "stall", 0, buf.size()}}, absl::Milliseconds(500));
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "the trickling peer held the caller";

  start = absl::Now();
  std::shared_ptr<Batch> batch =
      client_->Submit({{Op::kRead, buf.data(), "stall", 0, buf.size()}}, absl::Milliseconds(500));
  EXPECT_TRUE(batch->Wait(start + absl::Seconds(5)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "the trickling peer held a worker";
  EXPECT_THAT(batch->statuses()[0], StatusIs(absl::StatusCode::kDeadlineExceeded));
}

INSTANTIATE_TEST_SUITE_P(PlainAndTls, TcpDeadlineTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Tls" : "Plain"; });

// A daemon's engine serving one segment over tcp, with or without data
// grants, and raw frames sent to it.
class TcpLateWriteTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kSize = 1 << 20;
  static constexpr uint64_t kOffset = 4096;
  static constexpr uint64_t kLen = 256 << 10;
  static constexpr char kEarly = 'E', kLate = 'L';

  void Start(bool grants) {
    metadata_ = NewInMemoryMetadata();
    ASSERT_OK_AND_ASSIGN(region_, SharedRegion::Create(kSize, {}));
    std::memset(region_->data(), 0x5a, kSize);
    EngineOptions o{.metadata = metadata_, .transports = {"tcp"}};
    o.data_grants = grants;
    ASSERT_OK_AND_ASSIGN(server_, TransferEngine::Create(o));
    ASSERT_OK(server_->RegisterMemory(region_->data(), kSize, "cpu:0"));
    ASSERT_OK(server_->ServeSegment("seg", {region_->data()}));
    ASSERT_OK_AND_ASSIGN(desc_, SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey("seg"))));
    ASSERT_OK_AND_ASSIGN(key_, server_->SegmentDataKey("seg"));
    ASSERT_OK_AND_ASSIGN(fd_, net::Dial(absl::StrCat("127.0.0.1:", server_->port()), Deadline()));
  }
  static absl::Time Deadline() { return absl::Now() + absl::Seconds(5); }
  DataGrant Grant(absl::Duration ttl) const {
    DataGrant g;
    g.grant = auth::NewGrant(absl::Now() + ttl);
    g.session_key = auth::GrantSessionKey(key_, g.grant);
    return g;
  }

  absl::Status SendFrame(RequestHeader h, const std::string& payload, const std::string& grant = "") {
    h.id = ++id_;
    h.segment = desc_.segment_index;
    h.segment_id = desc_.segment_id;
    if (h.length == 0) h.length = payload.size();
    uint8_t head[kHeadMax];
    const size_t head_len = EncodeHead(h, grant, head);
    RETURN_IF_ERROR(net::WriteFull(fd_.get(), head, head_len, Deadline()));
    return payload.empty() ? absl::OkStatus() : net::WriteFull(fd_.get(), payload.data(), payload.size(), Deadline());
  }
  absl::StatusOr<std::pair<ReplyHeader, std::string>> Receive() {
    uint8_t buf[kReplySize];
    RETURN_IF_ERROR(net::ReadFull(fd_.get(), buf, sizeof buf, Deadline()));
    ASSIGN_OR_RETURN(ReplyHeader h, DecodeReply(buf, sizeof buf));
    if (h.length > kMaxHandshake) return absl::InternalError("reply too long");
    std::string payload(h.length, '\0');
    RETURN_IF_ERROR(net::ReadFull(fd_.get(), payload.data(), payload.size(), Deadline()));
    return std::make_pair(h, payload);
  }
  // CHALLENGE and AUTH on the raw connection, with a grant of `ttl`.
  void Admit(absl::Duration ttl) {
    ASSERT_OK(SendFrame({.op = WireOp::kChallenge}, ""));
    ASSERT_OK_AND_ASSIGN(auto nonce, Receive());
    ASSERT_EQ(nonce.first.status, WireStatus::kOk);
    const DataGrant g = Grant(ttl);
    ASSERT_OK(SendFrame({.op = WireOp::kAuth},
                        g.grant + auth::GrantProof(g.session_key, nonce.second, desc_.segment_index, desc_.segment_id)));
    ASSERT_OK_AND_ASSIGN(auto admitted, Receive());
    ASSERT_EQ(admitted.first.status, WireStatus::kOk) << admitted.second;
  }
  // The header and the first half of a WRITE of kLen bytes at kOffset;
  // with data grants, under an extent grant for it good for `grant_ttl`.
  void StartWrite(absl::Time deadline, absl::Duration grant_ttl = absl::Seconds(30)) {
    RequestHeader h{.op = WireOp::kWrite, .flags = kHasDeadline, .offset = kOffset, .length = kLen};
    h.deadline_ms32 = DeadlineMs32(deadline);
    const std::string grant =
        key_.empty() ? std::string()
                     : auth::ExtentMac(key_).Sign({kOffset, kLen, absl::ToUnixMillis(absl::Now() + grant_ttl),
                                                   auth::kExtentWrite});
    ASSERT_OK(SendFrame(h, std::string(kLen / 2, kEarly), grant));
  }
  // What a refused write left: no late byte anywhere, nothing past the
  // early half, and the early half either landed or untouched.
  void ExpectNoLateByte() {
    const char* extent = region_->data() + kOffset;
    size_t late = 0, early_landed = 0, beyond = 0;
    for (uint64_t i = 0; i < kLen; ++i) {
      late += extent[i] == kLate;
      if (i < kLen / 2) {
        early_landed += extent[i] == kEarly;
        EXPECT_TRUE(extent[i] == kEarly || extent[i] == 0x5a) << i;
      } else {
        beyond += extent[i] != 0x5a;
      }
    }
    EXPECT_EQ(late, 0u) << "bytes that arrived past the write's deadline landed";
    EXPECT_EQ(beyond, 0u);
    EXPECT_EQ(std::string(region_->data(), kOffset), std::string(kOffset, 0x5a));
    EXPECT_EQ(std::string(region_->data() + kOffset + kLen, kSize - kOffset - kLen),
              std::string(kSize - kOffset - kLen, 0x5a));
    RecordProperty("early_bytes_landed", static_cast<int>(early_landed));
  }

  std::shared_ptr<MetadataClient> metadata_;
  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<TransferEngine> server_;
  SegmentDescriptor desc_;
  std::string key_;
  net::Fd fd_;
  uint64_t id_ = 0;
};

TEST_F(TcpLateWriteTest, APayloadThatArrivesPastItsDeadlineLandsNoLateByte) {
  ASSERT_NO_FATAL_FAILURE(Start(/*grants=*/false));
  const absl::Time deadline = absl::Now() + absl::Milliseconds(300);
  ASSERT_NO_FATAL_FAILURE(StartWrite(deadline));
  ASSERT_OK(WaitFor("the write's deadline to pass", absl::Seconds(10),
                    [&] { return absl::Now() > deadline + absl::Milliseconds(100); }));
  const std::string rest(kLen / 2, kLate);
  ASSERT_OK(net::WriteFull(fd_.get(), rest.data(), rest.size(), Deadline()));
  ASSERT_OK_AND_ASSIGN(auto reply, Receive());
  EXPECT_EQ(reply.first.status, WireStatus::kExpired) << reply.second;
  ExpectNoLateByte();
  // The stream stayed in sync: the connection goes on serving.
  ASSERT_OK(SendFrame({.op = WireOp::kPing}, ""));
  ASSERT_OK_AND_ASSIGN(auto pong, Receive());
  EXPECT_EQ(pong.first.status, WireStatus::kOk);
}

TEST_F(TcpLateWriteTest, APayloadThatArrivesPastTheConnectionsDataGrantLandsNoLateByte) {
  ASSERT_NO_FATAL_FAILURE(Start(/*grants=*/true));
  const absl::Time admitted = absl::Now();
  ASSERT_NO_FATAL_FAILURE(Admit(absl::Seconds(1)));
  ASSERT_NO_FATAL_FAILURE(StartWrite(absl::Now() + absl::Seconds(10)));
  ASSERT_OK(WaitFor("the data grant to expire", absl::Seconds(10),
                    [&] { return absl::Now() > admitted + absl::Milliseconds(1100); }));
  const std::string rest(kLen / 2, kLate);
  ASSERT_OK(net::WriteFull(fd_.get(), rest.data(), rest.size(), Deadline()));
  ASSERT_OK_AND_ASSIGN(auto reply, Receive());
  EXPECT_EQ(reply.first.status, WireStatus::kUnauthenticated) << reply.second;
  EXPECT_NE(reply.second.find("expired"), std::string::npos) << reply.second;
  ExpectNoLateByte();
  char more;
  EXPECT_FALSE(net::ReadFull(fd_.get(), &more, 1, Deadline()).ok()) << "the connection stays open";
}

// The extent grant's expiry is the master's, not the writer's: a payload
// still arriving past it lands nothing, whatever deadline the frame named.
TEST_F(TcpLateWriteTest, APayloadThatArrivesPastItsExtentGrantLandsNoLateByte) {
  ASSERT_NO_FATAL_FAILURE(Start(/*grants=*/true));
  ASSERT_NO_FATAL_FAILURE(Admit(absl::Minutes(1)));
  const absl::Time granted = absl::Now();
  ASSERT_NO_FATAL_FAILURE(StartWrite(absl::Now() + absl::Seconds(30), absl::Seconds(1)));
  ASSERT_OK(WaitFor("the extent grant to expire", absl::Seconds(10),
                    [&] { return absl::Now() > granted + absl::Milliseconds(1100); }));
  const std::string rest(kLen / 2, kLate);
  ASSERT_OK(net::WriteFull(fd_.get(), rest.data(), rest.size(), Deadline()));
  ASSERT_OK_AND_ASSIGN(auto reply, Receive());
  EXPECT_EQ(reply.first.status, WireStatus::kDenied) << reply.second;
  EXPECT_NE(reply.second.find("expired"), std::string::npos) << reply.second;
  ExpectNoLateByte();
  ASSERT_OK(SendFrame({.op = WireOp::kPing}, ""));
  ASSERT_OK_AND_ASSIGN(auto pong, Receive());
  EXPECT_EQ(pong.first.status, WireStatus::kOk);
}

// The client's side of it: a pooled connection whose grant would expire
// before a batch's deadline is not used for it, so grants that expire
// while the client runs cost no failed transfer.
TEST_F(TcpLateWriteTest, PooledConnectionsAreRedialledBeforeTheirDataGrantExpires) {
  ASSERT_NO_FATAL_FAILURE(Start(/*grants=*/true));
  int asked = 0;
  EngineOptions o{.metadata = metadata_, .transports = {"tcp"}};
  o.grants = [&](const std::string&, bool, absl::Time) -> absl::StatusOr<DataGrant> {
    ++asked;
    return Grant(absl::Seconds(1));
  };
  ASSERT_OK_AND_ASSIGN(auto client, TransferEngine::Create(o));
  std::vector<char> out(4096, 'w'), in(4096, 0);
  const std::string grant =
      auth::ExtentMac(key_).Sign({0, 4096, absl::ToUnixMillis(absl::Now() + absl::Minutes(1)),
                                  auth::kExtentRead | auth::kExtentWrite});
  Request write{Op::kWrite, out.data(), "seg", 0, out.size()};
  write.grant = grant;
  Request read{Op::kRead, in.data(), "seg", 0, in.size()};
  read.grant = grant;
  ASSERT_OK(client->Transfer({write}, absl::Milliseconds(300))[0]);
  const int first = asked;
  const absl::Time granted = absl::Now();
  ASSERT_OK(WaitFor("the first grant to expire", absl::Seconds(10),
                    [&] { return absl::Now() > granted + absl::Milliseconds(1200); }));
  ASSERT_OK(client->Transfer({read}, absl::Milliseconds(300))[0]);
  EXPECT_EQ(in, out);
  EXPECT_GT(asked, first);
}

}  // namespace
}  // namespace tierkv::transport::tcp
