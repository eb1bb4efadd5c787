// Prefill-to-decode disaggregation (engine/pd.h): a prefill engine and a
// decode engine in this process, each with its own transfer engine in peer
// mode, over tcp and over shm.
#include <string>
#include <vector>

#include "engine/l3.h"
#include "engine/pd.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "tests/unit/engine_fixture.h"
#include "transport/engine.h"

namespace tierkv::engine {
namespace {

std::unique_ptr<transport::TransferEngine> PeerEngine(const std::string& transport, int port = 0) {
  transport::EngineOptions o;
  o.peer_mode = true;
  o.transports = {transport};
  o.backend.port = port;
  absl::StatusOr<std::unique_ptr<transport::TransferEngine>> e = transport::TransferEngine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

class PdTest : public ::testing::TestWithParam<std::string> {
 protected:
  // A prefill node: its engine, transfer engine and server.
  struct Prefill {
    std::unique_ptr<InferenceEngine> engine;
    std::unique_ptr<transport::TransferEngine> transfer;
    std::unique_ptr<PdPrefill> server;
  };
  Prefill StartPrefill(EngineConfig config, L3Store* l3 = nullptr, int port = 0) {
    Prefill p;
    p.engine = std::make_unique<InferenceEngine>(config, l3);
    p.transfer = PeerEngine(GetParam(), port);
    absl::StatusOr<std::unique_ptr<PdPrefill>> s = PdPrefill::Create(p.engine.get(), p.transfer.get());
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) p.server = std::move(*s);
    return p;
  }
  std::unique_ptr<PdDecode> StartDecode(InferenceEngine* engine, const std::vector<std::string>& prefills,
                                        PdOptions options = {}) {
    decode_transfer_ = PeerEngine(GetParam());
    absl::StatusOr<std::unique_ptr<PdDecode>> d = PdDecode::Create(engine, decode_transfer_.get(), prefills, options);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::move(*d) : nullptr;
  }
  std::unique_ptr<transport::TransferEngine> decode_transfer_;
};

TEST_P(PdTest, PagesFromPrefillGiveBitIdenticalLogitsAndContinuations) {
  Prefill prefill = StartPrefill(SmallModel());
  InferenceEngine decode_engine(SmallModel(), nullptr);
  std::unique_ptr<PdDecode> decode = StartDecode(&decode_engine, {prefill.transfer->session_id()});
  ASSERT_TRUE(decode);
  for (size_t len : {40u, 150u, 201u}) {
    std::vector<int32_t> prompt = Tokens(len, static_cast<int>(len));
    InferenceEngine local(SmallModel(), nullptr);
    RequestResult want = local.Serve(prompt);
    RequestResult got = decode->Serve(prompt);
    ASSERT_TRUE(got.pd) << decode->stats().last_error;
    EXPECT_EQ(got.logits, want.logits) << len;
    // The pages decode received are the KV: a continuation computed on them
    // gives the logits a local prefill of the whole continuation gives.
    std::vector<int32_t> longer = prompt;
    for (int32_t t : Tokens(37, 9)) longer.push_back(t);
    RequestResult cont = decode_engine.Serve(longer);
    EXPECT_EQ(cont.cached_tokens, len / 16 * 16) << len;
    InferenceEngine fresh(SmallModel(), nullptr);
    EXPECT_EQ(cont.logits, fresh.Serve(longer).logits) << len;
  }
  EXPECT_EQ(decode->stats().requests, 3u);
  EXPECT_EQ(decode->stats().fallbacks, 0u);
  EXPECT_GT(decode->stats().bytes_received, 0u);
  EXPECT_EQ(prefill.server->served(), 3u);
}

TEST_P(PdTest, TheStoreServesThePrefixAndPrefillOnlyTheRest) {
  InMemoryL3 store;
  Prefill prefill = StartPrefill(SmallModel(), &store);
  std::vector<int32_t> prompt = Tokens(200, 3);
  {
    InferenceEngine first(SmallModel(), &store);
    std::unique_ptr<PdDecode> d = StartDecode(&first, {prefill.transfer->session_id()});
    ASSERT_TRUE(d->Serve(prompt).pd);  // prefill writes the pages back to the store
  }
  ASSERT_GT(store.size(), 0u);
  InferenceEngine second(SmallModel(), &store);
  std::unique_ptr<PdDecode> d = StartDecode(&second, {prefill.transfer->session_id()});
  std::vector<int32_t> longer = prompt;
  for (int32_t t : Tokens(100, 4)) longer.push_back(t);
  RequestResult r = d->Serve(longer);
  ASSERT_TRUE(r.pd) << d->stats().last_error;
  EXPECT_EQ(r.l3_tokens, 192u);  // the prompt's whole pages, from the store
  EXPECT_EQ(d->stats().pages_received, (300u + 15) / 16 - 12);  // only the rest came from prefill
  InferenceEngine local(SmallModel(), nullptr);
  EXPECT_EQ(r.logits, local.Serve(longer).logits);
}

TEST_P(PdTest, ADeadPrefillMeansARecomputeThenAProbeBeforeItIsUsedAgain) {
  Prefill prefill = StartPrefill(SmallModel());
  const std::string session = prefill.transfer->session_id();
  const int port = prefill.transfer->port();
  InferenceEngine decode_engine(SmallModel(), nullptr);
  PdOptions o;
  o.min_timeout = absl::Seconds(1);
  o.avoid_for = absl::Milliseconds(300);
  std::unique_ptr<PdDecode> decode = StartDecode(&decode_engine, {session}, o);
  // The prefill node goes away: its server, then its transfer engine.
  prefill.server.reset();
  prefill.transfer.reset();
  std::vector<int32_t> prompt = Tokens(120, 5);
  InferenceEngine local(SmallModel(), nullptr);
  const std::vector<float> want = local.Serve(prompt).logits;
  const absl::Time start = absl::Now();
  RequestResult r = decode->Serve(prompt);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(r.pd);
  EXPECT_EQ(r.logits, want);
  EXPECT_EQ(decode->stats().fallbacks, 1u);
  // Avoided: the next request does not wait for it.
  EXPECT_FALSE(decode->Serve(Tokens(120, 6)).pd);
  EXPECT_NE(decode->stats().last_error.find("avoided"), std::string::npos) << decode->stats().last_error;
  // Back at the same session, it is probed and used again.
  Prefill again = StartPrefill(SmallModel(), nullptr, port);
  ASSERT_EQ(again.transfer->session_id(), session);
  ASSERT_OK(testing::WaitFor("the restarted prefill to serve a request", absl::Seconds(10),
                             [&] { return decode->Serve(Tokens(120, 7)).pd; }));
}

TEST_P(PdTest, AStalledPrefillMeansARecomputeByTheDeadline) {
  // A peer that never answers: an engine in peer mode with nothing serving requests.
  std::unique_ptr<transport::TransferEngine> silent = PeerEngine(GetParam());
  InferenceEngine decode_engine(SmallModel(), nullptr);
  PdOptions o;
  o.min_timeout = absl::Milliseconds(400);
  std::unique_ptr<PdDecode> decode = StartDecode(&decode_engine, {silent->session_id()}, o);
  std::vector<int32_t> prompt = Tokens(100, 8);
  const absl::Time start = absl::Now();
  RequestResult r = decode->Serve(prompt);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_FALSE(r.pd);
  InferenceEngine local(SmallModel(), nullptr);
  EXPECT_EQ(r.logits, local.Serve(prompt).logits);
  EXPECT_NE(decode->stats().last_error.find("deadline"), std::string::npos) << decode->stats().last_error;
}

TEST_P(PdTest, ALayoutMismatchIsRefusedBeforeAnyByteMoves) {
  Prefill prefill = StartPrefill(SmallModel(/*page=*/32));
  InferenceEngine decode_engine(SmallModel(/*page=*/16), nullptr);
  std::unique_ptr<PdDecode> decode = StartDecode(&decode_engine, {prefill.transfer->session_id()});
  std::vector<int32_t> prompt = Tokens(100, 10);
  RequestResult r = decode->Serve(prompt);
  EXPECT_FALSE(r.pd);
  EXPECT_NE(decode->stats().last_error.find("layout mismatch"), std::string::npos) << decode->stats().last_error;
  EXPECT_EQ(prefill.server->refused(), 1u);
  EXPECT_EQ(prefill.transfer->Stats().bytes_written, 0u);
  InferenceEngine local(SmallModel(16), nullptr);
  EXPECT_EQ(r.logits, local.Serve(prompt).logits);
}

INSTANTIATE_TEST_SUITE_P(Transports, PdTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tierkv::engine
