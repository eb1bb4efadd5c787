// High availability: failover (docs/ha.md). A leader killed, stalled or
// restarted under load, a standby far behind, and a write granted by a
// deposed leader: no acknowledged put is lost and nothing stale is served.
// The fixture is ha_fixture.h.
#include "tests/integration/ha_fixture.h"
#include "tests/support/sanitizers.h"
#include "transport/engine.h"
#include "transport/metadata.h"

namespace tierkv::integration {
namespace {

TEST_F(HaTest, KillingTheLeaderUnderLoadLosesNoAcknowledgedPut) {
  const int leader = StartGroup();
  ASSERT_GE(leader, 0);
  const int standby = 1 - leader;
  ASSERT_OK_AND_ASSIGN(json before, Ha(leader));

  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  Writer w(c.get(), "kill");
  ASSERT_OK(WaitFor("200 puts acknowledged", absl::Seconds(30), [&] { return w.acked() >= 200; })) << Logs();
  masters_[leader]->Kill(SIGKILL);
  const absl::Time killed = absl::Now();
  ASSERT_OK(WaitFor("a put begun after the kill to be acknowledged", absl::Seconds(20),
                    [&] { return w.FirstAckAfter(killed) != absl::InfiniteFuture(); })) << Logs();
  const absl::Duration failover = w.FirstAckAfter(killed) - killed;
  const size_t at_failover = w.acked();
  ASSERT_OK(WaitFor("100 more puts acknowledged after the failover", absl::Seconds(20),
                    [&] { return w.acked() >= at_failover + 100; })) << Logs();
  w.Stop();
  std::printf("failover: first put acknowledged %.0f ms after the leader was killed; %zu puts acknowledged, %d "
              "failed\n",
              absl::ToDoubleMilliseconds(failover), w.acked(), w.failed());
  // The target (docs/ha.md); a sanitizer's build serves several times slower.
  EXPECT_LT(failover, testing::kSanitized ? absl::Seconds(10) : absl::Seconds(5));

  ASSERT_OK_AND_ASSIGN(json after, Ha(standby));
  EXPECT_EQ(after["role"], "leader");
  EXPECT_GT(after["epoch"].get<uint64_t>(), before["epoch"].get<uint64_t>());
  ExpectAllReadable(c.get(), w.keys());

  // The killed master comes back as a standby and catches up.
  StartMaster(leader);
  EXPECT_OK(WaitForSynced(standby, 1)) << Logs();
  ASSERT_OK_AND_ASSIGN(json rejoined, Ha(standby));
  EXPECT_EQ(rejoined["standbys"][0]["name"], absl::StrCat("127.0.0.1:", rpc_[leader])) << rejoined.dump();
}

// A put granted by the leader, whose commit comes after that leader was
// killed: the new leader never knew of the grant (PutEnd: no put in
// progress), so the client puts it again from the start there, and the
// put succeeds. The writer is a separate process that stalls before its
// commit (a failpoint), so the kill falls inside the put.
TEST_F(HaTest, APutWhoseLeaderDiesBeforeItsCommitIsPutAgainAtTheNextOne) {
  const int leader = StartGroup();
  ASSERT_GE(leader, 0);
  const std::string worker_dir = dir_ + "/worker";
  std::filesystem::create_directories(worker_dir);
  const std::string cmd = absl::StrCat(
      "echo listening port=0; exec /usr/bin/env TIERKV_FAILPOINTS=client.put.before_end=sleep:4000 ",
      BinaryPath("../tests/tierkv-test-worker"), " session ", MasterList(), " ", MetadataList(), " ", worker_dir,
      " 1 1");
  ASSERT_OK_AND_ASSIGN(auto worker, ChildProcess::Start("/bin/sh", {"-c", cmd}));
  // The put is granted: it waits as pending at the leader.
  ASSERT_OK(WaitFor("the worker's put to be pending at the leader", absl::Seconds(10), [&] {
    absl::StatusOr<json> st = GetJson(hosts_[leader], http_[leader], "/v1/stats");
    return st.ok() && st->value("pending", 0) >= 1;
  })) << Logs();
  masters_[leader]->Kill(SIGKILL);
  ASSERT_EQ(WaitForLeader(absl::Seconds(20), leader), 1 - leader) << Logs();
  json phase1;
  ASSERT_OK(WaitFor("the worker's phase 1 report", absl::Seconds(30), [&] {
    std::ifstream in(worker_dir + "/phase1");
    if (!in) return false;
    phase1 = json::parse(in, nullptr, false);
    return !phase1.is_discarded();
  })) << worker->Stderr() << Logs();
  EXPECT_EQ(phase1["acked"], 1) << worker->Stderr();
  EXPECT_EQ(phase1["verified"], 1) << worker->Stderr();
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(std::string got, c->Get("s1-0"));
  EXPECT_EQ(got, testing::SessionValue("s1-0"));
}

// A PutStart the leader holds when it is killed: the client's connection
// breaks with no answer (UNAVAILABLE), and the grant, if any was made,
// died with that leader. The client puts it again at the next leader,
// and the put succeeds. Both masters stall PutStart (a failpoint), so the
// kill falls inside the call.
TEST_F(HaTest, APutStartTheLeaderDiesHoldingIsPutAgainAtTheNextOne) {
  ASSERT_EQ(setenv("TIERKV_FAILPOINTS", "master.rpc.put_start=sleep:800", 1), 0);
  const int leader = StartGroup();
  unsetenv("TIERKV_FAILPOINTS");  // for the masters alone
  ASSERT_GE(leader, 0);
  // Time for the failover (about 3 s) and a second stalled PutStart.
  std::unique_ptr<client::Client> c = NewClient(absl::Seconds(10));
  ASSERT_NE(c, nullptr);
  const std::string value = Payload("held", kValueBytes);
  absl::Status put;
  absl::Time begun;
  std::thread writer([&] {
    begun = absl::Now();
    put = c->Put("held", value);
  });
  // The kill falls inside the 800 ms stall: the call has reached the
  // leader (counted on arrival, before its handler stalls).
  const absl::Status reached = WaitFor("the PutStart to reach the leader", absl::Seconds(10), [&] {
    return Metric(leader, "tierkv_master_rpc_total{method=\"PutStart\"}") >= 1;
  });
  const absl::Time killed = absl::Now();
  masters_[leader]->Kill(SIGKILL);
  writer.join();
  ASSERT_OK(reached) << Logs();
  std::printf("put begun %.0f ms before the kill: %s after %.0f ms\n", absl::ToDoubleMilliseconds(killed - begun),
              put.ToString().c_str(), absl::ToDoubleMilliseconds(absl::Now() - begun));
  ASSERT_OK(put) << Logs();
  EXPECT_EQ(WaitForLeader(absl::Seconds(20), leader), 1 - leader) << Logs();
  ASSERT_OK_AND_ASSIGN(std::string got, c->Get("held"));
  EXPECT_EQ(got, value);
}

// SIGSTOP the leader past its lease, then SIGCONT: it finds itself
// deposed, answers nothing as the leader, rejoins as a standby and catches
// up; puts made meanwhile at the new leader are all there.
TEST_F(HaTest, AStalledLeaderWakesDeposedRefusesAndRejoins) {
  const int leader = StartGroup();
  ASSERT_GE(leader, 0);
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  std::vector<std::string> keys;
  for (int i = 0; i < 50; ++i) {
    const std::string k = absl::StrCat("before-", i);
    ASSERT_OK(c->Put(k, Payload(k, kValueBytes)));
    keys.push_back(k);
  }

  masters_[leader]->Kill(SIGSTOP);
  const int next = WaitForLeader(absl::Seconds(20), leader);
  ASSERT_EQ(next, 1 - leader) << Logs();
  ASSERT_OK(WaitForLiveSegments(next, 1)) << Logs();
  for (int i = 0; i < 50; ++i) {
    const std::string k = absl::StrCat("during-", i);
    // The first may wait out the stopped master; none is lost.
    absl::Status s = c->Put(k, Payload(k, kValueBytes));
    if (!s.ok()) s = c->Put(k, Payload(k, kValueBytes));
    ASSERT_OK(s);
    keys.push_back(k);
  }

  Prober woken(rpc_[leader]);
  masters_[leader]->Kill(SIGCONT);
  EXPECT_OK(StaysFalse("the deposed leader answering after it woke", absl::Seconds(1),
                       [&] { return woken.oks() > 0; }));
  woken.Stop();
  EXPECT_EQ(woken.oks(), 0) << "the deposed leader answered after it woke";
  EXPECT_OK(WaitForSynced(next, 1, absl::Seconds(30))) << Logs();
  ASSERT_OK_AND_ASSIGN(json ha, Ha(next));
  EXPECT_EQ(ha["standbys"][0]["name"], absl::StrCat("127.0.0.1:", rpc_[leader])) << ha.dump();
  ExpectAllReadable(c.get(), keys);
}

// The standby is stopped while the leader acknowledges puts it alone has;
// the leader is then killed. The standby, far behind, must not serve; the
// old leader, restarted, serves them all.
TEST_F(HaTest, AStandbyFarBehindDoesNotServeWhatItLacks) {
  const int leader = StartGroup();
  ASSERT_GE(leader, 0);
  const int standby = 1 - leader;
  auto c = NewClient();
  ASSERT_NE(c, nullptr);

  masters_[standby]->Kill(SIGSTOP);
  std::vector<std::string> keys;
  for (int i = 0; i < 100; ++i) {
    const std::string k = absl::StrCat("alone-", i);
    ASSERT_OK(c->Put(k, Payload(k, kValueBytes)));
    keys.push_back(k);
  }
  ASSERT_OK_AND_ASSIGN(json ha, Ha(leader));
  EXPECT_EQ(ha["sync"], "degraded") << ha.dump();
  EXPECT_GT(ha["degraded_writes"].get<uint64_t>(), 0u);
  masters_[leader]->Kill(SIGKILL);
  masters_[standby]->Kill(SIGCONT);
  // Three lease times: the standby sees the leader key gone, and stays a standby.
  EXPECT_OK(StaysFalse("a master serving as the leader", absl::Seconds(6), Throttled([&] { return LeaderNow() >= 0; })))
      << Logs();

  StartMaster(leader);
  ASSERT_EQ(WaitForLeader(), leader) << Logs();
  ASSERT_OK(WaitForLiveSegments(leader, 1)) << Logs();
  ExpectAllReadable(c.get(), keys);
  EXPECT_OK(WaitForSynced(leader, 1, absl::Seconds(30))) << Logs();
}

// Every master restarted in turn (SIGTERM, then started again) under a
// steady load of puts: nothing acknowledged is lost.
TEST_F(HaTest, ARollingRestartOfEveryMasterLosesNothing) {
  int leader = StartGroup();
  ASSERT_GE(leader, 0);
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  Writer w(c.get(), "rolling", 6000);
  // The standby first, then the leader (whose successor is the restarted
  // standby), then the first leader's successor.
  for (int round = 0; round < 3; ++round) {
    const size_t acked = w.acked();
    ASSERT_OK(WaitFor("100 more puts acknowledged", absl::Seconds(30),
                      [&] { return w.acked() >= acked + 100; })) << Logs();
    const int victim = round == 0 ? 1 - leader : leader;
    masters_[victim]->Kill(SIGTERM);
    ASSERT_EQ(masters_[victim]->Wait(absl::Seconds(20)), 0) << Logs();
    if (victim == leader) {
      leader = WaitForLeader(absl::Seconds(20), victim);
      ASSERT_EQ(leader, 1 - victim) << Logs();
    }
    StartMaster(victim);
    ASSERT_OK(WaitForSynced(leader, 1, absl::Seconds(30))) << Logs();
  }
  const size_t acked = w.acked();
  ASSERT_OK(WaitFor("100 more puts acknowledged", absl::Seconds(30),
                    [&] { return w.acked() >= acked + 100; })) << Logs();
  w.Stop();
  std::printf("rolling restart: %zu puts acknowledged, %d failed\n", w.acked(), w.failed());
  ExpectAllReadable(c.get(), w.keys());
}

// A write granted by the leader reaches the daemon only after that leader
// was replaced: the daemon, mounted at the new leader, refuses it (tcp
// frames carry the granting master's epoch), and writes at the new epoch
// go on.
TEST_F(HaTest, AWriteGrantedByADeposedLeaderIsRefusedByTheDaemon) {
  const int leader = StartGroup();
  ASSERT_GE(leader, 0);

  // The grant a client holds when its leader dies.
  ASSERT_OK_AND_ASSIGN(auto old_master, client::MasterClient::Create(absl::StrCat("127.0.0.1:", rpc_[leader])));
  v1::PutStartRequest start;
  v1::PutStartItem* item = start.add_items();
  item->set_key("granted-before-failover");
  item->set_size(4096);
  ASSERT_OK_AND_ASSIGN(v1::PutStartResponse granted, old_master->PutStart(start));
  ASSERT_EQ(granted.results_size(), 1);
  ASSERT_EQ(granted.results(0).status().code(), 0) << granted.results(0).status().message();
  const v1::Extent extent = granted.results(0).replicas(0);
  const uint64_t old_epoch = granted.epoch();
  ASSERT_GT(old_epoch, 0u);

  masters_[leader]->Kill(SIGKILL);
  const int next = WaitForLeader(absl::Seconds(20), leader);
  ASSERT_EQ(next, 1 - leader) << Logs();
  ASSERT_OK(WaitForLiveSegments(next, 1)) << Logs();  // the daemon mounted at the new epoch
  ASSERT_OK_AND_ASSIGN(json ha, Ha(next));
  const uint64_t new_epoch = ha["epoch"].get<uint64_t>();
  ASSERT_GT(new_epoch, old_epoch);

  ASSERT_OK_AND_ASSIGN(auto metadata, transport::NewHttpMetadata(MetadataList()));
  ASSERT_OK_AND_ASSIGN(auto engine, transport::TransferEngine::Create(
                                        {.metadata = std::shared_ptr<transport::MetadataClient>(std::move(metadata)),
                                         .transports = {"tcp"}}));
  std::string late(4096, 'L');
  std::vector<absl::Status> st = engine->Transfer(
      {{transport::Op::kWrite, late.data(), extent.segment(), extent.offset(), late.size(), nullptr, old_epoch}},
      absl::Seconds(5));
  EXPECT_TRUE(absl::IsFailedPrecondition(st[0])) << st[0];
  EXPECT_NE(st[0].message().find("epoch"), std::string::npos) << st[0];
  std::printf("a write granted at epoch %llu, sent after the failover to epoch %llu: %s\n",
              static_cast<unsigned long long>(old_epoch), static_cast<unsigned long long>(new_epoch),
              st[0].ToString().c_str());
  // The same bytes under the new epoch land (the fence refuses only the old).
  st = engine->Transfer(
      {{transport::Op::kWrite, late.data(), extent.segment(), extent.offset(), late.size(), nullptr, new_epoch}},
      absl::Seconds(5));
  EXPECT_OK(st[0]);

  // The client library's puts carry the new epoch and go through.
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ASSERT_OK(c->Put("after-failover", Payload("after-failover", kValueBytes)));
  ASSERT_OK_AND_ASSIGN(std::string back, c->Get("after-failover"));
  EXPECT_EQ(back, Payload("after-failover", kValueBytes));
}

}  // namespace
}  // namespace tierkv::integration
