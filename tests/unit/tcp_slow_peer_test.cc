// The tcp server under slow and stalled peers (slow-loris), plain and TLS:
// more stalled connections than I/O threads (half a header, a payload cut
// short, a header trickled a byte every 100 ms, a TLS handshake never
// finished) must cost only their own connections. A healthy client's
// transfers complete promptly meanwhile, the stalled connections are closed
// once their frame (or handshake) deadline passes, a parked payload holds
// no pin that unregistering memory would wait for, and Stop() returns at
// once.
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/net/socket.h"
#include "base/net/tls.h"
#include "tests/support/status_matchers.h"
#include "tests/support/process.h"
#include "tests/support/tls_certs.h"
#include "tests/support/wait.h"
#include "transport/tcp/connection.h"
#include "transport/tcp/server.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

using ::tierkv::testing::StaysFalse;
using ::tierkv::testing::WaitFor;

// One served segment over a plain buffer. `mu` stands for the engine's
// served-buffers lock: unregistering takes it exclusively, so it waits for
// every pin.
class FakeServed : public ServedMemory {
 public:
  static constexpr uint32_t kIndex = 3;
  static constexpr uint64_t kId = 77;
  FakeServed(size_t size, bool grants) : buf_(size, 0), grants_(grants) {}

  absl::StatusOr<Pin> Resolve(uint32_t segment, uint64_t id, uint64_t offset, uint64_t length) override {
    if (segment != kIndex || id != kId) return absl::NotFoundError("no such segment");
    if (offset > buf_.size() || length > buf_.size() - offset) return absl::OutOfRangeError("out of range");
    return Pin{buf_.data() + offset, std::shared_lock<std::shared_mutex>(mu)};
  }
  absl::StatusOr<std::string> Handshake(const std::string&, const std::string&,
                                        std::optional<std::pair<uint32_t, uint64_t>>) override {
    return std::string("{}");
  }
  bool DataGrantsRequired() const override { return grants_; }

  std::shared_mutex mu;

 private:
  std::vector<char> buf_;
  const bool grants_;
};

class SlowPeerTest : public ::testing::TestWithParam<bool> {
 protected:
  static constexpr uint64_t kSize = 4 << 20;
  static constexpr int kIoThreads = 2;
  // Long enough that a server holding a thread per stalled frame fails the
  // healthy client's budget below; short enough to wait out.
  static constexpr absl::Duration kFrameTimeout = absl::Seconds(4);
  static constexpr absl::Duration kHealthyBudget = absl::Seconds(2);

  bool tls() const { return GetParam(); }

  void StartServer(bool grants = false) {
    served_ = std::make_unique<FakeServed>(kSize, grants);
    ServerOptions o;
    o.io_threads = kIoThreads;
    o.frame_timeout = kFrameTimeout;
    o.handshake_timeout = kFrameTimeout;
    if (tls()) {
      absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts(testing::MakeTempDir("tierkv-slow-peer"));
      if (!certs.ok()) GTEST_SKIP() << certs.status();
      ca_ = certs->ca;
      ASSERT_OK_AND_ASSIGN(o.tls, net::NewServerContext({"", certs->server_cert, certs->server_key}));
    }
    server_ = std::make_unique<Server>(o, served_.get());
    ASSERT_OK(server_->Start());
  }
  void TearDown() override {
    stop_trickle_ = true;
    if (trickler_.joinable()) trickler_.join();
    if (server_) server_->Stop();
  }

  // A connected peer: its socket and, with TLS, its finished handshake.
  struct Peer {
    net::Fd fd;
    net::SslPtr ssl;
  };
  Peer Dial(bool handshake = true) {
    Peer p;
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    absl::StatusOr<net::Fd> fd = net::Dial(absl::StrCat("127.0.0.1:", server_->port()), deadline);
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (!fd.ok()) return p;
    p.fd = std::move(*fd);
    if (tls() && handshake) {
      absl::StatusOr<std::shared_ptr<SSL_CTX>> ctx = net::ClientContext(ca_);
      EXPECT_TRUE(ctx.ok()) << ctx.status();
      absl::StatusOr<net::SslPtr> ssl = net::TlsConnect(p.fd.get(), ctx->get(), "127.0.0.1", deadline);
      EXPECT_TRUE(ssl.ok()) << ssl.status();
      if (ssl.ok()) p.ssl = std::move(*ssl);
    }
    return p;
  }
  absl::Status Write(Peer& p, const void* data, size_t len) {
    absl::Time deadline = absl::Now() + absl::Seconds(5);
    iovec iov{const_cast<void*>(data), len};
    return p.ssl ? net::TlsWriteVecFull(p.ssl.get(), &iov, 1, deadline) : net::WriteFull(p.fd.get(), data, len, deadline);
  }
  static std::string WriteHeader(uint64_t length) {
    RequestHeader h;
    h.op = WireOp::kWrite;
    h.segment = FakeServed::kIndex;
    h.segment_id = FakeServed::kId;
    h.id = 1;
    h.length = length;
    uint8_t head[kRequestSize];
    EncodeRequest(h, head);
    return std::string(reinterpret_cast<char*>(head), kRequestSize);
  }
  // True once the server has closed the peer's socket (EOF or reset);
  // never blocks.
  static bool ClosedByServer(const Peer& p) {
    char buf[4096];
    for (;;) {
      ssize_t n = ::recv(p.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) continue;  // a TLS alert or handshake bytes: read past them
      if (n == 0) return true;
      return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    }
  }

  // Opens stalled connections, twice as many as I/O threads of each kind.
  void OpenStalledPeers() {
    for (int i = 0; i < 2 * kIoThreads; ++i) {
      Peer half = Dial();
      ASSERT_OK(Write(half, WriteHeader(0).data(), kRequestSize / 2));
      stalled_.push_back(std::move(half));
      Peer cut = Dial();
      std::string frame = WriteHeader(1 << 20) + std::string(100 << 10, 'x');
      ASSERT_OK(Write(cut, frame.data(), frame.size()));
      stalled_.push_back(std::move(cut));
      Peer trickle = Dial();
      ASSERT_OK(Write(trickle, "T", 1));  // 'T' of the magic; the rest trickles
      trickling_.push_back(stalled_.size());
      stalled_.push_back(std::move(trickle));
      if (tls()) {
        stalled_.push_back(Dial(/*handshake=*/false));  // connects, never says hello
        Peer hello = Dial(/*handshake=*/false);
        const char record[] = "\x16\x03\x01\x02\x00\x01";  // a 512-byte record, cut short
        ASSERT_OK(Write(hello, record, sizeof record - 1));
        stalled_.push_back(std::move(hello));
      }
    }
    ASSERT_OK(WaitFor("the stalled connections to be accepted", absl::Seconds(10),
                      [&] { return server_->open_connections() >= stalled_.size(); }));
    // A byte every 100 ms for the tricklers: a header never completes
    // within the frame deadline. Bounded: 30 s at most.
    trickler_ = std::thread([this] {
      const std::string header = WriteHeader(0);
      for (size_t byte = 1; byte < kRequestSize && !stop_trickle_; ++byte) {
        for (size_t i : trickling_) {
          Peer& p = stalled_[i];
          if (p.ssl) {
            (void)net::TlsWriteVecFull(p.ssl.get(), std::vector<iovec>{{const_cast<char*>(&header[byte]), 1}}.data(), 1,
                                       absl::Now() + absl::Milliseconds(10));
          } else {
            (void)::send(p.fd.get(), &header[byte], 1, MSG_NOSIGNAL | MSG_DONTWAIT);
          }
        }
        for (int i = 0; i < 10 && !stop_trickle_; ++i) absl::SleepFor(absl::Milliseconds(10));
      }
    });
  }

  // A healthy client: writes then reads back `rounds` times, each within
  // kHealthyBudget.
  void HealthyTransfers(int rounds) {
    Peer p = Dial();
    Connection conn(std::move(p.fd), "server", absl::ZeroDuration(), std::move(p.ssl));
    std::vector<char> out(256 << 10), in(out.size());
    for (int r = 0; r < rounds; ++r) {
      std::fill(out.begin(), out.end(), static_cast<char>('a' + r));
      Slice w{.op = Op::kWrite, .local = out.data(), .remote_offset = 4096, .length = out.size()};
      Slice rd{.op = Op::kRead, .local = in.data(), .remote_offset = 4096, .length = in.size()};
      const absl::Time start = absl::Now();
      Slice* ws[] = {&w};
      conn.RunBatch(FakeServed::kIndex, FakeServed::kId, ws, start + kHealthyBudget);
      ASSERT_OK(w.status) << "round " << r;
      Slice* rs[] = {&rd};
      conn.RunBatch(FakeServed::kIndex, FakeServed::kId, rs, start + kHealthyBudget);
      ASSERT_OK(rd.status) << "round " << r;
      ASSERT_EQ(in, out);
    }
  }

  std::unique_ptr<FakeServed> served_;
  std::unique_ptr<Server> server_;
  std::string ca_;
  std::vector<Peer> stalled_;
  std::vector<size_t> trickling_;
  std::atomic<bool> stop_trickle_{false};
  std::thread trickler_;
};

TEST_P(SlowPeerTest, StalledPeersCostOnlyTheirOwnConnections) {
  StartServer();
  if (IsSkipped()) return;
  OpenStalledPeers();
  const absl::Time opened = absl::Now();
  HealthyTransfers(10);
  // Every stalled connection is closed by the server once its frame (or
  // handshake) deadline passes, the tricklers' bytes notwithstanding. The
  // slack covers the once-a-second sweep on a loaded machine.
  for (size_t i = 0; i < stalled_.size(); ++i) {
    ASSERT_OK(WaitFor(absl::StrCat("the server to close stalled connection #", i),
                      opened + kFrameTimeout + absl::Seconds(3) - absl::Now(),
                      [&] { return ClosedByServer(stalled_[i]); }));
  }
  EXPECT_GE(server_->expired(), stalled_.size());
  HealthyTransfers(2);
}

TEST_P(SlowPeerTest, AStalledPayloadHoldsNoPinAndStopIsPrompt) {
  StartServer();
  if (IsSkipped()) return;
  OpenStalledPeers();
  // Unregistering takes the served-buffers lock exclusively: it must not
  // wait behind payloads that stopped arriving.
  std::atomic<bool> locked{false};
  std::thread unregister([&] {
    std::unique_lock<std::shared_mutex> lock(served_->mu);
    locked = true;
  });
  EXPECT_OK(WaitFor("an exclusive lock on the served memory", absl::Seconds(1), [&] { return locked.load(); }));
  unregister.join();
  const absl::Time start = absl::Now();
  server_->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST_P(SlowPeerTest, AConnectionThatNeverAuthenticatesIsClosedAfterTheHandshakeDeadline) {
  StartServer(/*grants=*/true);
  if (IsSkipped()) return;
  Peer silent = Dial();
  Peer challenged = Dial();
  RequestHeader h;
  h.op = WireOp::kChallenge;
  uint8_t head[kRequestSize];
  EncodeRequest(h, head);
  ASSERT_OK(Write(challenged, head, kRequestSize));
  const absl::Time opened = absl::Now();
  // Idle connections live for minutes; one never admitted does not.
  EXPECT_OK(StaysFalse("a connection closed before its handshake deadline", kFrameTimeout / 2,
                       [&] { return ClosedByServer(silent); }));
  EXPECT_OK(WaitFor("the server to close a connection that never authenticated",
                    opened + kFrameTimeout + absl::Seconds(3) - absl::Now(), [&] { return ClosedByServer(silent); }));
  EXPECT_OK(WaitFor("the server to close a connection that took a challenge and never answered",
                    opened + kFrameTimeout + absl::Seconds(3) - absl::Now(),
                    [&] { return ClosedByServer(challenged); }));
}

INSTANTIATE_TEST_SUITE_P(PlainAndTls, SlowPeerTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Tls" : "Plain"; });

}  // namespace
}  // namespace tierkv::transport::tcp
