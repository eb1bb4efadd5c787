// The tcp connection's receive path (transport/tcp/connection.h): spinning
// for a reply (base/net/socket.h's spin and tracker), replies that arrive
// in pieces, and a joined reply scattered over its reads' buffers.
#include "transport/tcp/connection.h"

#include <sys/socket.h>

#include <atomic>
#include <thread>
#include <vector>

#include "base/net/socket.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

using net::Fd;
using net::ReadFull;
using net::ServerSpin;
using net::SpinTracker;
using net::SpinUntilReadable;
using net::WriteFull;

TEST(TcpSpinTest, SpinUntilReadableSeesDataAndHangupsAndGivesUpAfterItsWindow) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  Fd a(sv[0]), b(sv[1]);
  EXPECT_FALSE(SpinUntilReadable(a.get(), absl::ZeroDuration()));
  absl::Time t0 = absl::Now();
  EXPECT_FALSE(SpinUntilReadable(a.get(), absl::Milliseconds(3)));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(3));
  ASSERT_EQ(::send(b.get(), "x", 1, 0), 1);
  EXPECT_TRUE(SpinUntilReadable(a.get(), absl::Seconds(5)));
  char c;
  ASSERT_EQ(::recv(a.get(), &c, 1, 0), 1);
  // A byte that lands while it spins ends the spin at once.
  std::atomic<bool> spun{false};
  std::thread late([&] {
    EXPECT_OK(::tierkv::testing::StaysFalse("a spin ended with nothing to read", absl::Milliseconds(2),
                                            [&] { return spun.load(); }));
    (void)::send(b.get(), "y", 1, 0);
  });
  t0 = absl::Now();
  EXPECT_TRUE(SpinUntilReadable(a.get(), absl::Seconds(5)));
  spun = true;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(4));
  late.join();
  ASSERT_EQ(::recv(a.get(), &c, 1, 0), 1);
  b = Fd();  // the peer hangs up: readable (EOF), not a wait for the window
  EXPECT_TRUE(SpinUntilReadable(a.get(), absl::Seconds(5)));
}

// A spin's permit: with one place, a second thread asking while the first
// spins is told kCapped and never polls.
TEST(TcpSpinTest, ServerSpinLetsAtMostItsCapSpinAtOnce) {
  int a[2], b[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a), 0);
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, b), 0);
  Fd a0(a[0]), a1(a[1]), b0(b[0]), b1(b[1]);
  ServerSpin spin(absl::Seconds(5), 1);  // cut to 1 ms
  EXPECT_TRUE(spin.enabled());
  EXPECT_EQ(spin.window(), absl::Milliseconds(1));
  EXPECT_EQ(spin.Spin(a0.get()), ServerSpin::Outcome::kIdle);
  ASSERT_EQ(::send(a1.get(), "x", 1, 0), 1);
  EXPECT_EQ(spin.Spin(a0.get()), ServerSpin::Outcome::kCall);
  char c;
  ASSERT_EQ(::recv(a0.get(), &c, 1, 0), 1);
  // One thread spins back to back (idle windows of 1 ms, or refused while
  // this one holds the place) while this one asks: it must be refused a
  // place. Both loops end by 10 s.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    while (!stop.load() && absl::Now() < until) (void)spin.Spin(a0.get());
  });
  bool capped = false;
  while (!capped && absl::Now() < until) capped = spin.Spin(b0.get()) == ServerSpin::Outcome::kCapped;
  stop = true;
  busy.join();
  EXPECT_TRUE(capped);
  EXPECT_FALSE(ServerSpin(absl::ZeroDuration(), 4).enabled());
  EXPECT_FALSE(ServerSpin(absl::Milliseconds(1), 0).enabled());
}

// When a connection is worth spinning for: a call soon after the reply
// heats it, an empty spin cools it for 1, then 2 ... calls, a call caught
// by a spin keeps it hot and ends the back-off, a long gap cools it.
TEST(TcpSpinTest, SpinTrackerHeatsOnQuickCallsAndBacksOffAfterEmptySpins) {
  ServerSpin spin(absl::Milliseconds(1), 1);
  SpinTracker t(&spin);
  EXPECT_FALSE(t.hot());
  // A call within 2 ms of the reply heats it (retried: this thread may be
  // descheduled between the two calls on a loaded machine).
  auto heat = [&t] {
    for (int i = 0; i < 50 && !t.hot(); ++i) {
      t.Replied();
      t.Arrived();
    }
    return t.hot();
  };
  ASSERT_TRUE(heat());
  t.Spun(ServerSpin::Outcome::kIdle);
  EXPECT_FALSE(t.hot());
  t.Replied();
  t.Arrived();  // the one call it sleeps through, however soon it came
  EXPECT_FALSE(t.hot());
  ASSERT_TRUE(heat());
  t.Spun(ServerSpin::Outcome::kIdle);  // a second empty spin in a row: two calls
  for (int i = 0; i < 2; ++i) {
    t.Replied();
    t.Arrived();
    EXPECT_FALSE(t.hot()) << i;
  }
  ASSERT_TRUE(heat());
  // A call caught by the spin keeps it hot whatever the clock says, and
  // the back-off starts over at one call.
  t.Spun(ServerSpin::Outcome::kCall);
  t.Arrived();
  EXPECT_TRUE(t.hot());
  t.Spun(ServerSpin::Outcome::kIdle);
  t.Replied();
  t.Arrived();
  EXPECT_FALSE(t.hot());
  ASSERT_TRUE(heat());
  // A capped spin changes nothing; a call 5 ms after the reply cools it.
  t.Spun(ServerSpin::Outcome::kCapped);
  EXPECT_TRUE(t.hot());
  t.Replied();
  // Kept: the gap is the input, and the tracker reads the steady clock (no Clock seam).
  absl::SleepFor(absl::Milliseconds(5));
  t.Arrived();
  EXPECT_FALSE(t.hot());
  // Without a spin, or with it off, never hot.
  SpinTracker none;
  none.Replied();
  none.Arrived();
  EXPECT_FALSE(none.hot());
  ServerSpin off(absl::ZeroDuration(), 1);
  SpinTracker cold(&off);
  cold.Replied();
  cold.Arrived();
  EXPECT_FALSE(cold.hot());
}

// A read reply that arrives in pieces, some sooner and some later than the
// spin window: with any window the batch ends OK with every byte, which
// walks the spinning receive, its empty polls and the sleeping one.
TEST(TcpSpinTest, RepliesInPiecesArriveWholeWithAnySpinWindow) {
  for (absl::Duration spin : {absl::ZeroDuration(), absl::Microseconds(50), absl::Milliseconds(20)}) {
    SCOPED_TRACE(absl::FormatDuration(spin));
    int sv[2];
    // Non-blocking, as Dial's sockets are.
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
    Fd server(sv[1]);
    Connection conn(Fd(sv[0]), "test-peer", spin);
    constexpr size_t kLen = 300'000;
    std::string want(kLen, '\0');
    for (size_t i = 0; i < kLen; ++i) want[i] = static_cast<char>(i * 7 + 1);
    std::thread peer([&] {
      uint8_t req[kRequestSize];
      if (!ReadFull(server.get(), req, sizeof req, absl::Now() + absl::Seconds(10)).ok()) return;
      auto h = DecodeRequest(req, sizeof req);
      if (!h.ok()) return;
      uint8_t head[kReplySize];
      EncodeReply({WireStatus::kOk, h->id, kLen}, head);
      // Header in two parts, then the payload in three, with pauses of
      // 0, 1 and 30 ms between them. (Kept sleeps: the pauses are the
      // input, arrivals before and after the spin window, in real time.)
      const absl::Duration pauses[] = {absl::ZeroDuration(), absl::Milliseconds(1), absl::Milliseconds(30),
                                       absl::Milliseconds(1)};
      (void)WriteFull(server.get(), head, 3, absl::Now() + absl::Seconds(10));
      absl::SleepFor(pauses[1]);
      (void)WriteFull(server.get(), head + 3, kReplySize - 3, absl::Now() + absl::Seconds(10));
      size_t at = 0;
      for (int part = 0; part < 3; ++part) {
        absl::SleepFor(pauses[part + 1]);
        size_t len = part == 2 ? kLen - at : kLen / 3;
        (void)WriteFull(server.get(), want.data() + at, len, absl::Now() + absl::Seconds(10));
        at += len;
      }
    });
    std::string got(kLen, '\0');
    Slice s;
    s.op = Op::kRead;
    s.local = got.data();
    s.length = kLen;
    Slice* slices[] = {&s};
    conn.RunBatch(0, 1, slices, absl::Now() + absl::Seconds(10));
    peer.join();
    EXPECT_OK(s.status);
    EXPECT_TRUE(got == want);
    EXPECT_FALSE(conn.broken());
  }
}

// A joined reply lands in pieces: each receive goes on where the last one
// stopped, across the reads' separate buffers.
TEST(TcpJoinedReadTest, TheRestOfAReplyIsScatteredFromWhereItStopped) {
  char a[10], b[16], c[37];
  Slice sa, sb, sc;
  sa.local = a, sa.length = sizeof a;
  sb.local = b, sb.length = sizeof b;
  sc.local = c, sc.length = sizeof c;
  std::vector<Slice*> joined = {&sa, &sb, &sc};
  iovec iov[3];
  ASSERT_EQ(ScatterRest(absl::MakeSpan(joined), 0, iov), 3u);
  EXPECT_EQ(iov[0].iov_base, a);
  EXPECT_EQ(iov[0].iov_len, 10u);
  EXPECT_EQ(iov[2].iov_base, c);
  EXPECT_EQ(iov[2].iov_len, 37u);
  ASSERT_EQ(ScatterRest(absl::MakeSpan(joined), 4, iov), 3u);
  EXPECT_EQ(iov[0].iov_base, a + 4);
  EXPECT_EQ(iov[0].iov_len, 6u);
  ASSERT_EQ(ScatterRest(absl::MakeSpan(joined), 10, iov), 2u);  // the first is full
  EXPECT_EQ(iov[0].iov_base, b);
  EXPECT_EQ(iov[0].iov_len, 16u);
  ASSERT_EQ(ScatterRest(absl::MakeSpan(joined), 30, iov), 1u);
  EXPECT_EQ(iov[0].iov_base, c + 4);
  EXPECT_EQ(iov[0].iov_len, 33u);
  EXPECT_EQ(ScatterRest(absl::MakeSpan(joined), 63, iov), 0u);
}

}  // namespace
}  // namespace tierkv::transport::tcp
