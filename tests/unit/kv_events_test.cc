// The KV-event encoder in both formats, decoded back with msgpack-cxx, and
// the publisher's bounded queue (what is dropped is counted in /metrics).
#include "master/kv_events.h"

#include <algorithm>
#include <filesystem>

#include <msgpack.hpp>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "master/master.h"
#include "tests/support/process.h"

namespace tierkv::master {
namespace {

std::string Str(const msgpack::object& o) {
  EXPECT_EQ(o.type, msgpack::type::STR);
  return std::string(o.via.str.ptr, o.via.str.size);
}

std::string Bin(const msgpack::object& o) {
  EXPECT_EQ(o.type, msgpack::type::BIN);
  return std::string(o.via.bin.ptr, o.via.bin.size);
}

const msgpack::object& Field(const msgpack::object& map, absl::string_view name, size_t index) {
  // Names in vLLM's field order, "type" first.
  EXPECT_LT(index, map.via.map.size);
  const msgpack::object_kv& kv = map.via.map.ptr[index];
  EXPECT_EQ(Str(kv.key), name);
  return kv.val;
}

std::vector<KvEvent> ThreeEvents() {
  return {{KvEvent::Type::kStored, "page-1", "page-0", 0},
          {KvEvent::Type::kRemoved, "page-0", "", 0},
          {KvEvent::Type::kAllCleared, "", "", 0}};
}

TEST(KvEventsEncode, BatchIsTsEventsNilEpoch) {
  std::string payload = EncodeKvEventBatch(ThreeEvents(), 1700000000.25, 42, KvEventFormat::kArray, "cpu");
  msgpack::object_handle h = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = h.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 4u);
  ASSERT_EQ(batch.via.array.ptr[0].type, msgpack::type::FLOAT64);
  EXPECT_DOUBLE_EQ(batch.via.array.ptr[0].via.f64, 1700000000.25);
  ASSERT_EQ(batch.via.array.ptr[1].type, msgpack::type::ARRAY);
  EXPECT_EQ(batch.via.array.ptr[1].via.array.size, 3u);
  EXPECT_EQ(batch.via.array.ptr[2].type, msgpack::type::NIL);  // data_parallel_rank
  EXPECT_EQ(batch.via.array.ptr[3].as<uint64_t>(), 42u);
}

TEST(KvEventsEncode, ArrayFormIsTagThenFieldsInOrder) {
  std::string payload = EncodeKvEventBatch(ThreeEvents(), 1.0, 7, KvEventFormat::kArray, "cpu");
  msgpack::object_handle h = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& events = h.get().via.array.ptr[1];

  const msgpack::object& stored = events.via.array.ptr[0];
  ASSERT_EQ(stored.type, msgpack::type::ARRAY);
  ASSERT_EQ(stored.via.array.size, 7u);
  const msgpack::object* f = stored.via.array.ptr;
  EXPECT_EQ(Str(f[0]), "BlockStored");
  ASSERT_EQ(f[1].type, msgpack::type::ARRAY);  // block_hashes
  ASSERT_EQ(f[1].via.array.size, 1u);
  EXPECT_EQ(Bin(f[1].via.array.ptr[0]), "page-1");
  EXPECT_EQ(Bin(f[2]), "page-0");  // parent_block_hash
  ASSERT_EQ(f[3].type, msgpack::type::ARRAY);  // token_ids
  EXPECT_EQ(f[3].via.array.size, 0u);
  EXPECT_EQ(f[4].as<uint64_t>(), 0u);  // block_size
  EXPECT_EQ(f[5].type, msgpack::type::NIL);  // lora_id
  EXPECT_EQ(Str(f[6]), "cpu");  // medium

  const msgpack::object& removed = events.via.array.ptr[1];
  ASSERT_EQ(removed.via.array.size, 3u);
  EXPECT_EQ(Str(removed.via.array.ptr[0]), "BlockRemoved");
  EXPECT_EQ(Bin(removed.via.array.ptr[1].via.array.ptr[0]), "page-0");
  EXPECT_EQ(Str(removed.via.array.ptr[2]), "cpu");

  const msgpack::object& cleared = events.via.array.ptr[2];
  ASSERT_EQ(cleared.via.array.size, 1u);
  EXPECT_EQ(Str(cleared.via.array.ptr[0]), "AllBlocksCleared");
}

TEST(KvEventsEncode, MapFormNamesEveryFieldWithTypeFirst) {
  std::string payload = EncodeKvEventBatch(ThreeEvents(), 1.0, 7, KvEventFormat::kMap, "cpu");
  msgpack::object_handle h = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = h.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);  // the batch keeps vLLM's array form
  const msgpack::object& events = batch.via.array.ptr[1];

  const msgpack::object& stored = events.via.array.ptr[0];
  ASSERT_EQ(stored.type, msgpack::type::MAP);
  ASSERT_EQ(stored.via.map.size, 7u);
  EXPECT_EQ(Str(Field(stored, "type", 0)), "BlockStored");
  EXPECT_EQ(Bin(Field(stored, "block_hashes", 1).via.array.ptr[0]), "page-1");
  EXPECT_EQ(Bin(Field(stored, "parent_block_hash", 2)), "page-0");
  EXPECT_EQ(Field(stored, "token_ids", 3).via.array.size, 0u);
  EXPECT_EQ(Field(stored, "block_size", 4).as<uint64_t>(), 0u);
  EXPECT_EQ(Field(stored, "lora_id", 5).type, msgpack::type::NIL);
  EXPECT_EQ(Str(Field(stored, "medium", 6)), "cpu");

  const msgpack::object& removed = events.via.array.ptr[1];
  ASSERT_EQ(removed.via.map.size, 3u);
  EXPECT_EQ(Str(Field(removed, "type", 0)), "BlockRemoved");
  EXPECT_EQ(Bin(Field(removed, "block_hashes", 1).via.array.ptr[0]), "page-0");
  EXPECT_EQ(Str(Field(removed, "medium", 2)), "cpu");

  const msgpack::object& cleared = events.via.array.ptr[2];
  ASSERT_EQ(cleared.via.map.size, 1u);
  EXPECT_EQ(Str(Field(cleared, "type", 0)), "AllBlocksCleared");
}

TEST(KvEventsEncode, NoParentIsNil) {
  std::string payload =
      EncodeKvEventBatch({{KvEvent::Type::kStored, "root", "", 0}}, 1.0, 1, KvEventFormat::kArray, "cpu");
  msgpack::object_handle h = msgpack::unpack(payload.data(), payload.size());
  EXPECT_EQ(h.get().via.array.ptr[1].via.array.ptr[0].via.array.ptr[2].type, msgpack::type::NIL);
}

TEST(KvEventsEncode, BytesOfAOneEventBatch) {
  // The example in docs/kv-events.md, byte for byte.
  std::string payload =
      EncodeKvEventBatch({{KvEvent::Type::kRemoved, "k1", "", 0}}, 1.5, 2, KvEventFormat::kArray, "cpu");
  const unsigned char want[] = {0x94, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0,  // [1.5,
                                0x91, 0x93, 0xac, 'B', 'l', 'o', 'c', 'k', 'R', 'e', 'm', 'o', 'v', 'e', 'd',
                                0x91, 0xc4, 0x02, 'k', '1', 0xa3, 'c', 'p', 'u',  // [["BlockRemoved",[b"k1"],"cpu"]]
                                0xc0, 0x02};  // nil, 2]
  EXPECT_EQ(payload, std::string(reinterpret_cast<const char*>(want), sizeof(want)));
}

TEST(KvEventsFormat, Parse) {
  EXPECT_EQ(*ParseKvEventFormat("array"), KvEventFormat::kArray);
  EXPECT_EQ(*ParseKvEventFormat("map"), KvEventFormat::kMap);
  EXPECT_EQ(ParseKvEventFormat("json").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvEventPublisher, FullQueueDropsAndCounts) {
  metrics::Registry registry;
  KvEventsOptions options;
  options.endpoint = "tcp://127.0.0.1:*";
  options.queue_capacity = 3;
  KvEventPublisher events(options, &registry);  // not started: nothing drains the queue
  for (int i = 0; i < 5; ++i) events.OnStored("k" + std::to_string(i), "", 1);
  events.OnRemoved("k0");
  EXPECT_EQ(events.dropped(), 3u);
  EXPECT_NE(registry.Serialize().find("tierkv_master_kv_events_dropped_total 3"), std::string::npos)
      << registry.Serialize();
}

TEST(KvEventPublisher, BindErrorsAreStatuses) {
  metrics::Registry registry;
  KvEventsOptions options;
  options.endpoint = "tcp://127.0.0.1:*";
  KvEventPublisher first(options, &registry);
  ASSERT_TRUE(first.Start().ok());
  EXPECT_EQ(first.Start().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_NE(first.bound_endpoint().find("tcp://127.0.0.1:"), std::string::npos) << first.bound_endpoint();

  metrics::Registry other;
  options.endpoint = first.bound_endpoint();  // taken
  KvEventPublisher second(options, &other);
  EXPECT_EQ(second.Start().code(), absl::StatusCode::kUnavailable);
  metrics::Registry third_registry;
  options.endpoint = "nonsense";
  KvEventPublisher third(options, &third_registry);
  EXPECT_EQ(third.Start().code(), absl::StatusCode::kInvalidArgument);
}

// An index listener that writes down what it is told: "+key<parent", "-key".
struct Recorder : IndexListener {
  std::vector<std::string> log;
  void OnStored(absl::string_view key, absl::string_view parent, uint64_t size) override {
    log.push_back(absl::StrCat("+", key, "<", parent));
  }
  void OnRemoved(absl::string_view key) override { log.push_back(absl::StrCat("-", key)); }
};

TEST(KvEventPublisher, IndexReportsStoredAndRemovedThroughTheListener) {
  // The index calls its listener at PutEnd and at every removal of a stored object.
  Recorder recorder;
  MasterOptions options;
  options.index.listener = &recorder;
  auto master = Master::Create(options, NewMemStore(), Clock::Real());
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE((*master)->Mount({{"seg", "host", 1 << 20, "inc", "tcp://x"}})[0].ok());
  ObjectIndex& index = (*master)->index();
  PutItem a{.key = "a", .size = 100};
  PutItem b{.key = "b", .size = 100, .parent_key = "a"};
  ASSERT_TRUE(index.PutStart({a, b})[0].status.ok());
  index.PutEnd({"a", "b"});
  PutItem pending{.key = "p", .size = 100};
  ASSERT_TRUE(index.PutStart({pending})[0].status.ok());
  index.PutRevoke({"p"});  // never stored: not reported
  index.Remove({"b"}, false);
  EXPECT_EQ(recorder.log, (std::vector<std::string>{"+a<", "+b<a", "-b"}));
}

TEST(KvEventPublisher, RecoveredObjectsAreReportedStored) {
  // A restarted master's consumers rebuild from its epoch: the objects it
  // recovered are announced as it restores them.
  Recorder recorder;
  const std::string dir = testing::MakeTempDir("tierkv-kv-events");
  {
    auto store = OpenRocksDbStore(dir);
    ASSERT_TRUE(store.ok()) << store.status();
    auto master = Master::Create({}, std::move(*store), Clock::Real());
    ASSERT_TRUE(master.ok()) << master.status();
    ASSERT_TRUE((*master)->Mount({{"seg", "host", 1 << 20, "inc", "tcp://x"}})[0].ok());
    PutItem a{.key = "a", .size = 100};
    PutItem b{.key = "b", .size = 100, .parent_key = "a"};
    ASSERT_TRUE((*master)->index().PutStart({a, b})[0].status.ok());
    (*master)->index().PutEnd({"a", "b"});
    ASSERT_TRUE((*master)->Flush().ok());
  }
  auto store = OpenRocksDbStore(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  MasterOptions options;
  options.index.listener = &recorder;
  auto master = Master::Create(options, std::move(*store), Clock::Real());
  ASSERT_TRUE(master.ok()) << master.status();
  master->reset();
  std::filesystem::remove_all(dir);
  std::sort(recorder.log.begin(), recorder.log.end());
  EXPECT_EQ(recorder.log, (std::vector<std::string>{"+a<", "+b<a"}));
}

}  // namespace
}  // namespace tierkv::master
