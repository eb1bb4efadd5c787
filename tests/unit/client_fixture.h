// What the client's end-to-end tests share (client_*_test.cc, one binary:
// tierkv_client_tests): a real master and two lenders in this process
// (ClientTest), "rdma" as the fake verbs fabric, and "gated", tcp behind a
// gate a test closes or slows (client_fixture.cc registers both).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "client/client.h"
#include "config/master_config.h"
#include "master/server.h"
#include "tests/support/status_matchers.h"
#include "transport/rdma/fake_verbs.h"

// Not in an anonymous namespace: one ClientTest (and one gate, one
// fabric) for every file of the binary.
namespace tierkv {

// The fake fabric behind "rdma": two NICs, on NUMA nodes 0 and 1.
std::shared_ptr<transport::rdma::FakeFabric> Fabric();
// Work requests posted on both of its NICs so far.
uint64_t RdmaPosted();

// The gate "gated" transfers pass.
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

Gate& TheGate();

const char* NoEnv(const char*);

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

// `n` patterned bytes.
std::string Value(size_t n, char seed);

// A client with the replica cache on (as by default), whose entries serve
// within `fresh` of the master's last answer.
std::unique_ptr<client::Client> Cached(client::ClientOptions o,
                                       absl::Duration fresh = client::ClientOptions().replica_cache_fresh);

}  // namespace tierkv
