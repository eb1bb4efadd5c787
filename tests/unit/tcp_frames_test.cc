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

using net::Dial;
using net::Fd;
using net::ReadFull;
using net::WriteFull;

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
