// Handshakes of the same-host backends (shm, cuda) and the engine's
// routing of every handshake: bytes from a peer of the wrong JSON types
// are refused with a status on both sides, never thrown (an exception out
// of a backend used to terminate the process). The rdma backend's
// handshakes are covered in rdma_backend_test.cc, over the fake fabric.
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "tests/support/status_matchers.h"
#include "transport/cuda/cuda_handshake.h"
#include "transport/engine.h"
#include "transport/internal/builtin.h"
#include "transport/memory.h"

namespace tierkv::transport {
namespace {

using ::tierkv::testing::StatusIs;

class HandshakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    metadata_ = NewInMemoryMetadata();
    region_ = std::move(*SharedRegion::Create(1 << 20, {}));
    server_ = std::move(*TransferEngine::Create({.metadata = metadata_, .transports = {"shm", "tcp"}}));
    ASSERT_OK(server_->RegisterMemory(region_->data(), region_->size(), "cpu:0", region_->fd()));
    ASSERT_OK(server_->ServeSegment("seg", {region_->data()}));
    desc_ = *SegmentDescriptor::FromJson(*metadata_->Get(DescriptorKey("seg")));
  }
  absl::StatusOr<std::string> Handshake(const std::string& transport, const std::string& request) {
    return internal::TcpHandshake(desc_.control, transport, request, absl::Now() + absl::Seconds(5));
  }
  std::string Target() const {
    return absl::StrCat(R"("segment_index": )", desc_.segment_index, R"(, "segment_id": )", desc_.segment_id);
  }

  std::shared_ptr<MetadataClient> metadata_;
  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<TransferEngine> server_;
  SegmentDescriptor desc_;
};

TEST_F(HandshakeTest, TheEngineRefusesMalformedTargetsAndStaleSegments) {
  for (const std::string& req :
       {std::string("not json"), std::string("[]"), std::string("7"), std::string(R"({"segment_index": "0"})"),
        std::string(R"({"segment_index": 0})"), std::string(R"({"segment_index": 4294967296, "segment_id": 1})"),
        absl::StrCat(R"({"segment_index": 0, "segment_id": {"a": 1}})")}) {
    EXPECT_THAT(Handshake("shm", req), StatusIs(absl::StatusCode::kInvalidArgument)) << req;
  }
  std::string stale = absl::StrCat(R"({"host_id": ")", LocalHostId(), R"(", "segment_index": )",
                                   desc_.segment_index, R"(, "segment_id": )", desc_.segment_id + 1, "}");
  EXPECT_THAT(Handshake("shm", stale), StatusIs(absl::StatusCode::kNotFound));
  std::string good = absl::StrCat(R"({"host_id": ")", LocalHostId(), R"(", )", Target(), "}");
  EXPECT_OK(Handshake("shm", good));
}

TEST_F(HandshakeTest, ShmServerRefusesWrongTypes) {
  for (const std::string& fields : {std::string(R"("host_id": 5)"), std::string(R"("host_id": ["x"])"),
                                    std::string(R"("host_id": null)")}) {
    std::string req = absl::StrCat("{", Target(), ", ", fields, "}");
    EXPECT_THAT(Handshake("shm", req), StatusIs(absl::StatusCode::kInvalidArgument)) << req;
  }
  std::vector<char> buf(64);
  EXPECT_OK(server_->Transfer({{Op::kRead, buf.data(), "seg", 0, buf.size()}})[0]);  // still serving
}

// "pid" as a string used to throw type_error out of Prepare, in the
// client's thread.
TEST_F(HandshakeTest, ShmClientRefusesAnswersOfTheWrongTypes) {
  auto shm = internal::NewShmBackend({});
  ASSERT_TRUE(shm.ok());
  const std::string pid = std::to_string(getpid());
  for (const std::string& answer :
       {std::string(R"({"pid": "1", "buffers": []})"), std::string(R"({"pid": 1, "buffers": [5]})"),
        absl::StrCat(R"({"pid": )", pid, R"(, "buffers": [{"index": "0", "fd": 3, "length": 1048576}]})"),
        absl::StrCat(R"({"pid": )", pid, R"(, "buffers": [{"index": 0, "fd": [3], "length": 1048576}]})"),
        absl::StrCat(R"({"pid": )", pid, R"(, "buffers": [{"index": 0, "fd": 3, "length": -1}]})"),
        std::string(R"({"pid": -5, "buffers": []})"), std::string(R"({"buffers": []})"), std::string("[]"),
        std::string("garbage")}) {
    PrepareContext ctx;
    ctx.local_host_id = desc_.host_id;
    ctx.deadline = absl::Now() + absl::Seconds(5);
    ctx.handshake = [&](const std::string&, const std::string&, const std::string&,
                        absl::Time) -> absl::StatusOr<std::string> { return answer; };
    EXPECT_THAT((*shm)->Prepare(desc_, ctx), StatusIs(absl::StatusCode::kUnavailable)) << answer;
  }
}

TEST(CudaHandshakeTest, ParsersRefuseWrongTypes) {
  EXPECT_OK(cuda::ParseCudaRequest(R"({"host_id": "h", "segment_index": 0})"));
  for (const char* req : {R"({"host_id": 1})", "[]", "x", R"({"host_id": null})"}) {
    EXPECT_THAT(cuda::ParseCudaRequest(req), StatusIs(absl::StatusCode::kInvalidArgument)) << req;
  }
  auto ok = cuda::ParseCudaAnswer(R"({"pid": 7, "buffers": [{"index": 0, "handle": "ab", "addr": 4096, "length": 64}]})");
  ASSERT_OK(ok);
  EXPECT_EQ(ok->pid, 7);
  ASSERT_EQ(ok->buffers.size(), 1u);
  EXPECT_EQ(ok->buffers[0].addr, 4096u);
  for (const char* answer : {R"({"pid": "7", "buffers": []})", R"({"pid": 7, "buffers": [1]})",
                             R"({"pid": 7, "buffers": [{"index": 0, "handle": 5, "length": 64}]})",
                             R"({"pid": 7, "buffers": [{"index": 0, "addr": "x", "length": 64}]})",
                             R"({"pid": 7, "buffers": [{"index": -1, "length": 64}]})", R"({"pid": 7})", "null"}) {
    EXPECT_THAT(cuda::ParseCudaAnswer(answer), StatusIs(absl::StatusCode::kInvalidArgument)) << answer;
  }
}

}  // namespace
}  // namespace tierkv::transport
