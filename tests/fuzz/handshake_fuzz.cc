// Every backend's handshake, both sides: the first input byte picks what
// the rest is fed to.
//
//   0  rdma ServeHandshake (the request a client sends), over the fake fabric
//   1  rdma Prepare, the rest being the server's answer (fake fabric)
//   2  shm ServeHandshake
//   3  shm Prepare, the rest being the server's answer
//   4  cuda's request and answer parsers (what its ServeHandshake and
//      Prepare call; the backend itself needs a GPU)
//   5  the engine's routing over the real tcp control channel: the next
//      byte picks the transport name (shm, rdma, tcp, cuda, unknown), the
//      rest is the request
//
// Whatever the bytes, each side answers a status (a server's OK answer is
// a JSON object; a client's malformed answer is UNAVAILABLE) and nothing
// throws: an exception out of a handshake used to terminate the daemon.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/fuzz.h"
#include "transport/cuda/cuda_handshake.h"
#include "transport/engine.h"
#include "transport/internal/builtin.h"
#include "transport/memory.h"
#include "transport/metadata.h"
#include "transport/rdma/fake_verbs.h"
#include "transport/rdma/rdma_backend.h"

namespace {

using namespace tierkv::transport;

rdma::PortInfo Port(const std::string& name) {
  rdma::PortInfo p;
  p.device = name;
  p.active = true;
  p.lid = 1;
  return p;
}

struct Fixture {
  std::shared_ptr<rdma::FakeFabric> fabric = rdma::FakeFabric::Create({Port("mlx5_0"), Port("mlx5_1")});
  std::unique_ptr<Backend> rdma;
  std::unique_ptr<Backend> shm;
  std::unique_ptr<SharedRegion> region;
  std::unique_ptr<TransferEngine> engine;
  SegmentDescriptor rdma_desc, shm_desc;
  LocalBuffer buffer;

  Fixture() {
    auto fabric_ref = fabric;
    RegisterBackend("rdma", [fabric_ref](const BackendOptions& o) { return rdma::NewRdmaBackend(o, fabric_ref); });
    rdma = Must(rdma::NewRdmaBackend({}, fabric));
    shm = Must(internal::NewShmBackend({}));
    region = Must(SharedRegion::Create(1 << 20, {}));
    EngineOptions o;
    o.metadata = NewInMemoryMetadata();
    o.transports = {"shm", "rdma", "tcp"};
    engine = Must(TransferEngine::Create(o));
    if (!engine->RegisterMemory(region->data(), region->size(), "cpu:0", region->fd()).ok()) std::abort();
    if (!engine->ServeSegment("fuzz", {region->data()}).ok()) std::abort();
    // The served segment's descriptor carries real rdma and shm keys.
    auto d = SegmentDescriptor::FromJson(*o.metadata->Get(DescriptorKey("fuzz")));
    if (!d.ok() || !d->transports.contains("rdma") || !d->transports.contains("shm")) std::abort();
    rdma_desc = shm_desc = *d;
    buffer.addr = region->data();
    buffer.length = region->size();
    buffer.memfd = region->fd();
  }
  template <class T>
  static T Must(absl::StatusOr<T> v) {
    if (!v.ok()) std::abort();
    return std::move(*v);
  }
};

PrepareContext Answering(const std::string& answer) {
  PrepareContext ctx;
  ctx.local_host_id = LocalHostId();
  ctx.deadline = absl::Now() + absl::Seconds(5);
  ctx.handshake = [answer](const std::string&, const std::string&, const std::string&,
                           absl::Time) -> absl::StatusOr<std::string> { return answer; };
  return ctx;
}

void CheckServed(const absl::StatusOr<std::string>& answer) {
  if (!answer.ok()) return;
  // A server only ever answers what its peer's Prepare can parse.
  FUZZ_CHECK(!answer->empty() && answer->front() == '{');
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* f = new Fixture();
  if (size < 1 || size > (64 << 10)) return 0;
  const uint8_t which = data[0] % 6;
  std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const LocalBuffer* buffers[] = {&f->buffer};
  switch (which) {
    case 0:
      CheckServed(f->rdma->ServeHandshake(rest, buffers, 1));
      break;
    case 1: {
      absl::StatusOr<std::unique_ptr<PeerChannel>> ch = f->rdma->Prepare(f->rdma_desc, Answering(rest));
      FUZZ_CHECK(!ch.ok() || *ch != nullptr);
      break;
    }
    case 2:
      CheckServed(f->shm->ServeHandshake(rest, buffers, 1));
      break;
    case 3: {
      absl::StatusOr<std::unique_ptr<PeerChannel>> ch = f->shm->Prepare(f->shm_desc, Answering(rest));
      FUZZ_CHECK(ch.ok() || absl::IsUnavailable(ch.status()));
      break;
    }
    case 4: {
      absl::StatusOr<std::string> host = tierkv::transport::cuda::ParseCudaRequest(rest);
      absl::StatusOr<tierkv::transport::cuda::CudaAnswer> answer = tierkv::transport::cuda::ParseCudaAnswer(rest);
      FUZZ_CHECK(host.ok() || absl::IsInvalidArgument(host.status()));
      FUZZ_CHECK(answer.ok() || absl::IsInvalidArgument(answer.status()));
      break;
    }
    case 5: {
      static const char* kNames[] = {"shm", "rdma", "tcp", "cuda", "nope"};
      const char* transport = kNames[(rest.empty() ? 0 : static_cast<uint8_t>(rest[0])) % 5];
      if (!rest.empty()) rest.erase(0, 1);
      absl::StatusOr<std::string> answer = internal::TcpHandshake(
          f->shm_desc.control, transport, rest, absl::Now() + absl::Seconds(5));
      CheckServed(answer);
      // The control channel still answers afterwards.
      std::string probe = absl::StrCat(R"({"segment_index": )", f->shm_desc.segment_index, R"(, "segment_id": )",
                                       f->shm_desc.segment_id, R"(, "host_id": ")", LocalHostId(), R"("})");
      FUZZ_CHECK(internal::TcpHandshake(f->shm_desc.control, "shm", probe, absl::Now() + absl::Seconds(5)).ok());
      break;
    }
  }
  return 0;
}
