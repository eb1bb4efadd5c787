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
// Each input goes to three servers: one open, one that needs data grants
// (--auth token), which must answer every frame it does not admit without
// touching its memory, and the same on a connection the harness admits
// first with a real data grant. There, every extent grant a frame carries
// (flag bit 1) is either left as the input wrote it (a forgery) or signed
// by the harness with the segment's key for an extent of the first half
// of the region, with the input's ops, bounds and expiry: whatever the
// frames do, the second half, which no grant names, must stay untouched.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "base/auth.h"
#include "base/extent_grant.h"
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
  // Nothing may write to a server that admits no one here; from `from` on
  // for one whose grants name only what lies before it.
  bool ServedIntact(size_t from = 0) const {
    for (size_t i = from; i < kServed; ++i) {
      if (memory[kGuard + i] != 0x47) return false;
    }
    return true;
  }
};

namespace tcp = tierkv::transport::tcp;

// One frame's round trip on `fd`: its reply status, and the reply payload.
tcp::WireStatus RoundTrip(int fd, const tcp::RequestHeader& h, const std::string& body, std::string* answer,
                          absl::Time deadline) {
  uint8_t head[tcp::kRequestSize];
  tcp::EncodeRequest(h, head);
  FUZZ_CHECK_OK(tierkv::net::WriteFull(fd, head, sizeof head, deadline));
  if (!body.empty()) FUZZ_CHECK_OK(tierkv::net::WriteFull(fd, body.data(), body.size(), deadline));
  uint8_t reply[tcp::kReplySize];
  FUZZ_CHECK_OK(tierkv::net::ReadFull(fd, reply, sizeof reply, deadline));
  auto r = tcp::DecodeReply(reply, sizeof reply);
  FUZZ_CHECK(r.ok() && r->length < (1 << 20));
  answer->assign(r->length, '\0');
  FUZZ_CHECK_OK(tierkv::net::ReadFull(fd, answer->data(), answer->size(), deadline));
  return r->status;
}

// CHALLENGE and AUTH with a real data grant for `f`'s segment.
void Admit(int fd, const std::string& data_key, uint64_t segment_id, absl::Time deadline) {
  tcp::RequestHeader h;
  h.op = tcp::WireOp::kChallenge;
  h.id = 1;
  std::string nonce;
  FUZZ_CHECK(RoundTrip(fd, h, "", &nonce, deadline) == tcp::WireStatus::kOk);
  const std::string grant = tierkv::auth::NewGrant(absl::Now() + absl::Minutes(5));
  h.op = tcp::WireOp::kAuth;
  h.id = 2;
  h.segment_id = segment_id;
  const std::string body =
      grant + tierkv::auth::GrantProof(tierkv::auth::GrantSessionKey(data_key, grant), nonce, 0, segment_id);
  h.length = body.size();
  std::string none;
  FUZZ_CHECK(RoundTrip(fd, h, body, &none, deadline) == tcp::WireStatus::kOk);
}

// Sends `bytes`, half-closes, and reads replies until the server closes
// (so its connection thread is done with the request). With a data key,
// the connection is admitted first.
void Exchange(int port, const uint8_t* data, size_t size, const std::string& data_key = "",
              uint64_t segment_id = 0) {
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto fd = tierkv::net::Dial("127.0.0.1:" + std::to_string(port), deadline);
  FUZZ_CHECK(fd.ok());
  if (!data_key.empty()) Admit(fd->get(), data_key, segment_id, deadline);
  // Best effort: a server that refuses a frame closes early, which ends the send.
  (void)tierkv::net::WriteFull(fd->get(), data, size, deadline);
  ::shutdown(fd->get(), SHUT_WR);
  tierkv::fuzz::DrainUntilClosed(fd->get(), deadline);
}

// An extent grant in place of the input's 48 bytes at `block`, unless its
// first byte's low bit asks to leave the forgery: signed with `mac` for an
// extent of [0, kServed / 2) that the input's bytes bound.
void SignGrant(const tierkv::auth::ExtentMac& mac, char* block) {
  if ((block[0] & 1) != 0) return;
  uint64_t off = 0, len = 0;
  std::memcpy(&off, block + 8, 8);
  std::memcpy(&len, block + 16, 8);
  tierkv::auth::ExtentGrantFields g;
  g.offset = off % (kServed / 2);
  g.length = len % (kServed / 2 - g.offset + 1);
  g.ops = static_cast<uint8_t>(block[24] & 3);
  g.expiry_unix_ms = absl::ToUnixMillis(absl::Now() + ((block[25] & 1) != 0 ? -absl::Seconds(1) : absl::Minutes(1)));
  const std::string signed_grant = mac.Sign(g);
  FUZZ_CHECK(signed_grant.size() == tcp::kGrantBlockBytes);
  std::memcpy(block, signed_grant.data(), signed_grant.size());
}

// Feeds the input to `f`'s server, then checks it kept its memory and
// still answers. With `mac`, on a connection admitted with a data grant,
// its extent grants signed as SignGrant says.
void Feed(Fixture* f, const uint8_t* data, size_t size, const tierkv::auth::ExtentMac* mac = nullptr,
          const std::string& data_key = "") {
  std::string stream(reinterpret_cast<const char*>(data), size);
  for (size_t pos = 0; pos + tcp::kRequestSize <= stream.size();) {
    for (int i = 0; i < 8; ++i) stream[pos + 16 + i] ^= static_cast<char>(f->segment_id >> (8 * i));
    uint8_t op = static_cast<uint8_t>(stream[pos + 4]);
    const bool granted = (static_cast<uint8_t>(stream[pos + 5]) & tcp::kHasGrant) != 0;
    uint64_t length = 0;
    std::memcpy(&length, stream.data() + pos + 40, 8);  // little-endian hosts only, as the fuzzers run
    pos += tcp::kRequestSize;
    if (granted && pos + tcp::kGrantBlockBytes <= stream.size()) {
      if (mac != nullptr) SignGrant(*mac, stream.data() + pos);
      pos += tcp::kGrantBlockBytes;
    }
    // The ops that carry a payload: WRITE, HANDSHAKE, AUTH, WRITEV, READV.
    const bool payload = op == static_cast<uint8_t>(tcp::WireOp::kWrite) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kHandshake) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kAuth) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kWriteV) ||
                         op == static_cast<uint8_t>(tcp::WireOp::kReadV);
    if (payload) pos += static_cast<size_t>(std::min<uint64_t>(length, stream.size() - pos));
  }
  Exchange(f->engine->port(), reinterpret_cast<const uint8_t*>(stream.data()), stream.size(), data_key,
           f->segment_id);
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
  static Fixture* admitted = new Fixture(/*data_grants=*/true);
  static const std::string admitted_key = *admitted->engine->SegmentDataKey("fuzz");
  static const tierkv::auth::ExtentMac* mac = new tierkv::auth::ExtentMac(admitted_key);
  if (size > (256 << 10)) return 0;
  Feed(open, data, size);
  Feed(granted, data, size);
  // No grant can be forged from the input: the key is random per run.
  FUZZ_CHECK(granted->ServedIntact());
  Feed(admitted, data, size, mac, admitted_key);
  // Grants name only the first half: the second is no frame's to write.
  FUZZ_CHECK(admitted->ServedIntact(kServed / 2));
  return 0;
}
