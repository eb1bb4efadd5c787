// Checksums and trailers: a corrupt value is DATA_LOSS over shm and tcp,
// puts store the checksum their copy worked out, another put's bytes read
// as a miss, older trailers stay readable; and where the metadata is.
#include "tests/unit/client_fixture.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/crc32c.h"
#include "client/internal/trailer_arena.h"
#include "transport/engine.h"

namespace tierkv {
namespace {

using ::tierkv::testing::StatusIs;
using transport::Op;

// One byte of a stored value changes under the index: every get is
// DATA_LOSS, never the bytes, whether the checksum is worked out while
// copying (shm) or after (tcp), and whether the replica was remembered.
void ExpectCorruptValueIsDataLoss(client::Client* c, const std::string& transport, const std::string& key) {
  SCOPED_TRACE(key);
  const std::string value = Value(200000, 13);
  ASSERT_OK(c->Put(key, value));
  ASSERT_OK_AND_ASSIGN(std::string got, c->Get(key));  // remembered
  EXPECT_EQ(got, value);
  auto replicas = c->master().GetReplicas({key});
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  const std::string segment = replicas->segments(replicas->replica_segments(0));
  char flipped = static_cast<char>(value[123456] ^ 0x20);
  ASSERT_OK(c->engine().Transfer({{Op::kWrite, &flipped, segment, replicas->replica_offsets(0) + 123456, 1}})[0]);
  EXPECT_EQ(c->engine().Describe(segment).transport, transport);
  EXPECT_THAT(c->Get(key).status(), StatusIs(absl::StatusCode::kDataLoss));
  std::vector<char> out(value.size());
  EXPECT_THAT(c->Get(key, absl::MakeSpan(out)).status(), StatusIs(absl::StatusCode::kDataLoss));
  std::vector<char> a(1000), b(value.size());
  auto scattered = c->BatchGetScatter({key}, {{absl::MakeSpan(a), absl::MakeSpan(b)}});
  EXPECT_THAT(scattered[0].status(), StatusIs(absl::StatusCode::kDataLoss));
}

TEST_F(ClientTest, ACorruptValueIsDataLossOverShm) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"shm", "tcp"}));
  ExpectCorruptValueIsDataLoss(client_.get(), "shm", "plain");
  auto cached = Cached(Options("host-e"));
  ASSERT_NE(cached, nullptr);
  ExpectCorruptValueIsDataLoss(cached.get(), "shm", "remembered");
}

// Over shm a put's first replica is written by a copy that works out the
// CRC as it goes, and the trailer is written from it once the value has
// landed. Every trailer must be the checksum of the value's bytes: single
// and batched puts, one and two replicas, values in parts (checksummed
// here), and the first put to a store (no channel yet: checksummed here).
TEST_F(ClientTest, PutsOverShmStoreTheChecksumTheirCopyWorkedOut) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"shm", "tcp"}));
  auto check = [&](const std::string& key, const std::string& value) {
    SCOPED_TRACE(key);
    ASSERT_OK_AND_ASSIGN(std::string got, client_->Get(key));
    EXPECT_TRUE(got == value);
    auto replicas = client_->master().GetReplicas({key});
    ASSERT_TRUE(replicas.ok()) << replicas.status();
    ASSERT_GE(replicas->replica_offsets_size(), 1);
    for (int r = 0; r < replicas->replica_offsets_size(); ++r) {
      const std::string segment = replicas->segments(replicas->replica_segments(r));
      char trailer[16];
      ASSERT_OK(client_->engine().Transfer(
          {{Op::kRead, trailer, segment, replicas->replica_offsets(r) + value.size(), sizeof trailer}})[0]);
      uint32_t crc;
      uint64_t put_id;
      std::memcpy(&crc, trailer, 4);
      std::memcpy(&put_id, trailer + 8, 8);
      EXPECT_EQ(crc, Crc32cExtend(Crc32c(key.data(), key.size()), value.data(), value.size())) << "replica " << r;
      EXPECT_EQ(std::string(trailer + 4, 4), "TKV2");
      ASSERT_EQ(replicas->put_ids_size(), 1);
      EXPECT_NE(put_id, 0u);
      EXPECT_EQ(put_id, replicas->put_ids(0)) << "replica " << r;
      EXPECT_EQ(client_->engine().Describe(segment).transport, "shm");
    }
  };
  const std::string first = Value(70000, 21);
  ASSERT_OK(client_->Put("first", first));
  check("first", first);
  for (int replicas : {1, 2}) {
    const std::string single = Value(300000 + replicas, 22);
    const std::string key = absl::StrCat("single-", replicas);
    ASSERT_OK(client_->Put(key, single, {.replicas = replicas}));
    check(key, single);
    std::vector<std::string> values;
    std::vector<client::PutItem> items;
    for (int i = 0; i < 6; ++i) values.push_back(Value(1000 + 90000 * i, 30 + i));
    for (int i = 0; i < 6; ++i) items.push_back({absl::StrCat("batch-", replicas, "-", i), values[i]});
    // One item in parts: its trailer is checksummed here.
    const std::string whole = values[2];
    items[2].value = {};
    items[2].parts = {absl::string_view(whole).substr(0, 500), absl::string_view(whole).substr(500)};
    for (const absl::Status& st : client_->BatchPut(items, {.replicas = replicas})) EXPECT_OK(st);
    for (int i = 0; i < 6; ++i) check(items[i].key, values[i]);
  }
}

// Bytes at a key's extent that are not that put of that key read as a
// miss, never as those bytes, with or without checksums: another key's
// value and trailer (what a late write granted by a deposed master, or a
// one-sided write nothing could fence, leaves there), and an older put of
// the same key.
void ExpectAnotherPutReadsAsAMiss(client::Client* c, client::Client* unverified) {
  auto stored = [&](const std::string& key, size_t size) -> absl::StatusOr<std::pair<std::string, uint64_t>> {
    ASSIGN_OR_RETURN(v1::GetReplicasResponse r, c->master().GetReplicas({key}));
    if (r.replica_offsets_size() < 1) return absl::NotFoundError(key);
    std::string bytes(client::StoredSize(size), '\0');
    const std::string segment = r.segments(r.replica_segments(0));
    RETURN_IF_ERROR(c->engine().Transfer({{Op::kRead, bytes.data(), segment, r.replica_offsets(0), bytes.size()}})[0]);
    return std::make_pair(bytes, r.put_ids_size() > 0 ? r.put_ids(0) : 0);
  };
  auto overwrite = [&](const std::string& key, const std::string& bytes) -> absl::Status {
    ASSIGN_OR_RETURN(v1::GetReplicasResponse r, c->master().GetReplicas({key}));
    for (int k = 0; k < r.replica_offsets_size(); ++k) {
      std::string copy = bytes;
      RETURN_IF_ERROR(c->engine().Transfer({{Op::kWrite, copy.data(), r.segments(r.replica_segments(k)),
                                             r.replica_offsets(k), copy.size()}})[0]);
    }
    return absl::OkStatus();
  };
  auto expect_miss = [&](const std::string& key, const std::string& not_this) {
    for (client::Client* reader : {c, unverified}) {
      absl::StatusOr<std::string> got = reader->Get(key);
      EXPECT_THAT(got.status(), StatusIs(absl::StatusCode::kNotFound)) << key;
      if (got.ok()) {
        EXPECT_FALSE(*got == not_this) << key << ": read another put's bytes";
      }
      EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("another put"));
      std::vector<char> out(not_this.size());
      EXPECT_THAT(reader->Get(key, absl::MakeSpan(out)).status(), StatusIs(absl::StatusCode::kNotFound));
    }
  };
  const std::string a = Value(100000, 41), b = Value(100000, 42);
  ASSERT_OK(c->Put("victim", a));
  ASSERT_OK(c->Put("other", b));
  ASSERT_OK_AND_ASSIGN(auto others, stored("other", b.size()));
  ASSERT_OK_AND_ASSIGN(auto victims, stored("victim", a.size()));
  EXPECT_NE(others.second, 0u);
  EXPECT_NE(others.second, victims.second);
  ASSERT_OK(overwrite("victim", others.first));
  expect_miss("victim", b);
  ASSERT_OK_AND_ASSIGN(std::string still, c->Get("other"));  // the other is untouched
  EXPECT_TRUE(still == b);

  // The same key put again: the first put's bytes are not the second's.
  const std::string old_value = Value(50000, 43), new_value = Value(50000, 44);
  ASSERT_OK(c->Put("again", old_value));
  ASSERT_OK_AND_ASSIGN(auto first, stored("again", old_value.size()));
  ASSERT_OK(c->Remove("again", /*force=*/true));
  ASSERT_OK(c->Put("again", new_value));
  ASSERT_OK_AND_ASSIGN(std::string fresh, c->Get("again"));
  EXPECT_TRUE(fresh == new_value);
  ASSERT_OK(overwrite("again", first.first));
  expect_miss("again", old_value);
}

TEST_F(ClientTest, AnotherPutsBytesAtAKeysExtentReadAsAMissOverShm) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"shm", "tcp"}));
  client::ClientOptions o = Options("host-e");
  o.verify_checksums = false;
  ASSERT_OK_AND_ASSIGN(auto unverified, client::Client::Create(o));
  ExpectAnotherPutReadsAsAMiss(client_.get(), unverified.get());
}

TEST_F(ClientTest, AnotherPutsBytesAtAKeysExtentReadAsAMissOverTcp) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  client::ClientOptions o = Options("host-e");
  o.verify_checksums = false;
  ASSERT_OK_AND_ASSIGN(auto unverified, client::Client::Create(o));
  ExpectAnotherPutReadsAsAMiss(client_.get(), unverified.get());
}

// An object put by a writer that predates put ids (a PutStart without
// put_ids gets put id 0, and the writer stores the 8-byte "TKV1"
// trailer) reads back whole, checksummed or not.
TEST_F(ClientTest, AnObjectWithTheOlderTrailerReadsBack) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  const std::string value = Value(30000, 5);
  v1::PutStartRequest req;
  v1::PutStartItem* item = req.add_items();
  item->set_key("legacy");
  item->set_size(value.size() + 8);
  ASSERT_OK_AND_ASSIGN(v1::PutStartResponse started, client_->master().PutStart(req));
  ASSERT_EQ(started.results_size(), 1);
  ASSERT_OK(client::FromItem(started.results(0).status()));
  EXPECT_EQ(started.results(0).put_id(), 0u);
  std::string stored = value;
  const uint32_t crc = Crc32c(value.data(), value.size());
  stored.append(reinterpret_cast<const char*>(&crc), 4);
  stored.append("TKV1");
  for (const v1::Extent& e : started.results(0).replicas()) {
    ASSERT_OK(client_->engine().Transfer(
        {{Op::kWrite, stored.data(), e.segment(), e.offset(), stored.size(), nullptr, started.epoch()}})[0]);
  }
  ASSERT_OK_AND_ASSIGN(v1::KeysResponse ended, client_->master().PutEnd({"legacy"}));
  ASSERT_OK(client::FromItem(ended.status(0)));
  client::ClientOptions o = Options("host-e");
  o.verify_checksums = false;
  ASSERT_OK_AND_ASSIGN(auto unverified, client::Client::Create(o));
  for (client::Client* reader : {client_.get(), unverified.get()}) {
    ASSERT_OK_AND_ASSIGN(std::string got, reader->Get("legacy"));
    EXPECT_TRUE(got == value);
    std::vector<char> out(value.size() + 100);
    ASSERT_OK_AND_ASSIGN(size_t n, reader->Get("legacy", absl::MakeSpan(out)));
    EXPECT_EQ(n, value.size());
  }
  // Its bytes changed under its trailer: DATA_LOSS, as before put ids.
  char flipped = static_cast<char>(value[100] ^ 1);
  ASSERT_OK_AND_ASSIGN(v1::GetReplicasResponse r, client_->master().GetReplicas({"legacy"}));
  ASSERT_OK(client_->engine().Transfer(
      {{Op::kWrite, &flipped, r.segments(r.replica_segments(0)), r.replica_offsets(0) + 100, 1}})[0]);
  EXPECT_THAT(client_->Get("legacy").status(), StatusIs(absl::StatusCode::kDataLoss));
}

// Where the metadata is when it is not given: the one master's host at
// the master's default HTTP port; a master named by a gRPC target URI
// names no host, and says so.
TEST(MetadataUrlTest, AnEmptyUrlComesFromTheMasterOrIsAskedFor) {
  EXPECT_EQ(*client::MetadataUrl("http://meta:1", "m:2"), "http://meta:1");
  EXPECT_EQ(*client::MetadataUrl("", "10.0.0.5:50051"), "http://10.0.0.5:8080");
  EXPECT_THAT(client::MetadataUrl("", "dns:///m:50051").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client::MetadataUrl("", "nohost").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Trailers of objects put before put ids (8 bytes: CRC32C over the value,
// "TKV1"; put id 0 in the index) stay readable and checked; a trailer of
// either kind where the other is due is not taken.
TEST(TrailerTest, LegacyTrailersStayReadableAndKindsAreNotMixed) {
  using client::internal::CheckTrailer;
  std::string value = Value(5000, 9);
  const std::vector<absl::Span<char>> parts = {absl::MakeSpan(value)};
  char legacy[16] = {};
  const uint32_t crc = Crc32c(value.data(), value.size());
  std::memcpy(legacy, &crc, 4);
  std::memcpy(legacy + 4, "TKV1", 4);
  EXPECT_OK(CheckTrailer(legacy, 0, "k", parts, true, {}));
  EXPECT_OK(CheckTrailer(legacy, 0, "k", parts, true, {crc, true}));
  EXPECT_THAT(CheckTrailer(legacy, 0, "k", parts, true, {crc ^ 1, true}), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(CheckTrailer(legacy, 7, "k", parts, true, {}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(client::ValueSizeOf(value.size() + 8, 0), value.size());

  char v2[16];
  client::internal::EncodeTrailer(Crc32cExtend(client::internal::KeyCrc("k"), value.data(), value.size()), 7, v2);
  EXPECT_OK(CheckTrailer(v2, 7, "k", parts, true, {}));
  EXPECT_THAT(CheckTrailer(v2, 7, "j", parts, true, {}), StatusIs(absl::StatusCode::kDataLoss));  // bound to its key
  EXPECT_OK(CheckTrailer(v2, 7, "j", parts, false, {}));  // unverified: only the put id is checked
  EXPECT_THAT(CheckTrailer(v2, 8, "k", parts, false, {}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(CheckTrailer(v2, 0, "k", parts, true, {}), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(client::ValueSizeOf(client::StoredSize(value.size()), 7), value.size());
  value[100] ^= 1;
  EXPECT_THAT(CheckTrailer(v2, 7, "k", parts, true, {}), StatusIs(absl::StatusCode::kDataLoss));
}

TEST_F(ClientTest, ACorruptValueIsDataLossOverTcp) {
  ASSERT_NO_FATAL_FAILURE(StartCluster({"tcp"}));
  ExpectCorruptValueIsDataLoss(client_.get(), "tcp", "plain");
  auto cached = Cached(Options("host-e"));
  ASSERT_NE(cached, nullptr);
  ExpectCorruptValueIsDataLoss(cached.get(), "tcp", "remembered");
}

}  // namespace
}  // namespace tierkv
