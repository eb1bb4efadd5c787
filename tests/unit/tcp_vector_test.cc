// Vectored tcp frames (WRITEV, READV; transport/tcp/wire.h): scattered
// small entries move through the engine byte for byte, the client groups
// them into vectored frames, and a server checks every range before it
// moves a byte: a frame with one bad range writes nothing, and hostile
// frames are refused without touching memory or stopping the server.
#include <sys/socket.h>

#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/net/socket.h"
#include "tests/support/status_matchers.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "transport/tcp/connection.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport::tcp {
namespace {

using net::Fd;
using net::ReadFull;
using net::WriteFull;

std::string Pattern(size_t n, uint64_t seed) {
  std::string v(n, '\0');
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(rng());
  return v;
}

uint64_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

std::unique_ptr<SharedRegion> Region(uint64_t size) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> r = SharedRegion::Create(size, {});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

TEST(TcpVectorWireTest, HeadersAndTablesAreCheckedAgainstTheLimits) {
  RequestHeader h;
  h.op = WireOp::kWriteV;
  h.offset = 2;
  h.length = 2 * kRangeBytes + 30;
  EXPECT_OK(CheckVectorHeader(h, 1 << 20));
  std::string table(2 * kRangeBytes, '\0');
  EncodeRange({100, 10}, reinterpret_cast<uint8_t*>(table.data()));
  EncodeRange({7, 20}, reinterpret_cast<uint8_t*>(table.data()) + kRangeBytes);
  std::vector<WireRange> ranges;
  absl::StatusOr<uint64_t> total = DecodeRanges(h, table, 1 << 20, &ranges);
  ASSERT_TRUE(total.ok()) << total.status();
  EXPECT_EQ(*total, 30u);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[1].offset, 7u);
  EXPECT_EQ(ranges[1].length, 20u);
  h.length += 1;  // one byte more than the ranges name
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeRanges(h, table, 1 << 20, &ranges).status()));
  EXPECT_TRUE(absl::IsResourceExhausted(CheckVectorHeader(h, 16)));  // data over the cap
  h.offset = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(CheckVectorHeader(h, 1 << 20)));
  h.offset = kMaxRanges + 1;
  h.length = h.offset * kRangeBytes;
  EXPECT_TRUE(absl::IsResourceExhausted(CheckVectorHeader(h, 1 << 20)));
  h.op = WireOp::kReadV;
  h.offset = 2;
  h.length = 2 * kRangeBytes;
  EXPECT_OK(CheckVectorHeader(h, 1 << 20));
  EXPECT_TRUE(absl::IsResourceExhausted(DecodeRanges(h, table, 29, &ranges).status()));  // reply over the cap
  h.length += 1;
  EXPECT_TRUE(absl::IsInvalidArgument(CheckVectorHeader(h, 1 << 20)));
}

// The P/D shape: 10,000 one-token entries (1,152 bytes) to every other
// slot at the peer, so none coalesce, written and read back over tcp.
TEST(TcpVectorEngineTest, ScatteredEntriesRoundTripByteIdentical) {
  constexpr uint64_t kEntries = 10000;
  constexpr uint64_t kEntry = 1152;
  constexpr uint64_t kSize = 2 * kEntries * kEntry + (1 << 20);
  EngineOptions o;
  o.peer_mode = true;
  o.transports = {"tcp"};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> prefill, TransferEngine::Create(o));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> decode, TransferEngine::Create(o));
  std::unique_ptr<SharedRegion> src = Region(kSize), dst = Region(kSize), back = Region(kSize);
  ASSERT_TRUE(src && dst && back);
  ASSERT_OK(prefill->RegisterMemory(src->data(), kSize, "cpu:0"));
  ASSERT_OK(prefill->RegisterMemory(back->data(), kSize, "cpu:0"));
  ASSERT_OK(decode->RegisterMemory(dst->data(), kSize, "cpu:0"));
  const std::string data = Pattern(kEntries * kEntry, 11);
  std::memcpy(src->data(), data.data(), data.size());
  std::memset(dst->data(), 0x5a, kSize);

  std::vector<Request> writes, reads;
  for (uint64_t i = 0; i < kEntries; ++i) {
    const uint64_t at = Addr(dst->data()) + 2 * i * kEntry;
    writes.push_back({Op::kWrite, src->data() + i * kEntry, decode->session_id(), at, kEntry});
    reads.push_back({Op::kRead, back->data() + i * kEntry, decode->session_id(), at, kEntry});
  }
  for (const absl::Status& s : prefill->Transfer(writes, absl::Seconds(60))) ASSERT_OK(s);
  for (uint64_t i = 0; i < kEntries; ++i) {
    ASSERT_EQ(std::memcmp(dst->data() + 2 * i * kEntry, data.data() + i * kEntry, kEntry), 0) << "entry " << i;
    // The slots between entries are untouched.
    ASSERT_EQ(dst->data()[(2 * i + 1) * kEntry], 0x5a) << "gap after entry " << i;
  }
  for (const absl::Status& s : prefill->Transfer(reads, absl::Seconds(60))) ASSERT_OK(s);
  EXPECT_EQ(std::memcmp(back->data(), data.data(), data.size()), 0);
  EXPECT_EQ(prefill->Stats().coalesced, 0u);  // scattered: every entry travelled as its own range
}

// A fake server on a socketpair that records each frame a Connection sends
// and answers OK (READ and READV with `fill` bytes).
struct Recorded {
  RequestHeader header;
  std::string payload;
  std::string grant;  // the extent grant after the header (kHasGrant)
};

class FakePeer {
 public:
  FakePeer(size_t frames, char fill) {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
    client_ = Fd(sv[0]);
    server_ = Fd(sv[1]);
    thread_ = std::thread([this, frames, fill] {
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      for (size_t i = 0; i < frames; ++i) {
        uint8_t head[kRequestSize];
        if (!ReadFull(server_.get(), head, sizeof head, deadline).ok()) return;
        absl::StatusOr<RequestHeader> h = DecodeRequest(head, sizeof head);
        if (!h.ok() || h->length > (64 << 20)) return;
        Recorded r{*h, std::string(h->length, '\0')};
        if (h->flags & kHasGrant) {
          r.grant.assign(kGrantBlockBytes, '\0');
          if (!ReadFull(server_.get(), r.grant.data(), r.grant.size(), deadline).ok()) return;
        }
        if (!ReadFull(server_.get(), r.payload.data(), r.payload.size(), deadline).ok()) return;
        uint64_t answer = 0;
        if (h->op == WireOp::kRead) answer = h->length;
        if (h->op == WireOp::kReadV) {
          for (uint64_t k = 0; k < h->offset; ++k) {
            answer += DecodeRange(reinterpret_cast<const uint8_t*>(r.payload.data()) + k * RangeEntryBytes(*h)).length;
          }
        }
        uint8_t reply[kReplySize];
        EncodeReply({WireStatus::kOk, h->id, answer}, reply);
        const std::string data(answer, fill);
        if (!WriteFull(server_.get(), reply, sizeof reply, deadline).ok() ||
            !WriteFull(server_.get(), data.data(), data.size(), deadline).ok()) {
          return;
        }
        frames_.push_back(std::move(r));
      }
    });
  }
  ~FakePeer() {
    if (thread_.joinable()) thread_.join();
  }
  Fd TakeClient() { return std::move(client_); }
  const std::vector<Recorded>& Join() {
    thread_.join();
    return frames_;
  }

 private:
  Fd client_, server_;
  std::thread thread_;
  std::vector<Recorded> frames_;
};

TEST(TcpVectorFramingTest, SmallScatteredSlicesGoAsOneVectoredFrame) {
  constexpr size_t kSlices = 64;
  constexpr uint64_t kEntry = 1152;
  const std::string data = Pattern(kSlices * kEntry, 3);
  std::vector<Slice> slices(kSlices);
  std::vector<Slice*> ptrs;
  for (size_t i = 0; i < kSlices; ++i) {
    slices[i] = {.op = Op::kWrite,
                 .local = const_cast<char*>(data.data()) + i * kEntry,
                 .remote_offset = 3 * i * kEntry,
                 .length = kEntry,
                 .epoch = 9};
    ptrs.push_back(&slices[i]);
  }
  FakePeer peer(1, 0);
  Connection conn(peer.TakeClient(), "fake");
  conn.RunBatch(4, 77, ptrs, absl::Now() + absl::Seconds(10));
  const std::vector<Recorded>& frames = peer.Join();
  for (const Slice& s : slices) EXPECT_OK(s.status);
  ASSERT_EQ(frames.size(), 1u);
  const RequestHeader& h = frames[0].header;
  EXPECT_EQ(h.op, WireOp::kWriteV);
  EXPECT_EQ(h.segment, 4u);
  EXPECT_EQ(h.segment_id, 77u);
  EXPECT_EQ(h.epoch, 9u);
  EXPECT_TRUE(h.flags & kHasDeadline);
  EXPECT_EQ(h.offset, kSlices);
  ASSERT_EQ(h.length, kSlices * kRangeBytes + data.size());
  for (size_t i = 0; i < kSlices; ++i) {
    const WireRange r = DecodeRange(reinterpret_cast<const uint8_t*>(frames[0].payload.data()) + i * kRangeBytes);
    EXPECT_EQ(r.offset, 3 * i * kEntry);
    EXPECT_EQ(r.length, kEntry);
  }
  EXPECT_EQ(frames[0].payload.substr(kSlices * kRangeBytes), data);
  EXPECT_FALSE(conn.broken());
}

// Slices under extent grants: a plain frame carries its slice's grant after
// the header; a vectored one carries each range's in its table; a read
// joins the read before it (a value's trailer) only under the same grant.
TEST(TcpVectorFramingTest, EachSliceCarriesItsExtentGrant) {
  std::string small(4096, 's'), large(1 << 20, 'L'), in(100, '\0'), tail(16, '\0'), other(16, '\0');
  const std::string g1(kGrantBlockBytes, '1'), g2(kGrantBlockBytes, '2'), g3(kGrantBlockBytes, '3');
  std::vector<Slice> slices = {
      {.op = Op::kWrite, .local = small.data(), .remote_offset = 0, .length = 100},
      {.op = Op::kWrite, .local = small.data(), .remote_offset = 8192, .length = 100},
      {.op = Op::kWrite, .local = large.data(), .remote_offset = 1 << 20, .length = large.size()},
      {.op = Op::kRead, .local = in.data(), .remote_offset = 5000, .length = in.size()},
      {.op = Op::kRead, .local = tail.data(), .remote_offset = 5100, .length = tail.size()},    // its trailer
      {.op = Op::kRead, .local = other.data(), .remote_offset = 5116, .length = other.size()},  // another's
  };
  slices[0].set_grant(g1);
  slices[1].set_grant(g2);
  slices[2].set_grant(g3);
  slices[3].set_grant(g1);
  slices[4].set_grant(g1);
  slices[5].set_grant(g2);
  std::vector<Slice*> ptrs;
  for (Slice& s : slices) ptrs.push_back(&s);
  FakePeer peer(3, 'r');
  Connection conn(peer.TakeClient(), "fake");
  conn.RunBatch(0, 1, ptrs, absl::Now() + absl::Seconds(10));
  const std::vector<Recorded>& frames = peer.Join();
  for (const Slice& s : slices) EXPECT_OK(s.status);
  ASSERT_EQ(frames.size(), 3u);
  const RequestHeader& wv = frames[0].header;
  EXPECT_EQ(wv.op, WireOp::kWriteV);
  EXPECT_TRUE(wv.flags & kRangeGrants);
  EXPECT_FALSE(wv.flags & kHasGrant);
  ASSERT_EQ(wv.length, 2 * (kRangeBytes + kGrantBlockBytes) + 200);
  EXPECT_EQ(frames[0].payload.substr(kRangeBytes, kGrantBlockBytes), g1);
  EXPECT_EQ(frames[0].payload.substr(2 * kRangeBytes + kGrantBlockBytes, kGrantBlockBytes), g2);
  EXPECT_EQ(DecodeRange(reinterpret_cast<const uint8_t*>(frames[0].payload.data()) + kRangeBytes + kGrantBlockBytes)
                .offset,
            8192u);
  EXPECT_EQ(frames[1].header.op, WireOp::kWrite);
  EXPECT_TRUE(frames[1].header.flags & kHasGrant);
  EXPECT_EQ(frames[1].grant, g3);
  // The other key's read, adjacent but under another grant, does not join
  // the value and its trailer: the three go as a vectored frame, each range
  // with its grant.
  EXPECT_EQ(frames[2].header.op, WireOp::kReadV);
  ASSERT_EQ(frames[2].header.offset, 3u);
  const size_t entry = kRangeBytes + kGrantBlockBytes;
  EXPECT_EQ(frames[2].payload.substr(kRangeBytes, kGrantBlockBytes), g1);
  EXPECT_EQ(frames[2].payload.substr(entry + kRangeBytes, kGrantBlockBytes), g1);
  EXPECT_EQ(frames[2].payload.substr(2 * entry + kRangeBytes, kGrantBlockBytes), g2);
  EXPECT_EQ(in, std::string(100, 'r'));
  EXPECT_EQ(other, std::string(16, 'r'));
}

TEST(TcpVectorFramingTest, LargeSlicesEpochsAndOpsSplitTheGroups) {
  std::string small(4096, 's'), large(1 << 20, 'L');
  std::string in_a(100, '\0'), in_b(200, '\0');
  std::vector<Slice> slices = {
      {.op = Op::kWrite, .local = small.data(), .remote_offset = 0, .length = 100, .epoch = 1},
      {.op = Op::kWrite, .local = small.data(), .remote_offset = 1000, .length = 100, .epoch = 1},
      {.op = Op::kWrite, .local = small.data(), .remote_offset = 2000, .length = 100, .epoch = 2},  // new epoch
      {.op = Op::kWrite, .local = large.data(), .remote_offset = 1 << 20, .length = large.size(), .epoch = 2},
      {.op = Op::kRead, .local = in_a.data(), .remote_offset = 5000, .length = in_a.size()},
      {.op = Op::kRead, .local = in_b.data(), .remote_offset = 9000, .length = in_b.size()},
  };
  std::vector<Slice*> ptrs;
  for (Slice& s : slices) ptrs.push_back(&s);
  FakePeer peer(4, 'r');
  Connection conn(peer.TakeClient(), "fake");
  conn.RunBatch(0, 1, ptrs, absl::Now() + absl::Seconds(10));
  const std::vector<Recorded>& frames = peer.Join();
  for (const Slice& s : slices) EXPECT_OK(s.status);
  ASSERT_EQ(frames.size(), 4u);
  EXPECT_EQ(frames[0].header.op, WireOp::kWriteV);
  EXPECT_EQ(frames[0].header.offset, 2u);
  EXPECT_EQ(frames[0].header.epoch, 1u);
  EXPECT_EQ(frames[1].header.op, WireOp::kWrite);  // alone under epoch 2: a plain WRITE
  EXPECT_EQ(frames[1].header.offset, 2000u);
  EXPECT_EQ(frames[2].header.op, WireOp::kWrite);  // too large to share a frame
  EXPECT_EQ(frames[2].header.length, large.size());
  EXPECT_EQ(frames[3].header.op, WireOp::kReadV);
  EXPECT_EQ(frames[3].header.offset, 2u);
  EXPECT_EQ(frames[3].header.length, 2 * kRangeBytes);
  EXPECT_EQ(in_a, std::string(100, 'r'));
  EXPECT_EQ(in_b, std::string(200, 'r'));
}

// Raw frames against a served segment.
constexpr uint64_t kSize = 1 << 20;

class TcpVectorFramesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    metadata_ = NewInMemoryMetadata();
    region_ = Region(kSize);
    ASSERT_TRUE(region_);
    EngineOptions o;
    o.metadata = metadata_;
    o.transports = {"tcp"};
    o.backend.max_frame = 512 << 10;
    ASSERT_OK_AND_ASSIGN(server_, TransferEngine::Create(o));
    ASSERT_OK(server_->RegisterMemory(region_->data(), kSize, "cpu:0"));
    ASSERT_OK(server_->ServeSegment("seg", {region_->data()}));
    auto desc = SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey("seg")));
    ASSERT_TRUE(desc.ok()) << desc.status();
    segment_id_ = desc->segment_id;
    std::memset(region_->data(), 0x5a, kSize);
    Connect();
  }
  void Connect() {
    auto fd = net::Dial("127.0.0.1:" + std::to_string(server_->port()), Deadline());
    ASSERT_TRUE(fd.ok()) << fd.status();
    fd_ = std::move(*fd);
  }
  static absl::Time Deadline() { return absl::Now() + absl::Seconds(5); }

  static std::string Table(const std::vector<WireRange>& ranges) {
    std::string t(ranges.size() * kRangeBytes, '\0');
    for (size_t i = 0; i < ranges.size(); ++i) {
      EncodeRange(ranges[i], reinterpret_cast<uint8_t*>(t.data()) + i * kRangeBytes);
    }
    return t;
  }
  // Sends one frame: its header (`count` in the offset field) and payload.
  void SendFrame(WireOp op, uint64_t count, uint64_t length, const std::string& payload, uint64_t epoch = 0,
                 std::optional<absl::Time> deadline = std::nullopt) {
    RequestHeader h;
    h.op = op;
    h.segment = segment_;
    h.segment_id = segment_id_;
    h.id = ++id_;
    h.offset = count;
    h.length = length;
    h.epoch = epoch;
    if (deadline) {
      h.flags = kHasDeadline;
      h.deadline_ms32 = DeadlineMs32(*deadline);
    }
    uint8_t buf[kRequestSize];
    EncodeRequest(h, buf);
    ASSERT_OK(WriteFull(fd_.get(), buf, sizeof buf, Deadline()));
    if (!payload.empty()) {
      ASSERT_OK(WriteFull(fd_.get(), payload.data(), payload.size(), Deadline()));
    }
  }
  // A well-formed WRITEV of `ranges` with `data`.
  void WriteV(const std::vector<WireRange>& ranges, const std::string& data, uint64_t epoch = 0,
              std::optional<absl::Time> deadline = std::nullopt) {
    const std::string payload = Table(ranges) + data;
    SendFrame(WireOp::kWriteV, ranges.size(), payload.size(), payload, epoch, deadline);
  }
  absl::StatusOr<std::pair<ReplyHeader, std::string>> Receive() {
    uint8_t buf[kReplySize];
    if (absl::Status s = ReadFull(fd_.get(), buf, sizeof buf, Deadline()); !s.ok()) return s;
    auto h = DecodeReply(buf, sizeof buf);
    if (!h.ok()) return h.status();
    if (h->id != id_) return absl::InternalError("reply to another request");
    if (h->length > kSize) return absl::InternalError("reply too long");
    std::string payload(h->length, '\0');
    if (absl::Status s = ReadFull(fd_.get(), payload.data(), payload.size(), Deadline()); !s.ok()) return s;
    return std::make_pair(*h, payload);
  }
  WireStatus Status() {
    auto r = Receive();
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->first.status : WireStatus::kInternal;
  }
  void ExpectAlive() {
    SendFrame(WireOp::kPing, 0, 0, "");
    EXPECT_EQ(Status(), WireStatus::kOk);
  }
  void ExpectClosed() {
    char c;
    EXPECT_FALSE(ReadFull(fd_.get(), &c, 1, Deadline()).ok()) << "the server kept the connection";
  }
  bool Untouched() const {
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
  uint32_t segment_ = 0;
  uint64_t segment_id_ = 0;
};

TEST_F(TcpVectorFramesTest, WriteVAndReadVRoundTrip) {
  const std::vector<WireRange> ranges = {{4096, 10}, {100, 5}, {kSize - 7, 7}, {50, 0}};
  const std::string data = "0123456789abcdeTAIL!!!";
  WriteV(ranges, data);
  EXPECT_EQ(Status(), WireStatus::kOk);
  EXPECT_EQ(std::string(region_->data() + 4096, 10), "0123456789");
  EXPECT_EQ(std::string(region_->data() + 100, 5), "abcde");
  EXPECT_EQ(std::string(region_->data() + kSize - 7, 7), "TAIL!!!");
  EXPECT_EQ(region_->data()[4096 + 10], 0x5a);
  const std::string table = Table(ranges);
  SendFrame(WireOp::kReadV, ranges.size(), table.size(), table);
  auto r = Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first.status, WireStatus::kOk);
  EXPECT_EQ(r->second, data);
}

TEST_F(TcpVectorFramesTest, ReadVRepliesLargerThanAStagingChunkArriveWhole) {
  // 200 ranges of 2,000 bytes: the reply is staged in two chunks.
  std::vector<WireRange> ranges;
  for (uint64_t i = 0; i < 200; ++i) ranges.push_back({(199 - i) * 4000, 2000});
  const std::string data = Pattern(200 * 2000, 5);
  WriteV(ranges, data);
  ASSERT_EQ(Status(), WireStatus::kOk);
  const std::string table = Table(ranges);
  SendFrame(WireOp::kReadV, ranges.size(), table.size(), table);
  auto r = Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first.status, WireStatus::kOk);
  EXPECT_TRUE(r->second == data);
}

TEST_F(TcpVectorFramesTest, OneRangeOutOfBoundsWritesNothing) {
  const std::vector<WireRange> ranges = {{0, 8}, {kSize - 4, 8}, {64, 8}};
  WriteV(ranges, std::string(24, 'w'));
  auto r = Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first.status, WireStatus::kOutOfRange);
  EXPECT_THAT(r->second, ::testing::HasSubstr("range 1 of 3"));
  EXPECT_TRUE(Untouched());
  ExpectAlive();  // the data was drained: the stream is in sync
  // The same ranges, fixed, land.
  WriteV({{0, 8}, {kSize - 8, 8}, {64, 8}}, std::string(24, 'w'));
  EXPECT_EQ(Status(), WireStatus::kOk);
  EXPECT_EQ(std::string(region_->data() + kSize - 8, 8), std::string(8, 'w'));
  // A READV with one bad range sends no data.
  const std::string table = Table({{0, 8}, {kSize, 1}});
  SendFrame(WireOp::kReadV, 2, table.size(), table);
  r = Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first.status, WireStatus::kOutOfRange);
  ExpectAlive();
}

TEST_F(TcpVectorFramesTest, LateStaleAndForeignWriteVsAreRefusedUntouched) {
  WriteV({{0, 8}, {16, 8}}, std::string(16, 'L'), 0, absl::Now() - absl::Milliseconds(5));
  EXPECT_EQ(Status(), WireStatus::kExpired);
  server_->ObserveEpoch(20);
  WriteV({{0, 8}, {16, 8}}, std::string(16, 'S'), 7);
  EXPECT_EQ(Status(), WireStatus::kStaleEpoch);
  segment_id_ ^= 1;
  WriteV({{0, 8}, {16, 8}}, std::string(16, 'F'));
  EXPECT_EQ(Status(), WireStatus::kNoSegment);
  EXPECT_TRUE(Untouched());
  ExpectAlive();
}

TEST_F(TcpVectorFramesTest, HostileShapesAreRefusedAndTheConnectionKeptWhereItCanBe) {
  // Ranges whose ends overflow: out of range, drained, kept.
  WriteV({{0, 4}, {UINT64_MAX - 5, 10}}, std::string(14, 'o'));
  EXPECT_EQ(Status(), WireStatus::kOutOfRange);
  ExpectAlive();
  // Lengths whose sum overflows: the table cannot match the payload.
  WriteV({{0, 1ull << 63}, {0, 1ull << 63}, {0, 4}}, "abcd");
  EXPECT_EQ(Status(), WireStatus::kBadRequest);
  ExpectAlive();
  // A table that promises more data than the frame carries, and less.
  WriteV({{0, 100}}, std::string(50, 'x'));
  EXPECT_EQ(Status(), WireStatus::kBadRequest);
  ExpectAlive();
  WriteV({{0, 10}}, std::string(50, 'x'));
  EXPECT_EQ(Status(), WireStatus::kBadRequest);
  ExpectAlive();
  // A READV asking for more than the frame cap.
  std::string table = Table({{0, kSize}});
  SendFrame(WireOp::kReadV, 1, table.size(), table);
  EXPECT_EQ(Status(), WireStatus::kTooLarge);
  ExpectAlive();
  EXPECT_TRUE(Untouched());

  // Shapes that cannot be followed close the connection after the reply.
  SendFrame(WireOp::kWriteV, kMaxRanges + 1, (kMaxRanges + 1) * kRangeBytes, "");
  EXPECT_EQ(Status(), WireStatus::kTooLarge);
  ExpectClosed();
  Connect();
  SendFrame(WireOp::kWriteV, 0, 0, "");
  EXPECT_EQ(Status(), WireStatus::kBadRequest);
  ExpectClosed();
  Connect();
  SendFrame(WireOp::kWriteV, 4, 3 * kRangeBytes, "");  // too short for its table
  EXPECT_EQ(Status(), WireStatus::kBadRequest);
  ExpectClosed();
  Connect();
  SendFrame(WireOp::kReadV, 1, kRangeBytes + 5, "");  // a READV carries its table only
  EXPECT_EQ(Status(), WireStatus::kBadRequest);
  ExpectClosed();
  Connect();
  SendFrame(WireOp::kWriteV, 1, kRangeBytes + (1ull << 40), "");  // data over the frame cap
  EXPECT_EQ(Status(), WireStatus::kTooLarge);
  ExpectClosed();
  Connect();
  ExpectAlive();
  EXPECT_TRUE(Untouched());
}

TEST_F(TcpVectorFramesTest, RangesInDifferentBuffersMoveOneAtATime) {
  // A segment of two buffers, the second at segment offset 64 KiB, and
  // ranges alternating between them: no one pin covers a run of them.
  constexpr uint64_t kBuffer = 64 << 10;
  std::unique_ptr<SharedRegion> a = Region(kBuffer), b = Region(kBuffer);
  ASSERT_TRUE(a && b);
  ASSERT_OK(server_->RegisterMemory(a->data(), kBuffer, "cpu:0"));
  ASSERT_OK(server_->RegisterMemory(b->data(), kBuffer, "cpu:0"));
  ASSERT_OK(server_->ServeSegment("two", {a->data(), b->data()}));
  auto desc = SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey("two")));
  ASSERT_TRUE(desc.ok()) << desc.status();
  segment_ = desc->segment_index;
  segment_id_ = desc->segment_id;
  std::vector<WireRange> ranges;
  for (uint64_t i = 0; i < 160; ++i) ranges.push_back({(i % 2) * kBuffer + (i / 2) * 800, 800});
  const std::string data = Pattern(160 * 800, 8);  // more than one scratch buffer's worth
  WriteV(ranges, data);
  ASSERT_EQ(Status(), WireStatus::kOk);
  for (uint64_t i = 0; i < 160; ++i) {
    const char* at = (i % 2 ? b : a)->data() + (i / 2) * 800;
    ASSERT_EQ(std::memcmp(at, data.data() + i * 800, 800), 0) << "range " << i;
  }
  const std::string table = Table(ranges);
  SendFrame(WireOp::kReadV, ranges.size(), table.size(), table);
  auto r = Receive();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first.status, WireStatus::kOk);
  EXPECT_TRUE(r->second == data);
  // A range across the two buffers refuses its frame.
  WriteV({{0, 8}, {kBuffer - 4, 8}}, std::string(16, 'x'));
  EXPECT_EQ(Status(), WireStatus::kOutOfRange);
  EXPECT_EQ(std::memcmp(a->data(), data.data(), 8), 0);
  ExpectAlive();
}

TEST_F(TcpVectorFramesTest, TheTableAndDataMayTrickleInPieces) {
  // Byte by byte, so every stage parks and resumes mid-table and mid-range.
  const std::vector<WireRange> ranges = {{300, 3}, {10, 4}, {2000, 2}};
  const std::string payload = Table(ranges) + "abcdefghi";
  RequestHeader h;
  h.op = WireOp::kWriteV;
  h.segment_id = segment_id_;
  h.id = ++id_;
  h.offset = ranges.size();
  h.length = payload.size();
  uint8_t buf[kRequestSize];
  EncodeRequest(h, buf);
  ASSERT_OK(WriteFull(fd_.get(), buf, sizeof buf, Deadline()));
  for (char c : payload) ASSERT_OK(WriteFull(fd_.get(), &c, 1, Deadline()));
  EXPECT_EQ(Status(), WireStatus::kOk);
  EXPECT_EQ(std::string(region_->data() + 300, 3), "abc");
  EXPECT_EQ(std::string(region_->data() + 10, 4), "defg");
  EXPECT_EQ(std::string(region_->data() + 2000, 2), "hi");
}

}  // namespace
}  // namespace tierkv::transport::tcp
