// High availability: etcd's part (docs/ha.md). Clients and daemons given
// only etcd find and follow the leader; a leader cut off from etcd, or
// answered late, or short of one etcd member; and the etcd calls the
// election rests on. The fixture is ha_fixture.h.
#include "tests/integration/ha_fixture.h"

namespace tierkv::integration {
namespace {

// A client given etcd:// learns of a master registered after it resolved
// the cluster: once every master it knows fails a call it reads etcd
// again, and follows the leader to a master it had never heard of.
TEST_F(HaTest, AnEtcdClientFindsAMasterThatJoinedAfterIt) {
  StartEtcd();
  StartMaster(0);
  ASSERT_EQ(WaitForLeader(), 0) << Logs();
  client::MasterClientOptions o;
  o.rpc_timeout = absl::Seconds(10);
  ASSERT_OK_AND_ASSIGN(auto mc,
                       client::MasterClient::Create(absl::StrCat("etcd://", etcd_->endpoints(), "/test"), o));
  ASSERT_OK(mc->Exists({"any"}).status());
  const std::string first = absl::StrCat("127.0.0.1:", rpc_[0]);
  ASSERT_EQ(mc->masters(), std::vector<std::string>{first});

  StartMaster(1);  // joins as a standby
  ASSERT_OK(WaitForSynced(0, 1)) << Logs();
  masters_[0]->Kill(SIGKILL);
  ASSERT_EQ(WaitForLeader(absl::Seconds(20), 0), 1) << Logs();
  absl::Status s = absl::UnknownError("not tried");
  ASSERT_OK(WaitFor("the etcd client to reach the new leader", absl::Seconds(20), [&] {
    s = mc->Exists({"any"}).status();
    return s.ok();
  })) << s;
  EXPECT_EQ(mc->masters(), (std::vector<std::string>{first, absl::StrCat("127.0.0.1:", rpc_[1])}));
}

// The same for the metadata URL: a client given only etcd, started when
// one master was up, reads a segment descriptor through a master that
// joined later, after the first is gone. Its metadata client finds the
// URLs again once every one it knew has failed.
TEST_F(HaTest, AnEtcdClientsMetadataFollowsAMasterThatJoinedAfterIt) {
  StartEtcd();
  StartMaster(0);
  ASSERT_EQ(WaitForLeader(), 0) << Logs();
  const std::string by_etcd = absl::StrCat("etcd://", etcd_->endpoints(), "/test");
  client::ClientOptions o;
  o.master = by_etcd;
  o.rpc_timeout = absl::Seconds(10);
  o.transfer_timeout = absl::Seconds(10);
  ASSERT_OK_AND_ASSIGN(auto c, client::Client::Create(o));
  EXPECT_EQ(c->metadata_url(), absl::StrCat("http://127.0.0.1:", http_[0]));

  StartMaster(1);
  ASSERT_OK(WaitForSynced(0, 1)) << Logs();
  masters_[0]->Kill(SIGKILL);
  ASSERT_EQ(WaitForLeader(absl::Seconds(20), 0), 1) << Logs();
  // A daemon that starts now publishes its descriptor to master 1 only.
  StartDaemon({"--master=" + by_etcd});
  ASSERT_OK(WaitForLiveSegments(1, 1)) << Logs();
  const std::string value(100000, 'm');
  ASSERT_OK(c->Put("after-the-move", value)) << Logs();
  ASSERT_OK_AND_ASSIGN(std::string back, c->Get("after-the-move"));
  EXPECT_EQ(back, value);
}

// Told only where etcd is (--master etcd://h:p/<cluster>, no metadata
// URL), a daemon and a client find the masters, the leader first, and the
// metadata URLs themselves, and follow the next leader when it is killed.
// The masters are hosts of their own (127.0.0.2 and .3, the same ports);
// the daemon starts with them, as on a host that starts everything at
// once, before they have elected a leader, and waits for one.
TEST_F(HaTest, DaemonsAndClientsGivenOnlyEtcdFindAndFollowTheLeader) {
  hosts_apart_ = true;
  StartEtcd();
  const std::string by_etcd = absl::StrCat("etcd://", etcd_->endpoints(), "/test");
  StartMaster(0);
  StartMaster(1);
  const bool leader_before_daemon = WaitForLeader(absl::Milliseconds(1)) >= 0;
  StartDaemon({"--master=" + by_etcd});
  std::printf("a leader was %selected when the daemon started\n", leader_before_daemon ? "" : "not yet ");
  const int leader = WaitForLeader();
  ASSERT_GE(leader, 0) << Logs();
  ASSERT_OK(WaitForSynced(leader, 1)) << Logs();
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> masters, ResolveEtcdMasters(by_etcd, absl::Seconds(2)));
  ASSERT_EQ(masters.size(), 2u);
  EXPECT_EQ(masters[0], absl::StrCat(hosts_[leader], ":", rpc_[leader]));
  EXPECT_EQ(masters[1], absl::StrCat(hosts_[1 - leader], ":", rpc_[1 - leader]));
  ASSERT_OK_AND_ASSIGN(std::string metadata, client::MetadataUrl("", by_etcd));
  EXPECT_EQ(metadata, absl::StrCat("http://", hosts_[leader], ":", http_[leader], ",http://", hosts_[1 - leader], ":",
                                   http_[leader]));
  // What cannot be resolved says why.
  EXPECT_TRUE(absl::IsInvalidArgument(ResolveEtcdMasters("etcd://127.0.0.1:1", absl::Seconds(1)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(client::MasterClient::Create("etcd:///test").status()));
  EXPECT_TRUE(absl::IsNotFound(
      ResolveEtcdMasters(absl::StrCat("etcd://", etcd_->endpoints(), "/no-such-cluster"), absl::Milliseconds(500)).status()));
  absl::Status unreachable = client::MasterClient::Create("etcd://127.0.0.1:1/test").status();
  EXPECT_TRUE(absl::IsUnavailable(unreachable) || absl::IsDeadlineExceeded(unreachable)) << unreachable;

  ASSERT_OK(WaitForLiveSegments(leader, 1)) << Logs();
  client::ClientOptions o;
  o.master = by_etcd;
  o.metadata = "";
  o.transfer_timeout = absl::Seconds(10);
  ASSERT_OK_AND_ASSIGN(auto c, client::Client::Create(o));
  Writer w(c.get(), "by-etcd", 4000, absl::Milliseconds(2));
  ASSERT_OK(WaitFor("100 puts acknowledged", absl::Seconds(30), [&] { return w.acked() >= 100; })) << Logs();
  masters_[leader]->Kill(SIGKILL);
  const absl::Time killed = absl::Now();
  ASSERT_EQ(WaitForLeader(absl::Seconds(20), leader), 1 - leader) << Logs();
  ASSERT_OK(WaitFor("a put begun after the kill to be acknowledged", absl::Seconds(20),
                    [&] { return w.FirstAckAfter(killed) != absl::InfiniteFuture(); })) << Logs();
  const size_t at_failover = w.acked();
  ASSERT_OK(WaitFor("50 more puts acknowledged after the failover", absl::Seconds(20),
                    [&] { return w.acked() >= at_failover + 50; })) << Logs();
  w.Stop();
  std::printf("given only etcd: first put acknowledged %.0f ms after the leader was killed; %zu acknowledged\n",
              absl::ToDoubleMilliseconds(w.FirstAckAfter(killed) - killed), w.acked());
  // The daemon re-mounted at the new leader, and everything acknowledged reads back.
  EXPECT_OK(WaitForLiveSegments(1 - leader, 1)) << Logs();
  ExpectAllReadable(c.get(), w.keys());

  // tierkvctl finds the new leader's HTTP port through etcd too.
  std::string cmd = absl::StrCat(BinaryPath("tierkvctl"), " --http=", by_etcd, " --json ha 2>&1");
  FILE* ctl = popen(cmd.c_str(), "r");
  ASSERT_NE(ctl, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, ctl)) > 0;) out.append(buf, n);
  ASSERT_EQ(pclose(ctl), 0) << out;
  json ha = json::parse(out, nullptr, false);
  ASSERT_FALSE(ha.is_discarded()) << out;
  EXPECT_EQ(ha.value("role", ""), "leader") << out;
  EXPECT_EQ(ha.value("leader", ""), absl::StrCat(hosts_[1 - leader], ":", rpc_[1 - leader])) << out;
}

// The leader loses etcd (its connections stall) while its standby keeps
// it: the leader stops answering before the standby starts to, and the new
// epoch is the higher.
TEST_F(HaTest, ALeaderCutOffFromEtcdStopsServingBeforeTheNextOneStarts) {
  StartEtcd();
  ASSERT_OK_AND_ASSIGN(auto proxy, FaultProxy::Start("127.0.0.1", 0, etcd_->endpoints()));
  StartMaster(0, {}, absl::StrCat("127.0.0.1:", proxy->port()));
  ASSERT_EQ(WaitForLeader(), 0) << Logs();
  StartMaster(1);
  ASSERT_OK(WaitForSynced(0, 1)) << Logs();
  ASSERT_OK_AND_ASSIGN(json old_ha, Ha(0));

  Prober old_leader(rpc_[0]), new_leader(rpc_[1]);
  ASSERT_OK(WaitFor("the old leader to answer a probe", absl::Seconds(5), [&] { return old_leader.oks() > 0; }));
  proxy->Set({FaultProxy::Mode::kStall});
  const absl::Time cut = absl::Now();
  ASSERT_EQ(WaitForLeader(absl::Seconds(20), 0), 1) << Logs();
  ASSERT_OK(WaitFor("the new leader to answer a probe", absl::Seconds(5), [&] { return new_leader.oks() > 0; }));
  // The old leader, probed for 500 ms more, never answers after the new one did.
  const int probed = old_leader.probes();
  EXPECT_OK(StaysFalse("the old leader answering after the new one", absl::Milliseconds(500),
                       [&] { return old_leader.last_ok() >= new_leader.first_ok(); }));
  ASSERT_OK(WaitFor("the old leader to be probed again", absl::Seconds(5),
                    [&] { return old_leader.probes() >= probed + 2; }));
  old_leader.Stop();
  new_leader.Stop();
  ASSERT_OK_AND_ASSIGN(json new_ha, Ha(1));
  std::printf("cut off at 0 ms: the old leader (epoch %llu) last answered at %.0f ms, the new one (epoch %llu) first "
              "at %.0f ms\n",
              static_cast<unsigned long long>(old_ha["epoch"].get<uint64_t>()),
              absl::ToDoubleMilliseconds(old_leader.last_ok() - cut),
              static_cast<unsigned long long>(new_ha["epoch"].get<uint64_t>()),
              absl::ToDoubleMilliseconds(new_leader.first_ok() - cut));
  EXPECT_LT(old_leader.last_ok(), new_leader.first_ok()) << "two masters answered as the leader at once";
  EXPECT_GT(new_ha["epoch"].get<uint64_t>(), old_ha["epoch"].get<uint64_t>());

  // With etcd back, the old leader rejoins as a standby of the new one.
  proxy->Set({FaultProxy::Mode::kPass});
  EXPECT_OK(WaitForSynced(1, 1, absl::Seconds(30))) << Logs();
}

// The leader's etcd answers stall past its gate but not past its lease
// (etcd electing a raft leader looks like this): it stops answering, keeps
// its key, and once etcd confirms the same lease serves again at the same
// epoch. No standby took over, and puts begun meanwhile went through.
TEST_F(HaTest, ALeaderWhoseEtcdAnswersLateHoldsItsEpochAndServesAgain) {
  StartEtcd();
  ASSERT_OK_AND_ASSIGN(auto proxy, FaultProxy::Start("127.0.0.1", 0, etcd_->endpoints()));
  // TTL 12 s: the gate closes by 8 s after the cut (TTL - TTL/3 after
  // the last keepalive answered), while etcd keeps the key for at least
  // 10 s after it (that keepalive was sent at most TTL/6 before the cut).
  StartMaster(0, {"--ha-lease-ttl=12s"}, absl::StrCat("127.0.0.1:", proxy->port()));
  ASSERT_EQ(WaitForLeader(), 0) << Logs();
  StartMaster(1, {"--ha-lease-ttl=12s"});
  ASSERT_OK(WaitForSynced(0, 1)) << Logs();
  StartDaemon();
  ASSERT_OK(WaitForLiveSegments(0, 1)) << Logs();
  ASSERT_OK_AND_ASSIGN(json before, Ha(0));
  EXPECT_EQ(before["serving"], true);
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  Writer w(c.get(), "held", 4000, absl::Milliseconds(5));
  ASSERT_OK(WaitFor("20 puts acknowledged", absl::Seconds(30), [&] { return w.acked() >= 20; })) << Logs();

  proxy->Set({FaultProxy::Mode::kStall});
  const absl::Time cut = absl::Now();
  ASSERT_OK(WaitFor("the leader's gate to close", absl::Seconds(10), [&] {
    absl::StatusOr<json> h = Ha(0);
    return h.ok() && (*h)["serving"] == false;
  })) << Logs();
  const absl::Time held = absl::Now();
  // Many rounds of the role thread with the gate closed: a leader that
  // took the lapse for a loss would step down (or the standby take over)
  // within this second.
  EXPECT_OK(StaysFalse("a change of leader while the gate was closed", absl::Seconds(1), Throttled([&] {
    absl::StatusOr<json> h0 = Ha(0), h1 = Ha(1);
    return (h0.ok() && (*h0)["role"] != "leader") || (h1.ok() && (*h1)["role"] == "leader");
  }))) << Logs();
  proxy->Set({FaultProxy::Mode::kPass});
  ASSERT_OK(WaitFor("the leader to serve again", absl::Seconds(10), [&] {
    absl::StatusOr<json> h = Ha(0);
    return h.ok() && (*h)["serving"] == true;
  })) << Logs();
  std::printf("etcd cut off at 0 ms: gate seen closed at %.0f ms, serving again at %.0f ms\n",
              absl::ToDoubleMilliseconds(held - cut), absl::ToDoubleMilliseconds(absl::Now() - cut));
  const size_t acked = w.acked();
  ASSERT_OK(WaitFor("20 more puts acknowledged once the gate opened", absl::Seconds(10),
                    [&] { return w.acked() >= acked + 20; })) << Logs();
  w.Stop();
  ASSERT_OK_AND_ASSIGN(json after, Ha(0));
  EXPECT_EQ(after["role"], "leader");
  EXPECT_EQ(after["epoch"], before["epoch"]) << "a new epoch began while the leader held its key";
  ASSERT_OK_AND_ASSIGN(json standby, Ha(1));
  EXPECT_EQ(standby["role"], "standby");
  EXPECT_EQ(w.failed(), 0) << Logs();
  ExpectAllReadable(c.get(), w.keys());
}

// One etcd member of three stopped, the raft leader (so etcd elects
// another, and answers no keepalive meanwhile): the leader keeps its lease
// and goes on serving; no failover happens and no put fails.
TEST_F(HaTest, AStoppedEtcdMemberStopsNeitherElectionNorKeepalives) {
  const int leader = StartGroup(3, {"--ha-lease-ttl=3s"});
  ASSERT_GE(leader, 0);
  ASSERT_OK_AND_ASSIGN(json before, Ha(leader));
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  Writer w(c.get(), "etcd-stop", 4000, absl::Milliseconds(5));
  ASSERT_OK(WaitFor("50 puts acknowledged", absl::Seconds(30), [&] { return w.acked() >= 50; })) << Logs();
  ASSERT_OK_AND_ASSIGN(const int stopped, etcd_->raft_leader());
  etcd_->member(stopped).Kill(SIGSTOP);
  // Three lease times: neither a new leader nor a failed put.
  EXPECT_OK(StaysFalse("a change of leader or a failed put", absl::Seconds(9), Throttled([&] {
    absl::StatusOr<json> h = Ha(leader);
    return w.failed() > 0 || (h.ok() && ((*h)["role"] != "leader" || (*h)["epoch"] != before["epoch"]));
  }))) << Logs();
  const size_t acked = w.acked();
  ASSERT_OK(WaitFor("50 more puts acknowledged with an etcd member stopped", absl::Seconds(10),
                    [&] { return w.acked() >= acked + 50; })) << Logs();
  etcd_->member(stopped).Kill(SIGCONT);
  w.Stop();
  absl::StatusOr<json> after = Ha(leader);
  ASSERT_TRUE(after.ok()) << "the leader stopped serving: " << after.status() << "\n" << Logs();
  EXPECT_EQ((*after)["role"], "leader");
  EXPECT_EQ((*after)["epoch"], before["epoch"]) << "the leader changed while one etcd member was stopped";
  EXPECT_EQ(w.failed(), 0);
  // A standby that lost its member's connection too is still copying.
  EXPECT_OK(WaitForSynced(leader, 1)) << Logs();
  ExpectAllReadable(c.get(), w.keys());
}

// The etcd calls the election rests on, against a real etcd of three.
TEST_F(HaTest, EtcdClientCreatesOnceFencesDeletesAndOutlivesAStoppedMember) {
  StartEtcd(3);
  ASSERT_OK_AND_ASSIGN(auto etcd, EtcdClient::Create(
                                      EtcdClient::SplitEndpoints(etcd_->endpoints()), absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(EtcdLease a, etcd->Grant(absl::Seconds(2)));
  ASSERT_OK_AND_ASSIGN(EtcdLease b, etcd->Grant(absl::Seconds(30)));
  ASSERT_OK_AND_ASSIGN(EtcdCreate first, etcd->CreateIfAbsent("/t/leader", "a", a.id));
  EXPECT_TRUE(first.created);
  EXPECT_EQ(first.key.value, "a");
  ASSERT_OK_AND_ASSIGN(EtcdCreate second, etcd->CreateIfAbsent("/t/leader", "b", b.id));
  EXPECT_FALSE(second.created) << "two holders of one key";
  EXPECT_EQ(second.key.value, "a");
  EXPECT_EQ(second.key.create_revision, first.key.create_revision);

  // Only the holder of that create revision deletes the key.
  EXPECT_OK(etcd->DeleteIfCreatedAt("/t/leader", first.key.create_revision + 1000));
  EXPECT_OK(etcd->Get("/t/leader").status());
  EXPECT_OK(etcd->DeleteIfValue("/t/leader", "b"));
  EXPECT_OK(etcd->Get("/t/leader").status());

  // A lease not kept alive takes its key with it; keepalives then say so.
  ASSERT_OK(WaitFor("the lapsed lease to take /t/leader with it", absl::Seconds(10),
                    [&] { return absl::IsNotFound(etcd->Get("/t/leader").status()); }));
  EXPECT_TRUE(absl::IsNotFound(etcd->KeepAlive(a.id).status()));
  ASSERT_OK_AND_ASSIGN(EtcdCreate third, etcd->CreateIfAbsent("/t/leader", "b", b.id));
  EXPECT_TRUE(third.created);
  EXPECT_GT(third.key.create_revision, first.key.create_revision) << "epochs only grow";
  ASSERT_OK_AND_ASSIGN(auto listed, etcd->List("/t/"));
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].second, "b");

  // The member tried first stops answering: each call still ends within
  // its deadline, answered by another member.
  // (The first may meet the raft election that follows, if member 0 led.)
  etcd_->member(0).Kill(SIGSTOP);
  int answered = 0;
  for (int i = 0; i < 6; ++i) {
    const absl::Time start = absl::Now();
    answered += etcd->KeepAlive(b.id).ok();
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500)) << "keepalive " << i;
  }
  EXPECT_GE(answered, 4);
  etcd_->member(0).Kill(SIGCONT);
  EXPECT_OK(etcd->Revoke(b.id));
  EXPECT_TRUE(absl::IsNotFound(etcd->Get("/t/leader").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(EtcdClient::Create({"no-port"}).status()));
}

// The "ahead" mark's fence against a real etcd: a removal names the mod
// revision its put answered, so one that arrives after the mark was made
// again (same key, same value) leaves the later mark in place.
TEST_F(HaTest, EtcdClientRemovesAMarkOnlyWhileItIsThePutItNames) {
  StartEtcd();
  ASSERT_OK_AND_ASSIGN(auto etcd, EtcdClient::Create(EtcdClient::SplitEndpoints(etcd_->endpoints())));
  ASSERT_OK_AND_ASSIGN(const int64_t first, etcd->PutRevision("/t/ahead", "m0"));
  ASSERT_OK_AND_ASSIGN(EtcdKey key, etcd->Get("/t/ahead"));
  EXPECT_EQ(key.mod_revision, first);
  ASSERT_OK_AND_ASSIGN(const int64_t second, etcd->PutRevision("/t/ahead", "m0"));
  EXPECT_GT(second, first);
  EXPECT_OK(etcd->DeleteIfModifiedAt("/t/ahead", first));  // the first mark's removal, late
  ASSERT_OK_AND_ASSIGN(key, etcd->Get("/t/ahead"));
  EXPECT_EQ(key.mod_revision, second) << "a late removal took a later mark";
  EXPECT_OK(etcd->DeleteIfModifiedAt("/t/ahead", second));
  EXPECT_TRUE(absl::IsNotFound(etcd->Get("/t/ahead").status()));
}

// A standby that finds the leader key naming itself, bound to its own live
// lease (what a campaign etcd applied but answered late leaves), deletes
// it and campaigns: the key is no one's to serve, and kept alive by the
// standby's own keepalives it would never expire.
TEST_F(HaTest, AStandbyFindingTheLeaderKeyNamingItselfUnderItsOwnLeaseTakesOver) {
  StartEtcd();
  ASSERT_OK_AND_ASSIGN(auto etcd, EtcdClient::Create(EtcdClient::SplitEndpoints(etcd_->endpoints())));
  const std::string leader_key = EtcdClusterKey("test", "leader");
  // A leader that never answers, so master 0 starts as a standby.
  ASSERT_OK_AND_ASSIGN(EtcdLease phantom, etcd->Grant(absl::Seconds(60)));
  ASSERT_OK(etcd->Put(leader_key, "127.0.0.1:1", phantom.id));
  const std::string self = Advertised(0);
  StartMaster(0);
  EtcdKey member;
  ASSERT_OK(WaitFor("master 0 to publish its member key under its lease", absl::Seconds(20), [&] {
    absl::StatusOr<EtcdKey> k = etcd->Get(EtcdClusterKey("test", "members/" + self));
    if (k.ok()) member = *k;
    return k.ok() && k->lease != 0;
  })) << Logs();
  ASSERT_OK_AND_ASSIGN(json before, Ha(0));
  EXPECT_EQ(before["role"], "standby");
  ASSERT_OK(etcd->Put(leader_key, self, member.lease));
  ASSERT_OK(etcd->Revoke(phantom.id));
  EXPECT_EQ(WaitForLeader(), 0) << "a leader key naming a standby under its own lease stayed, with no one serving\n"
                                << Logs();
  ASSERT_OK_AND_ASSIGN(EtcdKey now, etcd->Get(leader_key));
  EXPECT_EQ(now.value, self);
}

// A takeover that cannot record /initialized in etcd (a failpoint) is
// given up before anything is served, and its leader key given back: the
// record is what stops a standby with no copy from starting the cluster
// afresh after this leader. A master that can record it takes over.
TEST_F(HaTest, ATakeoverThatCannotRecordTheClusterInitializedIsGivenUp) {
  StartEtcd();
  ASSERT_OK_AND_ASSIGN(auto etcd, EtcdClient::Create(EtcdClient::SplitEndpoints(etcd_->endpoints())));
  StartMaster(0, {}, "", {{"TIERKV_FAILPOINTS", "master.ha.initialized=error"}});
  ASSERT_OK(WaitFor("master 0 to give up a takeover", absl::Seconds(20), [&] {
    return masters_[0]->Stderr().find("could not be recorded in etcd") != std::string::npos;
  })) << Logs();
  EXPECT_OK(StaysFalse("master 0 serving as the leader with /initialized unrecorded", absl::Seconds(2),
                       Throttled([&] { return LeaderNow() == 0; })))
      << Logs();
  EXPECT_TRUE(absl::IsNotFound(etcd->Get(EtcdClusterKey("test", "initialized")).status()));
  StartMaster(1);
  EXPECT_EQ(WaitForLeader(absl::Seconds(20), 0), 1) << Logs();
  EXPECT_OK(etcd->Get(EtcdClusterKey("test", "initialized")).status());
  EXPECT_EQ(LeaderNow(1), -1) << "master 0 leads beside master 1";
}

// /ahead names a master whose store is not a complete copy (here: new and
// empty, the one that had the writes lost). It must not lead from that
// store, which lacks exactly the writes the mark stands for.
TEST_F(HaTest, AMasterMarkedAheadLeadsOnlyFromACompleteCopy) {
  StartEtcd();
  ASSERT_OK_AND_ASSIGN(auto etcd, EtcdClient::Create(EtcdClient::SplitEndpoints(etcd_->endpoints())));
  ASSERT_OK(etcd->Put(EtcdClusterKey("test", "initialized"), "1"));
  ASSERT_OK(etcd->Put(EtcdClusterKey("test", "ahead"), Advertised(0)));
  StartMaster(0);
  ASSERT_OK(WaitFor("master 0 to say why it does not campaign", absl::Seconds(20), [&] {
    return masters_[0]->Stderr().find("is not a complete copy") != std::string::npos;
  })) << Logs();
  EXPECT_OK(StaysFalse("master 0 leading from a store without the writes it was marked ahead for",
                       absl::Seconds(2), Throttled([&] { return LeaderNow() == 0; })))
      << Logs();
  EXPECT_TRUE(absl::IsNotFound(etcd->Get(EtcdClusterKey("test", "leader")).status()));
}

}  // namespace
}  // namespace tierkv::integration
