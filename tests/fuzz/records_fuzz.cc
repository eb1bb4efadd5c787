// The records a restarting master reads back from its store: a corrupt or
// hostile data directory must give a clean error or a master whose
// invariants hold (Master::Create checks them), never a crash.
//
// Input: records as <u8 key length><key><u16 value length><value>, the
// keys steered toward the "s/" and "o/" prefixes the master scans.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/clock.h"
#include "master/master.h"
#include "master/persistence.h"
#include "google/protobuf/stubs/logging.h"
#include "tests/fuzz/fuzz.h"

// Protobuf logs every string field that is not UTF-8; that is expected here.
const bool kQuietProtobuf = [] {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return true;
}();

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<tierkv::master::Mutation> records;
  size_t at = 0;
  while (at < size && records.size() < 256) {
    size_t klen = data[at++];
    if (at + klen > size) break;
    std::string key(reinterpret_cast<const char*>(data + at), klen);
    at += klen;
    if (at + 2 > size) break;
    uint16_t vlen;
    std::memcpy(&vlen, data + at, 2);
    at += 2;
    if (at + vlen > size) vlen = static_cast<uint16_t>(size - at);
    std::string value(reinterpret_cast<const char*>(data + at), vlen);
    at += vlen;
    // The first key byte picks a prefix, so most records are ones the
    // master reads (segments and objects) rather than ignored noise.
    if (!key.empty()) {
      static const char* kPrefixes[] = {"s/", "o/", "m/", ""};
      key = kPrefixes[static_cast<uint8_t>(key[0]) % 4] + key.substr(1);
    }
    records.push_back({key, value, false});
  }
  auto store = tierkv::master::NewMemStore();
  if (!store->Write(records).ok()) return 0;
  tierkv::ManualClock clock;
  auto m = tierkv::master::Master::Create({}, std::move(store), &clock);
  if (!m.ok()) return 0;
  FUZZ_CHECK_OK((*m)->index().CheckInvariants());
  // The recovered master keeps working: segments re-mount, lookups answer.
  (*m)->Tick();
  (void)(*m)->index().GetReplicas({"a", "b"});
  return 0;
}
