// SharedRegion's promises (refusing what the host cannot back, prefault,
// NUMA placement) and the host-memory and NUMA helpers behind them. The
// logic that needs no hardware runs against hand-made inputs (a fake sysfs
// tree, a HostMemory filled in by hand); what needs two NUMA nodes skips
// on a host with one.
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "transport/host_memory.h"
#include "transport/memory.h"
#include "transport/numa.h"

namespace tierkv::transport {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::tierkv::testing::StatusIs;

const uint64_t kPage = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));

// Pages of [p, p+len) that are resident in RAM.
uint64_t ResidentPages(const char* p, uint64_t len) {
  std::vector<unsigned char> vec((len + kPage - 1) / kPage);
  if (mincore(const_cast<char*>(p), len, vec.data()) != 0) return 0;
  uint64_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n;
}

TEST(CpuListTest, KernelFormats) {
  EXPECT_THAT(*ParseCpuList("0-3,8-11\n"), ElementsAre(0, 1, 2, 3, 8, 9, 10, 11));
  EXPECT_THAT(*ParseCpuList("5"), ElementsAre(5));
  EXPECT_THAT(*ParseCpuList("0,2,1,2"), ElementsAre(0, 1, 2));
  EXPECT_TRUE(ParseCpuList("").ok() && ParseCpuList("\n")->empty());  // a memory-only node
  for (const char* bad : {"a", "3-", "-3", "5-3", "1,,2", "0-3;4", "1 2"}) {
    EXPECT_THAT(ParseCpuList(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

class FakeSysfsTest : public ::testing::Test {
 protected:
  void SetUp() override { root_ = tierkv::testing::MakeTempDir("tierkv-sysfs"); }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void Node(int n, const std::string& cpulist) {
    std::string dir = root_ + "/node" + std::to_string(n);
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/cpulist") << cpulist << "\n";
  }
  std::string root_;
};

TEST_F(FakeSysfsTest, TwoNodeHost) {
  Node(0, "0-1");
  Node(1, "2-3");
  std::ofstream(root_ + "/possible") << "0-1\n";  // siblings that are not nodes are ignored
  std::filesystem::create_directories(root_ + "/power");
  ASSERT_OK_AND_ASSIGN(NumaTopology topo, NumaTopology::Load(root_));
  EXPECT_THAT(topo.nodes(), ElementsAre(0, 1));
  EXPECT_THAT(topo.cpus(1), ElementsAre(2, 3));
  EXPECT_OK(topo.Check(1));
  absl::Status missing = topo.Check(99);
  EXPECT_THAT(missing, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(missing.message()), HasSubstr("no such NUMA node 99"));
  EXPECT_THAT(std::string(missing.message()), HasSubstr("nodes: 0, 1"));
}

TEST_F(FakeSysfsTest, MemoryOnlyNodeAndBadCpulist) {
  Node(0, "0-3");
  Node(2, "");  // CXL memory: a node without CPUs
  ASSERT_OK_AND_ASSIGN(NumaTopology topo, NumaTopology::Load(root_));
  EXPECT_THAT(topo.nodes(), ElementsAre(0, 2));
  EXPECT_TRUE(topo.cpus(2).empty());
  EXPECT_THAT(topo.Check(1), StatusIs(absl::StatusCode::kInvalidArgument));
  Node(3, "zero");
  EXPECT_THAT(NumaTopology::Load(root_), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(FakeSysfsTest, NoNumaSupportMeansOneNode) {
  ASSERT_OK_AND_ASSIGN(NumaTopology topo, NumaTopology::Load(root_ + "/absent"));
  EXPECT_THAT(topo.nodes(), ElementsAre(0));
  EXPECT_EQ(topo.cpus(0).size(), static_cast<size_t>(sysconf(_SC_NPROCESSORS_ONLN)));
  EXPECT_THAT(topo.Check(1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(HostMemoryTest, ParsesMeminfo) {
  auto m = ParseMeminfo("MemTotal:       24576000 kB\nMemAvailable:   23551520 kB\n"
                        "HugePages_Total:       4\nbroken line\n");
  EXPECT_EQ(m["MemAvailable"], 23551520ull * 1024);
  EXPECT_EQ(m["HugePages_Total"], 4u);
  EXPECT_FALSE(m.contains("broken line"));
}

TEST(HostMemoryTest, TheTightestLimitBindsAndIsNamed) {
  const uint64_t kGiB = 1ull << 30;
  HostMemory h;
  h.mem_available = 20 * kGiB;
  h.promised = 4 * kGiB;
  EXPECT_OK(h.CheckFits(16 * kGiB));
  absl::Status s = h.CheckFits(17 * kGiB);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(std::string(s.message()), HasSubstr("MemAvailable 20"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("promised to other tierkv segments"));

  h.cgroup_room = 8 * kGiB;
  h.cgroup_limit_file = "/sys/fs/cgroup/x/memory.max";
  EXPECT_OK(h.CheckFits(4 * kGiB));
  s = h.CheckFits(5 * kGiB);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(std::string(s.message()), HasSubstr("/sys/fs/cgroup/x/memory.max"));

  h.overcommit_mode = 2;  // strict accounting: the commit room counts too
  h.commit_room = 6 * kGiB;
  EXPECT_OK(h.CheckFits(2 * kGiB));
  s = h.CheckFits(3 * kGiB);
  EXPECT_THAT(std::string(s.message()), HasSubstr("vm.overcommit_memory=2"));
}

// A terabyte on a host with a fraction of that is refused when asked for,
// not accepted and left for the OOM killer.
TEST(SharedRegionTest, MoreThanTheHostCanBackIsRefused) {
  ASSERT_OK_AND_ASSIGN(HostMemory host, HostMemory::Read());
  uint64_t size = 1ull << 40;
  if (host.mem_available >= size) GTEST_SKIP() << "this host has a terabyte available";
  auto region = SharedRegion::Create(size, {});
  ASSERT_THAT(region, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(std::string(region.status().message()), HasSubstr("cannot be backed by RAM"));
}

// Untouched pages of a region are what the next region's check must count
// as taken; touched ones are in MemAvailable already.
TEST(SharedRegionTest, UntouchedPagesCountAsPromised) {
  const uint64_t size = 64ull << 20;
  uint64_t before = PromisedBytesOfProcess(getpid());
  ASSERT_OK_AND_ASSIGN(auto region, SharedRegion::Create(size, {}));
  EXPECT_EQ(PromisedBytesOfProcess(getpid()) - before, size);
  memset(region->data(), 1, 1 << 20);
  EXPECT_EQ(PromisedBytesOfProcess(getpid()) - before, size - (1 << 20));
  ASSERT_OK_AND_ASSIGN(auto prefaulted, SharedRegion::Create(size, {.prefault = true}));
  EXPECT_EQ(PromisedBytesOfProcess(getpid()) - before, size - (1 << 20));
}

TEST(SharedRegionTest, LazyByDefaultPrefaultTouchesEveryPage) {
  const uint64_t size = 256ull << 20;
  ASSERT_OK_AND_ASSIGN(auto lazy, SharedRegion::Create(size, {}));
  EXPECT_LT(ResidentPages(lazy->data(), size), size / kPage / 10);
  for (int threads : {1, 4}) {
    ASSERT_OK_AND_ASSIGN(auto region, SharedRegion::Create(size, {.prefault = true, .prefault_threads = threads}));
    EXPECT_EQ(ResidentPages(region->data(), size), size / kPage) << threads << " threads";
  }
  // A size that is not a multiple of the share each thread gets.
  const uint64_t odd = (64ull << 20) * 3 + 5 * kPage;
  ASSERT_OK_AND_ASSIGN(auto region, SharedRegion::Create(odd, {.prefault = true, .prefault_threads = 2}));
  EXPECT_EQ(ResidentPages(region->data(), odd), odd / kPage);
}

TEST(SharedRegionTest, MlockLocksOrNamesTheLimit) {
  auto region = SharedRegion::Create(16ull << 20, {.mlock = true});
  if (region.ok()) {
    EXPECT_TRUE((*region)->locked());
    EXPECT_EQ(ResidentPages((*region)->data(), 16ull << 20), (16ull << 20) / kPage);
  } else {
    EXPECT_THAT(region, StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(std::string(region.status().message()), HasSubstr("RLIMIT_MEMLOCK"));
  }
}

TEST(SharedRegionTest, LocationNamesTheNodeTheMemoryIsOn) {
  ASSERT_OK_AND_ASSIGN(NumaTopology topo, NumaTopology::Load());
  const uint64_t size = 16ull << 20;
  ASSERT_OK_AND_ASSIGN(auto lazy, SharedRegion::Create(size, {}));
  EXPECT_OK(topo.Check(lazy->numa_node()));
  EXPECT_EQ(lazy->location(), "cpu:" + std::to_string(lazy->numa_node()));
  ASSERT_OK_AND_ASSIGN(auto touched, SharedRegion::Create(size, {.prefault = true}));
  EXPECT_EQ(touched->numa_node(), NodeOfMemory(touched->data(), size).value_or(-1));
  for (int node : topo.nodes()) {
    if (topo.cpus(node).empty()) continue;
    ASSERT_OK_AND_ASSIGN(auto bound, SharedRegion::Create(size, {.prefault = true, .numa_node = node}));
    EXPECT_EQ(bound->location(), "cpu:" + std::to_string(node));
    EXPECT_EQ(NodeOfMemory(bound->data(), size), node);
  }
  if (topo.nodes().size() < 2) {
    std::printf("one NUMA node here: placement on a second node is not exercised\n");
  }
}

TEST(SharedRegionTest, ANodeTheKernelLacksIsRefused) {
  EXPECT_THAT(SharedRegion::Create(1 << 20, {.numa_node = 99}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(NumaTest, PinningAThreadKeepsItOnTheNode) {
  ASSERT_OK_AND_ASSIGN(NumaTopology topo, NumaTopology::Load());
  if (topo.nodes().size() < 2) {
    GTEST_SKIP() << "one NUMA node: pinning to one node is the same as not pinning";
  }
  int node = topo.nodes().back();
  std::thread([&] {
    ASSERT_TRUE(PinThisThread(topo.cpus(node)).ok());
    EXPECT_EQ(CurrentNode(), node);
    std::thread child([&] { EXPECT_EQ(CurrentNode(), node); });  // inherited
    child.join();
  }).join();
}

TEST(NumaTest, PinAndRestore) {
  std::thread([] {
    ASSERT_OK_AND_ASSIGN(NumaTopology topo, NumaTopology::Load());
    ASSERT_OK_AND_ASSIGN(std::vector<int> previous, PinThisThread({topo.cpus(topo.nodes()[0]).front()}));
    ASSERT_FALSE(previous.empty());
    cpu_set_t set;
    ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
    EXPECT_EQ(CPU_COUNT(&set), 1);
    ASSERT_TRUE(PinThisThread(previous).ok());
    ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
    EXPECT_EQ(CPU_COUNT(&set), static_cast<int>(previous.size()));
  }).join();
  EXPECT_THAT(PinThisThread({}), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace tierkv::transport
