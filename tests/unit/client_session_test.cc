// Read sessions (Client::StartReadSession, ReadRanges, EndReadSession)
// end to end: a real master and lenders in this process (ClientTest).
//
// What is checked: ranges of leased values read the right bytes with the
// master gone; a miss, a range past the value's end and a bad key index
// each get their own status; a leased value cannot be removed until the
// session ends, and can the moment it has; a client holds at most its cap
// of reservations, and reads short of their session's promise are counted; a range read after the lease or the session ended, or one
// that could not finish inside the lease, is ABORTED, never data. Write
// sessions: values written range by range, out of order, commit with the
// checksum a whole put would have stored (Get verifies it); a value not
// fully written, and its group, are never committed; nothing is visible
// before the commit, and a revoked key can be put again; sessions are
// written and read from several threads at once.
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/client_fixture.h"

namespace tierkv {
namespace {

using ::tierkv::testing::StatusIs;
using client::RangeRead;
using master::Master;

absl::Span<char> Span(std::string& s) { return absl::MakeSpan(s); }

TEST_F(ClientTest, RangesOfLeasedValuesAreReadWithoutTheMaster) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  const std::string big = Value(100000, 3), small = Value(5000, 9);
  ASSERT_OK(client_->Put("big", big, {.replicas = 2}));
  ASSERT_OK(client_->Put("small", small));

  std::unique_ptr<client::ReadSession> s = client_->StartReadSession({"big", "absent", "small"});
  ASSERT_EQ(s->size(), 3u);
  EXPECT_EQ(s->key(1), "absent");
  ASSERT_OK_AND_ASSIGN(uint64_t n, s->value_size(0));
  EXPECT_EQ(n, big.size());
  EXPECT_THAT(s->value_size(1), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_GT(s->lease_end(0), absl::Now());

  // The leases hold the values: reads need no master from here on.
  master_->Shutdown();
  std::string a(4000, 0), b(10000, 0), c(small.size(), 0), d(10, 0), e(10, 0), f(2000, 0), g(1, 0);
  std::vector<absl::Status> st = client_->ReadRanges(*s, {{0, 1000, Span(a)},
                                                          {0, 90000, Span(b)},
                                                          {2, 0, Span(c)},
                                                          {1, 0, Span(d)},
                                                          {7, 0, Span(e)},
                                                          {2, 4000, Span(f)},
                                                          {0, big.size(), {}},
                                                          {0, big.size(), Span(g)}});
  ASSERT_EQ(st.size(), 8u);
  EXPECT_OK(st[0]);
  EXPECT_EQ(a, big.substr(1000, 4000));
  EXPECT_OK(st[1]);
  EXPECT_EQ(b, big.substr(90000));
  EXPECT_OK(st[2]);
  EXPECT_EQ(c, small);
  EXPECT_THAT(st[3], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(st[4], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(st[5], StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_OK(st[6]);  // an empty range at the end is inside the value
  EXPECT_THAT(st[7], StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_EQ(f, std::string(2000, 0));  // a refused range writes nothing
  client_->EndReadSession(*s);
}

TEST_F(ClientTest, ASessionKeepsItsValuesUntilItEnds) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  const std::string v = Value(30000, 4);
  ASSERT_OK(client_->Put("k", v));
  std::unique_ptr<client::ReadSession> s = client_->StartReadSession({"k"});
  ASSERT_OK(s->value_size(0).status());
  ASSERT_OK_AND_ASSIGN(auto other, client::Client::Create(Options("host-d")));
  EXPECT_THAT(other->Remove("k"), StatusIs(absl::StatusCode::kFailedPrecondition));
  std::string got(v.size(), 0);
  EXPECT_OK(client_->ReadRanges(*s, {{0, 0, Span(got)}})[0]);
  EXPECT_EQ(got, v);

  client_->EndReadSession(*s);
  client_->EndReadSession(*s);  // idempotent
  EXPECT_THAT(client_->ReadRanges(*s, {{0, 0, Span(got)}})[0], StatusIs(absl::StatusCode::kAborted));
  // The reservation ended with the session, not at the lease's expiry.
  EXPECT_OK(other->Remove("k"));
}

TEST_F(ClientTest, RangesReadAfterOrPastTheLeaseAreAborted) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"gated"}, {"--lease-ttl=600ms"}));
  const std::string v = Value(20000, 6);
  ASSERT_OK(client_->Put("k", v));

  std::unique_ptr<client::ReadSession> s = client_->StartReadSession({"k"});
  std::string got(100, 0);
  ASSERT_OK(client_->ReadRanges(*s, {{0, 500, Span(got)}})[0]);
  EXPECT_EQ(got, v.substr(500, 100));
  absl::SleepFor(s->lease_end(0) - absl::Now() + absl::Milliseconds(20));
  EXPECT_THAT(client_->ReadRanges(*s, {{0, 500, Span(got)}})[0], StatusIs(absl::StatusCode::kAborted));

  // A read slower than the lease is given up at the lease, not the transfer timeout.
  std::unique_ptr<client::ReadSession> slow = client_->StartReadSession({"k"});
  TheGate().DelayReads(absl::Milliseconds(1500));
  const absl::Time start = absl::Now();
  EXPECT_THAT(client_->ReadRanges(*slow, {{0, 0, Span(got)}})[0], StatusIs(absl::StatusCode::kAborted));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  TheGate().DelayReads(absl::ZeroDuration());
  ASSERT_TRUE(TheGate().Drained(absl::Seconds(10)));

  // A new session reads the value again.
  std::unique_ptr<client::ReadSession> again = client_->StartReadSession({"k"});
  std::string all(v.size(), 0);
  ASSERT_OK(client_->ReadRanges(*again, {{0, 0, Span(all)}})[0]);
  EXPECT_EQ(all, v);
  client_->EndReadSession(*again);  // its give-back carries the shortfalls reported above
  // Both reads the lease no longer covered reached the master's count.
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  EXPECT_EQ(master_->master().reservations().totals(now_ms).shortfalls, 2u);
}

TEST_F(ClientTest, AClientHoldsAtMostItsCapOfReservations) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}, {"--max-reservations-per-client=3"}));
  std::vector<std::string> keys;
  for (int i = 0; i < 5; ++i) {
    keys.push_back(absl::StrCat("k", i));
    ASSERT_OK(client_->Put(keys.back(), Value(100, static_cast<char>(i))));
  }
  std::unique_ptr<client::ReadSession> s = client_->StartReadSession(keys);
  for (size_t i = 0; i < 3; ++i) EXPECT_OK(s->value_size(i).status()) << i;
  for (size_t i = 3; i < 5; ++i) {
    EXPECT_THAT(s->value_size(i), StatusIs(absl::StatusCode::kResourceExhausted)) << i;
  }
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  Master& m = master_->master();
  EXPECT_EQ(m.reservations().totals(now_ms).held, 3u);
  EXPECT_EQ(m.reservations().totals(now_ms).refused, 2u);
  // Another client has a cap of its own.
  ASSERT_OK_AND_ASSIGN(auto other, client::Client::Create(Options("host-d")));
  std::unique_ptr<client::ReadSession> o = other->StartReadSession({"k3", "k4"});
  EXPECT_OK(o->value_size(1).status());
  other->EndReadSession(*o);
  // Ended sessions free the room at once.
  client_->EndReadSession(*s);
  std::unique_ptr<client::ReadSession> again = client_->StartReadSession({"k2", "k3", "k4"});
  for (size_t i = 0; i < 3; ++i) EXPECT_OK(again->value_size(i).status()) << i;
  client_->EndReadSession(*again);
  EXPECT_EQ(m.reservations().totals(absl::ToUnixMillis(absl::Now())).held, 0u);
}

TEST_F(ClientTest, WriteSessionsCommitValuesWrittenRangeByRange) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  const std::string a = Value(50000, 1), b = Value(1000, 2), c = Value(3000, 3);
  ASSERT_OK(client_->Put("taken", "x"));
  std::unique_ptr<client::WriteSession> s = client_->StartWriteSession(
      {{"a", a.size()}, {"b", b.size()}, {"c", c.size()}, {"taken", 1}, {"empty", 0}}, {.replicas = 2});
  ASSERT_EQ(s->size(), 5u);
  EXPECT_OK(s->status(0));
  EXPECT_THAT(s->status(3), StatusIs(absl::StatusCode::kAlreadyExists));
  auto piece = [](const std::string& v, size_t at, size_t n) { return absl::string_view(v).substr(at, n); };
  std::vector<absl::Status> st = client_->WriteRanges(*s, {{0, 30000, piece(a, 30000, 20000)},
                                                           {0, 0, piece(a, 0, 10000)},
                                                           {1, 0, b},
                                                           {2, 0, piece(c, 0, 1500)},
                                                           {0, 5000, piece(a, 5000, 10)},
                                                           {1, 900, piece(b, 0, 200)},
                                                           {9, 0, b},
                                                           {3, 0, "y"}});
  EXPECT_OK(st[0]);
  EXPECT_OK(st[1]);
  EXPECT_OK(st[2]);
  EXPECT_OK(st[3]);
  EXPECT_THAT(st[4], StatusIs(absl::StatusCode::kInvalidArgument));  // overlaps [0, 10000)
  EXPECT_THAT(st[5], StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(st[6], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(st[7], StatusIs(absl::StatusCode::kAlreadyExists));
  ASSERT_OK(client_->WriteRanges(*s, {{0, 10000, piece(a, 10000, 20000)}})[0]);
  // Nothing is visible before the commit.
  ASSERT_OK_AND_ASSIGN(bool present, client_->Exists("a"));
  EXPECT_FALSE(present);

  std::vector<absl::Status> committed = client_->CommitWriteSession(*s);
  EXPECT_OK(committed[0]);
  EXPECT_OK(committed[1]);
  EXPECT_THAT(committed[2], StatusIs(absl::StatusCode::kFailedPrecondition));  // half written
  EXPECT_THAT(committed[3], StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_OK(committed[4]);
  // Get checks the joined checksum against the bytes.
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("a"));
  EXPECT_EQ(got, a);
  ASSERT_OK_AND_ASSIGN(got, client_->Get("b"));
  EXPECT_EQ(got, b);
  ASSERT_OK_AND_ASSIGN(got, client_->Get("empty"));
  EXPECT_EQ(got, "");
  EXPECT_THAT(client_->Get("c").status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("taken"));
  EXPECT_EQ(got, "x");
  EXPECT_THAT(client_->WriteRanges(*s, {{2, 1500, piece(c, 1500, 1500)}})[0],
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(client_->CommitWriteSession(*s)[0], StatusIs(absl::StatusCode::kFailedPrecondition));
  // The key that was not committed is free for a later put.
  EXPECT_OK(client_->Put("c", c));
}

TEST_F(ClientTest, AGroupWithAnUnfinishedMemberIsNotCommittedAndRevokedKeysArePutAgain) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  const std::string k = Value(4000, 5), v = Value(4000, 6);
  std::unique_ptr<client::WriteSession> s =
      client_->StartWriteSession({{"page_k", k.size(), "page"}, {"page_v", v.size(), "page"}});
  ASSERT_OK(client_->WriteRanges(*s, {{0, 0, k}})[0]);
  ASSERT_OK(client_->WriteRanges(*s, {{1, 0, absl::string_view(v).substr(0, 100)}})[0]);
  std::vector<absl::Status> committed = client_->CommitWriteSession(*s);
  EXPECT_THAT(committed[0], StatusIs(absl::StatusCode::kAborted));
  EXPECT_THAT(committed[1], StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK_AND_ASSIGN(std::vector<bool> present, client_->BatchExists({"page_k", "page_v"}));
  EXPECT_FALSE(present[0]);
  EXPECT_FALSE(present[1]);

  std::unique_ptr<client::WriteSession> r = client_->StartWriteSession({{"r", v.size()}});
  ASSERT_OK(client_->WriteRanges(*r, {{0, 0, v}})[0]);
  client_->RevokeWriteSession(*r);
  EXPECT_THAT(r->status(0), StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(client_->CommitWriteSession(*r)[0], StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(client_->Get("r").status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_OK(client_->Put("r", v));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("r"));
  EXPECT_EQ(got, v);
}

TEST_F(ClientTest, SessionsAreWrittenAndReadFromSeveralThreadsAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  constexpr int kThreads = 4;
  constexpr size_t kQuarter = 16384;
  const std::string a = Value(kThreads * kQuarter, 7), b = Value(kThreads * kQuarter, 8);
  std::unique_ptr<client::WriteSession> w = client_->StartWriteSession({{"a", a.size()}, {"b", b.size()}});
  std::vector<std::thread> threads;
  std::vector<absl::Status> wrote(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t at = t * kQuarter;
      std::vector<absl::Status> st = client_->WriteRanges(
          *w, {{0, at, absl::string_view(a).substr(at, kQuarter)}, {1, at, absl::string_view(b).substr(at, kQuarter)}});
      wrote[t] = st[0].ok() ? st[1] : st[0];
    });
  }
  for (std::thread& t : threads) t.join();
  threads.clear();
  for (const absl::Status& st : wrote) EXPECT_OK(st);
  std::vector<absl::Status> committed = client_->CommitWriteSession(*w);
  ASSERT_OK(committed[0]);
  ASSERT_OK(committed[1]);

  std::unique_ptr<client::ReadSession> r = client_->StartReadSession({"a", "b"});
  std::string got_a(a.size(), 0), got_b(b.size(), 0);
  std::vector<absl::Status> read(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t at = t * kQuarter;
      std::vector<absl::Status> st = client_->ReadRanges(
          *r, {{0, at, absl::MakeSpan(got_a).subspan(at, kQuarter)}, {1, at, absl::MakeSpan(got_b).subspan(at, kQuarter)}});
      read[t] = st[0].ok() ? st[1] : st[0];
    });
  }
  for (std::thread& t : threads) t.join();
  client_->EndReadSession(*r);
  for (const absl::Status& st : read) EXPECT_OK(st);
  EXPECT_EQ(got_a, a);
  EXPECT_EQ(got_b, b);
}

}  // namespace
}  // namespace tierkv
