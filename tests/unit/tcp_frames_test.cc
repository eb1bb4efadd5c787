// Crafted frames against the tcp server: every bad request gets an error
// reply, no byte outside the registered region is touched, and the server
// keeps serving (on the same connection where the stream stays in sync).
#include <cstring>
#include <filesystem>
#include <optional>

#include "tests/support/status_matchers.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "transport/tcp/connection.h"
#include "base/net/socket.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

constexpr uint64_t kSize = 1 << 20;

class TcpFramesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    metadata_ = NewInMemoryMetadata();
    region_ = std::move(*SharedRegion::Create(kSize, {}));
    EngineOptions o;
    o.metadata = metadata_;
    o.transports = {"tcp"};
    o.backend.max_frame = 8 << 20;
    server_ = std::move(*TransferEngine::Create(o));
    ASSERT_OK(server_->RegisterMemory(region_->data(), kSize, "cpu:0"));
    ASSERT_OK(server_->ServeSegment("seg", {region_->data()}));
    auto desc = SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey("seg")));
    ASSERT_TRUE(desc.ok()) << desc.status();
    segment_id_ = desc->segment_id;
    std::memset(region_->data(), 0x5a, kSize);
    Connect();
  }
  void Connect() {
    auto fd = Dial("127.0.0.1:" + std::to_string(server_->port()), Deadline());
    ASSERT_TRUE(fd.ok()) << fd.status();
    fd_ = std::move(*fd);
  }
  absl::Time Deadline() { return absl::Now() + absl::Seconds(5); }

  // Frames name the served segment's id unless told otherwise.
  void Send(WireOp op, uint32_t segment, uint64_t offset, uint64_t length, const std::string& payload = "",
            std::optional<uint64_t> segment_id = std::nullopt) {
    RequestHeader h;
    h.op = op;
    h.segment = segment;
    h.segment_id = segment_id.value_or(segment_id_);
    h.id = ++id_;
    h.offset = offset;
    h.length = length;
    uint8_t buf[kRequestSize];
    EncodeRequest(h, buf);
    ASSERT_OK(WriteFull(fd_.get(), buf, sizeof buf, Deadline()));
    if (!payload.empty()) {
      ASSERT_OK(WriteFull(fd_.get(), payload.data(), payload.size(), Deadline()));
    }
  }
  // Reads one reply and its payload.
  absl::StatusOr<std::pair<ReplyHeader, std::string>> Receive() {
    uint8_t buf[kReplySize];
    if (absl::Status s = ReadFull(fd_.get(), buf, sizeof buf, Deadline()); !s.ok()) return s;
    auto h = DecodeReply(buf, sizeof buf);
    if (!h.ok()) return h.status();
    if (h->length > kSize) return absl::InternalError("reply too long");
    std::string payload(h->length, '\0');
    if (absl::Status s = ReadFull(fd_.get(), payload.data(), payload.size(), Deadline()); !s.ok()) return s;
    return std::make_pair(*h, payload);
  }
  void ExpectAlive() {
    Send(WireOp::kPing, 0, 0, 0);
    auto r = Receive();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->first.status, WireStatus::kOk);
  }
  bool Untouched() {
    for (uint64_t i = 0; i < kSize; ++i) {
      if (static_cast<uint8_t>(region_->data()[i]) != 0x5a) return false;
    }
    return true;
  }

  std::shared_ptr<MetadataClient> metadata_;
  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<TransferEngine> server_;
  Fd fd_;
  uint64_t id_ = 0;
  uint64_t segment_id_ = 0;
};

TEST_F(TcpFramesTest, RefusedReadsKeepTheConnectionUsable) {
  struct Case {
    uint64_t offset, length;
    WireStatus want;
  } cases[] = {
      {kSize, 1, WireStatus::kOutOfRange},
      {kSize - 10, 20, WireStatus::kOutOfRange},
      {UINT64_MAX - 5, 10, WireStatus::kOutOfRange},  // offset + length overflows
      {10, UINT64_MAX - 5, WireStatus::kTooLarge},
      {0, 1ull << 40, WireStatus::kTooLarge},
  };
  for (const Case& c : cases) {
    Send(WireOp::kRead, 0, c.offset, c.length);
    auto r = Receive();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->first.status, c.want) << c.offset << "+" << c.length;
    EXPECT_FALSE(r->second.empty());  // an error message comes along
    ExpectAlive();
  }
  Send(WireOp::kRead, 7, 0, 16);  // no such segment
  auto r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kNoSegment);
  Send(WireOp::kRead, 0, 100, 0);  // zero length: OK, nothing follows
  r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kOk);
  EXPECT_TRUE(r->second.empty());
  ExpectAlive();
}

TEST_F(TcpFramesTest, RefusedWritesTouchNothing) {
  Send(WireOp::kWrite, 0, kSize - 4, 8, std::string(8, 'w'));
  auto r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kOutOfRange);
  ExpectAlive();  // the payload was drained; the stream is in sync
  Send(WireOp::kWrite, 9, 0, 8, std::string(8, 'w'));
  r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kNoSegment);
  ExpectAlive();
  EXPECT_TRUE(Untouched());
  // A write too long to drain: error reply, then the server closes.
  Send(WireOp::kWrite, 0, 0, 1ull << 40);
  r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kTooLarge);
  EXPECT_FALSE(Receive().ok());
  EXPECT_TRUE(Untouched());
  Connect();
  ExpectAlive();  // and it keeps serving new connections
}

TEST_F(TcpFramesTest, WritesPastTheirDeadlineAreRefusedUntouched) {
  // A write delayed past its sender's deadline (its put may be revoked and
  // the extent reused) must not land.
  RequestHeader h;
  h.op = WireOp::kWrite;
  h.flags = kHasDeadline;
  h.deadline_ms32 = DeadlineMs32(absl::Now() - absl::Milliseconds(5));
  h.segment_id = segment_id_;
  h.id = ++id_;
  h.offset = 0;
  h.length = 8;
  uint8_t buf[kRequestSize];
  EncodeRequest(h, buf);
  ASSERT_OK(WriteFull(fd_.get(), buf, sizeof buf, Deadline()));
  ASSERT_OK(WriteFull(fd_.get(), "late!!!!", 8, Deadline()));
  auto r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kExpired);
  EXPECT_TRUE(Untouched());
  ExpectAlive();
  // The same write within its deadline lands.
  h.deadline_ms32 = DeadlineMs32(absl::Now() + absl::Seconds(5));
  h.id = ++id_;
  EncodeRequest(h, buf);
  ASSERT_OK(WriteFull(fd_.get(), buf, sizeof buf, Deadline()));
  ASSERT_OK(WriteFull(fd_.get(), "on time!", 8, Deadline()));
  r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kOk);
  EXPECT_EQ(std::string(static_cast<char*>(region_->data()), 8), "on time!");
}

TEST_F(TcpFramesTest, WritesGrantedByAnOlderMasterEpochAreRefusedUntouched) {
  // A daemon that has mounted at master epoch 20 (docs/ha.md) refuses a
  // write granted at epoch 7: its extent may belong to someone else now.
  server_->ObserveEpoch(20);
  auto write = [&](uint64_t epoch, const char* bytes) {
    RequestHeader h;
    h.op = WireOp::kWrite;
    h.segment_id = segment_id_;
    h.id = ++id_;
    h.length = 8;
    h.epoch = epoch;
    uint8_t buf[kRequestSize];
    EncodeRequest(h, buf);
    EXPECT_OK(WriteFull(fd_.get(), buf, sizeof buf, Deadline()));
    EXPECT_OK(WriteFull(fd_.get(), bytes, 8, Deadline()));
    auto r = Receive();
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->first.status : WireStatus::kInternal;
  };
  EXPECT_EQ(write(7, "deposed!"), WireStatus::kStaleEpoch);
  EXPECT_TRUE(Untouched());
  ExpectAlive();
  // Unfenced writes (a single master), the current epoch and a newer one land.
  EXPECT_EQ(write(0, "unfenced"), WireStatus::kOk);
  EXPECT_EQ(write(20, "current!"), WireStatus::kOk);
  EXPECT_EQ(write(21, "newer!!!"), WireStatus::kOk);
  EXPECT_EQ(std::string(static_cast<char*>(region_->data()), 8), "newer!!!");
  // A write from a newer master moves the fence: 20 is now old.
  EXPECT_EQ(write(20, "stale 20"), WireStatus::kStaleEpoch);
  EXPECT_EQ(std::string(static_cast<char*>(region_->data()), 8), "newer!!!");
  EXPECT_TRUE(absl::IsFailedPrecondition(ReplyToStatus(WireStatus::kStaleEpoch, "x")));
}

TEST(TcpWireTest, TheEpochRoundTripsInTheHeader) {
  RequestHeader h;
  h.op = WireOp::kWrite;
  h.epoch = 0x0123456789abcdefull;
  h.length = 3;
  uint8_t buf[kRequestSize];
  EncodeRequest(h, buf);
  auto back = DecodeRequest(buf, sizeof buf);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->epoch, h.epoch);
  EXPECT_EQ(back->length, 3u);
  EXPECT_FALSE(DecodeRequest(buf, kRequestSize - 1).ok()) << "a header one byte short";
}

TEST(TcpWireTest, DeadlinesCompareAcrossTheWrap) {
  EXPECT_FALSE(DeadlinePassed(DeadlineMs32(absl::Now() + absl::Seconds(1)), absl::Now()));
  EXPECT_TRUE(DeadlinePassed(DeadlineMs32(absl::Now() - absl::Seconds(1)), absl::Now()));
  // 2^32 ms after the epoch the low bits wrap; the comparison does not care.
  absl::Time near_wrap = absl::FromUnixMillis((int64_t{1} << 32) * 400 - 10);
  EXPECT_FALSE(DeadlinePassed(DeadlineMs32(near_wrap + absl::Milliseconds(20)), near_wrap));
  EXPECT_TRUE(DeadlinePassed(DeadlineMs32(near_wrap), near_wrap + absl::Milliseconds(20)));
}

TEST_F(TcpFramesTest, GarbageClosesOnlyThatConnection) {
  std::string junk(kRequestSize, '\x7f');
  ASSERT_OK(WriteFull(fd_.get(), junk.data(), junk.size(), Deadline()));
  auto r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kBadRequest);
  EXPECT_FALSE(Receive().ok());
  Connect();
  ExpectAlive();
  EXPECT_TRUE(Untouched());
}

TEST_F(TcpFramesTest, UnmountedSegmentIsRefused) {
  ASSERT_OK(server_->StopServing("seg"));
  Send(WireOp::kWrite, 0, 0, 4, "abcd");
  auto r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kNoSegment);
  EXPECT_TRUE(Untouched());
  ExpectAlive();
}

TEST_F(TcpFramesTest, FramesNamingAnotherSegmentIdAreRefusedUntouched) {
  // Index 0 is served, but as another segment than the sender believes.
  Send(WireOp::kWrite, 0, 0, 8, std::string(8, 'w'), segment_id_ ^ 1);
  auto r = Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first.status, WireStatus::kNoSegment);
  EXPECT_THAT(r->second, ::testing::HasSubstr("not served here"));
  ExpectAlive();  // drained: the stream is in sync
  Send(WireOp::kRead, 0, 0, 8, "", segment_id_ + 1);
  r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kNoSegment);
  EXPECT_TRUE(r->second.find(std::string(8, '\x5a')) == std::string::npos);  // no data came back
  EXPECT_TRUE(Untouched());
  // With the right id the same write lands.
  Send(WireOp::kWrite, 0, 0, 8, std::string(8, 'w'));
  r = Receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first.status, WireStatus::kOk);
  EXPECT_EQ(std::string(static_cast<char*>(region_->data()), 8), std::string(8, 'w'));
}

TEST(TcpWireTest, HeadersRoundTripAndGarbageIsRejected) {
  RequestHeader h{WireOp::kWrite, 3, 17, 99, 1ull << 33, 4096, 0, 0xfeedface12345678ull};
  uint8_t buf[kRequestSize];
  EncodeRequest(h, buf);
  auto d = DecodeRequest(buf, sizeof buf);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->op, WireOp::kWrite);
  EXPECT_EQ(d->segment, 17u);
  EXPECT_EQ(d->segment_id, 0xfeedface12345678ull);
  EXPECT_EQ(d->id, 99u);
  EXPECT_EQ(d->offset, 1ull << 33);
  EXPECT_EQ(d->length, 4096u);
  EXPECT_FALSE(DecodeRequest(buf, sizeof buf - 1).ok());
  buf[4] = 9;  // unknown op
  EXPECT_FALSE(DecodeRequest(buf, sizeof buf).ok());
  buf[0] ^= 1;
  EXPECT_FALSE(DecodeRequest(buf, sizeof buf).ok());
  ReplyHeader rh{WireStatus::kOutOfRange, 5, 12};
  uint8_t rb[kReplySize];
  EncodeReply(rh, rb);
  auto rd = DecodeReply(rb, sizeof rb);
  ASSERT_TRUE(rd.ok());
  EXPECT_EQ(rd->status, WireStatus::kOutOfRange);
  rb[4] = 77;
  EXPECT_FALSE(DecodeReply(rb, sizeof rb).ok());
}

TEST(DescriptorTest, JsonRoundTripAndValidation) {
  SegmentDescriptor d;
  d.name = "node1:8800";
  d.host = "node1";
  d.host_id = "abc";
  d.segment_index = 3;
  d.segment_id = 0x8000000000000001ull;
  d.control = "10.0.0.1:8800";
  d.transports = {{"tcp", "10.0.0.1:8800"}, {"shm", "abc"}};
  d.buffers = {{0, 1 << 20, "cpu:0", {{"shm", "memfd"}}}, {1 << 20, 4096, "cuda:1", {}}};
  auto back = SegmentDescriptor::FromJson(d.ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ToJson(), d.ToJson());
  EXPECT_EQ(back->size(), (1u << 20) + 4096);
  EXPECT_TRUE(back->Locate(0, 1 << 20).ok());
  EXPECT_FALSE(back->Locate((1 << 20) - 1, 2).ok());  // straddles two buffers
  EXPECT_FALSE(back->Locate(UINT64_MAX, 2).ok());
  EXPECT_EQ(back->segment_id, d.segment_id);
  for (const char* bad : {"", "[]", "{}", "{\"name\":1}",
                          R"({"name":"a","host":"h","host_id":"i","control":"c","segment_index":1,"transports":{},"buffers":[]})",
                          R"({"name":"a","host":"h","host_id":"i","control":"c","segment_index":1,"segment_id":"7","transports":{},"buffers":[]})",
                          R"({"name":"a","host":"h","host_id":"i","control":"c","segment_index":-1,"segment_id":7,"transports":{},"buffers":[]})",
                          R"({"name":"a","host":"h","host_id":"i","control":"c","segment_index":1,"segment_id":7,"transports":{"tcp":5},"buffers":[]})",
                          R"({"name":"a","host":"h","host_id":"i","control":"c","segment_index":1,"segment_id":7,"transports":{},"buffers":[{"offset":18446744073709551615,"length":2}]})",
                          R"({"name":"a","host":"h","host_id":"i","control":"c","segment_index":1,"segment_id":7,"transports":{},"buffers":[{"offset":0,"length":2,"location":"gpu:0"}]})"}) {
    EXPECT_FALSE(SegmentDescriptor::FromJson(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace tierkv::transport::tcp

namespace tierkv::transport {
namespace {

size_t OpenFds() {
  size_t n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST(TcpFailures, DescriptorsStayFlatOverManyDeadPeers) {
  auto metadata = NewInMemoryMetadata();
  auto client = std::move(*TransferEngine::Create({.metadata = metadata, .transports = {"tcp"}}));
  auto region = std::move(*SharedRegion::Create(1 << 20, {}));
  std::vector<char> buf(64 << 10);
  size_t before = 0;
  for (int round = 0; round < 60; ++round) {
    {
      auto server = std::move(*TransferEngine::Create({.metadata = metadata, .transports = {"tcp"}}));
      ASSERT_OK(server->RegisterMemory(region->data(), region->size(), "cpu:0"));
      ASSERT_OK(server->ServeSegment("s", {region->data()}));
      ASSERT_OK(client->Transfer({{Op::kWrite, buf.data(), "s", 0, buf.size()}})[0]);
      // Kill the peer while a batch is in flight.
      std::vector<std::vector<char>> dst(16, std::vector<char>(buf.size()));
      std::vector<Request> reqs;
      for (auto& d : dst) reqs.push_back({Op::kRead, d.data(), "s", 0, d.size()});
      auto batch = client->Submit(reqs, absl::Seconds(5));
      server.reset();
      ASSERT_TRUE(batch->Wait(absl::Now() + absl::Seconds(10)));
    }
    EXPECT_FALSE(client->Transfer({{Op::kRead, buf.data(), "s", 0, 16}}, absl::Seconds(2))[0].ok());
    client->ForgetPeers();
    if (round == 9) before = OpenFds();  // after warm-up (worker threads, pools)
  }
  EXPECT_LE(OpenFds(), before + 2);
}

}  // namespace
}  // namespace tierkv::transport

namespace tierkv::transport {
namespace {

using ::tierkv::testing::StatusIs;

// A daemon restarts on the same address and serves another segment at the
// same index (indices start at 0 in every process). A client still holding
// the old segment's descriptor must be refused, and the new segment's
// memory must stay untouched.
TEST(TcpStaleDescriptor, WritesForARestartedServersOldSegmentAreRefusedUntouched) {
  constexpr uint64_t kLen = 1 << 20;
  auto metadata = NewInMemoryMetadata();
  auto client = std::move(*TransferEngine::Create({.metadata = metadata, .transports = {"tcp"}}));
  auto old_region = std::move(*SharedRegion::Create(kLen, {}));
  auto new_region = std::move(*SharedRegion::Create(kLen, {}));
  std::vector<char> buf(4096, 'x');
  int port = 0;
  {
    auto server = std::move(*TransferEngine::Create({.metadata = metadata, .transports = {"tcp"}}));
    ASSERT_OK(server->RegisterMemory(old_region->data(), kLen, "cpu:0"));
    ASSERT_OK(server->ServeSegment("a", {old_region->data()}));
    ASSERT_OK(client->Transfer({{Op::kWrite, buf.data(), "a", 0, buf.size()}})[0]);
    port = server->port();
  }
  EngineOptions o{.metadata = metadata, .transports = {"tcp"}};
  o.backend.port = port;
  auto restarted = TransferEngine::Create(o);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  std::memset(new_region->data(), 0x5a, kLen);
  ASSERT_OK((*restarted)->RegisterMemory(new_region->data(), kLen, "cpu:0"));
  ASSERT_OK((*restarted)->ServeSegment("b", {new_region->data()}));
  // The client's pooled connection to the old server fails first
  // (UNAVAILABLE); the next one reaches the restarted server.
  absl::Status st;
  for (int attempt = 0; attempt < 3; ++attempt) {
    st = client->Transfer({{Op::kWrite, buf.data(), "a", 0, buf.size()}}, absl::Seconds(5))[0];
    if (!absl::IsUnavailable(st)) break;
  }
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kNotFound));
  for (uint64_t i = 0; i < kLen; ++i) {
    ASSERT_EQ(static_cast<uint8_t>(new_region->data()[i]), 0x5a) << "byte " << i << " was written";
  }
  // The refusal also makes the client drop the stale descriptor: "a" is no
  // longer published, and it says so.
  EXPECT_THAT(client->Transfer({{Op::kRead, buf.data(), "a", 0, 16}}, absl::Seconds(5))[0],
              StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace tierkv::transport

#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "transport/tcp/connection.h"

namespace tierkv::transport::tcp {
namespace {

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
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(2));
    (void)::send(b.get(), "y", 1, 0);
  });
  t0 = absl::Now();
  EXPECT_TRUE(SpinUntilReadable(a.get(), absl::Seconds(5)));
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
      // 0, 1 and 30 ms between them.
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

}  // namespace
}  // namespace tierkv::transport::tcp

// --- Data grants (--auth token on a daemon) ----------------------------------

#include <functional>
#include <map>

#include "absl/strings/str_join.h"
#include "base/auth.h"

namespace tierkv::transport::tcp {
namespace {

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
