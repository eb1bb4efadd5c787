// The cuda backend (built when the CUDA toolkit is found). Without a GPU
// the backend must refuse to start with the runtime's reason, and the GPU
// tests skip saying so. With one, the transport conformance cases run over
// GPU memory: device-to-device and device-to-host, 1 B to 64 MiB.
#include <cstring>
#include <random>
#include <thread>

#include "tests/support/status_matchers.h"
#include "transport/cuda/cuda_backend.h"
#include "transport/engine.h"
#include "transport/metadata.h"

namespace tierkv::transport::cuda {
namespace {

using ::tierkv::testing::StatusIs;

TEST(CudaBackendTest, StartsOnlyWithAGpuAndSaysWhyNot) {
  absl::StatusOr<int> gpus = DeviceCount();
  auto backend = NewCudaBackend({});
  if (gpus.ok()) {
    EXPECT_TRUE(backend.ok()) << backend.status();
  } else {
    EXPECT_THAT(backend, StatusIs(absl::StatusCode::kUnavailable));
    EXPECT_NE(backend.status().message().find("no GPU"), std::string::npos) << backend.status();
    // An engine choosing transports by itself runs without it.
    auto engine = TransferEngine::Create({.metadata = NewInMemoryMetadata()});
    EXPECT_TRUE(engine.ok()) << engine.status();
  }
}

class CudaConformance : public ::testing::Test {
 protected:
  static constexpr uint64_t kSize = 96ull << 20;
  void SetUp() override {
    absl::StatusOr<int> gpus = DeviceCount();
    if (!gpus.ok()) GTEST_SKIP() << gpus.status().message() << "; the GPU tests need a GPU";
    metadata_ = NewInMemoryMetadata();
    remote_ = static_cast<char*>(*DeviceAlloc(kSize, 0));
    local_dev_ = static_cast<char*>(*DeviceAlloc(kSize, 0));
    local_host_ = static_cast<char*>(*PinnedAlloc(kSize));
    auto server = TransferEngine::Create({.metadata = metadata_, .transports = {"cuda"}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_OK(server_->RegisterMemory(remote_, kSize, "cuda:0"));
    ASSERT_OK(server_->ServeSegment("gpu", {remote_}));
    auto client = TransferEngine::Create({.metadata = metadata_, .transports = {"cuda"}});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    ASSERT_OK(client_->RegisterMemory(local_dev_, kSize, "cuda:0"));
    ASSERT_OK(client_->RegisterMemory(local_host_, kSize, "cpu:0"));
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
    if (remote_) DeviceFree(remote_);
    if (local_dev_) DeviceFree(local_dev_);
    if (local_host_) PinnedFree(local_host_);
  }
  std::string Pattern(size_t n, uint64_t seed) {
    std::string v(n, '\0');
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < n; i += 8) {
      uint64_t x = rng();
      std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
    }
    return v;
  }
  std::string HostCopy(const char* p, size_t n) {
    std::string out(n, '\0');
    EXPECT_OK(Copy(out.data(), p, n));
    return out;
  }

  std::shared_ptr<MetadataClient> metadata_;
  char* remote_ = nullptr;
  char* local_dev_ = nullptr;
  char* local_host_ = nullptr;
  std::unique_ptr<TransferEngine> server_, client_;
};

TEST_F(CudaConformance, RoundTripsDeviceToDeviceAndDeviceToHost) {
  EXPECT_EQ(client_->Describe("gpu").transport, "cuda");
  uint64_t offset = 12345;
  for (uint64_t size : {1ull, 7ull, 4096ull, 65537ull, 1ull << 20, (4ull << 20) + 3, 64ull << 20}) {
    std::string want = Pattern(size, size);
    std::memcpy(local_host_, want.data(), size);
    ASSERT_OK(client_->Transfer({{Op::kWrite, local_host_, "gpu", offset, size}})[0]) << size;  // H2D
    EXPECT_EQ(HostCopy(remote_ + offset, size), want) << size;
    ASSERT_OK(client_->Transfer({{Op::kRead, local_dev_, "gpu", offset, size}})[0]) << size;  // D2D
    EXPECT_EQ(HostCopy(local_dev_, size), want) << size;
    std::memset(local_host_, 0, size);
    ASSERT_OK(client_->Transfer({{Op::kRead, local_host_, "gpu", offset, size}})[0]) << size;  // D2H
    EXPECT_EQ(std::string(local_host_, size), want) << size;
    offset += size + 1;
  }
}

TEST_F(CudaConformance, BatchesOutOfRangeAndConcurrency) {
  std::vector<Request> batch;
  for (int i = 0; i < 1024; ++i) batch.push_back({Op::kWrite, local_dev_ + i * 4096, "gpu", (1023 - i) * 8192ull, 4096});
  for (const absl::Status& s : client_->Transfer(batch)) ASSERT_OK(s);
  EXPECT_THAT(client_->Transfer({{Op::kRead, local_dev_, "gpu", kSize - 10, 20}})[0],
              StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(client_->Transfer({{Op::kRead, local_dev_, "gpu", UINT64_MAX - 5, 10}})[0],
              StatusIs(absl::StatusCode::kOutOfRange));
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 20; ++k) {
        auto st = client_->Transfer({{Op::kRead, local_host_ + t * (1 << 20), "gpu", t * (1ull << 20), 1 << 20}});
        bad += !st[0].ok();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace tierkv::transport::cuda
