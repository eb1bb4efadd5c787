// What the master counts of what clients ask: pages asked, found and
// possible per client and key prefix, in /v1/stats, /metrics, tierkvctl
// stats and tierkvctl top. The fixture is store_fixture.h.
#include "tests/integration/store_fixture.h"

#include <cstdio>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "tests/support/promtool.h"

namespace tierkv::integration {
namespace {

std::string RunCtl(const std::string& args) {
  std::string cmd = testing::BinaryPath("tierkvctl") + " " + args;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return "popen failed";
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = ::pclose(p);
  if (rc != 0) out += absl::StrCat("\n[exit ", rc, "]");
  return out;
}

// The master counts what each client asks, whatever its engine: pages
// asked and found by prefix lookups (cumulative and windowed), in
// /v1/stats, /metrics and tierkvctl stats.
TEST_F(StoreClusterTest, PrefixLookupsAreCountedPerClient) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib"}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.client_id = "engine-a";
  auto c = client::Client::Create(o);
  ASSERT_OK(c);
  std::vector<std::string> chain = {"q-0", "q-1", "q-2", "q-3"};
  for (const char* k : {"q-0", "q-1", "q-3"}) ASSERT_OK((*c)->Put(k, ValueFor(k, 1024)));
  EXPECT_EQ(*(*c)->PrefixMatch(chain), 2u);  // a hole at q-2
  EXPECT_EQ(*(*c)->PrefixMatch({"q-0"}), 1u);
  EXPECT_EQ(*(*c)->BatchExists(chain), (std::vector<bool>{true, true, false, true}));
  nlohmann::json q = Stats()["queries"];
  ASSERT_TRUE(q.is_object()) << Stats().dump();
  nlohmann::json row;
  for (const auto& r : q["clients"]) {
    if (r["client"] == "engine-a") row = r;
  }
  ASSERT_TRUE(row.is_object()) << q.dump();
  EXPECT_EQ(row["prefix"]["pages_asked"], 5);
  EXPECT_EQ(row["prefix"]["pages_found"], 3);
  EXPECT_DOUBLE_EQ(row["prefix"]["hit_rate"].get<double>(), 0.6);
  EXPECT_EQ(row["prefix"]["window_pages_asked"], 5);
  EXPECT_EQ(row["exists"]["pages_asked"], 4);
  EXPECT_EQ(row["exists"]["pages_found"], 3);
  EXPECT_EQ(q["clients"][0]["client"], "all");
  absl::StatusOr<std::string> metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(metrics);
  EXPECT_THAT(*metrics, ::testing::HasSubstr(R"(tierkv_master_query_pages_asked_total{call="prefix",client="engine-a"} 5)"));
  EXPECT_THAT(*metrics, ::testing::HasSubstr(R"(tierkv_master_query_pages_found_total{call="prefix",client="engine-a"} 3)"));
  EXPECT_TRUE(testing::PromtoolAccepts(*metrics));
  std::string cmd = testing::BinaryPath("tierkvctl") + " --http=127.0.0.1:" + std::to_string(cluster_.http_port()) + " stats";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  EXPECT_EQ(::pclose(p), 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("engine-a"));
  EXPECT_THAT(out, ::testing::HasSubstr("60.0%"));
}

// The hit rate against its bound: pages found, and pages "possible" (ever
// stored, whether since removed or evicted), per client and per key
// prefix, with bytes found and the matched-length histogram, exactly as
// asked, in /v1/stats, /metrics, tierkvctl stats and tierkvctl top.
TEST_F(StoreClusterTest, HitRatesAreShownAgainstTheBoundOfEverStoredPages) {
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "4mib",
                            .master_flags = {"--query-stats-key-prefix-separator=@", "--hit-bound-sketch-bytes=1mib"}}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.client_id = "engine-h";
  auto c = client::Client::Create(o);
  ASSERT_OK(c);
  client::Client& cli = **c;

  // A chain of 8 pages of one model; page 5 removed; 2 never stored.
  constexpr size_t kPage = 64 << 10;
  std::vector<std::string> chain;
  for (int i = 0; i < 10; ++i) chain.push_back(absl::StrCat("llama3@p-", i));
  std::vector<std::string> values;
  std::vector<client::PutItem> items;
  for (int i = 0; i < 8; ++i) values.push_back(ValueFor(chain[i], kPage));
  for (int i = 0; i < 8; ++i) items.push_back({chain[i], values[i], "", i > 0 ? chain[i - 1] : ""});
  for (const auto& st : cli.BatchPut(items)) ASSERT_OK(st);
  ASSERT_OK(cli.Remove("llama3@p-5", true));
  ASSERT_EQ(*cli.master().PrefixMatch(chain), 5u);  // asked 10, found 5, possible 8

  // Another model's pages overflow the segment: the oldest are evicted.
  constexpr size_t kBig = 256 << 10;
  constexpr int kBigPages = 40;
  std::vector<std::string> big;
  for (int i = 0; i < kBigPages; ++i) {
    big.push_back(absl::StrCat("qwen@e-", i));
    ASSERT_OK(cli.Put(big.back(), ValueFor(big.back(), kBig)));
  }
  big.push_back("qwen@never");
  absl::StatusOr<v1::GetReplicasResponse> got = cli.master().GetReplicas(big);
  ASSERT_OK(got.status());
  uint64_t present = 0;
  for (uint32_t n : got->replica_counts()) present += n > 0;
  ASSERT_GT(present, 0u);
  ASSERT_LT(present, static_cast<uint64_t>(kBigPages)) << "nothing was evicted";
  nlohmann::json st = Stats();
  EXPECT_GT(st["evictions"].get<uint64_t>(), 0u);

  nlohmann::json q = st["queries"];
  nlohmann::json row, llama, qwen;
  for (const auto& r : q["clients"]) {
    if (r["client"] == "engine-h") row = r;
  }
  for (const auto& r : q["prefixes"]) {
    if (r["key_prefix"] == "llama3") llama = r;
    if (r["key_prefix"] == "qwen") qwen = r;
  }
  ASSERT_TRUE(row.is_object() && llama.is_object() && qwen.is_object()) << q.dump();
  EXPECT_EQ(row["prefix"]["pages_asked"], 10);
  EXPECT_EQ(row["prefix"]["pages_found"], 5);
  EXPECT_EQ(row["prefix"]["pages_possible"], 8);
  EXPECT_EQ(row["prefix"]["bytes_found"], 5 * client::StoredSize(kPage));
  EXPECT_DOUBLE_EQ(row["prefix"]["possible_rate"].get<double>(), 0.8);
  EXPECT_EQ(row["prefix"]["window_pages_possible"], 8);
  EXPECT_EQ(row["get"]["pages_asked"], kBigPages + 1);
  EXPECT_EQ(row["get"]["pages_found"], present);
  EXPECT_EQ(row["get"]["pages_possible"], kBigPages);  // evicted pages count: once stored
  EXPECT_EQ(row["get"]["bytes_found"], present * client::StoredSize(kBig));
  EXPECT_EQ(llama["prefix"]["pages_possible"], 8);
  EXPECT_EQ(llama["get"]["pages_asked"], 0);
  EXPECT_EQ(qwen["get"]["pages_found"], present);
  EXPECT_EQ(qwen["get"]["pages_possible"], kBigPages);
  EXPECT_EQ(q["prefix_match_pages"]["count"], 1);
  EXPECT_EQ(q["prefix_match_pages"]["sum"], 5.0);
  EXPECT_EQ(q["reuse_seconds"]["get"]["count"], present);
  EXPECT_LT(q["sketch_false_positive_rate"].get<double>(), 1e-6);

  absl::StatusOr<std::string> metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(metrics);
  for (const std::string& line :
       {std::string(R"(tierkv_master_query_pages_possible_total{call="prefix",client="engine-h"} 8)"),
        absl::StrCat(R"(tierkv_master_query_pages_possible_total{call="get",client="engine-h"} )", kBigPages),
        absl::StrCat(R"(tierkv_master_query_pages_found_total{call="get",client="engine-h"} )", present),
        absl::StrCat(R"(tierkv_master_query_bytes_found_total{call="prefix",client="engine-h"} )",
                     5 * client::StoredSize(kPage)),
        std::string(R"(tierkv_master_query_prefix_pages_possible_total{call="prefix",prefix="llama3"} 8)"),
        absl::StrCat(R"(tierkv_master_query_prefix_pages_asked_total{call="get",prefix="qwen"} )", kBigPages + 1),
        std::string("tierkv_master_prefix_match_pages_count 1")}) {
    EXPECT_THAT(*metrics, ::testing::HasSubstr(line));
  }

  const std::string http = absl::StrCat("--http=127.0.0.1:", cluster_.http_port());
  std::string out = RunCtl(http + " stats");
  EXPECT_THAT(out, ::testing::HasSubstr("hit rate 50.0 % of a possible 80.0 % (5 of 10 pages, 8 possible")) << out;
  out = RunCtl(http + " --iterations=2 --interval=100ms top");
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(out, "tierkvctl top")).size(), 3u) << out;  // two frames
  const std::string expect_prefix = absl::StrFormat("%-32s %-7s %10d %10d %10d %6.1f%% %6.1f%%", "client engine-h",
                                                    "prefix", 10, 5, 8, 50.0, 80.0);
  const std::string expect_get =
      absl::StrFormat("%-32s %-7s %10d %10d %10d", "prefix qwen", "get", kBigPages + 1, present, kBigPages);
  EXPECT_THAT(out, ::testing::HasSubstr(expect_prefix)) << out;
  EXPECT_THAT(out, ::testing::HasSubstr(expect_get)) << out;
  // The first frame has no rate yet; the second has one.
  EXPECT_THAT(out, ::testing::HasSubstr("evictions/s -")) << out;
  EXPECT_THAT(out, ::testing::ContainsRegex("evictions/s [0-9]+\\.[0-9]")) << out;
}

}  // namespace
}  // namespace tierkv::integration
