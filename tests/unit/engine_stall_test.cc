// One slow or dead peer stalls nobody else (issue #48, items 3 and 6).
//
// - A dead daemon's descriptor lookup, stalled at the metadata server,
//   holds no lock the engine's workers need: transfers to a live peer
//   through the same small worker pool complete meanwhile, and each
//   transfer to the dead segment fails at its own deadline.
// - A slow memory registration (an rdma NIC pinning hundreds of GB) does
//   not stop the engine serving the memory it already lends, nor its
//   local lookups of the served table.
//
// The slow parts are test backends made by the registry ("stallfab",
// "slowreg") whose steps wait on gates the test opens, and a loopback
// HTTP metadata server whose answer for one key waits likewise; every
// gate is bounded, so a broken engine fails the test instead of hanging it.
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "httplib.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "transport/engine.h"
#include "transport/metadata.h"
#include "transport/registry.h"

namespace tierkv::transport {
namespace {

using ::tierkv::testing::StatusIs;
using ::tierkv::testing::WaitFor;

// How long any gate holds at most: far past every deadline below, so a
// test that depends on a gate opening by itself fails clearly.
constexpr absl::Duration kGateBound = absl::Seconds(20);

// Waits on `cv` while `closed()` holds, at most kGateBound.
template <class Pred>
void HoldWhile(Mutex* mu, CondVar* cv, Pred closed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
  const absl::Time bound = absl::Now() + kGateBound;
  while (closed() && absl::Now() < bound) cv->WaitFor(mu, std::chrono::milliseconds(20));
}

// What the test backends do. They are made inside TransferEngine::Create,
// out of the test's reach, so their behaviour lives here.
struct Fabric {
  Mutex mu;
  CondVar cv;
  // stallfab: posts to `gated` wait while the gate is closed, then fail as
  // a dead peer's do.
  std::string gated ABSL_GUARDED_BY(mu);
  bool post_gate_closed ABSL_GUARDED_BY(mu) = false;
  int posts_held ABSL_GUARDED_BY(mu) = 0;
  std::set<std::string> unhealthy ABSL_GUARDED_BY(mu);  // segments whose channels report unhealthy
  // slowreg: RegisterBuffer waits while this gate is closed.
  bool registration_gate_closed ABSL_GUARDED_BY(mu) = false;
  int registrations_held ABSL_GUARDED_BY(mu) = 0;

  void Reset() {
    MutexLock lock(&mu);
    gated.clear();
    post_gate_closed = registration_gate_closed = false;
    posts_held = registrations_held = 0;
    unhealthy.clear();
    cv.SignalAll();
  }
};

Fabric& TheFabric() {
  static Fabric* fabric = new Fabric;
  return *fabric;
}

class FabChannel final : public PeerChannel {
 public:
  explicit FabChannel(std::string segment) : segment_(std::move(segment)) {}
  void Post(absl::Span<Slice* const> slices, absl::Time) override {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    if (f.post_gate_closed && f.gated == segment_) {
      ++f.posts_held;
      f.cv.SignalAll();
      HoldWhile(&f.mu, &f.cv, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(f.mu) { return f.post_gate_closed; });
      --f.posts_held;
      dead_ = true;
      for (Slice* s : slices) s->status = absl::UnavailableError("the fake peer died");
      return;
    }
    for (Slice* s : slices) {
      if (s->op == Op::kRead) std::memset(s->local, 0x5a, s->length);
      s->status = absl::OkStatus();
    }
  }
  bool healthy() const override {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    return !dead_ && !f.unhealthy.contains(segment_);
  }

 private:
  const std::string segment_;
  bool dead_ = false;  // guarded by TheFabric().mu
};

// Reaches every segment whose descriptor offers it; data never leaves the process.
class FabBackend final : public Backend {
 public:
  std::string name() const override { return "stallfab"; }
  Capabilities capabilities() const override { return {.rank = 1}; }
  absl::Status Start(ServedMemory*) override { return absl::OkStatus(); }
  void Stop() override {}
  std::string endpoint() const override { return "fab"; }
  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer&) override { return std::string(); }
  void UnregisterBuffer(const LocalBuffer&) override {}
  absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor& remote,
                                                       const PrepareContext&) override {
    return std::make_unique<FabChannel>(remote.name);
  }
};

// Registers local memory as slowly as the test wants (as rdma pins it), and
// reaches no peer.
class SlowRegBackend final : public Backend {
 public:
  std::string name() const override { return "slowreg"; }
  Capabilities capabilities() const override { return {.rank = 0, .needs_registered_local = true}; }
  absl::Status Start(ServedMemory*) override { return absl::OkStatus(); }
  void Stop() override {}
  std::string endpoint() const override { return "slowreg"; }
  absl::StatusOr<std::string> RegisterBuffer(const LocalBuffer&) override {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    if (f.registration_gate_closed) {
      ++f.registrations_held;
      f.cv.SignalAll();
      HoldWhile(&f.mu, &f.cv, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(f.mu) { return f.registration_gate_closed; });
      --f.registrations_held;
    }
    return std::string();
  }
  void UnregisterBuffer(const LocalBuffer&) override {}
  absl::StatusOr<std::unique_ptr<PeerChannel>> Prepare(const SegmentDescriptor&, const PrepareContext&) override {
    return absl::UnavailableError("slowreg reaches no peer");
  }
};

// The master's metadata endpoint (GET/PUT/DELETE /metadata?key=) on
// loopback, whose GET of one key can be held.
class MetadataServer {
 public:
  MetadataServer() {
    server_.Get("/metadata", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string key = req.get_param_value("key");
      MutexLock lock(&mu_);
      if (stalling_ && key == stalled_key_) {
        ++stalled_gets_;
        HoldWhile(&mu_, &cv_, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stalling_; });
      }
      auto it = data_.find(key);
      if (it == data_.end()) {
        res.status = 404;
        return;
      }
      res.set_content(it->second, "application/octet-stream");
    });
    server_.Put("/metadata", [this](const httplib::Request& req, httplib::Response&) {
      MutexLock lock(&mu_);
      data_[req.get_param_value("key")] = req.body;
    });
    server_.Delete("/metadata", [this](const httplib::Request& req, httplib::Response& res) {
      MutexLock lock(&mu_);
      if (data_.erase(req.get_param_value("key")) == 0) res.status = 404;
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~MetadataServer() {
    Release();
    server_.stop();
    thread_.join();
  }
  bool running() const { return port_ > 0 && server_.is_running(); }
  std::string url() const { return absl::StrCat("http://127.0.0.1:", port_); }

  void Set(const std::string& key, const std::string& value) {
    MutexLock lock(&mu_);
    data_[key] = value;
  }
  void Stall(const std::string& key) {
    MutexLock lock(&mu_);
    stalled_key_ = key;
    stalling_ = true;
  }
  void Release() {
    MutexLock lock(&mu_);
    stalling_ = false;
    cv_.SignalAll();
  }
  int stalled_gets() {
    MutexLock lock(&mu_);
    return stalled_gets_;
  }

 private:
  httplib::Server server_;
  int port_ = -1;
  std::thread thread_;
  Mutex mu_;
  CondVar cv_;
  std::map<std::string, std::string> data_ ABSL_GUARDED_BY(mu_);
  std::string stalled_key_ ABSL_GUARDED_BY(mu_);
  bool stalling_ ABSL_GUARDED_BY(mu_) = false;
  int stalled_gets_ ABSL_GUARDED_BY(mu_) = 0;
};

// A descriptor for a segment only "stallfab" reaches.
std::string FabDescriptor(const std::string& name) {
  SegmentDescriptor d;
  d.name = name;
  d.host = "fab-" + name;
  d.host_id = "fab-host";
  d.segment_id = 1;
  d.control = "127.0.0.1:1";
  d.transports["stallfab"] = "fab";
  d.buffers.push_back({0, 4 << 20, "cpu:0", {}});
  return d.ToJson();
}

class EngineStallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TheFabric().Reset();
    RegisterBackend("stallfab", [](const BackendOptions&) -> absl::StatusOr<std::unique_ptr<Backend>> {
      return std::make_unique<FabBackend>();
    });
    RegisterBackend("slowreg", [](const BackendOptions&) -> absl::StatusOr<std::unique_ptr<Backend>> {
      return std::make_unique<SlowRegBackend>();
    });
  }
  void TearDown() override { TheFabric().Reset(); }

  static void ClosePostGate(const std::string& segment) {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    f.gated = segment;
    f.post_gate_closed = true;
  }
  static void OpenGates() {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    f.post_gate_closed = false;
    f.registration_gate_closed = false;
    f.cv.SignalAll();
  }
  static int PostsHeld() {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    return f.posts_held;
  }
  static void MarkUnhealthy(const std::string& segment) {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    f.unhealthy.insert(segment);
  }
  static void CloseRegistrationGate() {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    f.registration_gate_closed = true;
  }
  static int RegistrationsHeld() {
    Fabric& f = TheFabric();
    MutexLock lock(&f.mu);
    return f.registrations_held;
  }
};

// Issue #48 item 3. Both workers end tasks for the dead segment (each then
// drops its dead channel) while a transfer to it is looking its
// descriptor up again and the metadata server does not answer.
TEST_F(EngineStallTest, StalledDescriptorLookupStallsNobodyElse) {
  MetadataServer server;
  ASSERT_OK(WaitFor("the metadata server to listen", absl::Seconds(10), [&] { return server.running(); }));
  server.Set(DescriptorKey("dead"), FabDescriptor("dead"));
  server.Set(DescriptorKey("live"), FabDescriptor("live"));
  // The client's own timeout is longer than any transfer's: only the
  // transfer's deadline can end the stalled lookup in time.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MetadataClient> metadata,
                       NewHttpMetadata(server.url(), absl::Seconds(15)));
  EngineOptions options;
  options.metadata = std::move(metadata);
  options.transports = {"stallfab"};
  options.workers = 2;
  options.host_id = "client-host";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> engine, TransferEngine::Create(options));

  // The engine's smallest task: two requests, two tasks (apart locally,
  // so they do not coalesce into one).
  constexpr uint64_t kTask = 256 << 10;
  std::vector<char> held_buf(3 * kTask), dead_buf(4096), other_buf(4096), live_buf(4096);
  ASSERT_OK(engine->Transfer({{Op::kRead, dead_buf.data(), "dead", 0, 4096}}, absl::Seconds(5))[0]);
  ASSERT_OK(engine->Transfer({{Op::kRead, live_buf.data(), "live", 0, 4096}}, absl::Seconds(5))[0]);

  // Every worker busy posting to the dead peer, which then dies.
  ClosePostGate("dead");
  std::shared_ptr<Batch> held = engine->Submit({{Op::kRead, held_buf.data(), "dead", 0, kTask},
                                                {Op::kRead, held_buf.data() + 2 * kTask, "dead", kTask, kTask}},
                                               absl::Seconds(30));
  ASSERT_OK(WaitFor("both workers to post to the dead peer", absl::Seconds(10), [] { return PostsHeld() == 2; }));
  MarkUnhealthy("dead");

  // A transfer to it looks its descriptor up again; the answer stalls.
  server.Stall(DescriptorKey("dead"));
  std::atomic<bool> stalled_done{false};
  absl::Status stalled_status;
  const absl::Time stalled_start = absl::Now();
  std::thread stalled([&] {
    stalled_status = engine->Transfer({{Op::kRead, dead_buf.data(), "dead", 0, 4096}}, absl::Seconds(4))[0];
    stalled_done = true;
  });
  ASSERT_OK(WaitFor("the dead segment's descriptor lookup to stall", absl::Seconds(10),
                    [&] { return server.stalled_gets() >= 1; }));

  // The workers' posts fail now; each drops the dead channel and moves on.
  OpenGates();
  std::vector<absl::Status> live =
      engine->Transfer({{Op::kRead, live_buf.data(), "live", 0, 4096}}, absl::Seconds(2));
  EXPECT_OK(live[0]) << "a transfer to a live peer waited behind the dead peer's descriptor lookup";
  EXPECT_OK(WaitFor("the workers to finish the dead peer's tasks", absl::Seconds(5), [&] { return held->Done(); }));

  // Another transfer to the dead segment waits for that lookup no longer
  // than its own deadline.
  const absl::Time other_start = absl::Now();
  absl::Status other =
      engine->Transfer({{Op::kRead, other_buf.data(), "dead", 0, 4096}}, absl::Milliseconds(500))[0];
  EXPECT_FALSE(other.ok());
  EXPECT_LT(absl::Now() - other_start, absl::Seconds(3)) << other;

  // The stalled transfer itself ends at its deadline, though the server
  // still holds the answer.
  EXPECT_OK(WaitFor("the stalled transfer to end at its deadline", absl::Seconds(10),
                    [&] { return stalled_done.load(); }));
  const absl::Duration stalled_took = absl::Now() - stalled_start;
  server.Release();
  stalled.join();
  EXPECT_LT(stalled_took, absl::Seconds(4) + absl::Seconds(5));
  EXPECT_TRUE(absl::IsDeadlineExceeded(stalled_status) || absl::IsUnavailable(stalled_status)) << stalled_status;
  EXPECT_EQ(server.stalled_gets(), 1) << "a second lookup of the same descriptor went out while one was in flight";
}

// Issue #48 item 6. An engine lends memory as a segment and then registers
// more; while that registration is slow, a peer reads the lent memory and
// the engine answers lookups of its served table.
TEST_F(EngineStallTest, SlowRegistrationDoesNotStopServing) {
  std::shared_ptr<MetadataClient> metadata = NewInMemoryMetadata();
  EngineOptions lender_options;
  lender_options.metadata = metadata;
  lender_options.transports = {"tcp", "slowreg"};
  lender_options.host_id = "lender-host";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> lender, TransferEngine::Create(lender_options));
  std::vector<char> lent(1 << 20, 'a');
  ASSERT_OK(lender->RegisterMemory(lent.data(), lent.size(), "cpu:0"));
  ASSERT_OK(lender->ServeSegment("lent", {lent.data()}));

  EngineOptions client_options;
  client_options.metadata = metadata;
  client_options.transports = {"tcp"};
  client_options.host_id = "client-host";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> client, TransferEngine::Create(client_options));
  std::vector<char> got(4096);
  ASSERT_OK(client->Transfer({{Op::kRead, got.data(), "lent", 0, 4096}}, absl::Seconds(5))[0]);

  CloseRegistrationGate();
  std::vector<char> more(1 << 20);
  std::atomic<bool> registered{false};
  absl::Status register_status;
  std::thread registering([&] {
    register_status = lender->RegisterMemory(more.data(), more.size(), "cpu:0");
    registered = true;
  });
  ASSERT_OK(WaitFor("the registration to be under way", absl::Seconds(10), [] { return RegistrationsHeld() == 1; }));

  std::memset(lent.data(), 'b', 4096);
  EXPECT_OK(client->Transfer({{Op::kRead, got.data(), "lent", 0, 4096}}, absl::Seconds(2))[0])
      << "the lender stopped serving while it registered other memory";
  EXPECT_EQ(got[0], 'b');
  std::atomic<bool> looked_up{false};
  std::thread lookup([&] {
    (void)lender->SegmentDataKey("lent");
    looked_up = true;
  });
  EXPECT_OK(WaitFor("a lookup of the served table", absl::Seconds(2), [&] { return looked_up.load(); }));
  // A range overlapping the one being registered is refused at once.
  if (looked_up) {
    EXPECT_THAT(lender->RegisterMemory(more.data() + 4096, 4096, "cpu:0"),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
  EXPECT_FALSE(registered.load());

  OpenGates();
  lookup.join();
  ASSERT_OK(WaitFor("the registration to finish", absl::Seconds(10), [&] { return registered.load(); }));
  registering.join();
  EXPECT_OK(register_status);
  EXPECT_OK(lender->ServeSegment("more", {more.data()}));
  EXPECT_OK(client->Transfer({{Op::kRead, got.data(), "more", 0, 4096}}, absl::Seconds(5))[0]);
}

}  // namespace
}  // namespace tierkv::transport
