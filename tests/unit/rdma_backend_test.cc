// The rdma backend's logic over the fake fabric (two NICs, on NUMA nodes 0
// and 1): striping, NUMA affinity, retries on another device, QP
// re-establishment, pausing a failing device, and clean failure when no
// device can reach the peer. This file also makes "rdma" mean the fake in
// this binary, so the transport conformance suite runs against it. The
// real libibverbs backend is exercised last, where hardware exists.
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "transport/engine.h"
#include "transport/internal/builtin.h"
#include "transport/memory.h"
#include "transport/rdma/fake_verbs.h"
#include "transport/rdma/rdma_backend.h"

namespace tierkv::transport::rdma {
namespace {

using ::tierkv::testing::StatusIs;
using ::tierkv::testing::WaitFor;

PortInfo FakePort(const std::string& name, int numa) {
  PortInfo p;
  p.device = name;
  p.active = true;
  p.numa_node = numa;
  p.lid = 1;
  return p;
}

std::shared_ptr<FakeFabric> Fabric() {
  static auto* fabric = new std::shared_ptr<FakeFabric>(
      FakeFabric::Create({FakePort("mlx5_0", 0), FakePort("mlx5_1", 1), FakePort("mlx5_2", 0)}));
  return *fabric;
}

RdmaOptions TestOptions() {
  RdmaOptions o;
  o.chunk = 256 << 10;
  o.pause = absl::Milliseconds(300);
  return o;
}

// "rdma" in this binary is the fake fabric (mlx5_2 is left inactive by
// default: tests name the devices they want).
const bool kRegistered = [] {
  RegisterBackend("rdma", [](const BackendOptions& o) {
    BackendOptions with = o;
    if (with.rdma_devices.empty()) with.rdma_devices = {"mlx5_0", "mlx5_1"};
    return NewRdmaBackend(with, Fabric(), TestOptions());
  });
  return true;
}();

void ReviveAll() {
  for (const char* d : {"mlx5_0", "mlx5_1", "mlx5_2"}) Fabric()->Revive(d);
}

class RdmaTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kSize = 32 << 20;
  void SetUp() override {
    ReviveAll();
    metadata_ = NewInMemoryMetadata();
    auto region = SharedRegion::Create(kSize, {});
    ASSERT_TRUE(region.ok());
    region_ = std::move(*region);
    auto server = TransferEngine::Create({.metadata = metadata_, .transports = {"rdma"}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_OK(server_->RegisterMemory(region_->data(), kSize, "cpu:0"));
    ASSERT_OK(server_->ServeSegment("seg", {region_->data()}));
    local_.reset(new char[kSize]);
    client_ = NewClient("cpu:0");
  }
  void TearDown() override { ReviveAll(); }

  std::unique_ptr<TransferEngine> NewClient(const std::string& location) {
    auto client = TransferEngine::Create({.metadata = metadata_, .transports = {"rdma"}});
    EXPECT_TRUE(client.ok()) << client.status();
    EXPECT_OK((*client)->RegisterMemory(local_.get(), kSize, location));
    return std::move(*client);
  }

  // Writes `n` patterned bytes at `offset`, reads them back, compares.
  absl::Status RoundTrip(uint64_t offset, uint64_t n, uint64_t seed, TransferEngine* engine = nullptr) {
    if (engine == nullptr) engine = client_.get();
    std::mt19937_64 rng(seed);
    for (uint64_t i = 0; i < n; i += 8) {
      uint64_t x = rng();
      std::memcpy(local_.get() + i, &x, std::min<uint64_t>(8, n - i));
    }
    std::string expect(local_.get(), n);
    auto w = engine->Transfer({{Op::kWrite, local_.get(), "seg", offset, n}}, absl::Seconds(5));
    if (!w[0].ok()) return w[0];
    if (std::memcmp(region_->data() + offset, expect.data(), n) != 0) return absl::DataLossError("served bytes differ");
    std::memset(local_.get(), 0, n);
    auto r = engine->Transfer({{Op::kRead, local_.get(), "seg", offset, n}}, absl::Seconds(5));
    if (!r[0].ok()) return r[0];
    if (std::memcmp(local_.get(), expect.data(), n) != 0) return absl::DataLossError("read bytes differ");
    return absl::OkStatus();
  }

  std::shared_ptr<MetadataClient> metadata_;
  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<TransferEngine> server_;
  std::unique_ptr<TransferEngine> client_;
  std::unique_ptr<char[]> local_;
};

TEST_F(RdmaTest, LargeTransfersAreStripedOverEveryDevice) {
  client_ = NewClient("cpu:5");  // near no NIC: chunks go round-robin
  uint64_t a = Fabric()->posted("mlx5_0"), b = Fabric()->posted("mlx5_1");
  ASSERT_OK(RoundTrip(4096, 24 << 20, 1));
  // 2 x 96 chunks of 256 KiB, alternating over the two NICs.
  EXPECT_GT(Fabric()->posted("mlx5_0") - a, 20u);
  EXPECT_GT(Fabric()->posted("mlx5_1") - b, 20u);
  EXPECT_EQ(client_->Describe("seg").transport, "rdma");
}

TEST_F(RdmaTest, ChunksPreferTheDeviceOnTheBuffersNumaNode) {
  client_ = NewClient("cpu:1");  // mlx5_1 sits on node 1
  uint64_t a = Fabric()->posted("mlx5_0"), b = Fabric()->posted("mlx5_1");
  ASSERT_OK(RoundTrip(0, 2 << 20, 2));
  EXPECT_EQ(Fabric()->posted("mlx5_0") - a, 0u);
  EXPECT_EQ(Fabric()->posted("mlx5_1") - b, 16u);  // 8 chunks each way
}

TEST_F(RdmaTest, FailedCompletionsAreRetriedOnAnotherDevice) {
  ASSERT_OK(RoundTrip(0, 4 << 20, 3));  // connect first
  Fabric()->FailCompletions("mlx5_0", 2);
  ASSERT_OK(RoundTrip(0, 8 << 20, 4));
  ASSERT_OK(RoundTrip(1 << 20, 8 << 20, 5));
}

TEST_F(RdmaTest, QueuePairsInErrorAreReestablishedOnNextUse) {
  client_ = NewClient("cpu:5");  // near no NIC: both carry chunks
  ASSERT_OK(RoundTrip(0, 24 << 20, 6));
  uint64_t qa = Fabric()->queue_pairs_created("mlx5_0"), qb = Fabric()->queue_pairs_created("mlx5_1");
  Fabric()->BreakQueuePairs("mlx5_0");
  Fabric()->BreakQueuePairs("mlx5_1");
  ASSERT_OK(RoundTrip(0, 24 << 20, 7));
  // A fresh QP on each side of each link (client and server).
  EXPECT_GE(Fabric()->queue_pairs_created("mlx5_0") - qa, 2u);
  EXPECT_GE(Fabric()->queue_pairs_created("mlx5_1") - qb, 2u);
  ASSERT_OK(RoundTrip(0, 8 << 20, 8));
}

TEST_F(RdmaTest, DeviceDyingMidTransferFailsOverAndIsPaused) {
  ASSERT_OK(RoundTrip(0, 1 << 20, 9));
  Fabric()->KillDeviceAfter("mlx5_1", 5);
  ASSERT_OK(RoundTrip(0, 16 << 20, 10));  // every byte arrives over mlx5_0
  // The dead NIC is paused: the next transfer does not even try it.
  uint64_t b = Fabric()->posted("mlx5_1");
  ASSERT_OK(RoundTrip(0, 4 << 20, 11));
  EXPECT_EQ(Fabric()->posted("mlx5_1"), b);
}

TEST_F(RdmaTest, NoDeviceLeftFailsCleanlyNamingDeviceAndPeer) {
  ASSERT_OK(RoundTrip(0, 1 << 20, 12));
  Fabric()->KillDeviceAfter("mlx5_0", 0);
  Fabric()->KillDeviceAfter("mlx5_1", 0);
  absl::Time start = absl::Now();
  auto st = client_->Transfer({{Op::kWrite, local_.get(), "seg", 0, 4 << 20}}, absl::Seconds(3));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_NE(st[0].message().find("mlx5_"), std::string::npos) << st[0];
  EXPECT_NE(st[0].message().find("seg"), std::string::npos) << st[0];
  // The NICs come back; after the pause the segment is reachable again.
  ReviveAll();
  absl::Status reached = absl::UnknownError("not tried");
  EXPECT_OK(WaitFor("the segment to be reachable again after the pause", absl::Seconds(10), [&] {
    client_->ForgetPeers();
    reached = RoundTrip(0, 1 << 20, 13);
    return reached.ok();
  })) << reached;
}

TEST_F(RdmaTest, DevicesComeFromTheConfiguredList) {
  BackendOptions o;
  o.rdma_devices = {"mlx5_2"};
  auto only = NewRdmaBackend(o, Fabric(), TestOptions());
  ASSERT_TRUE(only.ok()) << only.status();
  EXPECT_EQ((*only)->endpoint(), "mlx5_2");
  o.rdma_devices = {"mlx9_9"};
  auto none = NewRdmaBackend(o, Fabric(), TestOptions());
  EXPECT_THAT(none, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_NE(none.status().message().find("mlx9_9"), std::string::npos) << none.status();
  // No device list: every active port.
  auto all = NewRdmaBackend({}, Fabric(), TestOptions());
  ASSERT_TRUE(all.ok());
  EXPECT_EQ((*all)->endpoint(), "mlx5_0,mlx5_1,mlx5_2");
}

TEST_F(RdmaTest, UnregisteredLocalMemoryIsRefused) {
  std::vector<char> stray(4096);
  auto st = client_->Transfer({{Op::kRead, stray.data(), "seg", 0, 4096}});
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(RdmaTest, MalformedHandshakesAreRefused) {
  auto b = NewRdmaBackend({}, Fabric(), TestOptions());
  ASSERT_TRUE(b.ok());
  for (const char* req : {"", "{}", "{\"qps\": 3}", "{\"qps\": [{\"qpn\": -1}]}", "{\"qps\": [{\"qpn\": 99999, \"psn\": 1}]}"}) {
    EXPECT_FALSE((*b)->ServeHandshake(req, nullptr, 0).ok()) << req;
  }
}

// Handshake fields of the wrong JSON type used to throw nlohmann's
// type_error out of ServeHandshake, through the tcp server, and terminate
// the serving process. They are refused over the wire now, and the server
// keeps serving.
TEST_F(RdmaTest, HandshakeFieldsOfTheWrongTypeAreRefusedOverTheWire) {
  ASSERT_OK(RoundTrip(0, 1 << 20, 7));
  auto desc = SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey("seg")));
  ASSERT_TRUE(desc.ok()) << desc.status();
  const std::string target =
      absl::StrCat(R"("segment_index": )", desc->segment_index, R"(, "segment_id": )", desc->segment_id);
  for (const std::string& fields : {std::string(R"("first_device": "x", "qps": [{"qpn": 1, "psn": 1}])"),
                                    std::string(R"("qps": [{"qpn": 1, "psn": 1, "lid": "x"}])"),
                                    std::string(R"("qps": [{"qpn": 1, "psn": 1, "mtu": [1024]}])"),
                                    std::string(R"("qps": [{"qpn": 1, "psn": 1, "gid": 5}])"),
                                    std::string(R"("qps": [{"qpn": "1", "psn": 1}])")}) {
    std::string req = absl::StrCat("{", target, ", ", fields, "}");
    auto answer = internal::TcpHandshake(desc->control, "rdma", req, absl::Now() + absl::Seconds(5));
    EXPECT_THAT(answer, StatusIs(absl::StatusCode::kInvalidArgument)) << req;
  }
  for (const char* req : {R"({"segment_index": "0", "qps": []})", R"({"segment_index": 0, "segment_id": -3})",
                          R"([1, 2])", R"("just a string")", R"({"segment_index": 0, "segment_id": 1.5})"}) {
    auto answer = internal::TcpHandshake(desc->control, "rdma", req, absl::Now() + absl::Seconds(5));
    EXPECT_THAT(answer, StatusIs(absl::StatusCode::kInvalidArgument)) << req;
  }
  // A handshake naming another incarnation of the segment is not served.
  std::string stale = absl::StrCat(R"({"segment_index": )", desc->segment_index, R"(, "segment_id": )",
                                   desc->segment_id ^ 1, R"(, "qps": [{"qpn": 1, "psn": 1}]})");
  EXPECT_THAT(internal::TcpHandshake(desc->control, "rdma", stale, absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(RoundTrip(0, 1 << 20, 8));  // still serving
}

// The client side: a malformed answer to Prepare's handshake fails Prepare
// (UNAVAILABLE, so the engine falls back), whatever the types.
TEST_F(RdmaTest, HandshakeAnswersOfTheWrongTypeFailPrepareCleanly) {
  BackendOptions o;
  o.rdma_devices = {"mlx5_0", "mlx5_1"};
  auto b = NewRdmaBackend(o, Fabric(), TestOptions());
  ASSERT_TRUE(b.ok()) << b.status();
  auto desc = SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey("seg")));
  ASSERT_TRUE(desc.ok());
  for (const char* answer :
       {R"({"qps": [{"qpn": 1, "psn": 1, "device": 5}, {"qpn": 2, "psn": 1, "device": 5}]})",
        R"({"qps": [{"qpn": 1, "psn": 1, "lid": "x"}, {"qpn": 2, "psn": 1}]})",
        R"({"qps": [{"qpn": 1, "psn": 1, "device": "mlx5_0"}, 7]})", R"({"qps": {"a": 1}})", R"([])", R"(null)",
        R"({"qps": [{"qpn": 1, "psn": 1, "mtu": "big", "device": "mlx5_0"}, {"qpn": 2, "psn": 1}]})"}) {
    PrepareContext ctx;
    ctx.deadline = absl::Now() + absl::Seconds(5);
    ctx.handshake = [&](const std::string&, const std::string&, const std::string&,
                        absl::Time) -> absl::StatusOr<std::string> { return std::string(answer); };
    auto ch = (*b)->Prepare(*desc, ctx);
    EXPECT_THAT(ch, StatusIs(absl::StatusCode::kUnavailable)) << answer;
  }
}

// The libibverbs backend itself, on a machine with an RDMA NIC.
TEST(RdmaHardwareTest, LoopbackRoundTripOnARealNic) {
  std::vector<PortInfo> ports = RealVerbs()->Ports();
  bool active = std::any_of(ports.begin(), ports.end(), [](const PortInfo& p) { return p.active; });
  if (!active) {
    GTEST_SKIP() << "no RDMA device: ibv_get_device_list found " << ports.size()
                 << " port(s), none active; the real backend is built but cannot run here";
  }
  auto metadata = NewInMemoryMetadata();
  BackendOptions o;
  auto real = [](const BackendOptions& opts) { return NewRdmaBackend(opts, RealVerbs()); };
  RegisterBackend("rdma", real);
  auto region = SharedRegion::Create(8 << 20, {});
  ASSERT_TRUE(region.ok());
  auto server = TransferEngine::Create({.metadata = metadata, .transports = {"rdma"}});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_OK((*server)->RegisterMemory((*region)->data(), 8 << 20, "cpu:0"));
  ASSERT_OK((*server)->ServeSegment("hw", {(*region)->data()}));
  auto client = TransferEngine::Create({.metadata = metadata, .transports = {"rdma"}});
  ASSERT_TRUE(client.ok());
  std::vector<char> buf(4 << 20, 'r');
  ASSERT_OK((*client)->RegisterMemory(buf.data(), buf.size(), "cpu:0"));
  ASSERT_OK((*client)->Transfer({{Op::kWrite, buf.data(), "hw", 0, buf.size()}})[0]);
  EXPECT_EQ(std::memcmp((*region)->data(), buf.data(), buf.size()), 0);
}

}  // namespace
}  // namespace tierkv::transport::rdma
