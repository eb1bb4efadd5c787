// The master's direct lane (master/direct_lane.h), fed a raw byte stream
// over a real loopback connection: call headers, request messages, caps.
// The first four bytes are forced to the call magic, so every input is
// taken as direct rather than handed to gRPC. After each input the index's
// invariants must hold and a new connection's ping must be answered.
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "master/direct_lane.h"
#include "proto/direct_frame.h"
#include "proto/master.grpc.pb.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/master_fixture.h"

namespace {

using namespace tierkv;

struct Fixture {
  ManualClock clock;
  std::unique_ptr<master::Master> master = fuzz::NewFuzzMaster(&clock);
  master::rpc::RpcMetrics metrics{master.get()};
  // Takes what is not direct; every method UNIMPLEMENTED (a gRPC server
  // needs a service to start).
  v1::Master::Service unimplemented;
  std::unique_ptr<grpc::Server> grpc;
  std::unique_ptr<master::DirectLane> lane;
  int port = 0;
  Fixture() {
    grpc::ServerBuilder builder;
    builder.RegisterService(&unimplemented);
    grpc = builder.BuildAndStart();
    if (grpc == nullptr) std::abort();
    auto listener = net::Listen("127.0.0.1", 0, &port);
    if (!listener.ok()) std::abort();
    master::DirectLane::Options o;
    o.limits.max_batch = 1024;
    o.max_message = 1 << 20;
    o.first_bytes_timeout = absl::Seconds(1);
    lane = std::make_unique<master::DirectLane>(master.get(), &metrics, o);
    lane->Start(std::move(*listener), grpc.get());
  }
};

// Sends `bytes`, half-closes, and reads replies until the master closes,
// so its connection thread is done with them before the next input.
void Exchange(int port, const std::string& bytes) {
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto fd = net::Dial("127.0.0.1:" + std::to_string(port), deadline);
  FUZZ_CHECK(fd.ok());
  (void)net::WriteFull(fd->get(), bytes.data(), bytes.size(), deadline);
  ::shutdown(fd->get(), SHUT_WR);
  fuzz::DrainUntilClosed(fd->get(), deadline);
}

}  // namespace

// Protobuf logs every string field that is not UTF-8; that is expected here.
const bool kQuietProtobuf = [] {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return true;
}();

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* f = new Fixture();
  if (size < 4 || size > (256 << 10)) return 0;
  std::string stream(reinterpret_cast<const char*>(data), size);
  std::memcpy(stream.data(), &direct::kCallMagic, 4);
  Exchange(f->port, stream);
  FUZZ_CHECK_OK(f->master->index().CheckInvariants());
  // Still serving: a ping on a new connection is answered OK.
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto fd = net::Dial("127.0.0.1:" + std::to_string(f->port), deadline);
  FUZZ_CHECK(fd.ok());
  char frame[direct::kHeaderSize];
  direct::EncodeCall({direct::DirectMethod::kPing, 0}, frame);
  FUZZ_CHECK(net::WriteFull(fd->get(), frame, sizeof frame, deadline).ok());
  char reply[direct::kHeaderSize];
  FUZZ_CHECK(net::ReadFull(fd->get(), reply, sizeof reply, deadline).ok());
  auto h = direct::DecodeReply(reply, 1 << 20);
  FUZZ_CHECK(h.ok() && h->code == 0 && h->length == 0);
  ::shutdown(fd->get(), SHUT_WR);
  fuzz::DrainUntilClosed(fd->get(), deadline);
  return 0;
}
