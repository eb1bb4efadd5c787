// The fabric, the gate and the backends of client_fixture.h, registered
// once for the whole binary.
#include "tests/unit/client_fixture.h"

#include <algorithm>

#include "base/status.h"
#include "transport/engine.h"
#include "transport/rdma/rdma_backend.h"

namespace tierkv {
namespace {

using transport::Op;

transport::rdma::PortInfo FakePort(const std::string& name, int numa) {
  transport::rdma::PortInfo p;
  p.device = name;
  p.active = true;
  p.numa_node = numa;
  p.lid = 1;
  return p;
}

class GatedChannel final : public transport::PeerChannel {
 public:
  explicit GatedChannel(std::unique_ptr<transport::PeerChannel> inner) : inner_(std::move(inner)) {}
  void Post(absl::Span<transport::Slice* const> slices, absl::Time deadline) override {
    bool write = std::any_of(slices.begin(), slices.end(), [](auto* s) { return s->op == Op::kWrite; });
    TheGate().Pass(write);
    inner_->Post(slices, deadline);
  }
  bool healthy() const override { return inner_->healthy(); }

 private:
  std::unique_ptr<transport::PeerChannel> inner_;
};

// Offered beside tcp by every engine that lists it; moves bytes through
// the serving engine's tcp server.
class GatedBackend final : public transport::Backend {
 public:
  explicit GatedBackend(std::unique_ptr<transport::Backend> tcp) : tcp_(std::move(tcp)) {}
  std::string name() const override { return "gated"; }
  transport::Capabilities capabilities() const override { return {.rank = 5}; }
  absl::Status Start(transport::ServedMemory*) override { return absl::OkStatus(); }
  void Stop() override {}
  std::string endpoint() const override { return "gated"; }
  absl::StatusOr<std::string> RegisterBuffer(const transport::LocalBuffer&) override { return std::string(); }
  void UnregisterBuffer(const transport::LocalBuffer&) override {}
  absl::StatusOr<std::unique_ptr<transport::PeerChannel>> Prepare(const transport::SegmentDescriptor& remote,
                                                                  const transport::PrepareContext& ctx) override {
    ASSIGN_OR_RETURN(std::unique_ptr<transport::PeerChannel> inner, tcp_->Prepare(remote, ctx));
    return std::unique_ptr<transport::PeerChannel>(new GatedChannel(std::move(inner)));
  }

 private:
  std::unique_ptr<transport::Backend> tcp_;  // client side only: never started
};

const bool kRegistered = [] {
  transport::RegisterBackend("rdma", [](const transport::BackendOptions& o) {
    transport::rdma::RdmaOptions r;
    r.chunk = 256 << 10;
    return transport::rdma::NewRdmaBackend(o, Fabric(), r);
  });
  transport::RegisterBackend("gated", [](const transport::BackendOptions& o)
                                          -> absl::StatusOr<std::unique_ptr<transport::Backend>> {
    ASSIGN_OR_RETURN(std::unique_ptr<transport::Backend> tcp, transport::CreateBackend("tcp", o));
    return std::unique_ptr<transport::Backend>(new GatedBackend(std::move(tcp)));
  });
  return true;
}();

}  // namespace

std::shared_ptr<transport::rdma::FakeFabric> Fabric() {
  static auto* fabric = new std::shared_ptr<transport::rdma::FakeFabric>(
      transport::rdma::FakeFabric::Create({FakePort("mlx5_0", 0), FakePort("mlx5_1", 1)}));
  return *fabric;
}

uint64_t RdmaPosted() { return Fabric()->posted("mlx5_0") + Fabric()->posted("mlx5_1"); }

Gate& TheGate() {
  static auto* gate = new Gate();
  return *gate;
}

const char* NoEnv(const char*) { return nullptr; }

std::string Value(size_t n, char seed) {
  std::string v(n, '\0');
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(seed + i * 7);
  return v;
}

std::unique_ptr<client::Client> Cached(client::ClientOptions o, absl::Duration fresh) {
  o.replica_cache = 1024;
  o.replica_cache_fresh = fresh;
  auto c = client::Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

}  // namespace tierkv
