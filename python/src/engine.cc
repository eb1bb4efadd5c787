// tierkv._tierkv.PeerEngine: the transfer engine in peer mode
// (transport/engine.h, EngineOptions::peer_mode) for Python, under the
// Mooncake-compatible TransferEngine in tierkv/mooncake_engine.py.
//
// Calls never raise for a network or peer failure: they return a code
// (and, for transfers, the first failure's message), as Mooncake's binding
// does; only a bad argument type raises (pybind11's TypeError). Lists are
// converted while holding the GIL, every wait runs without it, and an
// engine is shared by any number of Python threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "nlohmann/json.hpp"
#include "transport/engine.h"
#include "transport/memory.h"
#include "transport/numa.h"
#ifdef TIERKV_HAVE_CUDA
#include "transport/cuda/cuda_backend.h"
#endif

namespace py = pybind11;
using tierkv::transport::Batch;
using tierkv::transport::EngineOptions;
using tierkv::transport::Op;
using tierkv::transport::Request;
using tierkv::transport::SharedRegion;
using tierkv::transport::TransferEngine;

namespace {

// A transfer's outcome: 0, or -1 with the first failure's text.
using Outcome = std::pair<int, std::string>;

class PeerEngine {
 public:
  PeerEngine(const std::string& host, int port, const std::vector<std::string>& transports,
             const std::vector<std::string>& rdma_devices, int workers) {
    EngineOptions o;
    o.peer_mode = true;
    o.transports = transports;
    o.workers = workers;
    // Peers on other hosts dial the advertised host; every interface
    // listens, as Mooncake's engine does.
    o.backend.listen = "0.0.0.0";
    o.backend.advertise = host;
    o.backend.port = port;  // 0: the kernel picks
    o.backend.rdma_devices = rdma_devices;
    absl::StatusOr<std::unique_ptr<TransferEngine>> e = TransferEngine::Create(o);
    if (!e.ok()) throw std::runtime_error(std::string(e.status().message()));
    engine_ = std::move(*e);
  }

  ~PeerEngine() {
    py::gil_scoped_release nogil;
    std::lock_guard lock(mu_);
    pending_.clear();
    for (auto& [addr, region] : managed_) (void)engine_->UnregisterMemory(region->data());
    managed_.clear();
    engine_.reset();
  }

  const std::string& session_id() const { return engine_->session_id(); }
  int port() const { return engine_->port(); }

  int RegisterMemory(uint64_t addr, uint64_t length, std::string location) {
    py::gil_scoped_release nogil;
    if (location.empty() || location == "*") location = LocationOf(addr);
    absl::Status st = engine_->RegisterMemory(reinterpret_cast<void*>(addr), length, location);
    if (!st.ok()) TKV_LOG(WARNING) << "register_memory(" << addr << ", " << length << "): " << st.message();
    return st.ok() ? 0 : -1;
  }

  int UnregisterMemory(uint64_t addr) {
    py::gil_scoped_release nogil;
    absl::Status st = engine_->UnregisterMemory(reinterpret_cast<void*>(addr));
    if (!st.ok()) TKV_LOG(WARNING) << "unregister_memory(" << addr << "): " << st.message();
    return st.ok() ? 0 : -1;
  }

  // Moves every entry and waits, by `timeout` plus 1 ns per byte.
  Outcome Transfer(const std::string& session, int opcode, const std::vector<uint64_t>& locals,
                   const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lengths, double timeout) {
    std::vector<Request> requests;
    absl::Time deadline;
    if (Outcome bad = Build(session, opcode, locals, remotes, lengths, timeout, &requests, &deadline);
        bad.first != 0) {
      return bad;
    }
    py::gil_scoped_release nogil;
    std::shared_ptr<Batch> b = engine_->SubmitHere(std::move(requests), deadline - absl::Now());
    (void)b->Wait(deadline);
    return Summarize(b->statuses());
  }

  // The same entries moved `rounds` times from C++ alone (a prebuilt
  // request list copied per call, as a C++ caller holds one): the
  // reference Python's calls are measured against. Seconds, or -1 when a
  // round failed.
  double Repeat(const std::string& session, int opcode, const std::vector<uint64_t>& locals,
                const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lengths, int rounds, double timeout) {
    std::vector<Request> requests;
    absl::Time unused;
    if (Build(session, opcode, locals, remotes, lengths, timeout, &requests, &unused).first != 0) return -1;
    py::gil_scoped_release nogil;
    const absl::Time start = absl::Now();
    for (int i = 0; i < rounds; ++i) {
      const absl::Time deadline = absl::Now() + absl::Seconds(timeout);
      std::shared_ptr<Batch> b = engine_->SubmitHere(requests, deadline - absl::Now());
      (void)b->Wait(deadline);
      if (Summarize(b->statuses()).first != 0) return -1;
    }
    return absl::ToDoubleSeconds(absl::Now() - start);
  }

  // Starts the entries; an id for Check/WaitAll, 0 when nothing started.
  uint64_t Submit(const std::string& session, int opcode, const std::vector<uint64_t>& locals,
                  const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lengths, double timeout) {
    std::vector<Request> requests;
    absl::Time deadline;
    if (Build(session, opcode, locals, remotes, lengths, timeout, &requests, &deadline).first != 0) return 0;
    py::gil_scoped_release nogil;
    std::shared_ptr<Batch> b = engine_->Submit(std::move(requests), deadline - absl::Now());
    std::lock_guard lock(mu_);
    const uint64_t id = next_id_++;
    pending_[id] = {std::move(b), deadline};
    return id;
  }

  // 1 done (the id is freed), 0 still moving, -1 failed (freed), -2 past
  // its deadline (kept until WaitAll or Forget), -3 unknown id.
  int Check(uint64_t id) {
    py::gil_scoped_release nogil;
    std::lock_guard lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return -3;
    Batch& b = *it->second.batch;
    if (!b.Done()) {
      if (absl::Now() < it->second.deadline) return 0;
      (void)b.Wait(absl::Now());  // seals it: nothing lands in its buffers from now on
      return -2;
    }
    const int rc = Summarize(b.statuses()).first == 0 ? 1 : -1;
    pending_.erase(it);
    return rc;
  }

  // Waits for every batch named, frees them, and answers 0 when every
  // entry of every one landed (-1 otherwise, or for an unknown id).
  int WaitAll(const std::vector<uint64_t>& ids) {
    py::gil_scoped_release nogil;
    int rc = 0;
    for (uint64_t id : ids) {
      Pending p;
      {
        std::lock_guard lock(mu_);
        auto it = pending_.find(id);
        if (it == pending_.end()) {
          rc = -1;
          continue;
        }
        p = std::move(it->second);
        pending_.erase(it);
      }
      (void)p.batch->Wait(p.deadline);
      if (Summarize(p.batch->statuses()).first != 0) rc = -1;
    }
    return rc;
  }

  Outcome Notify(const std::string& session, const std::string& name, const py::bytes& message, double timeout) {
    std::string msg = message;
    py::gil_scoped_release nogil;
    absl::Status st = engine_->Notify(session, name, msg, absl::Now() + absl::Seconds(timeout));
    return {st.ok() ? 0 : -1, std::string(st.message())};
  }

  // (name, message, sender) of each notification, in arrival order.
  std::vector<std::tuple<std::string, py::bytes, std::string>> TakeNotifications() {
    std::vector<tierkv::transport::Notification> got;
    {
      py::gil_scoped_release nogil;
      got = engine_->TakeNotifications();
    }
    std::vector<std::tuple<std::string, py::bytes, std::string>> out;
    out.reserve(got.size());
    for (auto& n : got) out.emplace_back(n.name, py::bytes(n.message), n.from);
    return out;
  }

  // The peer's first registered buffer's address: 0 when it answers
  // with none; -1 when it does not answer.
  int64_t Probe(const std::string& session, double timeout) {
    py::gil_scoped_release nogil;
    absl::StatusOr<tierkv::transport::SegmentDescriptor> d =
        engine_->Probe(session, absl::Now() + absl::Seconds(timeout));
    if (!d.ok()) {
      TKV_LOG(INFO) << "probe of " << session << ": " << d.status().message();
      return -1;
    }
    for (const auto& b : d->buffers) {
      if (b.length > 0) return static_cast<int64_t>(b.offset);
    }
    return 0;
  }

  // Host memory other processes on this host can map (shm), registered;
  // 0 when it cannot be had.
  uint64_t Allocate(uint64_t length) {
    py::gil_scoped_release nogil;
    absl::StatusOr<std::unique_ptr<SharedRegion>> r = SharedRegion::Create(length, {});
    if (!r.ok()) {
      TKV_LOG(WARNING) << "allocate_managed_buffer(" << length << "): " << r.status().message();
      return 0;
    }
    absl::Status st = engine_->RegisterMemory((*r)->data(), (*r)->size(), "cpu:0", (*r)->fd());
    if (!st.ok()) {
      TKV_LOG(WARNING) << "allocate_managed_buffer(" << length << "): " << st.message();
      return 0;
    }
    const uint64_t addr = reinterpret_cast<uintptr_t>((*r)->data());
    std::lock_guard lock(mu_);
    managed_[addr] = std::move(*r);
    return addr;
  }

  int Free(uint64_t addr, uint64_t length) {
    py::gil_scoped_release nogil;
    std::unique_ptr<SharedRegion> region;
    {
      std::lock_guard lock(mu_);
      auto it = managed_.find(addr);
      if (it == managed_.end() || it->second->size() != length) return -1;
      region = std::move(it->second);
      managed_.erase(it);
    }
    return engine_->UnregisterMemory(region->data()).ok() ? 0 : -1;
  }

  // Mooncake's topology shape: one entry per memory location, with the
  // NICs this engine was given.
  std::string Topology() const {
    nlohmann::json out = nlohmann::json::object();
    absl::StatusOr<tierkv::transport::NumaTopology> topo = tierkv::transport::NumaTopology::Load();
    std::vector<int> nodes = topo.ok() ? topo->nodes() : std::vector<int>{0};
    for (int n : nodes) {
      out[absl::StrCat("cpu:", n)] = {{"preferred_hca", nlohmann::json::array()},
                                      {"avail_hca", nlohmann::json::array()}};
    }
    return out.dump();
  }

  tierkv::transport::EngineStats Stats() const { return engine_->Stats(); }

 private:
  struct Pending {
    std::shared_ptr<Batch> batch;
    absl::Time deadline;
  };

  static std::string LocationOf(uint64_t addr) {
#ifdef TIERKV_HAVE_CUDA
    if (int dev = tierkv::transport::cuda::PointerDevice(reinterpret_cast<void*>(addr)); dev >= 0) {
      return absl::StrCat("cuda:", dev);
    }
#endif
    return "cpu:0";
  }

  static Outcome Build(const std::string& session, int opcode, const std::vector<uint64_t>& locals,
                       const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lengths, double timeout,
                       std::vector<Request>* requests, absl::Time* deadline) {
    if (locals.size() != remotes.size() || locals.size() != lengths.size()) {
      return {-1, absl::StrCat("lists of unequal lengths (", locals.size(), ", ", remotes.size(), ", ",
                               lengths.size(), ")")};
    }
    if (opcode != 0 && opcode != 1) return {-1, absl::StrCat("opcode ", opcode, " is neither Read (0) nor Write (1)")};
    const Op op = opcode == 0 ? Op::kRead : Op::kWrite;
    uint64_t bytes = 0;
    requests->reserve(locals.size());
    for (size_t i = 0; i < locals.size(); ++i) {
      requests->push_back({op, reinterpret_cast<void*>(locals[i]), session, remotes[i], lengths[i]});
      bytes += lengths[i];
    }
    *deadline = absl::Now() + absl::Seconds(timeout) + absl::Nanoseconds(static_cast<int64_t>(bytes));
    return {0, ""};
  }

  static Outcome Summarize(const std::vector<absl::Status>& statuses) {
    for (const absl::Status& s : statuses) {
      if (!s.ok()) return {-1, std::string(s.message())};
    }
    return {0, ""};
  }

  std::unique_ptr<TransferEngine> engine_;
  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Pending> pending_;
  std::map<uint64_t, std::unique_ptr<SharedRegion>> managed_;
};

}  // namespace

void BindPeerEngine(py::module_& m) {
  py::class_<PeerEngine>(m, "PeerEngine",
                         "The transfer engine in peer mode; use tierkv.mooncake_engine.TransferEngine.")
      .def(py::init<const std::string&, int, const std::vector<std::string>&, const std::vector<std::string>&, int>(),
           py::arg("host"), py::arg("port") = 0, py::arg("transports") = std::vector<std::string>{},
           py::arg("rdma_devices") = std::vector<std::string>{}, py::arg("workers") = 4)
      .def_property_readonly("session_id", &PeerEngine::session_id)
      .def_property_readonly("port", &PeerEngine::port)
      .def("register_memory", &PeerEngine::RegisterMemory, py::arg("addr"), py::arg("length"),
           py::arg("location") = "*")
      .def("unregister_memory", &PeerEngine::UnregisterMemory, py::arg("addr"))
      .def("transfer", &PeerEngine::Transfer, py::arg("session"), py::arg("opcode"), py::arg("locals"),
           py::arg("remotes"), py::arg("lengths"), py::arg("timeout"))
      .def("submit", &PeerEngine::Submit, py::arg("session"), py::arg("opcode"), py::arg("locals"),
           py::arg("remotes"), py::arg("lengths"), py::arg("timeout"))
      .def("cxx_reference", &PeerEngine::Repeat, py::arg("session"), py::arg("opcode"), py::arg("locals"),
           py::arg("remotes"), py::arg("lengths"), py::arg("rounds"), py::arg("timeout"))
      .def("check", &PeerEngine::Check, py::arg("id"))
      .def("wait_all", &PeerEngine::WaitAll, py::arg("ids"))
      .def("notify", &PeerEngine::Notify, py::arg("session"), py::arg("name"), py::arg("message"),
           py::arg("timeout"))
      .def("take_notifications", &PeerEngine::TakeNotifications)
      .def("probe", &PeerEngine::Probe, py::arg("session"), py::arg("timeout"))
      .def("allocate", &PeerEngine::Allocate, py::arg("length"))
      .def("free", &PeerEngine::Free, py::arg("addr"), py::arg("length"))
      .def("topology", &PeerEngine::Topology)
      .def("coalesced", [](const PeerEngine& e) { return e.Stats().coalesced; });
}
