// The daemon's halves of moving objects between its tiers, in one process:
// a master, a StoreDaemon with an SSD tier on a temporary directory, and a
// client. An object put to DRAM is offloaded to the SSD tier, staged back
// into the segment, and read there through the normal transfer path.
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "base/io/file_io.h"
#include "client/client.h"
#include "config/master_config.h"
#include "config/store_config.h"
#include "master/server.h"
#include "store/daemon.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/values.h"
#include "tests/support/wait.h"

namespace tierkv::store {
namespace {

using ::tierkv::testing::StatusIs;
using io::UringAvailable;

const char* NoEnv(const char*) { return nullptr; }

class TierMoveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status u = UringAvailable(); !u.ok()) GTEST_SKIP() << u.message();
    const char* margv[] = {"tierkv-master", "--rpc-port=0", "--http-port=0"};
    auto mcfg = MasterFlags().Parse(3, margv, nullptr, NoEnv);
    ASSERT_OK(mcfg.status());
    auto m = master::MasterServer::Start(*mcfg);
    ASSERT_OK(m.status());
    master_ = std::move(*m);
    dir_ = testing::MakeTempDir("tierkv-ssd");
    std::string maddr = absl::StrCat("127.0.0.1:", master_->rpc_port());
    std::string meta = absl::StrCat("http://127.0.0.1:", master_->http_port());
    std::vector<std::string> args{"tierkv-store", "--master=" + maddr, "--metadata=" + meta, "--port=0",
                                  "--http-port=0", "--segment-size=16mib", "--name=move-0", "--transport=tcp",
                                  "--ssd-dir=" + dir_, "--ssd-size=8mib", "--ssd-region-size=1mib"};
    std::vector<const char*> argv;
    for (auto& a : args) argv.push_back(a.c_str());
    auto scfg = StoreFlags().Parse(static_cast<int>(argv.size()), argv.data(), nullptr, NoEnv);
    ASSERT_OK(scfg.status());
    auto d = StoreDaemon::Start(*scfg);
    ASSERT_OK(d.status());
    daemon_ = std::move(*d);
    ASSERT_OK(testing::WaitFor("the store daemon to be ready", absl::Seconds(10), [&] { return daemon_->ready(); }));
    ASSERT_TRUE(daemon_->ready());
    client::ClientOptions co;
    co.master = maddr;
    co.metadata = meta;
    co.transports = {"tcp"};
    auto c = client::Client::Create(co);
    ASSERT_OK(c.status());
    client_ = std::move(*c);
  }
  void TearDown() override {
    client_.reset();
    daemon_.reset();
    master_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::unique_ptr<master::MasterServer> master_;
  std::string dir_;
  std::unique_ptr<StoreDaemon> daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(TierMoveTest, AnOffloadedObjectStagedBackIsReadThroughTheTransferPath) {
  std::string value = testing::Payload("page", 100000);
  ASSERT_OK(client_->Put("page", value));
  auto info = master_->master().index().Describe("page");
  ASSERT_OK(info.status());
  ASSERT_EQ(info->replicas.size(), 1u);
  TierMove move{"page", info->replicas[0].offset, info->replicas[0].length};
  ASSERT_OK(daemon_->OffloadToSsd({move})[0]);
  EXPECT_EQ(daemon_->ssd()->SizeOf("page"), move.length);

  // Stage it at the segment's far end, where nothing was put, and read it
  // there as a peer would: the value and its trailer, byte for byte.
  TierMove staged{"page", 16 * 1024 * 1024 - 256 * 1024, move.length};
  absl::StatusOr<uint64_t> n = daemon_->StageFromSsd({staged})[0];
  ASSERT_OK(n.status());
  EXPECT_EQ(*n, move.length);
  std::string at_put(move.length, '\0'), at_stage(move.length, '\0');
  std::vector<absl::Status> got = client_->engine().Transfer(
      {{transport::Op::kRead, at_put.data(), daemon_->segment(), move.offset, move.length},
       {transport::Op::kRead, at_stage.data(), daemon_->segment(), staged.offset, staged.length}});
  ASSERT_OK(got[0]);
  ASSERT_OK(got[1]);
  EXPECT_EQ(at_put.substr(0, value.size()), value);
  EXPECT_TRUE(at_stage == at_put) << "the staged bytes differ from the put's";
}

TEST_F(TierMoveTest, ExtentsOutsideTheSegmentAndMissingRecordsAreRefused) {
  EXPECT_THAT(daemon_->OffloadToSsd({{"k", 16 << 20, 1}})[0], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(daemon_->OffloadToSsd({{"k", 1, ~uint64_t{0}}})[0], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(daemon_->StageFromSsd({{"absent", 0, 4096}})[0].status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(daemon_->OffloadToSsd({{"k", 0, 8192}})[0]);
  EXPECT_THAT(daemon_->StageFromSsd({{"k", 0, 4096}})[0].status(), StatusIs(absl::StatusCode::kOutOfRange));
}

}  // namespace
}  // namespace tierkv::store
