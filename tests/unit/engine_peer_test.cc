// The transfer engine in peer mode (EngineOptions::peer_mode): two engines
// in this process, no metadata server, each reaching the other by its
// session id and naming memory by absolute address, over tcp and over shm.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/status_matchers.h"
#include "transport/engine.h"
#include "transport/memory.h"

namespace tierkv::transport {
namespace {

using ::tierkv::testing::StatusIs;

std::vector<char> Pattern(size_t n, uint64_t seed) {
  std::vector<char> v(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(rng());
  return v;
}

uint64_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

class EnginePeerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    a_ = MakeEngine();
    b_ = MakeEngine();
    ASSERT_TRUE(a_ && b_);
    a_mem_ = Region(kSize);
    b_mem_ = Region(kSize);
    ASSERT_OK(a_->RegisterMemory(a_mem_->data(), kSize, "cpu:0", a_mem_->fd()));
    ASSERT_OK(b_->RegisterMemory(b_mem_->data(), kSize, "cpu:0", b_mem_->fd()));
  }

  std::unique_ptr<TransferEngine> MakeEngine() {
    EngineOptions o;
    o.peer_mode = true;
    o.transports = {GetParam()};
    absl::StatusOr<std::unique_ptr<TransferEngine>> e = TransferEngine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  static std::unique_ptr<SharedRegion> Region(uint64_t size) {
    absl::StatusOr<std::unique_ptr<SharedRegion>> r = SharedRegion::Create(size, {});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }

  // One request from a_ to b_'s memory at `remote`.
  absl::Status Move(Op op, char* local, uint64_t remote, uint64_t length) {
    return a_->Transfer({{op, local, b_->session_id(), remote, length}}, absl::Seconds(10))[0];
  }

  static constexpr uint64_t kSize = 8 << 20;
  std::unique_ptr<TransferEngine> a_, b_;
  std::unique_ptr<SharedRegion> a_mem_, b_mem_;
};

TEST_P(EnginePeerTest, SessionIdIsTheAdvertisedAddressAndPort) {
  EXPECT_EQ(a_->session_id(), absl::StrCat(a_->advertised_address(), ":", a_->port()));
  EXPECT_NE(a_->session_id(), b_->session_id());
  EXPECT_EQ(JoinHostPort("fe80::1", 17000), "[fe80::1]:17000");
}

TEST_P(EnginePeerTest, WritesAndReadsByAbsoluteAddress) {
  std::vector<char> data = Pattern(1 << 20, 1);
  std::memcpy(a_mem_->data(), data.data(), data.size());
  char* at = b_mem_->data() + 4096;
  ASSERT_OK(Move(Op::kWrite, a_mem_->data(), Addr(at), data.size()));
  EXPECT_EQ(std::memcmp(at, data.data(), data.size()), 0);
  std::memset(a_mem_->data(), 0, data.size());
  ASSERT_OK(Move(Op::kRead, a_mem_->data(), Addr(at), data.size()));
  EXPECT_EQ(std::memcmp(a_mem_->data(), data.data(), data.size()), 0);
  // And the other way round, b_ reaching into a_.
  ASSERT_OK(b_->Transfer({{Op::kWrite, at, a_->session_id(), Addr(a_mem_->data() + kSize / 2), 4096}})[0]);
  EXPECT_EQ(std::memcmp(a_mem_->data() + kSize / 2, at, 4096), 0);
}

TEST_P(EnginePeerTest, RangesOutsideTheRegisteredBuffersAreRefusedWithNothingWritten) {
  std::memset(b_mem_->data(), 0x5a, kSize);
  std::vector<char> data = Pattern(8192, 2);
  std::memcpy(a_mem_->data(), data.data(), data.size());
  const uint64_t end = Addr(b_mem_->data()) + kSize;
  // Straddling the end, wholly past it, before the start, wrapping around.
  EXPECT_THAT(Move(Op::kWrite, a_mem_->data(), end - 4096, 8192), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(Move(Op::kWrite, a_mem_->data(), end + 4096, 4096), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(Move(Op::kWrite, a_mem_->data(), Addr(b_mem_->data()) - 1, 2), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(Move(Op::kWrite, a_mem_->data(), UINT64_MAX - 10, 4096), StatusIs(absl::StatusCode::kOutOfRange));
  for (uint64_t i = 0; i < kSize; ++i) ASSERT_EQ(b_mem_->data()[i], 0x5a) << "byte " << i << " was written";
}

TEST_P(EnginePeerTest, MemoryThePeerRegistersLaterIsFoundAndUnregisteredMemoryIsRefused) {
  ASSERT_OK(Move(Op::kWrite, a_mem_->data(), Addr(b_mem_->data()), 64));  // caches b_'s table
  std::unique_ptr<SharedRegion> later = Region(1 << 20);
  ASSERT_OK(b_->RegisterMemory(later->data(), later->size(), "cpu:0", later->fd()));
  std::vector<char> data = Pattern(1 << 20, 3);
  std::memcpy(a_mem_->data(), data.data(), data.size());
  ASSERT_OK(Move(Op::kWrite, a_mem_->data(), Addr(later->data()), data.size()));
  EXPECT_EQ(std::memcmp(later->data(), data.data(), data.size()), 0);

  ASSERT_OK(b_->UnregisterMemory(later->data()));
  std::memset(later->data(), 0, later->size());
  absl::Status st = Move(Op::kWrite, a_mem_->data(), Addr(later->data()), 4096);
  // tcp asks the peer, which refuses the range; a one-sided transport
  // finds the range gone from the peer's table when it looks it up again
  // (its channel may still map the old buffer, whose owner now frees it).
  if (GetParam() == "tcp") {
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kOutOfRange));
    for (uint64_t i = 0; i < later->size(); ++i) ASSERT_EQ(later->data()[i], 0) << i;
  }
  // Memory registered after the unregistration is reached again.
  ASSERT_OK(b_->RegisterMemory(later->data(), later->size(), "cpu:0", later->fd()));
  ASSERT_OK(Move(Op::kWrite, a_mem_->data(), Addr(later->data()), 4096));
  EXPECT_EQ(std::memcmp(later->data(), data.data(), 4096), 0);
}

TEST_P(EnginePeerTest, AdjacentEntriesMoveAsOneRunAndKeepTheirOwnStatus) {
  // 9,000 entries of 576 bytes, scattered as one per token would be:
  // pairs of neighbours on both sides coalesce, the rest do not.
  constexpr size_t kEntry = 576, kEntries = 9000;
  std::vector<char> data = Pattern(kEntry * kEntries, 4);
  std::memcpy(a_mem_->data(), data.data(), data.size());
  std::vector<Request> reqs;
  for (size_t i = 0; i < kEntries; ++i) {
    // Entry i goes to slot i, each pair of entries followed by a gap of one slot.
    const uint64_t slot = i + i / 2;
    reqs.push_back({Op::kWrite, a_mem_->data() + i * kEntry, b_->session_id(), Addr(b_mem_->data()) + slot * kEntry,
                    kEntry});
  }
  // One entry in the middle is out of range: it alone fails.
  reqs[5001].offset = Addr(b_mem_->data()) + kSize;
  const uint64_t before = a_->Stats().coalesced;
  std::vector<absl::Status> st = a_->Transfer(reqs, absl::Seconds(20));
  ASSERT_EQ(st.size(), kEntries);
  for (size_t i = 0; i < kEntries; ++i) {
    if (i == 5001) {
      EXPECT_THAT(st[i], StatusIs(absl::StatusCode::kOutOfRange));
      continue;
    }
    ASSERT_OK(st[i]) << i;
    const uint64_t slot = i + i / 2;
    ASSERT_EQ(std::memcmp(b_mem_->data() + slot * kEntry, data.data() + i * kEntry, kEntry), 0) << i;
  }
  EXPECT_EQ(a_->Stats().coalesced - before, kEntries / 2 - 1);

  // Wholly adjacent entries collapse into one run.
  reqs.clear();
  for (size_t i = 0; i < kEntries; ++i) {
    reqs.push_back({Op::kRead, a_mem_->data() + i * kEntry, b_->session_id(), Addr(b_mem_->data()) + i * kEntry,
                    kEntry});
  }
  std::memset(a_mem_->data(), 0, kEntry * kEntries);
  const uint64_t before2 = a_->Stats().coalesced;
  st = a_->Transfer(reqs, absl::Seconds(20));
  for (size_t i = 0; i < kEntries; ++i) ASSERT_OK(st[i]) << i;
  EXPECT_EQ(a_->Stats().coalesced - before2, kEntries - 1);
  EXPECT_EQ(std::memcmp(a_mem_->data(), b_mem_->data(), kEntry * kEntries), 0);
}

TEST_P(EnginePeerTest, NotificationsArriveInOrderWithTheirBytes) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string binary("\0\xff\x01 msg", 8);
  ASSERT_OK(a_->Notify(b_->session_id(), "req-1", "done", deadline));
  ASSERT_OK(a_->Notify(b_->session_id(), "req-2", binary, deadline));
  ASSERT_OK(a_->Notify(b_->session_id(), "req-3", "", deadline));
  std::vector<Notification> got = b_->TakeNotifications();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].name, "req-1");
  EXPECT_EQ(got[0].message, "done");
  EXPECT_EQ(got[0].from, a_->session_id());
  EXPECT_EQ(got[1].message, binary);
  EXPECT_EQ(got[2].name, "req-3");
  EXPECT_TRUE(b_->TakeNotifications().empty());
  EXPECT_TRUE(a_->TakeNotifications().empty());
  EXPECT_THAT(a_->Notify(b_->session_id(), "big", std::string(40 << 10, 'x'), deadline),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // An engine serving segments (a store daemon) takes none: nothing there
  // reads them, and anyone reaching its port could fill its memory.
  EngineOptions o;
  o.metadata = NewInMemoryMetadata();
  o.transports = {GetParam()};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> daemon, TransferEngine::Create(o));
  EXPECT_THAT(a_->Notify(absl::StrCat("127.0.0.1:", daemon->port()), "x", "y", deadline),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_TRUE(daemon->TakeNotifications().empty());
}

TEST_P(EnginePeerTest, AGonePeerIsUnavailableWithinTheDeadline) {
  ASSERT_OK(Move(Op::kWrite, a_mem_->data(), Addr(b_mem_->data()), 64));
  const std::string gone = b_->session_id();
  ASSERT_OK(b_->UnregisterMemory(b_mem_->data()));
  b_.reset();
  const absl::Time start = absl::Now();
  std::vector<absl::Status> st = a_->Transfer({{Op::kWrite, a_mem_->data(), gone, Addr(b_mem_->data()), 64}},
                                              absl::Seconds(3));
  EXPECT_FALSE(st[0].ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE(a_->Notify(gone, "x", "y", absl::Now() + absl::Seconds(2)).ok());
  EXPECT_FALSE(a_->Transfer({{Op::kWrite, a_mem_->data(), "127.0.0.1:1", 0, 64}}, absl::Seconds(2))[0].ok());
}

// A peer whose buffers are partly shared memory and partly not: with shm
// and tcp both allowed, requests into the plain buffer go by tcp (shm has
// no key for it) and those into the shared one by shm.
TEST(EnginePeerMixedTest, BuffersShmCannotReachGoByTheNextTransport) {
  EngineOptions o;
  o.peer_mode = true;
  o.transports = {"shm", "tcp"};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> a, TransferEngine::Create(o));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TransferEngine> b, TransferEngine::Create(o));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> shared, SharedRegion::Create(1 << 20, {}));
  std::vector<char> plain(1 << 20, 0);
  ASSERT_OK(b->RegisterMemory(shared->data(), shared->size(), "cpu:0", shared->fd()));
  ASSERT_OK(b->RegisterMemory(plain.data(), plain.size(), "cpu:0"));
  std::vector<char> data = Pattern(64 << 10, 9);
  std::vector<absl::Status> st =
      a->Transfer({{Op::kWrite, data.data(), b->session_id(), Addr(plain.data()) + 100, data.size()},
                   {Op::kWrite, data.data(), b->session_id(), Addr(shared->data()) + 100, data.size()}});
  ASSERT_OK(st[0]);
  ASSERT_OK(st[1]);
  EXPECT_EQ(std::memcmp(plain.data() + 100, data.data(), data.size()), 0);
  EXPECT_EQ(std::memcmp(shared->data() + 100, data.data(), data.size()), 0);
  EXPECT_EQ(a->Describe(b->session_id()).transport, "shm");
}

INSTANTIATE_TEST_SUITE_P(Transports, EnginePeerTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tierkv::transport
