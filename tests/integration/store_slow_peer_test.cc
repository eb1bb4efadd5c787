// tierkv-store's data port holds a stalled peer no longer than its flags
// say: --frame-timeout bounds a frame from its first byte, whatever the
// peer trickles after it (the server itself is tested in
// tests/unit/tcp_slow_peer_test.cc; this checks the daemon wires the flag).
#include <sys/socket.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "base/net/socket.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"

namespace tierkv {
namespace {

using testing::ChildProcess;

// True once the server has closed `fd` (EOF); false while it is open.
bool ClosedByPeer(int fd) {
  char b;
  return ::recv(fd, &b, 1, MSG_DONTWAIT) == 0;
}

TEST(StoreSlowPeerTest, AFrameStalledPastFrameTimeoutIsClosed) {
  // No master: the daemon serves its data port while mounting retries.
  auto d = ChildProcess::Start(testing::BinaryPath("tierkv-store"),
                               {"--master=127.0.0.1:1", "--metadata=http://127.0.0.1:1", "--segment-size=16mib",
                                "--port=0", "--http-port=0", "--name=slow-peer-test", "--frame-timeout=1s"});
  ASSERT_OK(d.status());
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial("127.0.0.1:" + std::to_string((*d)->port("port")), deadline));
  // Half a request header, then nothing.
  const char half[8] = {'T', 'K', 'V', 0, 0, 0, 0, 0};
  ASSERT_OK(net::WriteFull(fd.get(), half, sizeof half, deadline));
  const absl::Time sent = absl::Now();
  EXPECT_OK(testing::StaysFalse("the daemon closed the stalled connection before its frame deadline",
                                absl::Milliseconds(500), [&] { return ClosedByPeer(fd.get()); }));
  ASSERT_OK(testing::WaitFor("the daemon to close a connection stalled mid-frame", absl::Seconds(5),
                             [&] { return ClosedByPeer(fd.get()); }));
  // --frame-timeout=1s, and the server sweeps at least once a second; the
  // default (5 s) would not have closed it yet.
  EXPECT_LT(absl::Now() - sent, absl::Milliseconds(2900));
}

}  // namespace
}  // namespace tierkv
