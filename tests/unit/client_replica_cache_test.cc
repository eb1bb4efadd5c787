// The client's replica cache (client/internal/replica_cache.h): a repeated
// get inside its lease skips the master and never outlives what the lease
// promises, end to end and as a unit.
#include "tests/unit/client_fixture.h"

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "client/internal/replica_cache.h"
#include "tests/support/wait.h"

namespace tierkv {
namespace {

using ::tierkv::testing::StatusIs;
using ::tierkv::testing::WaitFor;

// Polls `get` until it answers NOT_FOUND (or fails otherwise) or `limit`
// passes; how long it took.
absl::StatusOr<absl::Duration> UntilMiss(const std::function<absl::Status()>& get, absl::Duration limit) {
  const absl::Time start = absl::Now();
  absl::Status s;
  RETURN_IF_ERROR(WaitFor("a get to miss", limit, [&] {
    s = get();
    return !s.ok();
  }));
  if (!absl::IsNotFound(s)) return s;
  return absl::Now() - start;
}

TEST_F(ClientTest, ARepeatedGetInsideItsLeaseIsReadWhereItWasUntilTheLeaseEnds) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}, {"--lease-ttl=1s"}));
  ASSERT_OK_AND_ASSIGN(auto other, client::Client::Create(Options("host-d")));
  // What bounds the cache here is the lease, not the master's last answer.
  client_ = Cached(Options("host-e"), absl::InfiniteDuration());
  ASSERT_NE(client_, nullptr);
  const std::string value = Value(30000, 8);
  ASSERT_OK(client_->Put("k", value));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("k"));  // takes the lease, remembers where
  EXPECT_EQ(got, value);
  const absl::Time leased = absl::Now();
  // Removed elsewhere (a lease lets that happen only with force): the
  // master no longer knows the key, but the lease keeps its bytes, so
  // this client still reads them, without asking.
  ASSERT_OK(other->Remove("k", /*force=*/true));
  EXPECT_THAT(other->Get("k").status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("k"));
  EXPECT_EQ(got, value);
  // Never past the lease (1 s, less its margin): then it is a miss.
  ASSERT_OK(UntilMiss([&] { return client_->Get("k").status(); }, absl::Seconds(10)).status());
  const absl::Duration served = absl::Now() - leased;
  EXPECT_GE(served, absl::Milliseconds(800));
  EXPECT_LE(served, absl::Seconds(3));
}

TEST_F(ClientTest, AKeyThisClientRemovedIsNeverReadFromTheReplicaCache) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  client_ = Cached(Options("host-e"));
  ASSERT_NE(client_, nullptr);
  const std::string value = Value(30000, 9);
  ASSERT_OK(client_->Put("k", value));
  ASSERT_OK(client_->Put("j", value));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("k"));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("j"));
  ASSERT_OK(client_->Remove("k", /*force=*/true));
  EXPECT_THAT(client_->Get("k").status(), StatusIs(absl::StatusCode::kNotFound));
  std::vector<char> out(value.size());
  EXPECT_THAT(client_->Get("k", absl::MakeSpan(out)).status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(uint64_t removed, client_->RemoveAll(/*force=*/true));
  EXPECT_EQ(removed, 1u);
  EXPECT_THAT(client_->Get("j").status(), StatusIs(absl::StatusCode::kNotFound));
  // Put anew: the new value, from where it now sits.
  const std::string fresh = Value(40000, 10);
  ASSERT_OK(client_->Put("k", fresh));
  ASSERT_OK_AND_ASSIGN(got, client_->Get("k"));
  EXPECT_EQ(got, fresh);
}

TEST_F(ClientTest, ARememberedReplicaWhoseStoreIsGoneIsAskedOfTheMasterAgain) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  ASSERT_OK_AND_ASSIGN(auto other, client::Client::Create(Options("host-d")));
  // Never renewed, the entry outlives the drop unseen: its read fails. (By
  // default the next answer names the new membership, which forgets it.)
  client_ = Cached(Options("host-e"), absl::InfiniteDuration());
  ASSERT_NE(client_, nullptr);
  const std::string old_value = Value(30000, 11), new_value = Value(30000, 12);
  ASSERT_OK(other->Put("k", old_value, {.preferred_segment = "seg-host-a"}));
  ASSERT_OK_AND_ASSIGN(std::string got, client_->Get("k"));  // remembered on seg-host-a
  EXPECT_EQ(got, old_value);
  // The store dies (it unmounts on the way out): its objects are gone, and
  // the key is put again on the other store.
  stores_[0].reset();
  ASSERT_OK(UntilMiss([&] { return other->Get("k").status(); }, absl::Seconds(10)).status());
  ASSERT_OK(other->Put("k", new_value, {.preferred_segment = "seg-host-b"}));
  // The remembered location fails; the master names the new one.
  ASSERT_OK_AND_ASSIGN(got, client_->Get("k"));
  EXPECT_EQ(got, new_value);
}

TEST(ReplicaCacheTest, EntriesEndWithTheirLeaseAndInvalidationRefusesInsertsBegunBefore) {
  client::internal::ReplicaCache cache(2);
  const absl::Time now = absl::Now();
  client::internal::Located a;
  a.stored_size = 10;
  a.lease_end = now + absl::Seconds(1);
  a.replicas.emplace_back("seg", 0);
  cache.Insert("a", a, cache.generation());
  ASSERT_TRUE(cache.Lookup("a", now).has_value());
  EXPECT_TRUE(cache.Lookup("a", now)->cached);
  EXPECT_FALSE(cache.Lookup("a", now + absl::Seconds(1)).has_value());  // the lease ended
  EXPECT_FALSE(cache.Lookup("a", now).has_value());                     // and it was dropped
  // A get that began before this client removed the key must not bring it back.
  const uint64_t before = cache.generation();
  cache.Invalidate("a");
  cache.Insert("a", a, before);
  EXPECT_FALSE(cache.Lookup("a", now).has_value());
  cache.Insert("a", a, cache.generation());
  EXPECT_TRUE(cache.Lookup("a", now).has_value());
  // Bounded: a third key makes room.
  cache.Insert("b", a, cache.generation());
  cache.Insert("c", a, cache.generation());
  EXPECT_LE(cache.size(), 2u);
  EXPECT_TRUE(cache.Lookup("c", now).has_value());
  // Off: never remembers.
  client::internal::ReplicaCache off(0);
  off.Insert("a", a, off.generation());
  EXPECT_FALSE(off.Lookup("a", now).has_value());
}

// A full cache makes room by dropping ended leases, and everything when
// that would leave more than half: so it is scanned at most once per
// capacity / 2 inserts, whatever the mix.
TEST(ReplicaCacheTest, AFullCacheKeepsAtMostHalfSoItIsNotScannedOnEveryInsert) {
  const absl::Time now = absl::Now();
  auto located = [&](absl::Duration left) {
    client::internal::Located w;
    w.stored_size = 10;
    w.lease_end = now + left;
    w.replicas.emplace_back("seg", 0);
    return w;
  };
  client::internal::ReplicaCache few_ended(8);
  for (int i = 0; i < 8; ++i) {
    few_ended.Insert(absl::StrCat("k", i), located(i < 2 ? absl::ZeroDuration() : absl::Seconds(5)),
                     few_ended.generation(), now);
  }
  few_ended.Insert("new", located(absl::Seconds(5)), few_ended.generation(), now);
  EXPECT_EQ(few_ended.size(), 1u);  // six left would have been more than half
  EXPECT_TRUE(few_ended.Lookup("new", now).has_value());
  client::internal::ReplicaCache most_ended(8);
  for (int i = 0; i < 8; ++i) {
    most_ended.Insert(absl::StrCat("k", i), located(i < 6 ? absl::ZeroDuration() : absl::Seconds(5)),
                      most_ended.generation(), now);
  }
  most_ended.Insert("new", located(absl::Seconds(5)), most_ended.generation(), now);
  EXPECT_EQ(most_ended.size(), 3u);  // the two live ones stay
  EXPECT_TRUE(most_ended.Lookup("k7", now).has_value());
}

// Entries serve only within `fresh` of the master's last answer, and an
// answer naming another epoch or membership forgets them all, unless it
// was asked before this client heard of the change.
TEST(ReplicaCacheTest, EntriesServeWhileTheMasterAnswersAndANewMembershipForgetsThem) {
  const absl::Duration fresh = absl::Milliseconds(100);
  client::internal::ReplicaCache cache(8, absl::ZeroDuration(), nullptr, fresh);
  const absl::Time now = absl::Now();
  client::internal::Located a;
  a.stored_size = 10;
  a.lease_end = now + absl::Seconds(5);
  a.replicas.emplace_back("seg", 0);
  cache.Insert("a", a, cache.generation(), now);
  EXPECT_FALSE(cache.Lookup("a", now).has_value()) << "no answer heard yet";
  cache.Heard(now, 1, 7);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(50)).has_value());
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value()) << "the master has been silent";
  // Kept meanwhile: an answer naming the same view makes it serve again.
  cache.Heard(now + absl::Milliseconds(140), 1, 7);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  // Segments left: everything goes, and a get begun before cannot bring it back.
  const uint64_t before = cache.generation();
  cache.Heard(now + absl::Milliseconds(145), 1, 8);
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  EXPECT_EQ(cache.size(), 0u);
  cache.Insert("a", a, before, now);
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  cache.Insert("a", a, cache.generation(), now);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  // A late answer asked before the change was heard changes nothing, and
  // renews nothing.
  cache.Heard(now - absl::Seconds(1), 1, 7);
  EXPECT_TRUE(cache.Lookup("a", now + absl::Milliseconds(150)).has_value());
  EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(250)).has_value());
  // A new leader (another epoch) forgets them too.
  cache.Heard(absl::Now(), 2, 8);
  EXPECT_EQ(cache.size(), 0u);
}

// A counted read's lease is the cache's once inserted: held at most `hold`
// and given back exactly once, whatever makes the entry go, or at once when
// it is not kept; never given back when a read through it may still move.
TEST(ReplicaCacheTest, ACountedReadIsHeldAtMostItsHoldAndGivenBackOnce) {
  std::map<uint64_t, int> given;  // token -> give-backs
  auto release = [&](const std::string&, uint64_t token, int64_t) { ++given[token]; };
  const absl::Time now = absl::Now();
  uint64_t next_token = 1;
  auto counted = [&] {
    client::internal::Located w;
    w.stored_size = 10;
    w.lease_end = now + absl::Seconds(2);
    w.replicas.emplace_back("seg", 0);
    w.lease_token = next_token++;
    w.lease_expiry_ms = absl::ToUnixMillis(now + absl::Seconds(2));
    return w;
  };
  {
    client::internal::ReplicaCache cache(3, absl::Milliseconds(100), release);
    const client::internal::Located a = counted();
    cache.Insert("a", a, cache.generation(), now);
    std::optional<client::internal::Located> hit = cache.Lookup("a", now + absl::Milliseconds(50));
    ASSERT_TRUE(hit.has_value());
    EXPECT_TRUE(hit->cached);
    EXPECT_EQ(hit->lease_token, 0u);  // a hit holds nothing of its own
    EXPECT_EQ(hit->lease_end, now + absl::Milliseconds(100));  // the hold, not the lease
    cache.ReleaseEnded(now + absl::Milliseconds(99));
    EXPECT_TRUE(given.empty());
    cache.ReleaseEnded(now + absl::Milliseconds(100));
    EXPECT_EQ(given[a.lease_token], 1);
    EXPECT_FALSE(cache.Lookup("a", now + absl::Milliseconds(50)).has_value());
    // Each other way out gives it back once.
    const client::internal::Located b = counted(), c = counted(), d = counted(), e = counted();
    cache.Insert("b", b, cache.generation(), now);
    EXPECT_FALSE(cache.Lookup("b", now + absl::Milliseconds(100)).has_value());  // found ended
    cache.Insert("c", c, cache.generation(), now);
    cache.Erase("c");
    cache.Insert("d", d, cache.generation(), now);
    cache.Invalidate("d");
    cache.Insert("e", e, cache.generation(), now);
    const client::internal::Located e2 = counted();
    cache.Insert("e", e2, cache.generation(), now);  // replaced
    for (const auto* w : {&b, &c, &d, &e}) EXPECT_EQ(given[w->lease_token], 1) << w->lease_token;
    EXPECT_EQ(given.count(e2.lease_token), 0u);
    // An insert begun before an invalidation is refused, and its lease goes back.
    const uint64_t before = cache.generation();
    cache.Invalidate("x");
    const client::internal::Located f = counted();
    cache.Insert("f", f, before, now);
    EXPECT_EQ(given[f.lease_token], 1);
    EXPECT_FALSE(cache.Lookup("f", now).has_value());
    // A read that may still be moving bytes: forgotten, its lease kept.
    const client::internal::Located g = counted();
    cache.Insert("g", g, cache.generation(), now);
    cache.Erase("g", /*give_back=*/false);
    EXPECT_EQ(given.count(g.lease_token), 0u);
    // Full: what goes to make room gives its lease back.
    const client::internal::Located h = counted(), i = counted(), j = counted();
    cache.Insert("h", h, cache.generation(), now);
    cache.Insert("i", i, cache.generation(), now);
    cache.Insert("j", j, cache.generation(), now);  // e2, h, i were there: all go
    for (const auto* w : {&e2, &h, &i}) EXPECT_EQ(given[w->lease_token], 1) << w->lease_token;
    EXPECT_EQ(given.count(j.lease_token), 0u);
    cache.ReleaseEnded(now + absl::Seconds(1));  // the older records find nothing of theirs
    EXPECT_EQ(given[j.lease_token], 1);
    const client::internal::Located k = counted();
    cache.Insert("k", k, cache.generation(), now);
    cache.Clear();
    EXPECT_EQ(given[k.lease_token], 1);
    const client::internal::Located l = counted();
    cache.Insert("l", l, cache.generation(), now);
    EXPECT_EQ(given.count(l.lease_token), 0u);
  }
  EXPECT_EQ(given[next_token - 1], 1);  // l, at the cache's end
  // No hold, or no cache: a counted read is given back at once, never kept.
  for (auto [capacity, hold] : {std::pair<size_t, absl::Duration>{4, absl::ZeroDuration()},
                                {0, absl::Milliseconds(100)}}) {
    client::internal::ReplicaCache cache(capacity, hold, release);
    const client::internal::Located m = counted();
    cache.Insert("m", m, cache.generation(), now);
    EXPECT_EQ(given[m.lease_token], 1);
    EXPECT_FALSE(cache.Lookup("m", now).has_value());
  }
  for (const auto& [token, n] : given) EXPECT_LE(n, 1) << token;
}

}  // namespace
}  // namespace tierkv
