// The tcp transport's server, fed a raw byte stream over a real loopback
// connection: frame decoding, range checks, write draining, handshakes,
// vectored frames (WRITEV, READV: range tables, every range checked).
// The served region sits between two guard regions that must stay intact:
// whatever the frames say, no byte outside the served range is touched,
// and the server keeps answering afterwards.
//
// The served segment's id is random per run, so the target XORs it into
// the segment-id field of every frame header it can walk: an input whose
// field is 0 names the served segment, any other value another one.
// Each input goes to two servers: one open, one that needs data grants
// (--auth token), which must answer every frame it does not admit without
// touching its memory.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "tests/fuzz/fuzz.h"
#include "transport/descriptor.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "transport/metadata.h"
#include "base/net/socket.h"
#include "transport/tcp/wire.h"

namespace {

using namespace tierkv::transport;

constexpr size_t kGuard = 4096;
constexpr size_t kServed = 64 << 10;

struct Fixture {
  std::unique_ptr<char[]> memory{new char[kGuard + kServed + kGuard]};
  std::unique_ptr<TransferEngine> engine;
  explicit Fixture(bool data_grants) {
    std::memset(memory.get(), 0x47, kGuard + kServed + kGuard);
    EngineOptions o;
    o.metadata = NewInMemoryMetadata();
    o.transports = {"tcp"};
    o.backend.max_frame = 1 << 20;
    o.data_grants = data_grants;
    auto e = TransferEngine::Create(o);
    if (!e.ok()) std::abort();
    engine = std::move(*e);
    char* served = memory.get() + kGuard;
    if (!engine->RegisterMemory(served, kServed, "cpu:0").ok()) std::abort();
    if (!engine->ServeSegment("fuzz", {served}).ok()) std::abort();
    auto d = SegmentDescriptor::FromJson(*o.metadata->Get(DescriptorKey("fuzz")));
    if (!d.ok()) std::abort();
    segment_id = d->segment_id;
  }
  uint64_t segment_id = 0;
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (memory[i] != 0x47 || memory[kGuard + kServed + i] != 0x47) return false;
    }
    return true;
  }
  // Nothing may write to a server that admits no one here.
  bool ServedIntact() const {
    for (size_t i = 0; i < kServed; ++i) {
      if (memory[kGuard + i] != 0x47) return false;
    }
    return true;
  }
};

// Sends `bytes`, half-closes, and reads replies until the server closes
// (so its connection thread is done with the request).
void Exchange(int port, const uint8_t* data, size_t size) {
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto fd = tierkv::net::Dial("127.0.0.1:" + std::to_string(port), deadline);
  FUZZ_CHECK(fd.ok());
  // Best effort: a server that refuses a frame closes early, which ends the send.
  (void)tierkv::net::WriteFull(fd->get(), data, size, deadline);
  ::shutdown(fd->get(), SHUT_WR);
  tierkv::fuzz::DrainUntilClosed(fd->get(), deadline);
}

// Feeds the input to `f`'s server, then checks it kept its memory and
// still answers.
void Feed(Fixture* f, const uint8_t* data, size_t size) {
  std::string stream(reinterpret_cast<const char*>(data), size);
  namespace tcp = tierkv::transport::tcp;
  for (size_t pos = 0; pos + tcp::kRequestSize <= stream.size();) {
    for (int i = 0; i < 8; ++i) stream[pos + 16 + i] ^= static_cast<char>(f->segment_id >> (8 * i));
    uint8_t op = static_cast<uint8_t>(stream[pos + 4]);
    uint64_t length = 0;
    std::memcpy(&length, stream.data() + pos + 40, 8);  // little-endian hosts only, as the fuzzers run
    pos += tcp::kRequestSize;
    // The ops that carry a payload: WRITE, HANDSHAKE, AUTH, WRITEV, READV.
    const bool payload = op == static_cast<uint8_t>(tcp::WireOp::kWrite) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kHandshake) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kAuth) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kWriteV) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kReadV);
    if (payload) pos += static_cast<size_t>(std::min<uint64_t>(length, stream.size() - pos));
  }
  Exchange(f->engine->port(), reinterpret_cast<const uint8_t*>(stream.data()), stream.size());
  FUZZ_CHECK(f->GuardsIntact());
  // Still serving: a well-formed ping gets its reply.
  tcp::RequestHeader ping;
  ping.op = tcp::WireOp::kPing;
  ping.id = 7;
  uint8_t frame[tcp::kRequestSize];
  tcp::EncodeRequest(ping, frame);
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto fd = tierkv::net::Dial("127.0.0.1:" + std::to_string(f->engine->port()), deadline);
  FUZZ_CHECK(fd.ok());
  FUZZ_CHECK(tierkv::net::WriteFull(fd->get(), frame, sizeof(frame), deadline).ok());
  uint8_t reply[tcp::kReplySize];
  FUZZ_CHECK(tierkv::net::ReadFull(fd->get(), reply, sizeof(reply), deadline).ok());
  auto h = tcp::DecodeReply(reply, sizeof(reply));
  FUZZ_CHECK(h.ok() && h->id == 7 && h->status == tcp::WireStatus::kOk);
  // Return only once the server has finished with this connection too, as
  // with the first one: libFuzzer's leak check runs after each input, and
  // must not catch a server thread between allocating and freeing.
  ::shutdown(fd->get(), SHUT_WR);
  tierkv::fuzz::DrainUntilClosed(fd->get(), deadline);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* open = new Fixture(/*data_grants=*/false);
  static Fixture* granted = new Fixture(/*data_grants=*/true);
  if (size > (256 << 10)) return 0;
  Feed(open, data, size);
  Feed(granted, data, size);
  // No grant can be forged from the input: the key is random per run.
  FUZZ_CHECK(granted->ServedIntact());
  return 0;
}
