// One suite that every transport backend must pass: the in-process fake
// (loopback), tcp, tcp over TLS (--data-tls), shm, and rdma over the fake
// fabric (two NICs). Two
// engines in this process: one serves a segment, the other is the client
// restricted to the transport under test. Local buffers come from memory
// registered with the client engine, as rdma requires.
#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tls_certs.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "base/net/socket.h"
#include "transport/tcp/wire.h"

namespace tierkv::transport {
namespace {

using ::tierkv::testing::StatusIs;

constexpr uint64_t kSegmentSize = 160ull << 20;

uint64_t Checksum(const char* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint8_t>(p[i])) * 1099511628211ull;
  return h;
}

std::vector<char> Pattern(size_t n, uint64_t seed) {
  std::vector<char> v(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

// Certificates for the "tls" case, made once per process.
const testing::TestCerts& Certs() {
  static const testing::TestCerts* certs = [] {
    absl::StatusOr<testing::TestCerts> c = testing::MakeTestCerts(testing::MakeTempDir("tierkv-data-tls"));
    if (!c.ok()) ADD_FAILURE() << c.status();
    return new testing::TestCerts(c.ok() ? *c : testing::TestCerts{});
  }();
  return *certs;
}

// The engine options for a case: "tls" is tcp with the server on TLS and
// the client trusting its CA.
EngineOptions OptionsFor(const std::string& param, bool server) {
  EngineOptions o;
  o.transports = {param == "tls" ? "tcp" : param};
  if (param == "tls") {
    o.backend.tls = {Certs().ca, server ? Certs().server_cert : "", server ? Certs().server_key : ""};
    o.backend.serve_tls = server;
  }
  return o;
}

class TransportConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    metadata_ = NewInMemoryMetadata();
    auto region = SharedRegion::Create(kSegmentSize, {});
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = std::move(*region);
    StartServer();
    EngineOptions c = OptionsFor(GetParam(), /*server=*/false);
    c.metadata = metadata_;
    auto client = TransferEngine::Create(c);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    arena_.reset(new char[kArena]);
    ASSERT_OK(client_->RegisterMemory(arena_.get(), kArena, "cpu:0"));
  }

  // `n` bytes of registered local memory (a bump allocator over the arena).
  char* Local(size_t n) {
    char* p = arena_.get() + used_;
    used_ += (n + 63) & ~size_t{63};
    EXPECT_LE(used_, kArena);
    return p;
  }
  char* LocalPattern(size_t n, uint64_t seed) {
    char* p = Local(n);
    std::vector<char> v = Pattern(n, seed);
    std::memcpy(p, v.data(), n);
    return p;
  }

  void StartServer(SharedRegion* region = nullptr) {
    if (region == nullptr) region = region_.get();
    EngineOptions s = OptionsFor(GetParam(), /*server=*/true);
    s.metadata = metadata_;
    auto server = TransferEngine::Create(s);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_OK(server_->RegisterMemory(region->data(), region->size(), "cpu:0", region->fd()));
    ASSERT_OK(server_->ServeSegment("seg", {region->data()}));
  }

  std::vector<absl::Status> Do(Op op, char* local, uint64_t offset, uint64_t length) {
    return client_->Transfer({{op, local, "seg", offset, length}}, absl::Seconds(20));
  }

  std::shared_ptr<MetadataClient> metadata_;
  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<TransferEngine> server_;
  std::unique_ptr<TransferEngine> client_;
  static constexpr size_t kArena = 200ull << 20;
  std::unique_ptr<char[]> arena_;
  size_t used_ = 0;
};

TEST_P(TransportConformance, RoundTripsFromOneByteTo64MiB) {
  uint64_t offset = 12345;
  for (uint64_t size : {1ull, 7ull, 4096ull, 65537ull, 1ull << 20, (4ull << 20) + 3, 64ull << 20}) {
    char* out = LocalPattern(size, size);
    char* in = Local(size);
    ASSERT_OK(Do(Op::kWrite, out, offset, size)[0]) << size;
    // The bytes really are in the served memory...
    EXPECT_EQ(Checksum(region_->data() + offset, size), Checksum(out, size)) << size;
    // ... and come back.
    ASSERT_OK(Do(Op::kRead, in, offset, size)[0]) << size;
    EXPECT_EQ(Checksum(in, size), Checksum(out, size)) << size;
    offset += size + 1;
  }
  EngineStats st = client_->Stats();
  EXPECT_GT(st.bytes_written, 64u << 20);
  EXPECT_GT(st.bytes_read, 64u << 20);
}

// A read or a write may ask for the CRC32C of its bytes: a transport that
// works it out as it copies (shm) gives exactly the checksum of what
// landed, and the engine's hint says so once the peer has been reached;
// the others leave it unset, and so does every transport for a request of
// more than one slice.
TEST_P(TransportConformance, ACopiedChecksumIsTheChecksumOfTheBytesOrUnset) {
  uint64_t offset = 777;
  const bool sets = GetParam() == "shm";
  EXPECT_FALSE(client_->ChecksumsCopies("seg", 1));  // not reached yet: no hint
  for (uint64_t size : {1ull, 4096ull, 100001ull, 1ull << 20, (4ull << 20) + 3}) {
    char* out = LocalPattern(size, size + 1);
    char* in = Local(size);
    CopyCrc wrote;
    ASSERT_OK(client_->Transfer({{Op::kWrite, out, "seg", offset, size, &wrote}}, absl::Seconds(20))[0]) << size;
    EXPECT_EQ(client_->ChecksumsCopies("seg", size), sets && size <= EngineOptions{}.slice_size);
    EXPECT_EQ(std::memcmp(region_->data() + offset, out, size), 0) << size;
    const bool one_slice_write = size <= EngineOptions{}.slice_size;
    EXPECT_EQ(wrote.set, sets && one_slice_write) << size;
    if (wrote.set) EXPECT_EQ(wrote.value, Crc32c(out, size)) << size;
    CopyCrc crc;
    ASSERT_OK(client_->Transfer({{Op::kRead, in, "seg", offset, size, &crc}}, absl::Seconds(20))[0]) << size;
    EXPECT_EQ(std::memcmp(in, out, size), 0) << size;
    const bool one_slice = size <= EngineOptions{}.slice_size;
    if (GetParam() == "shm" && one_slice) EXPECT_TRUE(crc.set) << size;
    if (!one_slice) EXPECT_FALSE(crc.set) << size;
    if (crc.set) EXPECT_EQ(crc.value, Crc32c(in, size)) << size;
    offset += size + 1;
  }
}

// A single get is its value and its 8-byte trailer: SubmitHere moves both
// on the caller's thread (a worker's wake-up costs more than the move), so
// the batch is over when it returns, for a transport that promises to end
// by its deadline. A batch worth splitting still finishes whole.
TEST_P(TransportConformance, SubmitHereMovesASmallBatchOnTheCallersThread) {
  const uint64_t value = 1 << 20;
  char* out = LocalPattern(value + 8, 99);
  ASSERT_OK(Do(Op::kWrite, out, 0, value + 8)[0]);
  char* in = Local(value + 8);
  std::shared_ptr<Batch> b = client_->SubmitHere(
      {{Op::kRead, in, "seg", 0, value}, {Op::kRead, in + value, "seg", value, 8}}, absl::Seconds(20));
  if (GetParam() == "tcp" || GetParam() == "shm") EXPECT_TRUE(b->Done());
  ASSERT_TRUE(b->Wait(absl::Now() + absl::Seconds(30)));
  for (const absl::Status& st : b->statuses()) EXPECT_OK(st);
  EXPECT_EQ(std::memcmp(in, out, value + 8), 0);
  std::vector<Request> many;
  char* big = Local(8 * value);
  for (uint64_t i = 0; i < 8; ++i) many.push_back({Op::kRead, big + i * value, "seg", i * value, value});
  b = client_->SubmitHere(std::move(many), absl::Seconds(20));
  ASSERT_TRUE(b->Wait(absl::Now() + absl::Seconds(30)));
  for (const absl::Status& st : b->statuses()) EXPECT_OK(st);
  EXPECT_EQ(Checksum(big, 8 * value), Checksum(region_->data(), 8 * value));
}

TEST_P(TransportConformance, BatchesOfOneTo1024Requests) {
  for (size_t n : {1u, 16u, 1024u}) {
    constexpr uint64_t kBlock = 4096 + 64;
    char* out = LocalPattern(n * kBlock, n);
    char* in = Local(n * kBlock);
    std::vector<Request> writes, reads;
    for (size_t i = 0; i < n; ++i) {
      // Scatter: request i goes to a distinct, non-adjacent remote place.
      uint64_t remote = (n - 1 - i) * 2 * kBlock;
      writes.push_back({Op::kWrite, out + i * kBlock, "seg", remote, kBlock});
      reads.push_back({Op::kRead, in + i * kBlock, "seg", remote, kBlock});
    }
    for (const absl::Status& s : client_->Transfer(writes)) ASSERT_OK(s);
    std::vector<absl::Status> got = client_->Transfer(reads);
    ASSERT_EQ(got.size(), n);
    for (const absl::Status& s : got) ASSERT_OK(s);
    EXPECT_EQ(std::memcmp(in, out, n * kBlock), 0) << n;
  }
}

TEST_P(TransportConformance, OutOfRangeAndOverflowingOffsetsAreRefused) {
  char* buf = Local(64);
  std::memset(buf, 'x', 64);
  std::vector<char> tail_before(region_->data() + kSegmentSize - 4096, region_->data() + kSegmentSize);
  EXPECT_THAT(Do(Op::kWrite, buf, kSegmentSize, 1)[0], StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(Do(Op::kWrite, buf, kSegmentSize - 10, 20)[0], StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(Do(Op::kWrite, buf, UINT64_MAX - 5, 10)[0], StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(Do(Op::kRead, buf, 10, UINT64_MAX - 5)[0], StatusIs(absl::StatusCode::kOutOfRange));
  std::vector<char> tail_after(region_->data() + kSegmentSize - 4096, region_->data() + kSegmentSize);
  EXPECT_EQ(tail_before, tail_after);  // no byte touched
  // Good requests in the same batch as bad ones still work.
  char* a = Local(100);
  std::memset(a, 'a', 100);
  auto st = client_->Transfer({{Op::kWrite, a, "seg", kSegmentSize + 1, 100},
                               {Op::kWrite, a, "seg", 0, 100}});
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_OK(st[1]);
  // Unknown segment and a null buffer are per-request errors too.
  EXPECT_THAT(client_->Transfer({{Op::kRead, a, "nope", 0, 1}})[0],
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(client_->Transfer({{Op::kRead, nullptr, "seg", 0, 1}})[0],
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Reads that follow one another in the segment but land in separate local
// buffers (a value and its trailer; runs of small records) each get their
// own bytes, though a transport may move them in one request (tcp joins a
// small read to the one it follows and scatters the reply). A joined read
// that runs out of the segment fails; the one it joined may fail with it.
TEST_P(TransportConformance, AdjacentReadsOfOneBatchEachGetTheirOwnBytes) {
  constexpr uint64_t kBase = 1000, kValue = (1 << 20) + 3, kTotal = 2 << 20;
  char* out = LocalPattern(kTotal, 77);
  ASSERT_OK(Do(Op::kWrite, out, kBase, kTotal)[0]);
  struct Read {
    uint64_t at, length;  // within what was written
  };
  std::vector<Read> plan = {{0, kValue}, {kValue, 16}};
  uint64_t at = kValue + 16;
  for (int i = 0; i < 100; ++i, at += 37) plan.push_back({at, 37});  // more than one request takes
  at += 5;                                                            // a gap
  plan.push_back({at, 4097});                                         // too large to join
  at += 4097;
  plan.push_back({at, 4096});
  std::vector<Request> reads;
  std::vector<char*> into;
  for (const Read& r : plan) {
    into.push_back(Local(r.length));
    std::memset(into.back(), 0, r.length);
    reads.push_back({Op::kRead, into.back(), "seg", kBase + r.at, r.length});
  }
  std::vector<absl::Status> got = client_->Transfer(reads, absl::Seconds(20));
  ASSERT_EQ(got.size(), plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    ASSERT_OK(got[i]) << i;
    EXPECT_EQ(std::memcmp(into[i], out + plan[i].at, plan[i].length), 0) << "read " << i;
  }

  char* value = Local(100);
  char* trailer = Local(16);
  got = client_->Transfer({{Op::kRead, value, "seg", kSegmentSize - 100, 100},
                           {Op::kRead, trailer, "seg", kSegmentSize, 16}});
  EXPECT_THAT(got[1], StatusIs(absl::StatusCode::kOutOfRange));
  if (got[0].ok()) {
    EXPECT_EQ(std::memcmp(value, region_->data() + kSegmentSize - 100, 100), 0);
  } else {
    EXPECT_THAT(got[0], StatusIs(absl::StatusCode::kOutOfRange));
  }
}

TEST_P(TransportConformance, ZeroLengthRequestsSucceedAndTouchNothing) {
  region_->data()[0] = 'q';
  auto st = client_->Transfer({{Op::kWrite, nullptr, "seg", 0, 0}, {Op::kRead, nullptr, "seg", kSegmentSize, 0}});
  EXPECT_OK(st[0]);
  EXPECT_OK(st[1]);
  EXPECT_EQ(region_->data()[0], 'q');
}

TEST_P(TransportConformance, ConcurrentSubmitters) {
  constexpr int kThreads = 4;
  constexpr uint64_t kBlock = 256 << 10;
  std::atomic<int> bad{0};
  std::vector<char*> bufs;
  for (int t = 0; t < kThreads; ++t) bufs.push_back(Local(8 * kBlock));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      char* out = bufs[t];
      char* in = bufs[t] + 4 * kBlock;
      for (int iter = 0; iter < 20; ++iter) {
        std::vector<char> pattern = Pattern(4 * kBlock, t * 1000 + iter);
        std::memcpy(out, pattern.data(), pattern.size());
        std::vector<Request> w, r;
        for (int k = 0; k < 4; ++k) {
          uint64_t remote = (t * 4 + k) * kBlock;
          w.push_back({Op::kWrite, out + k * kBlock, "seg", remote, kBlock});
          r.push_back({Op::kRead, in + k * kBlock, "seg", remote, kBlock});
        }
        for (auto& s : client_->Transfer(w)) bad += !s.ok();
        for (auto& s : client_->Transfer(r)) bad += !s.ok();
        bad += std::memcmp(in, out, 4 * kBlock) != 0;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_P(TransportConformance, PeerKilledMidBatchFailsWithinDeadline) {
  constexpr int kRequests = 256;
  constexpr uint64_t kBlock = 512 << 10;
  char* local = Local(kRequests * kBlock);
  std::vector<Request> reqs;
  for (int i = 0; i < kRequests; ++i) reqs.push_back({Op::kRead, local + i * kBlock, "seg", i * kBlock, kBlock});
  absl::Time start = absl::Now();
  std::shared_ptr<Batch> batch = client_->Submit(reqs, absl::Seconds(5));
  server_.reset();  // the peer goes away while the batch is in flight
  ASSERT_TRUE(batch->Wait(absl::Now() + absl::Seconds(10))) << "batch hung";
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  int ok = 0, failed = 0;
  for (const absl::Status& s : batch->statuses()) {
    if (s.ok()) {
      ++ok;
    } else {
      ++failed;
      EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsNotFound(s)) << s;
    }
  }
  EXPECT_EQ(ok + failed, kRequests);
  // A later transfer to the departed segment fails fast and cleanly.
  absl::Time again = absl::Now();
  auto st = client_->Transfer({{Op::kRead, local, "seg", 0, 4096}}, absl::Seconds(5));
  EXPECT_FALSE(st[0].ok()) << "served by a stopped peer";
  EXPECT_LT(absl::Now() - again, absl::Seconds(6));
  // And the segment can come back.
  StartServer();
  client_->ForgetPeers();
  char* out = LocalPattern(4096, 9);
  EXPECT_OK(Do(Op::kWrite, out, 0, 4096)[0]);
}

// The peer restarts (a new process would have new memory: here, a new
// engine serving a new region under the same name) while this client
// keeps its cached channel. Without being told, the client reaches the new
// incarnation: at most one transfer fails on the way, and no transfer is
// ever OK while its bytes went to the old incarnation's memory.
TEST_P(TransportConformance, PeerRestartedUnderALongLivedClientIsReachedAgain) {
  char* before = LocalPattern(4096, 1);
  ASSERT_OK(Do(Op::kWrite, before, 0, 4096)[0]);  // the channel is now cached
  auto fresh = SharedRegion::Create(kSegmentSize, {});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  server_.reset();
  StartServer(fresh->get());
  char* after = LocalPattern(4096, 2);
  int failures = 0;
  absl::Status st;
  std::string why;
  for (int attempt = 0; attempt < 3; ++attempt) {
    st = Do(Op::kWrite, after, 0, 4096)[0];
    if (st.ok()) break;
    ++failures;
    absl::StrAppend(&why, st.ToString(), "; ");
    EXPECT_TRUE(absl::IsUnavailable(st) || absl::IsNotFound(st)) << st;
  }
  ASSERT_OK(st);
  EXPECT_LE(failures, 1) << why;
  EXPECT_EQ(Checksum((*fresh)->data(), 4096), Checksum(after, 4096)) << "the write went elsewhere";
  EXPECT_EQ(Checksum(region_->data(), 4096), Checksum(before, 4096)) << "the old incarnation was written";
  char* in = Local(4096);
  ASSERT_OK(Do(Op::kRead, in, 0, 4096)[0]);
  EXPECT_EQ(Checksum(in, 4096), Checksum(after, 4096));
  server_.reset();  // before `fresh` is unmapped
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportConformance,
                         ::testing::Values("loopback", "tcp", "tls", "shm", "rdma"),
                         [](const auto& info) { return info.param; });

// A batch far larger than socket buffers hold, of small writes (many
// small replies) and then small reads (many requests before their data):
// neither side may end up waiting on the other.
TEST_P(TransportConformance, ABatchOfTwentyThousandSmallRequestsCompletes) {
  constexpr int kRequests = 20000;
  constexpr uint64_t kBlock = 64;
  char* out = LocalPattern(kRequests * kBlock, 5);
  char* in = Local(kRequests * kBlock);
  std::vector<Request> writes, reads;
  for (int i = 0; i < kRequests; ++i) {
    writes.push_back({Op::kWrite, out + i * kBlock, "seg", i * kBlock, kBlock});
    reads.push_back({Op::kRead, in + i * kBlock, "seg", i * kBlock, kBlock});
  }
  int bad = 0;
  for (const absl::Status& s : client_->Transfer(writes, absl::Seconds(60))) bad += !s.ok();
  for (const absl::Status& s : client_->Transfer(reads, absl::Seconds(60))) bad += !s.ok();
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(std::memcmp(in, out, kRequests * kBlock), 0);
}

// A daemon's transfer port over TLS: it advertises tls://, refuses a
// plain peer (the process serving on), and a client that does not trust
// its certificate is told so.
TEST(TcpTls, PlainPeersAndUntrustingClientsAreRefusedClearly) {
  auto metadata = NewInMemoryMetadata();
  auto region = SharedRegion::Create(8 << 20, {});
  ASSERT_TRUE(region.ok()) << region.status();
  EngineOptions s = OptionsFor("tls", /*server=*/true);
  s.metadata = metadata;
  auto server = TransferEngine::Create(s);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_OK((*server)->RegisterMemory((*region)->data(), (*region)->size(), "cpu:0"));
  ASSERT_OK((*server)->ServeSegment("seg", {(*region)->data()}));
  auto desc = SegmentDescriptor::FromJson(*metadata->Get(DescriptorKey("seg")));
  ASSERT_TRUE(desc.ok()) << desc.status();
  const std::string endpoint = desc->transports.at("tcp");
  EXPECT_EQ(endpoint.rfind("tls://127.0.0.1:", 0), 0u) << endpoint;

  // Plain frames on the TLS port: no reply, the connection closes.
  {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(endpoint.substr(6), deadline));
    tcp::RequestHeader h;
    h.op = tcp::WireOp::kPing;
    h.id = 1;
    uint8_t head[tcp::kRequestSize];
    tcp::EncodeRequest(h, head);
    (void)net::WriteFull(fd.get(), head, sizeof head, deadline);
    uint8_t reply[tcp::kReplySize];
    EXPECT_FALSE(net::ReadFull(fd.get(), reply, sizeof reply, deadline).ok());
  }
  // A client without the CA (the system's trust store) is refused, and told why.
  EngineOptions c;
  c.metadata = metadata;
  c.transports = {"tcp"};
  auto client = TransferEngine::Create(c);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<char> buf(4096);
  ASSERT_OK((*client)->RegisterMemory(buf.data(), buf.size(), "cpu:0"));
  std::vector<absl::Status> st = (*client)->Transfer({{Op::kRead, buf.data(), "seg", 0, 4096}}, absl::Seconds(5));
  ASSERT_FALSE(st[0].ok());
  EXPECT_NE(st[0].message().find("not trusted"), std::string::npos) << st[0];
  // One that trusts it gets the bytes, from the same server.
  std::memcpy((*region)->data(), "tls-bytes", 9);
  EngineOptions t = OptionsFor("tls", /*server=*/false);
  t.metadata = metadata;
  auto trusting = TransferEngine::Create(t);
  ASSERT_TRUE(trusting.ok()) << trusting.status();
  ASSERT_OK((*trusting)->RegisterMemory(buf.data(), buf.size(), "cpu:0"));
  st = (*trusting)->Transfer({{Op::kRead, buf.data(), "seg", 0, 4096}}, absl::Seconds(5));
  ASSERT_OK(st[0]);
  EXPECT_EQ(std::string(buf.data(), 9), "tls-bytes");
}

TEST(TransportSelection, FallsBackWhenThePreferredTransportCannotReach) {
  auto metadata = NewInMemoryMetadata();
  auto region = SharedRegion::Create(8 << 20, {});
  ASSERT_TRUE(region.ok());
  EngineOptions so;
  so.metadata = metadata;
  so.host_id = "another-machine";  // shm's same-host check must refuse
  auto server = TransferEngine::Create(so);
  ASSERT_TRUE(server.ok());
  ASSERT_OK((*server)->RegisterMemory((*region)->data(), (*region)->size(), "cpu:0", (*region)->fd()));
  ASSERT_OK((*server)->ServeSegment("remote", {(*region)->data()}));

  EngineOptions co;
  co.metadata = metadata;
  co.transports = {"shm", "tcp"};
  auto client = TransferEngine::Create(co);
  ASSERT_TRUE(client.ok());
  std::vector<char> out = Pattern(1 << 20, 3), in(1 << 20);
  ASSERT_OK((*client)->Transfer({{Op::kWrite, out.data(), "remote", 100, out.size()}})[0]);
  ASSERT_OK((*client)->Transfer({{Op::kRead, in.data(), "remote", 100, in.size()}})[0]);
  EXPECT_EQ(in, out);
  PeerInfo info = (*client)->Describe("remote");
  EXPECT_EQ(info.transport, "tcp");
  ASSERT_FALSE(info.fallbacks.empty());
  EXPECT_NE(info.fallbacks[0].find("shm"), std::string::npos) << info.fallbacks[0];
}

TEST(TransportSelection, AutoPicksShmOnTheSameHost) {
  auto metadata = NewInMemoryMetadata();
  auto region = SharedRegion::Create(1 << 20, {});
  ASSERT_TRUE(region.ok());
  auto server = TransferEngine::Create({.metadata = metadata});
  ASSERT_TRUE(server.ok());
  ASSERT_OK((*server)->RegisterMemory((*region)->data(), (*region)->size(), "cpu:0", (*region)->fd()));
  ASSERT_OK((*server)->ServeSegment("local", {(*region)->data()}));
  auto client = TransferEngine::Create({.metadata = metadata});
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->Describe("local").transport, "shm");
}

TEST(TransportSelection, OnlyAGpuTransportTouchesGpuMemory) {
  // tcp and shm would dereference a device pointer; the engine refuses
  // before any backend sees it (the memory here is host memory labelled
  // cuda:0, so nothing faults if the check were missing).
  auto metadata = NewInMemoryMetadata();
  auto region = SharedRegion::Create(1 << 20, {});
  ASSERT_TRUE(region.ok());
  auto server = TransferEngine::Create({.metadata = metadata, .transports = {"tcp"}});
  ASSERT_TRUE(server.ok());
  ASSERT_OK((*server)->RegisterMemory((*region)->data(), (*region)->size(), "cpu:0"));
  ASSERT_OK((*server)->ServeSegment("host", {(*region)->data()}));
  auto client = TransferEngine::Create({.metadata = metadata, .transports = {"tcp"}});
  ASSERT_TRUE(client.ok());
  std::vector<char> gpu_labelled(4096);
  ASSERT_OK((*client)->RegisterMemory(gpu_labelled.data(), gpu_labelled.size(), "cuda:0"));
  auto st = (*client)->Transfer({{Op::kRead, gpu_labelled.data(), "host", 0, 4096}});
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(st[0].message().find("GPU"), std::string::npos) << st[0];
}

TEST(TransportSelection, NothingReachesAnUnreachablePeer) {
  auto metadata = NewInMemoryMetadata();
  SegmentDescriptor d;
  d.name = "ghost";
  d.host = "ghost-host";
  d.host_id = "ghost";
  d.segment_id = 1;
  d.control = "127.0.0.1:1";
  d.transports = {{"tcp", "127.0.0.1:1"}};
  d.buffers = {{0, 4096, "cpu:0", {}}};
  ASSERT_OK(metadata->Put(DescriptorKey("ghost"), d.ToJson()));
  auto client = TransferEngine::Create({.metadata = metadata});
  ASSERT_TRUE(client.ok());
  char buf[16];
  auto st = (*client)->Transfer({{Op::kRead, buf, "ghost", 0, 16}}, absl::Seconds(2));
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace tierkv::transport
