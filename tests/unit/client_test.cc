// The client and the transfer engine end to end, in one process: a real
// master (MasterServer), real lenders (Clients that lend memory, the code a
// store daemon runs) and a client, over
//
// - "rdma": the fake verbs fabric (transport/rdma/fake_verbs.h), preferred
//   over tcp, as auto selection does on a host with an active NIC;
// - "gated": tcp behind a gate the test closes or slows, standing in for a
//   stalled transfer (a backend that overstays its deadline, a slow read).
//
// What is checked: puts and gets of every shape succeed with rdma
// preferred, the bytes of registered buffers travel over rdma and those
// of unregistered ones over tcp; a Wait that runs out leaves its requests
// DEADLINE_EXCEEDED; a put whose bytes did not arrive in time is never
// committed; a read that outlives its lease is a miss, not data.
#include "tests/unit/client_fixture.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "transport/engine.h"
#include "transport/memory.h"

namespace tierkv {
namespace {

using ::tierkv::testing::StatusIs;
using transport::Op;

TEST_F(ClientTest, PutsAndGetsOfEveryShapeWorkWithRdmaPreferred) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"rdma", "tcp"}));
  // Registered buffers: the fast path, over rdma.
  constexpr size_t kBuf = 4 << 20;
  std::unique_ptr<char[]> buf(new char[kBuf]);
  ASSERT_OK(client_->RegisterMemory(buf.get(), kBuf));
  const std::string big = Value(1 << 20, 1);
  std::memcpy(buf.get(), big.data(), big.size());

  uint64_t before = RdmaPosted();
  ASSERT_OK(client_->Put("big", {buf.get(), big.size()}, {.replicas = 2}));
  EXPECT_GT(RdmaPosted() - before, 2 * 4u);  // 4 chunks of 256 KiB per replica, and the trailers
  before = RdmaPosted();
  ASSERT_OK_AND_ASSIGN(size_t n, client_->Get("big", {buf.get() + (2 << 20), 2 << 20}));
  EXPECT_EQ(n, big.size());
  EXPECT_EQ(std::memcmp(buf.get() + (2 << 20), big.data(), n), 0);
  EXPECT_GE(RdmaPosted() - before, 4u);
  EXPECT_EQ(client_->engine().Describe("seg-host-a").transport, "rdma");

  // The caller's own unregistered bytes still work (over tcp).
  const std::string small = Value(5000, 2);
  ASSERT_OK(client_->Put("small", small, {.replicas = 2}));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("small"));
  EXPECT_EQ(got, small);
  ASSERT_OK(client_->Put("empty", ""));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("empty"));
  EXPECT_EQ(got, "");

  // Batches with a group, both kinds of memory mixed, two replicas.
  const std::string a = Value(300000, 3), b = Value(70000, 4);
  std::memcpy(buf.get(), a.data(), a.size());
  std::vector<client::PutItem> items{{"ga", {buf.get(), a.size()}, "g1", ""}, {"gb", b, "g1", "ga"},
                                     {"solo", b, "", ""}};
  for (const absl::Status& st : client_->BatchPut(items, {.replicas = 2})) EXPECT_OK(st);
  std::vector<absl::Span<char>> outs{{buf.get() + (1 << 20), 1 << 20}, {buf.get() + (2 << 20), 1 << 20}};
  auto spans = client_->BatchGet({"ga", "gb"}, outs);
  ASSERT_OK(spans[0].status());
  ASSERT_OK(spans[1].status());
  EXPECT_EQ(std::string(buf.get() + (1 << 20), *spans[0]), a);
  EXPECT_EQ(std::string(buf.get() + (2 << 20), *spans[1]), b);
  auto strings = client_->BatchGet(std::vector<std::string>{"solo", "ga", "missing"});
  ASSERT_OK(strings[0].status());
  EXPECT_EQ(*strings[0], b);
  ASSERT_OK(strings[1].status());
  EXPECT_EQ(*strings[1], a);
  EXPECT_THAT(strings[2].status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(size_t matched, client_->PrefixMatch({"ga", "gb", "missing"}));
  EXPECT_EQ(matched, 2u);
  ASSERT_OK(client_->UnregisterMemory(buf.get()));
}

TEST_F(ClientTest, GatheredPutsAndScatteredGetsMoveEachPieceInPlace) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"rdma", "tcp"}));
  constexpr size_t kBuf = 4 << 20;
  std::unique_ptr<char[]> buf(new char[kBuf]);
  ASSERT_OK(client_->RegisterMemory(buf.get(), kBuf));
  // Three parts far apart in registered memory, and an empty one.
  const std::string p0 = Value(100000, 5), p1 = Value(1, 6), p2 = Value(250000, 7);
  std::memcpy(buf.get(), p0.data(), p0.size());
  std::memcpy(buf.get() + (1 << 20), p1.data(), p1.size());
  std::memcpy(buf.get() + (2 << 20), p2.data(), p2.size());
  client::PutItem item{"gathered", {}, "", ""};
  item.parts = {{buf.get(), p0.size()}, {}, {buf.get() + (1 << 20), 1}, {buf.get() + (2 << 20), p2.size()}};
  const uint64_t before = RdmaPosted();
  ASSERT_OK(client_->BatchPut({item}, {.replicas = 2})[0]);
  // Read where they lie: a joined copy would be unregistered and go over tcp.
  EXPECT_GE(RdmaPosted() - before, 3u * 2);
  const std::string whole = p0 + p1 + p2;
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("gathered"));  // the checksum covers every part
  EXPECT_EQ(got, whole);

  // Scattered over three buffers; the last has room to spare, left untouched.
  std::memset(buf.get(), 0x5a, kBuf);
  std::vector<absl::Span<char>> pieces{{buf.get(), 50000}, {buf.get() + (1 << 20), 200000},
                                       {buf.get() + (2 << 20), 300000}};
  auto sizes = client_->BatchGetScatter({"gathered", "missing"}, {pieces, pieces});
  ASSERT_OK(sizes[0].status());
  EXPECT_EQ(*sizes[0], whole.size());
  EXPECT_THAT(sizes[1].status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(std::string(buf.get(), 50000), whole.substr(0, 50000));
  EXPECT_EQ(std::string(buf.get() + (1 << 20), 200000), whole.substr(50000, 200000));
  const size_t rest = whole.size() - 250000;
  EXPECT_EQ(std::string(buf.get() + (2 << 20), rest), whole.substr(250000));
  EXPECT_EQ(buf[(2 << 20) + rest], 0x5a);
  // Buffers that cannot hold the value: a clear error, nothing read.
  auto small = client_->BatchGetScatter({"gathered"}, {{{buf.get(), 1000}, {buf.get() + 4096, 1000}}});
  EXPECT_THAT(small[0].status(), StatusIs(absl::StatusCode::kInvalidArgument));
  auto unequal = client_->BatchGetScatter({"gathered", "missing"}, {pieces});
  EXPECT_THAT(unequal[1].status(), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(client_->UnregisterMemory(buf.get()));
}

TEST(EngineFallbackTest, ARequestRdmaRefusesIsServedByTcp) {
  auto metadata = transport::NewInMemoryMetadata();
  constexpr uint64_t kSize = 1 << 20;
  ASSERT_OK_AND_ASSIGN(auto region, transport::SharedRegion::Create(kSize, {}));
  ASSERT_OK_AND_ASSIGN(auto server, transport::TransferEngine::Create({.metadata = metadata, .transports = {"rdma", "tcp"}}));
  ASSERT_OK(server->RegisterMemory(region->data(), kSize, "cpu:0"));
  ASSERT_OK(server->ServeSegment("seg", {region->data()}));
  ASSERT_OK_AND_ASSIGN(auto client, transport::TransferEngine::Create({.metadata = metadata, .transports = {"rdma", "tcp"}}));

  std::string registered(4096, 'r'), unregistered(4096, 'u');
  ASSERT_OK(client->RegisterMemory(registered.data(), registered.size(), "cpu:0"));
  uint64_t before = RdmaPosted();
  auto st = client->Transfer({{Op::kWrite, registered.data(), "seg", 0, 4096},
                              {Op::kWrite, unregistered.data(), "seg", 8192, 4096}});
  ASSERT_OK(st[0]);
  ASSERT_OK(st[1]);  // refused by rdma (unregistered), moved by tcp
  EXPECT_EQ(RdmaPosted() - before, 1u);
  EXPECT_EQ(std::string(region->data(), 4096), registered);
  EXPECT_EQ(std::string(region->data() + 8192, 4096), unregistered);
  EXPECT_EQ(client->Describe("seg").transport, "rdma");

  std::string back(4096, '\0');
  st = client->Transfer({{Op::kRead, back.data(), "seg", 8192, 4096}});
  ASSERT_OK(st[0]);
  EXPECT_EQ(back, unregistered);
  ASSERT_OK(client->UnregisterMemory(registered.data()));
}

TEST(EngineFallbackTest, ARefusedRequestWithNoOtherTransportFailsCleanly) {
  auto metadata = transport::NewInMemoryMetadata();
  ASSERT_OK_AND_ASSIGN(auto region, transport::SharedRegion::Create(1 << 20, {}));
  ASSERT_OK_AND_ASSIGN(auto server, transport::TransferEngine::Create({.metadata = metadata, .transports = {"rdma"}}));
  ASSERT_OK(server->RegisterMemory(region->data(), 1 << 20, "cpu:0"));
  ASSERT_OK(server->ServeSegment("seg", {region->data()}));
  ASSERT_OK_AND_ASSIGN(auto client, transport::TransferEngine::Create({.metadata = metadata, .transports = {"rdma"}}));
  std::string unregistered(4096, 'u');
  auto st = client->Transfer({{Op::kWrite, unregistered.data(), "seg", 0, 4096}});
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(BatchTest, AWaitThatTimesOutLeavesUnfinishedRequestsDeadlineExceeded) {
  auto metadata = transport::NewInMemoryMetadata();
  ASSERT_OK_AND_ASSIGN(auto region, transport::SharedRegion::Create(1 << 20, {}));
  ASSERT_OK_AND_ASSIGN(auto server, transport::TransferEngine::Create({.metadata = metadata, .transports = {"gated"}}));
  ASSERT_OK(server->RegisterMemory(region->data(), 1 << 20, "cpu:0"));
  ASSERT_OK(server->ServeSegment("seg", {region->data()}));
  ASSERT_OK_AND_ASSIGN(auto client, transport::TransferEngine::Create({.metadata = metadata, .transports = {"gated"}}));
  std::string data(4096, 'x');
  TheGate().HoldWrites(true);
  std::shared_ptr<transport::Batch> batch = client->Submit(
      {{Op::kWrite, data.data(), "seg", 0, 4096}, {Op::kWrite, data.data(), "seg", 65536, 4096}}, absl::Seconds(10));
  // Still in flight: not OK.
  for (const absl::Status& st : batch->statuses()) EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_FALSE(batch->Wait(absl::Now() + absl::Milliseconds(100)));
  EXPECT_FALSE(batch->Done());
  for (const absl::Status& st : batch->statuses()) EXPECT_THAT(st, StatusIs(absl::StatusCode::kDeadlineExceeded));
  // The bytes landing later do not make them OK.
  TheGate().HoldWrites(false);
  EXPECT_TRUE(batch->Wait(absl::Now() + absl::Seconds(10)));
  for (const absl::Status& st : batch->statuses()) EXPECT_THAT(st, StatusIs(absl::StatusCode::kDeadlineExceeded));
  // Transfer, which waits inside, reports the same for a stalled request.
  // It returns by its deadline (and the grace for the last completions)
  // although the transport overstays it: a caller's thread never runs a
  // transport that does not promise to end by the deadline.
  TheGate().HoldWrites(true);
  const absl::Time start = absl::Now();
  auto st = client->Transfer({{Op::kWrite, data.data(), "seg", 0, 4096}}, absl::Milliseconds(100));
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  TheGate().HoldWrites(false);
  EXPECT_TRUE(TheGate().Drained(absl::Seconds(10)));
}

TEST_F(ClientTest, APutWhoseWritesStallPastTheDeadlineFailsAndCommitsNothing) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"gated"}));
  client::ClientOptions o = Options("host-d");
  o.transfer_timeout = absl::Milliseconds(300);
  ASSERT_OK_AND_ASSIGN(auto writer, client::Client::Create(o));
  ASSERT_OK(writer->Put("before", "fine"));

  TheGate().HoldWrites(true);
  EXPECT_THAT(writer->Put("stalled", Value(10000, 5), {.replicas = 2}),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  auto batch = writer->BatchPut({{"s1", "one", "g", ""}, {"s2", "two", "g", "s1"}});
  EXPECT_THAT(batch[0], ::testing::Not(::tierkv::testing::IsOk()));
  EXPECT_THAT(batch[1], ::testing::Not(::tierkv::testing::IsOk()));
  TheGate().HoldWrites(false);
  ASSERT_TRUE(TheGate().Drained(absl::Seconds(30)));

  // Nothing was committed, although the bytes arrived in the end.
  for (const char* key : {"stalled", "s1", "s2"}) {
    ASSERT_OK_AND_ASSIGN(bool present, client_->Exists(key));
    EXPECT_FALSE(present) << key;
    EXPECT_THAT(client_->Get(key).status(), StatusIs(absl::StatusCode::kNotFound)) << key;
  }
  ASSERT_OK_AND_ASSIGN(std::string v, client_->Get("before"));
  EXPECT_EQ(v, "fine");
}

TEST_F(ClientTest, AReadThatOutlivesItsLeaseIsAMiss) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"gated"}, {"--lease-ttl=600ms"}));
  const std::string value = Value(20000, 6);
  ASSERT_OK(client_->Put("k", value));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("k"));  // inside the lease: data
  EXPECT_EQ(got, value);

  TheGate().DelayReads(absl::Milliseconds(1500));
  absl::Time start = absl::Now();
  EXPECT_THAT(client_->Get("k").status(), StatusIs(absl::StatusCode::kNotFound));
  std::vector<char> out(value.size());
  EXPECT_THAT(client_->Get("k", absl::MakeSpan(out)).status(), StatusIs(absl::StatusCode::kNotFound));
  // Given up at the lease, not at the 30 s transfer timeout.
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  TheGate().DelayReads(absl::ZeroDuration());
  ASSERT_TRUE(TheGate().Drained(absl::Seconds(10)));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("k"));  // the object itself is intact
  EXPECT_EQ(got, value);
}

}  // namespace
}  // namespace tierkv
