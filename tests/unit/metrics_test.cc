#include "base/metrics.h"

#include <gtest/gtest.h>

#include "tests/support/promtool.h"

namespace tierkv::metrics {
namespace {

TEST(MetricsTest, RendersTextFormat) {
  Registry r;
  auto& calls = BuildCounter().Name("rpc_total").Help("RPCs served").Register(r);
  calls.Add({{"method", "Put"}}).Increment();
  calls.Add({{"method", "Put"}}).Increment(2);
  calls.Add({{"method", "Get \"x\"\n"}}).Increment();
  auto& g = BuildGauge().Name("used_bytes").Help("Bytes\\used\nnow").Register(r);
  g.Add({}).Set(1.5);
  auto& h = BuildHistogram().Name("latency_seconds").Help("Latency").Register(r);
  Histogram& hist = h.Add({{"method", "Put"}}, Histogram::BucketBoundaries{0.1, 1});
  hist.Observe(0.05);
  hist.Observe(0.5);
  hist.Observe(5);
  std::string text = r.Serialize();
  EXPECT_NE(text.find("# HELP rpc_total RPCs served\n# TYPE rpc_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("rpc_total{method=\"Put\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("rpc_total{method=\"Get \\\"x\\\"\\n\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("# HELP used_bytes Bytes\\\\used\\nnow\n"), std::string::npos);
  EXPECT_NE(text.find("used_bytes 1.5\n"), std::string::npos);
  EXPECT_NE(text.find("latency_seconds_bucket{method=\"Put\",le=\"0.1\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("latency_seconds_bucket{method=\"Put\",le=\"1\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("latency_seconds_bucket{method=\"Put\",le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("latency_seconds_sum{method=\"Put\"} 5.55\n"), std::string::npos);
  EXPECT_NE(text.find("latency_seconds_count{method=\"Put\"} 3\n"), std::string::npos);
}

TEST(MetricsTest, HooksRunBeforeSerializeAndRemoveDrops) {
  Registry r;
  auto& g = BuildGauge().Name("segments").Help("x").Register(r);
  int calls = 0;
  r.AddCollectHook([&] {
    ++calls;
    g.Add({{"segment", "a"}}).Set(calls);
  });
  EXPECT_NE(r.Serialize().find("segments{segment=\"a\"} 1\n"), std::string::npos);
  RemoveLabels(g, {{"segment", "a"}});
  g.Add({{"segment", "b"}}).Set(9);
  std::string text = r.Serialize();
  EXPECT_NE(text.find("segments{segment=\"a\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("segments{segment=\"b\"} 9\n"), std::string::npos);
}

TEST(MetricsTest, SeveralRegistriesMakeOneValidExpositionWithTheirLabels) {
  // Two engines export the same families; a master exports its own.
  Registry a, b, master;
  for (Registry* r : {&a, &b}) {
    BuildCounter().Name("tierkv_engine_requests_total").Help("Prompts served").Register(*r).Add({}).Increment(
        r == &a ? 3 : 5);
    BuildHistogram()
        .Name("tierkv_engine_ttft_seconds")
        .Help("Time to first token")
        .Register(*r)
        .Add({}, ExponentialBuckets(1e-3, 10, 3))
        .Observe(0.02);
  }
  BuildGauge().Name("tierkv_master_objects").Help("Objects").Register(master).Add({{"state", "complete"}}).Set(7);
  std::string text = SerializeAll({{&a, {{"engine", "a"}}}, {&b, {{"engine", "b"}}}, {&master, {}}});
  EXPECT_NE(text.find("tierkv_engine_requests_total{engine=\"a\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("tierkv_engine_requests_total{engine=\"b\"} 5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("tierkv_master_objects{state=\"complete\"} 7\n"), std::string::npos) << text;
  size_t first = text.find("# TYPE tierkv_engine_requests_total");
  EXPECT_EQ(text.find("# TYPE tierkv_engine_requests_total", first + 1), std::string::npos) << "declared twice";
  EXPECT_TRUE(testing::PromtoolAccepts(text));
  // Concatenating the registries' own texts would not be valid.
  EXPECT_FALSE(testing::PromtoolAccepts(a.Serialize() + b.Serialize()));
}

}  // namespace
}  // namespace tierkv::metrics

#include <random>

#include "base/crc32c.h"

namespace tierkv {
namespace {

TEST(Crc32cTest, KnownValuesAndPathsAgree) {
  // The standard check value of CRC-32C.
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  // Long buffers take the three-lane path; compare with byte-at-a-time
  // extension, which takes the short path, at many lengths and offsets.
  std::string data(200'000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 131) ^ (i >> 7));
  for (size_t len : {0ul, 1ul, 7ul, 8ul, 24575ul, 24576ul, 24577ul, 49152ul, 100'001ul, 200'000ul}) {
    uint32_t whole = Crc32c(data.data(), len);
    uint32_t pieces = 0;
    for (size_t at = 0; at < len; at += 1000) {
      pieces = Crc32cExtend(pieces, data.data() + at, std::min<size_t>(1000, len - at));
    }
    EXPECT_EQ(whole, pieces) << len;
    uint32_t split = Crc32cExtend(Crc32c(data.data(), len / 3), data.data() + len / 3, len - len / 3);
    EXPECT_EQ(whole, split) << len;
  }
}

TEST(Crc32cTest, CombiningPiecesChecksummedApartGivesTheWholesCrc) {
  std::string data(70'000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 37) ^ (i >> 5));
  const uint32_t seed = Crc32c("a key", 5);  // a value's CRC starts from its key's
  const uint32_t whole = Crc32cExtend(seed, data.data(), data.size());
  for (size_t cut : {0ul, 1ul, 4096ul, 65'536ul, 69'999ul, 70'000ul}) {
    const uint32_t a = Crc32cExtend(seed, data.data(), cut);
    const uint32_t b = Crc32c(data.data() + cut, data.size() - cut);
    EXPECT_EQ(Crc32cCombine(a, b, data.size() - cut), whole) << cut;
  }
  // Three pieces, checksummed in another order, joined in value order.
  const uint32_t p3 = Crc32c(data.data() + 50'000, 20'000);
  const uint32_t p1 = Crc32c(data.data(), 10'000);
  const uint32_t p2 = Crc32c(data.data() + 10'000, 40'000);
  EXPECT_EQ(Crc32cCombine(Crc32cCombine(Crc32cCombine(seed, p1, 10'000), p2, 40'000), p3, 20'000), whole);
  EXPECT_NE(Crc32cCombine(Crc32cCombine(Crc32cCombine(seed, p2, 40'000), p1, 10'000), p3, 20'000), whole);
}

// The bit-at-a-time definition, to check every path against.
uint32_t ReferenceCrc32c(uint32_t crc, const char* p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= static_cast<uint8_t>(p[i]);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1)));
  }
  return ~crc;
}

TEST(Crc32cTest, EveryPathMatchesTheDefinition) {
  std::printf("long buffers take the %s path\n", Crc32cPath());
  std::mt19937_64 rng(7);
  std::string data(300'000, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  std::vector<size_t> lengths = {0, 1, 15, 16, 255, 256, 511, 512, 513, 767, 768, 1023, 1024, 4096, 24576, 65536,
                                 99'999, 262'145, 299'936};
  for (int i = 0; i < 300; ++i) lengths.push_back(rng() % 6000);
  int checked_fold = 0, checked_stream = 0;
  for (size_t len : lengths) {
    const size_t off = rng() % 64;
    const uint32_t init = len % 2 ? static_cast<uint32_t>(rng()) : 0;
    const uint32_t want = ReferenceCrc32c(init, data.data() + off, len);
    EXPECT_EQ(Crc32cExtend(init, data.data() + off, len), want) << len;
    std::string copy(len + 2, '\0');
    EXPECT_EQ(Crc32cCopy(init, copy.data() + 1, data.data() + off, len), want) << len;
    EXPECT_EQ(copy.substr(1, len), data.substr(off, len)) << len;
    // The copies out: into a 64-byte aligned place (the streaming path)
    // and one off it, with guard bytes either side that must stay.
    for (size_t skew : {size_t{0}, size_t{1} + rng() % 63}) {
      std::string out(len + 192, '#');
      char* at = out.data() + (64 - reinterpret_cast<uintptr_t>(out.data()) % 64) + skew;
      const size_t before = static_cast<size_t>(at - out.data()), after = out.size() - before - len;
      EXPECT_EQ(Crc32cCopyOut(init, at, data.data() + off, len), want) << len << " skew " << skew;
      EXPECT_EQ(out.substr(before, len), data.substr(off, len)) << len << " skew " << skew;
      std::fill(at, at + len, '#');
      EXPECT_EQ(out, std::string(out.size(), '#')) << "Crc32cCopyOut wrote outside its range: " << len;
      CopyOut(at, data.data() + off, len);
      EXPECT_EQ(out.substr(before, len), data.substr(off, len)) << len << " skew " << skew;
      EXPECT_EQ(out.substr(0, before) + out.substr(before + len), std::string(before + after, '#')) << len;
    }
    for (const char* path : {"table", "sse4.2", "vpclmulqdq", "vpclmulqdq-copy", "vpclmulqdq-stream", "copy-blocks"}) {
      uint32_t crc = init;
      std::string out(len + 130, '\0');
      const bool stream = std::string_view(path) == "vpclmulqdq-stream";
      // The streaming path needs a line-aligned destination; the others get
      // one off a line (odd lengths) or on one (even), so the fold's copy
      // runs with and without its aligning head.
      const size_t aligned = 64 - reinterpret_cast<uintptr_t>(out.data()) % 64;
      const size_t at = stream || len % 2 == 0 ? aligned : 1;
      if (!Crc32cExtendVia(path, &crc, out.data() + at, data.data() + off, len)) continue;
      EXPECT_EQ(crc, want) << path << " " << len;
      if (std::string_view(path).find("cop") != std::string_view::npos || stream) {
        EXPECT_EQ(out.substr(at, len), data.substr(off, len)) << path << " " << len;
      }
      if (std::string_view(path).starts_with("vpclmulqdq")) ++checked_fold;
      if (stream) ++checked_stream;
    }
  }
  if (checked_fold == 0) std::printf("this CPU has no VPCLMULQDQ: the fold was not checked here\n");
  if (checked_fold > 0) {
    EXPECT_GT(checked_stream, 0);
  }
}

}  // namespace
}  // namespace tierkv
