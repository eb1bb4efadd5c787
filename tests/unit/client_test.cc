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
#include <cstring>
#include <functional>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal/replica_cache.h"
#include "client/internal/trailer_arena.h"
#include "base/crc32c.h"
#include "base/status.h"
#include "config/master_config.h"
#include "master/server.h"
#include "tests/support/status_matchers.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "transport/rdma/fake_verbs.h"
#include "transport/rdma/rdma_backend.h"

namespace tierkv {
namespace {

using ::tierkv::testing::StatusIs;
using transport::Op;

// --- the fake fabric as "rdma"

transport::rdma::PortInfo FakePort(const std::string& name, int numa) {
  transport::rdma::PortInfo p;
  p.device = name;
  p.active = true;
  p.numa_node = numa;
  p.lid = 1;
  return p;
}

std::shared_ptr<transport::rdma::FakeFabric> Fabric() {
  static auto* fabric = new std::shared_ptr<transport::rdma::FakeFabric>(
      transport::rdma::FakeFabric::Create({FakePort("mlx5_0", 0), FakePort("mlx5_1", 1)}));
  return *fabric;
}

uint64_t RdmaPosted() { return Fabric()->posted("mlx5_0") + Fabric()->posted("mlx5_1"); }

// --- "gated": tcp that waits at a gate before moving slices

struct Gate {
  Mutex mu;
  CondVar cv;
  bool hold_writes ABSL_GUARDED_BY(mu) = false;
  absl::Duration read_delay ABSL_GUARDED_BY(mu);
  int held ABSL_GUARDED_BY(mu) = 0;  // Posts waiting at the gate now

  void HoldWrites(bool hold) {
    MutexLock lock(&mu);
    hold_writes = hold;
    cv.SignalAll();
  }
  void DelayReads(absl::Duration d) {
    MutexLock lock(&mu);
    read_delay = d;
    cv.SignalAll();
  }
  // Blocks while writes are held (bounded, so a failing test cannot hang),
  // then for the read delay.
  void Pass(bool write) {
    MutexLock lock(&mu);
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    ++held;
    cv.SignalAll();
    while (write && hold_writes && absl::Now() < give_up) cv.WaitFor(&mu, std::chrono::milliseconds(20));
    const absl::Time until = absl::Now() + (write ? absl::ZeroDuration() : read_delay);
    while (absl::Now() < until) cv.WaitFor(&mu, absl::ToChronoMicroseconds(until - absl::Now()));
    --held;
    cv.SignalAll();
  }
  // Waits until no Post is at the gate (the stalled transfers finished).
  bool Drained(absl::Duration timeout) {
    MutexLock lock(&mu);
    const absl::Time until = absl::Now() + timeout;
    while (held > 0 && absl::Now() < until) cv.WaitFor(&mu, std::chrono::milliseconds(20));
    return held == 0;
  }
};

Gate& TheGate() {
  static auto* gate = new Gate();
  return *gate;
}

class GatedChannel final : public transport::PeerChannel {
 public:
  explicit GatedChannel(std::unique_ptr<transport::PeerChannel> inner) : inner_(std::move(inner)) {}
  void Post(absl::Span<transport::Slice* const> slices, absl::Time deadline) override {
    bool write = std::any_of(slices.begin(), slices.end(), [](auto* s) { return s->op == Op::kWrite; });
    TheGate().Pass(write);
    inner_->Post(slices, deadline);
  }
  bool healthy() const override { return inner_->healthy(); }

 private:
  std::unique_ptr<transport::PeerChannel> inner_;
};

// Offered beside tcp by every engine that lists it; moves bytes through
// the serving engine's tcp server.
class GatedBackend final : public transport::Backend {
 public:
  explicit GatedBackend(std::unique_ptr<transport::Backend> tcp) : tcp_(std::move(tcp)) {}
  std::string name() const override { return "gated"; }
  transport::Capabilities capabilities() const override { return {.rank = 5}; }
  absl::Status Start(transport::ServedMemory*) override { return absl::OkStatus(); }
  void Stop() override {}
  std::string endpoint() const override { return "gated"; }
  absl::StatusOr<std::string> RegisterBuffer(const transport::LocalBuffer&) override { return std::string(); }
  void UnregisterBuffer(const transport::LocalBuffer&) override {}
  absl::StatusOr<std::unique_ptr<transport::PeerChannel>> Prepare(const transport::SegmentDescriptor& remote,
                                                                  const transport::PrepareContext& ctx) override {
    ASSIGN_OR_RETURN(std::unique_ptr<transport::PeerChannel> inner, tcp_->Prepare(remote, ctx));
    return std::unique_ptr<transport::PeerChannel>(new GatedChannel(std::move(inner)));
  }

 private:
  std::unique_ptr<transport::Backend> tcp_;  // client side only: never started
};

const bool kRegistered = [] {
  transport::RegisterBackend("rdma", [](const transport::BackendOptions& o) {
    transport::rdma::RdmaOptions r;
    r.chunk = 256 << 10;
    return transport::rdma::NewRdmaBackend(o, Fabric(), r);
  });
  transport::RegisterBackend("gated", [](const transport::BackendOptions& o)
                                          -> absl::StatusOr<std::unique_ptr<transport::Backend>> {
    ASSIGN_OR_RETURN(std::unique_ptr<transport::Backend> tcp, transport::CreateBackend("tcp", o));
    return std::unique_ptr<transport::Backend>(new GatedBackend(std::move(tcp)));
  });
  return true;
}();

const char* NoEnv(const char*) { return nullptr; }

// A master and two lenders on distinct "hosts" in this process.
class ClientTest : public ::testing::Test {
 protected:
  void TearDown() override {
    TheGate().HoldWrites(false);
    TheGate().DelayReads(absl::ZeroDuration());
    EXPECT_TRUE(TheGate().Drained(absl::Seconds(30)));
    client_.reset();
    stores_.clear();
    if (master_) master_->Shutdown();
  }

  void StartCluster(std::vector<std::string> transports, std::vector<std::string> master_flags = {}) {
    transports_ = std::move(transports);
    std::vector<std::string> args{"tierkv-master", "--rpc-port=0", "--http-port=0", "--check-interval=50ms"};
    args.insert(args.end(), master_flags.begin(), master_flags.end());
    std::vector<const char*> argv;
    for (auto& a : args) argv.push_back(a.c_str());
    ASSERT_OK_AND_ASSIGN(MasterConfig config,
                         MasterFlags().Parse(static_cast<int>(argv.size()), argv.data(), nullptr, NoEnv));
    ASSERT_OK_AND_ASSIGN(master_, master::MasterServer::Start(config));
    for (const char* host : {"host-a", "host-b"}) {
      client::ClientOptions o = Options(host);
      o.lend_size = 16 << 20;
      o.lend_name = absl::StrCat("seg-", host);
      ASSERT_OK_AND_ASSIGN(auto store, client::Client::Create(o));
      stores_.push_back(std::move(store));
    }
    ASSERT_OK_AND_ASSIGN(client_, client::Client::Create(Options("host-c")));
  }

  client::ClientOptions Options(const std::string& host) {
    client::ClientOptions o;
    o.master = absl::StrCat("127.0.0.1:", master_->rpc_port());
    o.metadata = absl::StrCat("http://127.0.0.1:", master_->http_port());
    o.transports = transports_;
    o.host = host;
    return o;
  }

  std::vector<std::string> transports_;
  std::unique_ptr<master::MasterServer> master_;
  std::vector<std::unique_ptr<client::Client>> stores_;
  std::unique_ptr<client::Client> client_;
};

std::string Value(size_t n, char seed) {
  std::string v(n, '\0');
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(seed + i * 7);
  return v;
}

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

// --- the replica cache (client.h): a repeated get inside its lease skips
// the master, and never outlives what the lease promises.

// Polls `get` until it answers NOT_FOUND or `limit` passes; how long it took.
absl::StatusOr<absl::Duration> UntilMiss(const std::function<absl::Status()>& get, absl::Duration limit) {
  const absl::Time start = absl::Now();
  while (absl::Now() - start < limit) {
    absl::Status s = get();
    if (absl::IsNotFound(s)) return absl::Now() - start;
    if (!s.ok()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError("still found");
}

// A client with the replica cache on (as by default), whose entries serve
// within `fresh` of the master's last answer.
std::unique_ptr<client::Client> Cached(client::ClientOptions o,
                                       absl::Duration fresh = client::ClientOptions().replica_cache_fresh) {
  o.replica_cache = 1024;
  o.replica_cache_fresh = fresh;
  auto c = client::Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

TEST_F(ClientTest, ARepeatedGetInsideItsLeaseIsReadWhereItWasUntilTheLeaseEnds) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}, {"--lease-ttl=1s"}));
  ASSERT_OK_AND_ASSIGN(auto other, client::Client::Create(Options("host-d")));
  // What bounds the cache here is the lease, not the master's last answer.
  client_ = Cached(Options("host-e"), absl::InfiniteDuration());
  ASSERT_NE(client_, nullptr);
  const std::string value = Value(30000, 8);
  ASSERT_OK(client_->Put("k", value));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("k"));  // takes the lease, remembers where
  EXPECT_EQ(got, value);
  const absl::Time leased = absl::Now();
  // Removed elsewhere (a lease lets that happen only with force): the
  // master no longer knows the key, but the lease keeps its bytes, so
  // this client still reads them, without asking.
  ASSERT_OK(other->Remove("k", /*force=*/true));
  EXPECT_THAT(other->Get("k").status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("k"));
  EXPECT_EQ(got, value);
  // Never past the lease (1 s, less its margin): then it is a miss.
  ASSERT_OK(UntilMiss([&] { return client_->Get("k").status(); }, absl::Seconds(10)).status());
  const absl::Duration served = absl::Now() - leased;
  EXPECT_GE(served, absl::Milliseconds(800));
  EXPECT_LE(served, absl::Seconds(3));
}

TEST_F(ClientTest, AKeyThisClientRemovedIsNeverReadFromTheReplicaCache) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  client_ = Cached(Options("host-e"));
  ASSERT_NE(client_, nullptr);
  const std::string value = Value(30000, 9);
  ASSERT_OK(client_->Put("k", value));
  ASSERT_OK(client_->Put("j", value));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("k"));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("j"));
  ASSERT_OK(client_->Remove("k", /*force=*/true));
  EXPECT_THAT(client_->Get("k").status(), StatusIs(absl::StatusCode::kNotFound));
  std::vector<char> out(value.size());
  EXPECT_THAT(client_->Get("k", absl::MakeSpan(out)).status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(uint64_t removed, client_->RemoveAll(/*force=*/true));
  EXPECT_EQ(removed, 1u);
  EXPECT_THAT(client_->Get("j").status(), StatusIs(absl::StatusCode::kNotFound));
  // Put anew: the new value, from where it now sits.
  const std::string fresh = Value(40000, 10);
  ASSERT_OK(client_->Put("k", fresh));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("k"));
  EXPECT_EQ(got, fresh);
}

TEST_F(ClientTest, ARememberedReplicaWhoseStoreIsGoneIsAskedOfTheMasterAgain) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  ASSERT_OK_AND_ASSIGN(auto other, client::Client::Create(Options("host-d")));
  // Never renewed, the entry outlives the drop unseen: its read fails. (By
  // default the next answer names the new membership, which forgets it.)
  client_ = Cached(Options("host-e"), absl::InfiniteDuration());
  ASSERT_NE(client_, nullptr);
  const std::string old_value = Value(30000, 11), new_value = Value(30000, 12);
  ASSERT_OK(other->Put("k", old_value, {.preferred_segment = "seg-host-a"}));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("k"));  // remembered on seg-host-a
  EXPECT_EQ(got, old_value);
  // The store dies (it unmounts on the way out): its objects are gone, and
  // the key is put again on the other store.
  stores_[0].reset();
  ASSERT_OK(UntilMiss([&] { return other->Get("k").status(); }, absl::Seconds(10)).status());
  ASSERT_OK(other->Put("k", new_value, {.preferred_segment = "seg-host-b"}));
  // The remembered location fails; the master names the new one.
  ASSERT_OK_AND_ASSIGN(got, client_->Get("k"));
  EXPECT_EQ(got, new_value);
}

// One byte of a stored value changes under the index: every get is
// DATA_LOSS, never the bytes, whether the checksum is worked out while
// copying (shm) or after (tcp), and whether the replica was remembered.
void ExpectCorruptValueIsDataLoss(client::Client* c, const std::string& transport, const std::string& key) {
  SCOPED_TRACE(key);
  const std::string value = Value(200000, 13);
  ASSERT_OK(c->Put(key, value));
  ASSERT_OK_AND_ASSIGN(std::string got, c->Get(key));  // remembered
  EXPECT_EQ(got, value);
  auto replicas = c->master().GetReplicas({key});
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  const std::string segment = replicas->segments(replicas->replica_segments(0));
  char flipped = static_cast<char>(value[123456] ^ 0x20);
  ASSERT_OK(c->engine().Transfer({{Op::kWrite, &flipped, segment, replicas->replica_offsets(0) + 123456, 1}})[0]);
  EXPECT_EQ(c->engine().Describe(segment).transport, transport);
  EXPECT_THAT(c->Get(key).status(), StatusIs(absl::StatusCode::kDataLoss));
  std::vector<char> out(value.size());
  EXPECT_THAT(c->Get(key, absl::MakeSpan(out)).status(), StatusIs(absl::StatusCode::kDataLoss));
  std::vector<char> a(1000), b(value.size());
  auto scattered = c->BatchGetScatter({key}, {{absl::MakeSpan(a), absl::MakeSpan(b)}});
  EXPECT_THAT(scattered[0].status(), StatusIs(absl::StatusCode::kDataLoss));
}

TEST_F(ClientTest, ACorruptValueIsDataLossOverShm) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"shm", "tcp"}));
  ExpectCorruptValueIsDataLoss(client_.get(), "shm", "plain");
  auto cached = Cached(Options("host-e"));
  ASSERT_NE(cached, nullptr);
  ExpectCorruptValueIsDataLoss(cached.get(), "shm", "remembered");
}

// Over shm a put's first replica is written by a copy that works out the
// CRC as it goes, and the trailer is written from it once the value has
// landed. Every trailer must be the checksum of the value's bytes: single
// and batched puts, one and two replicas, values in parts (checksummed
// here), and the first put to a store (no channel yet: checksummed here).
TEST_F(ClientTest, PutsOverShmStoreTheChecksumTheirCopyWorkedOut) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"shm", "tcp"}));
  auto check = [&](const std::string& key, const std::string& value) {
    SCOPED_TRACE(key);
    ASSERT_OK_AND_ASSIGN(std::string got, client_->Get(key));
    EXPECT_TRUE(got == value);
    auto replicas = client_->master().GetReplicas({key});
    ASSERT_TRUE(replicas.ok()) << replicas.status();
    ASSERT_GE(replicas->replica_offsets_size(), 1);
    for (int r = 0; r < replicas->replica_offsets_size(); ++r) {
      const std::string segment = replicas->segments(replicas->replica_segments(r));
      char trailer[16];
      ASSERT_OK(client_->engine().Transfer(
          {{Op::kRead, trailer, segment, replicas->replica_offsets(r) + value.size(), sizeof trailer}})[0]);
      uint32_t crc;
      uint64_t put_id;
      std::memcpy(&crc, trailer, 4);
      std::memcpy(&put_id, trailer + 8, 8);
      EXPECT_EQ(crc, Crc32cExtend(Crc32c(key.data(), key.size()), value.data(), value.size())) << "replica " << r;
      EXPECT_EQ(std::string(trailer + 4, 4), "TKV2");
      ASSERT_EQ(replicas->put_ids_size(), 1);
      EXPECT_NE(put_id, 0u);
      EXPECT_EQ(put_id, replicas->put_ids(0)) << "replica " << r;
      EXPECT_EQ(client_->engine().Describe(segment).transport, "shm");
    }
  };
  const std::string first = Value(70000, 21);
  ASSERT_OK(client_->Put("first", first));
  check("first", first);
  for (int replicas : {1, 2}) {
    const std::string single = Value(300000 + replicas, 22);
    const std::string key = absl::StrCat("single-", replicas);
    ASSERT_OK(client_->Put(key, single, {.replicas = replicas}));
    check(key, single);
    std::vector<std::string> values;
    std::vector<client::PutItem> items;
    for (int i = 0; i < 6; ++i) values.push_back(Value(1000 + 90000 * i, 30 + i));
    for (int i = 0; i < 6; ++i) items.push_back({absl::StrCat("batch-", replicas, "-", i), values[i]});
    // One item in parts: its trailer is checksummed here.
    const std::string whole = values[2];
    items[2].value = {};
    items[2].parts = {absl::string_view(whole).substr(0, 500), absl::string_view(whole).substr(500)};
    for (const absl::Status& st : client_->BatchPut(items, {.replicas = replicas})) EXPECT_OK(st);
    for (int i = 0; i < 6; ++i) check(items[i].key, values[i]);
  }
}

// Bytes at a key's extent that are not that put of that key read as a
// miss, never as those bytes, with or without checksums: another key's
// value and trailer (what a late write granted by a deposed master, or a
// one-sided write nothing could fence, leaves there), and an older put of
// the same key.
void ExpectAnotherPutReadsAsAMiss(client::Client* c, client::Client* unverified) {
  auto stored = [&](const std::string& key, size_t size) -> absl::StatusOr<std::pair<std::string, uint64_t>> {
    ASSIGN_OR_RETURN(v1::GetReplicasResponse r, c->master().GetReplicas({key}));
    if (r.replica_offsets_size() < 1) return absl::NotFoundError(key);
    std::string bytes(client::StoredSize(size), '\0');
    const std::string segment = r.segments(r.replica_segments(0));
    RETURN_IF_ERROR(c->engine().Transfer({{Op::kRead, bytes.data(), segment, r.replica_offsets(0), bytes.size()}})[0]);
    return std::make_pair(bytes, r.put_ids_size() > 0 ? r.put_ids(0) : 0);
  };
  auto overwrite = [&](const std::string& key, const std::string& bytes) -> absl::Status {
    ASSIGN_OR_RETURN(v1::GetReplicasResponse r, c->master().GetReplicas({key}));
    for (int k = 0; k < r.replica_offsets_size(); ++k) {
      std::string copy = bytes;
      RETURN_IF_ERROR(c->engine().Transfer({{Op::kWrite, copy.data(), r.segments(r.replica_segments(k)),
                                             r.replica_offsets(k), copy.size()}})[0]);
    }
    return absl::OkStatus();
  };
  auto expect_miss = [&](const std::string& key, const std::string& not_this) {
    for (client::Client* reader : {c, unverified}) {
      absl::StatusOr<std::string> got = reader->Get(key);
      EXPECT_THAT(got.status(), StatusIs(absl::StatusCode::kNotFound)) << key;
      if (got.ok()) {
        EXPECT_FALSE(*got == not_this) << key << ": read another put's bytes";
      }
      EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("another put"));
      std::vector<char> out(not_this.size());
      EXPECT_THAT(reader->Get(key, absl::MakeSpan(out)).status(), StatusIs(absl::StatusCode::kNotFound));
    }
  };
  const std::string a = Value(100000, 41), b = Value(100000, 42);
  ASSERT_OK(c->Put("victim", a));
  ASSERT_OK(c->Put("other", b));
  ASSERT_OK_AND_ASSIGN(auto others, stored("other", b.size()));
  ASSERT_OK_AND_ASSIGN(auto victims, stored("victim", a.size()));
  EXPECT_NE(others.second, 0u);
  EXPECT_NE(others.second, victims.second);
  ASSERT_OK(overwrite("victim", others.first));
  expect_miss("victim", b);
  ASSERT_OK_AND_ASSIGN(std::string still, c->Get("other"));  // the other is untouched
  EXPECT_TRUE(still == b);

  // The same key put again: the first put's bytes are not the second's.
  const std::string old_value = Value(50000, 43), new_value = Value(50000, 44);
  ASSERT_OK(c->Put("again", old_value));
  ASSERT_OK_AND_ASSIGN(auto first, stored("again", old_value.size()));
  ASSERT_OK(c->Remove("again", /*force=*/true));
  ASSERT_OK(c->Put("again", new_value));
  ASSERT_OK_AND_ASSIGN(std::string fresh, c->Get("again"));
  EXPECT_TRUE(fresh == new_value);
  ASSERT_OK(overwrite("again", first.first));
  expect_miss("again", old_value);
}

TEST_F(ClientTest, AnotherPutsBytesAtAKeysExtentReadAsAMissOverShm) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"shm", "tcp"}));
  client::ClientOptions o = Options("host-e");
  o.verify_checksums = false;
  ASSERT_OK_AND_ASSIGN(auto unverified, client::Client::Create(o));
  ExpectAnotherPutReadsAsAMiss(client_.get(), unverified.get());
}

TEST_F(ClientTest, AnotherPutsBytesAtAKeysExtentReadAsAMissOverTcp) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  client::ClientOptions o = Options("host-e");
  o.verify_checksums = false;
  ASSERT_OK_AND_ASSIGN(auto unverified, client::Client::Create(o));
  ExpectAnotherPutReadsAsAMiss(client_.get(), unverified.get());
}

// An object put by a writer that predates put ids (a PutStart without
// put_ids gets put id 0, and the writer stores the 8-byte "TKV1"
// trailer) reads back whole, checksummed or not.
TEST_F(ClientTest, AnObjectWithTheOlderTrailerReadsBack) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  const std::string value = Value(30000, 5);
  v1::PutStartRequest req;
  v1::PutStartItem* item = req.add_items();
  item->set_key("legacy");
  item->set_size(value.size() + 8);
  ASSERT_OK_AND_ASSIGN(v1::PutStartResponse started, client_->master().PutStart(req));
  ASSERT_EQ(started.results_size(), 1);
  ASSERT_OK(client::FromItem(started.results(0).status()));
  EXPECT_EQ(started.results(0).put_id(), 0u);
  std::string stored = value;
  const uint32_t crc = Crc32c(value.data(), value.size());
  stored.append(reinterpret_cast<const char*>(&crc), 4);
  stored.append("TKV1");
  for (const v1::Extent& e : started.results(0).replicas()) {
    ASSERT_OK(client_->engine().Transfer(
        {{Op::kWrite, stored.data(), e.segment(), e.offset(), stored.size(), nullptr, started.epoch()}})[0]);
  }
  ASSERT_OK_AND_ASSIGN(v1::KeysResponse ended, client_->master().PutEnd({"legacy"}));
  ASSERT_OK(client::FromItem(ended.status(0)));
  client::ClientOptions o = Options("host-e");
  o.verify_checksums = false;
  ASSERT_OK_AND_ASSIGN(auto unverified, client::Client::Create(o));
  for (client::Client* reader : {client_.get(), unverified.get()}) {
    ASSERT_OK_AND_ASSIGN(std::string got, reader->Get("legacy"));
    EXPECT_TRUE(got == value);
    std::vector<char> out(value.size() + 100);
    ASSERT_OK_AND_ASSIGN(size_t n, reader->Get("legacy", absl::MakeSpan(out)));
    EXPECT_EQ(n, value.size());
  }
  // Its bytes changed under its trailer: DATA_LOSS, as before put ids.
  char flipped = static_cast<char>(value[100] ^ 1);
  ASSERT_OK_AND_ASSIGN(v1::GetReplicasResponse r, client_->master().GetReplicas({"legacy"}));
  ASSERT_OK(client_->engine().Transfer(
      {{Op::kWrite, &flipped, r.segments(r.replica_segments(0)), r.replica_offsets(0) + 100, 1}})[0]);
  EXPECT_THAT(client_->Get("legacy").status(), StatusIs(absl::StatusCode::kDataLoss));
}

// Where the metadata is when it is not given: the one master's host at
// the master's default HTTP port; a master named by a gRPC target URI
// names no host, and says so.
TEST(MetadataUrlTest, AnEmptyUrlComesFromTheMasterOrIsAskedFor) {
  EXPECT_EQ(*client::MetadataUrl("http://meta:1", "m:2"), "http://meta:1");
  EXPECT_EQ(*client::MetadataUrl("", "10.0.0.5:50051"), "http://10.0.0.5:8080");
  EXPECT_THAT(client::MetadataUrl("", "dns:///m:50051").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client::MetadataUrl("", "nohost").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Trailers of objects put before put ids (8 bytes: CRC32C over the value,
// "TKV1"; put id 0 in the index) stay readable and checked; a trailer of
// either kind where the other is due is not taken.
TEST(TrailerTest, LegacyTrailersStayReadableAndKindsAreNotMixed) {
  using client::internal::CheckTrailer;
  std::string value = Value(5000, 9);
  const std::vector<absl::Span<char>> parts = {absl::MakeSpan(value)};
  char legacy[16] = {};
  const uint32_t crc = Crc32c(value.data(), value.size());
  std::memcpy(legacy, &crc, 4);
  std::memcpy(legacy + 4, "TKV1", 4);
  EXPECT_OK(CheckTrailer(legacy, 0, "k", parts, true, {}));
  EXPECT_OK(CheckTrailer(legacy, 0, "k", parts, true, {crc, true}));
  EXPECT_THAT(CheckTrailer(legacy, 0, "k", parts, true, {crc ^ 1, true}), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(CheckTrailer(legacy, 7, "k", parts, true, {}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(client::ValueSizeOf(value.size() + 8, 0), value.size());

  char v2[16];
  client::internal::EncodeTrailer(Crc32cExtend(client::internal::KeyCrc("k"), value.data(), value.size()), 7, v2);
  EXPECT_OK(CheckTrailer(v2, 7, "k", parts, true, {}));
  EXPECT_THAT(CheckTrailer(v2, 7, "j", parts, true, {}), StatusIs(absl::StatusCode::kDataLoss));  // bound to its key
  EXPECT_OK(CheckTrailer(v2, 7, "j", parts, false, {}));  // unverified: only the put id is checked
  EXPECT_THAT(CheckTrailer(v2, 8, "k", parts, false, {}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(CheckTrailer(v2, 0, "k", parts, true, {}), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(client::ValueSizeOf(client::StoredSize(value.size()), 7), value.size());
  value[100] ^= 1;
  EXPECT_THAT(CheckTrailer(v2, 7, "k", parts, true, {}), StatusIs(absl::StatusCode::kDataLoss));
}

TEST_F(ClientTest, ACorruptValueIsDataLossOverTcp) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  ExpectCorruptValueIsDataLoss(client_.get(), "tcp", "plain");
  auto cached = Cached(Options("host-e"));
  ASSERT_NE(cached, nullptr);
  ExpectCorruptValueIsDataLoss(cached.get(), "tcp", "remembered");
}

TEST(ReplicaCacheTest, EntriesEndWithTheirLeaseAndInvalidationRefusesInsertsBegunBefore) {
  client::internal::ReplicaCache cache(2);
  const absl::Time now = absl::Now();
  client::internal::Located a;
  a.stored_size = 10;
  a.lease_end = now + absl::Seconds(1);
  a.replicas.emplace_back("seg", 0);
  cache.Insert("a", a, cache.generation());
  ASSERT_TRUE(cache.Lookup("a", now).has_value());
  EXPECT_TRUE(cache.Lookup("a", now)->cached);
  EXPECT_FALSE(cache.Lookup("a", now + absl::Seconds(1)).has_value());  // the lease ended
  EXPECT_FALSE(cache.Lookup("a", now).has_value());                     // and it was dropped
  // A get that began before this client removed the key must not bring it back.
  const uint64_t before = cache.generation();
  cache.Invalidate("a");
  cache.Insert("a", a, before);
  EXPECT_FALSE(cache.Lookup("a", now).has_value());
  cache.Insert("a", a, cache.generation());
  EXPECT_TRUE(cache.Lookup("a", now).has_value());
  // Bounded: a third key makes room.
  cache.Insert("b", a, cache.generation());
  cache.Insert("c", a, cache.generation());
  EXPECT_LE(cache.size(), 2u);
  EXPECT_TRUE(cache.Lookup("c", now).has_value());
  // Off: never remembers.
  client::internal::ReplicaCache off(0);
  off.Insert("a", a, off.generation());
  EXPECT_FALSE(off.Lookup("a", now).has_value());
}

// A full cache makes room by dropping ended leases, and everything when
// that would leave more than half: so it is scanned at most once per
// capacity / 2 inserts, whatever the mix.
TEST(ReplicaCacheTest, AFullCacheKeepsAtMostHalfSoItIsNotScannedOnEveryInsert) {
  const absl::Time now = absl::Now();
  auto located = [&](absl::Duration left) {
    client::internal::Located w;
    w.stored_size = 10;
    w.lease_end = now + left;
    w.replicas.emplace_back("seg", 0);
    return w;
  };
  client::internal::ReplicaCache few_ended(8);
  for (int i = 0; i < 8; ++i) {
    few_ended.Insert(absl::StrCat("k", i), located(i < 2 ? absl::ZeroDuration() : absl::Seconds(5)),
                     few_ended.generation(), now);
  }
  few_ended.Insert("new", located(absl::Seconds(5)), few_ended.generation(), now);
  EXPECT_EQ(few_ended.size(), 1u);  // six left would have been more than half
  EXPECT_TRUE(few_ended.Lookup("new", now).has_value());
  client::internal::ReplicaCache most_ended(8);
  for (int i = 0; i < 8; ++i) {
    most_ended.Insert(absl::StrCat("k", i), located(i < 6 ? absl::ZeroDuration() : absl::Seconds(5)),
                      most_ended.generation(), now);
  }
  most_ended.Insert("new", located(absl::Seconds(5)), most_ended.generation(), now);
  EXPECT_EQ(most_ended.size(), 3u);  // the two live ones stay
  EXPECT_TRUE(most_ended.Lookup("k7", now).has_value());
}

// Entries serve only within `fresh` of the master's last answer, and an
// answer naming another epoch or membership forgets them all, unless it
// was asked before this client heard of the change.
TEST(ReplicaCacheTest, EntriesServeWhileTheMasterAnswersAndANewMembershipForgetsThem) {
  const absl::Duration fresh = absl::Milliseconds(100);
  client::internal::ReplicaCache cache(8, absl::ZeroDuration(), nullptr, fresh);
  const absl::Time now = absl::Now();
  client::internal::Located a;
  a.stored_size = 10;
  a.lease_end = now + absl::Seconds(5);
  a.replicas.emplace_back("seg", 0);
  cache.Insert("a", a, cache.generation(), now);
  EXPECT_FALSE(cache.Lookup("a", now).has_value()) << "no answer heard yet";
  cache.Heard(now, 1, 7);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(50)).has_value());
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value()) << "the master has been silent";
  // Kept meanwhile: an answer naming the same view makes it serve again.
  cache.Heard(now + absl::Milliseconds(140), 1, 7);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  // Segments left: everything goes, and a get begun before cannot bring it back.
  const uint64_t before = cache.generation();
  cache.Heard(now + absl::Milliseconds(145), 1, 8);
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  EXPECT_EQ(cache.size(), 0u);
  cache.Insert("a", a, before, now);
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  cache.Insert("a", a, cache.generation(), now);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  // A late answer asked before the change was heard changes nothing, and
  // renews nothing.
  cache.Heard(now - absl::Seconds(1), 1, 7);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(250)).has_value());
  // A new leader (another epoch) forgets them too.
  cache.Heard(absl::Now(), 2, 8);
  EXPECT_EQ(cache.size(), 0u);
}

// A counted read's lease is the cache's once inserted: held at most `hold`
// and given back exactly once, whatever makes the entry go, or at once when
// it is not kept; never given back when a read through it may still move.
TEST(ReplicaCacheTest, ACountedReadIsHeldAtMostItsHoldAndGivenBackOnce) {
  std::map<uint64_t, int> given;  // token -> give-backs
  auto release = [&](const std::string&, uint64_t token, int64_t) { ++given[token]; };
  const absl::Time now = absl::Now();
  uint64_t next_token = 1;
  auto counted = [&] {
    client::internal::Located w;
    w.stored_size = 10;
    w.lease_end = now + absl::Seconds(2);
    w.replicas.emplace_back("seg", 0);
    w.lease_token = next_token++;
    w.lease_expiry_ms = absl::ToUnixMillis(now + absl::Seconds(2));
    return w;
  };
  {
    client::internal::ReplicaCache cache(3, absl::Milliseconds(100), release);
    const client::internal::Located a = counted();
    cache.Insert("a", a, cache.generation(), now);
    std::optional<client::internal::Located> hit = cache.Lookup("a", now + absl::Milliseconds(50));
    ASSERT_TRUE(hit.has_value());
    EXPECT_TRUE(hit->cached);
    EXPECT_EQ(hit->lease_token, 0u);  // a hit holds nothing of its own
    EXPECT_EQ(hit->lease_end, now + absl::Milliseconds(100));  // the hold, not the lease
    cache.ReleaseEnded(now + absl::Milliseconds(99));
    EXPECT_TRUE(given.empty());
    cache.ReleaseEnded(now + absl::Milliseconds(100));
    EXPECT_EQ(given[a.lease_token], 1);
    EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(50)).has_value());
    // Each other way out gives it back once.
    const client::internal::Located b = counted(), c = counted(), d = counted(), e = counted();
    cache.Insert("b", b, cache.generation(), now);
    EXPECT_FALSE(cache.Lookup("b", now + absl::Milliseconds(100)).has_value());  // found ended
    cache.Insert("c", c, cache.generation(), now);
    cache.Erase("c");
    cache.Insert("d", d, cache.generation(), now);
    cache.Invalidate("d");
    cache.Insert("e", e, cache.generation(), now);
    const client::internal::Located e2 = counted();
    cache.Insert("e", e2, cache.generation(), now);  // replaced
    for (const auto* w : {&b, &c, &d, &e}) EXPECT_EQ(given[w->lease_token], 1) << w->lease_token;
    EXPECT_EQ(given.count(e2.lease_token), 0u);
    // An insert begun before an invalidation is refused, and its lease goes back.
    const uint64_t before = cache.generation();
    cache.Invalidate("x");
    const client::internal::Located f = counted();
    cache.Insert("f", f, before, now);
    EXPECT_EQ(given[f.lease_token], 1);
    EXPECT_FALSE(cache.Lookup("f", now).has_value());
    // A read that may still be moving bytes: forgotten, its lease kept.
    const client::internal::Located g = counted();
    cache.Insert("g", g, cache.generation(), now);
    cache.Erase("g", /*give_back=*/false);
    EXPECT_EQ(given.count(g.lease_token), 0u);
    // Full: what goes to make room gives its lease back.
    const client::internal::Located h = counted(), i = counted(), j = counted();
    cache.Insert("h", h, cache.generation(), now);
    cache.Insert("i", i, cache.generation(), now);
    cache.Insert("j", j, cache.generation(), now);  // e2, h, i were there: all go
    for (const auto* w : {&e2, &h, &i}) EXPECT_EQ(given[w->lease_token], 1) << w->lease_token;
    EXPECT_EQ(given.count(j.lease_token), 0u);
    cache.ReleaseEnded(now + absl::Seconds(1));  // the older records find nothing of theirs
    EXPECT_EQ(given[j.lease_token], 1);
    const client::internal::Located k = counted();
    cache.Insert("k", k, cache.generation(), now);
    cache.Clear();
    EXPECT_EQ(given[k.lease_token], 1);
    const client::internal::Located l = counted();
    cache.Insert("l", l, cache.generation(), now);
    EXPECT_EQ(given.count(l.lease_token), 0u);
  }
  EXPECT_EQ(given[next_token - 1], 1);  // l, at the cache's end
  // No hold, or no cache: a counted read is given back at once, never kept.
  for (auto [capacity, hold] : {std::pair<size_t, absl::Duration>{4, absl::ZeroDuration()},
                                {0, absl::Milliseconds(100)}}) {
    client::internal::ReplicaCache cache(capacity, hold, release);
    const client::internal::Located m = counted();
    cache.Insert("m", m, cache.generation(), now);
    EXPECT_EQ(given[m.lease_token], 1);
    EXPECT_FALSE(cache.Lookup("m", now).has_value());
  }
  for (const auto& [token, n] : given) EXPECT_LE(n, 1) << token;
}

}  // namespace
}  // namespace tierkv
