// tierkv._tierkv: the C++ client (client::Client) for Python.
//
// A thin layer: it converts arguments while holding the GIL, releases the
// GIL around every call into the client (gil_scoped_release), and converts
// results back. Values come from any buffer-protocol object (read in place;
// the buffer stays exported, so pinned, for the call) or from a raw address
// and size. Policy (exception classes, Mooncake's return codes) lives in
// the Python package, which calls this module.
//
// Errors: single-key calls raise tierkv.Error subclasses through
// tierkv._errors.from_status(code, message); a miss on a read returns None.
// Batch calls never raise for one key: they return one entry per key, an
// int (bytes or 0 on success, or -absl code) and, for failures, the
// messages in a side list.
//
// Thread-safe: a Client is shared by threads; close() waits for nothing but
// lets calls already running finish on their own reference.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "client/client.h"
#include "base/auth.h"
#include "python/src/common.h"
#include "python/src/sessions.h"

namespace py = pybind11;

void BindPeerEngine(py::module_& m);  // engine.cc
using tierkv::client::Client;
using tierkv::client::ClientOptions;
using tierkv::client::PutItem;
using tierkv::client::PutOptions;
using tierkv::python::AsPointer;
using tierkv::python::BatchResult;
using tierkv::python::FromSizes;
using tierkv::python::FromStatuses;
using tierkv::python::PyReadSession;
using tierkv::python::PyWriteSession;
using tierkv::python::StatusException;
using tierkv::python::Throw;

namespace {

class Buffer {
 public:
  Buffer(py::handle obj, bool writable) {
    int flags = writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
    held_ = true;
  }
  Buffer(Buffer&& o) noexcept : view_(o.view_), held_(std::exchange(o.held_, false)) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  char* data() const { return static_cast<char*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

class PyClient {
 public:
  PyClient(const std::string& master, const std::string& metadata, std::vector<std::string> transports,
           std::vector<std::string> rdma_devices, uint64_t lend_size, const std::string& lend_name,
           const std::string& host, const std::string& client_id, const std::string& listen,
           double rpc_timeout, double transfer_timeout, bool verify_checksums, int connections, int workers,
           double reply_spin, int64_t replica_cache, const std::string& token, const std::string& tls_ca,
           const std::string& tls_cert, const std::string& tls_key) {
    ClientOptions o;
    o.token = token;
    o.tls = {tls_ca, tls_cert, tls_key};
    o.master = master;
    o.metadata = metadata;
    o.transports = std::move(transports);
    o.rdma_devices = std::move(rdma_devices);
    o.lend_size = lend_size;
    o.lend_name = lend_name;
    o.host = host;
    o.client_id = client_id;
    o.listen = listen;
    o.rpc_timeout = absl::Seconds(rpc_timeout);
    o.transfer_timeout = absl::Seconds(transfer_timeout);
    o.verify_checksums = verify_checksums;
    o.connections = connections;
    o.workers = workers;
    o.reply_spin = absl::Seconds(reply_spin);
    if (replica_cache < 0) Throw(absl::InvalidArgumentError("replica_cache must be 0 (off) or more entries"));
    o.replica_cache = static_cast<size_t>(replica_cache);
    absl::StatusOr<std::unique_ptr<Client>> c;
    {
      py::gil_scoped_release nogil;
      c = Client::Create(std::move(o));
    }
    if (!c.ok()) Throw(c.status());
    client_ = std::shared_ptr<Client>(std::move(*c));
  }

  ~PyClient() { Close(); }

  // Stops the client. Calls made after it raise FailedPrecondition. It waits,
  // without the GIL, for the calls still running on other threads (each
  // holds its own reference) and then destroys the client here: the
  // destructor unmounts over the network and joins threads, and a call that
  // destroyed it on its way out would do so holding the GIL, freezing every
  // Python thread for as long as the master takes to answer.
  void Close() {
    std::shared_ptr<Client> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = std::move(client_);
    }
    if (c == nullptr) return;
    py::gil_scoped_release nogil;
    // A call in flight drops its reference as it returns; it needs the GIL
    // to get there, which this thread no longer holds. Each call is bounded
    // by the client's own timeouts.
    while (c.use_count() > 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    c.reset();
  }

  void Put(const std::string& key, py::handle value, const PutOptions& po, const std::string& group,
           const std::string& parent) {
    Buffer b(value, false);
    PutRaw(key, b.data(), b.size(), po, group, parent);
  }

  void PutPtr(const std::string& key, uintptr_t ptr, size_t size, const PutOptions& po, const std::string& group,
              const std::string& parent) {
    PutRaw(key, AsPointer(ptr), size, po, group, parent);
  }

  // Puts the concatenation of `parts` (Mooncake's put_parts), each read in place.
  void PutParts(const std::string& key, const py::list& parts, const PutOptions& po) {
    std::vector<Buffer> bufs;
    std::vector<PutItem> items(1);
    items[0].key = key;
    for (py::handle p : parts) {
      bufs.emplace_back(p, false);
      items[0].parts.emplace_back(bufs.back().data(), bufs.back().size());
    }
    if (items[0].parts.empty()) items[0].parts.emplace_back();  // an empty value
    std::shared_ptr<Client> c = Get();
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = c->BatchPut(items, po)[0];
    }
    if (!s.ok()) Throw(s);
  }

  // Key i's value is the concatenation of parts[i] (buffers), read in place.
  BatchResult BatchPutParts(const std::vector<std::string>& keys, const py::list& parts,
                            const std::vector<std::string>& groups, const std::vector<std::string>& parents,
                            const PutOptions& po) {
    std::vector<Buffer> bufs;
    std::vector<PutItem> items(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      items[i].key = keys[i];
      items[i].group = At(groups, i);
      items[i].parent_key = At(parents, i);
      for (py::handle p : py::object(parts[i])) {
        bufs.emplace_back(p, false);
        items[i].parts.emplace_back(bufs.back().data(), bufs.back().size());
      }
      if (items[i].parts.empty()) items[i].parts.emplace_back();
    }
    return PutItems(items, po);
  }

  // Key i's value is the concatenation of sizes[i][j] bytes at ptrs[i][j].
  BatchResult BatchPutPtrParts(const std::vector<std::string>& keys, const std::vector<std::vector<uintptr_t>>& ptrs,
                               const std::vector<std::vector<size_t>>& sizes, const std::vector<std::string>& groups,
                               const std::vector<std::string>& parents, const PutOptions& po) {
    std::vector<PutItem> items(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      items[i].key = keys[i];
      items[i].group = At(groups, i);
      items[i].parent_key = At(parents, i);
      for (size_t j = 0; j < ptrs[i].size(); ++j) items[i].parts.emplace_back(AsPointer(ptrs[i][j]), sizes[i][j]);
      if (items[i].parts.empty()) items[i].parts.emplace_back();
    }
    return PutItems(items, po);
  }

  py::object GetValue(const std::string& key) {
    std::shared_ptr<Client> c = Get();
    absl::StatusOr<std::string> v;
    {
      py::gil_scoped_release nogil;
      v = c->Get(key);
    }
    if (absl::IsNotFound(v.status())) return py::none();
    if (!v.ok()) Throw(v.status());
    return py::bytes(*v);
  }

  py::object GetInto(const std::string& key, py::handle out) {
    Buffer b(out, true);
    return GetRaw(key, b.data(), b.size());
  }
  py::object GetIntoPtr(const std::string& key, uintptr_t ptr, size_t size) {
    return GetRaw(key, AsPointer(ptr), size);
  }

  BatchResult BatchPut(const std::vector<std::string>& keys, const py::list& values,
                       const std::vector<std::string>& groups, const std::vector<std::string>& parents,
                       const PutOptions& po) {
    std::vector<Buffer> bufs;
    bufs.reserve(keys.size());
    for (py::handle v : values) bufs.emplace_back(v, false);
    std::vector<PutItem> items(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      items[i] = {keys[i], absl::string_view(bufs[i].data(), bufs[i].size()), At(groups, i), At(parents, i)};
    }
    return PutItems(items, po);
  }

  BatchResult BatchPutPtrs(const std::vector<std::string>& keys, const std::vector<uintptr_t>& ptrs,
                           const std::vector<size_t>& sizes, const std::vector<std::string>& groups,
                           const std::vector<std::string>& parents, const PutOptions& po) {
    std::vector<PutItem> items(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      items[i] = {keys[i], absl::string_view(AsPointer(ptrs[i]), sizes[i]), At(groups, i), At(parents, i)};
    }
    return PutItems(items, po);
  }

  // bytes, or (code, message) for a key that was not read.
  py::list BatchGet(const std::vector<std::string>& keys) {
    std::shared_ptr<Client> c = Get();
    std::vector<absl::StatusOr<std::string>> got;
    {
      py::gil_scoped_release nogil;
      got = c->BatchGet(keys);
    }
    py::list out;
    for (auto& g : got) {
      if (g.ok()) {
        out.append(py::bytes(*g));
      } else {
        out.append(py::make_tuple(static_cast<int>(g.status().code()), std::string(g.status().message())));
      }
    }
    return out;
  }

  BatchResult BatchGetInto(const std::vector<std::string>& keys, const py::list& outs, double timeout) {
    std::vector<Buffer> bufs;
    bufs.reserve(keys.size());
    for (py::handle o : outs) bufs.emplace_back(o, true);
    std::vector<absl::Span<char>> spans;
    for (const Buffer& b : bufs) spans.emplace_back(b.data(), b.size());
    return GetSpans(keys, spans, timeout);
  }

  BatchResult BatchGetIntoPtrs(const std::vector<std::string>& keys, const std::vector<uintptr_t>& ptrs,
                               const std::vector<size_t>& sizes, double timeout) {
    std::vector<absl::Span<char>> spans;
    for (size_t i = 0; i < keys.size(); ++i) spans.emplace_back(AsPointer(ptrs[i]), sizes[i]);
    return GetSpans(keys, spans, timeout);
  }

  // Scatters key i's value over outs[i] (writable buffers), in order.
  BatchResult BatchGetIntoParts(const std::vector<std::string>& keys, const py::list& outs, double timeout) {
    std::vector<Buffer> bufs;
    std::vector<std::vector<absl::Span<char>>> spans(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      for (py::handle o : py::object(outs[i])) {
        bufs.emplace_back(o, true);
        spans[i].emplace_back(bufs.back().data(), bufs.back().size());
      }
    }
    return ScatterSpans(keys, spans, timeout);
  }

  BatchResult BatchGetIntoPtrParts(const std::vector<std::string>& keys,
                                   const std::vector<std::vector<uintptr_t>>& ptrs,
                                   const std::vector<std::vector<size_t>>& sizes, double timeout) {
    std::vector<std::vector<absl::Span<char>>> spans(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      for (size_t j = 0; j < ptrs[i].size(); ++j) spans[i].emplace_back(AsPointer(ptrs[i][j]), sizes[i][j]);
    }
    return ScatterSpans(keys, spans, timeout);
  }

  bool Exists(const std::string& key) {
    std::shared_ptr<Client> c = Get();
    absl::StatusOr<bool> r;
    {
      py::gil_scoped_release nogil;
      r = c->Exists(key);
    }
    if (!r.ok()) Throw(r.status());
    return *r;
  }

  std::vector<bool> BatchExists(const std::vector<std::string>& keys) {
    std::shared_ptr<Client> c = Get();
    absl::StatusOr<std::vector<bool>> r;
    {
      py::gil_scoped_release nogil;
      r = c->BatchExists(keys);
    }
    if (!r.ok()) Throw(r.status());
    return *r;
  }

  size_t PrefixMatch(const std::vector<std::string>& keys) {
    std::shared_ptr<Client> c = Get();
    absl::StatusOr<size_t> r;
    {
      py::gil_scoped_release nogil;
      r = c->PrefixMatch(keys);
    }
    if (!r.ok()) Throw(r.status());
    return *r;
  }

  void Remove(const std::string& key, bool force) {
    std::shared_ptr<Client> c = Get();
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = c->Remove(key, force);
    }
    if (!s.ok()) Throw(s);
  }

  uint64_t RemoveAll(bool force) {
    std::shared_ptr<Client> c = Get();
    absl::StatusOr<uint64_t> r;
    {
      py::gil_scoped_release nogil;
      r = c->RemoveAll(force);
    }
    if (!r.ok()) Throw(r.status());
    return *r;
  }

  void RegisterMemory(uintptr_t ptr, size_t size) {
    std::shared_ptr<Client> c = Get();
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = c->RegisterMemory(AsPointer(ptr), size);
    }
    if (!s.ok()) Throw(s);
  }

  void UnregisterMemory(uintptr_t ptr) {
    std::shared_ptr<Client> c = Get();
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = c->UnregisterMemory(AsPointer(ptr));
    }
    if (!s.ok()) Throw(s);
  }

  py::dict Stats() {
    std::shared_ptr<Client> c = Get();
    absl::StatusOr<tierkv::v1::StatsResponse> r;
    {
      py::gil_scoped_release nogil;
      r = c->master().Stats();
    }
    if (!r.ok()) Throw(r.status());
    py::dict d;
    d["objects"] = r->objects();
    d["pending"] = r->pending();
    d["used_bytes"] = r->used_bytes();
    d["capacity_bytes"] = r->capacity_bytes();
    d["segments"] = r->segments();
    d["evictions"] = r->evictions();
    d["groups"] = r->groups();
    d["leased"] = r->leased();
    return d;
  }

  // The C++ client moving the same pages with no Python between calls: the
  // reference a Python benchmark compares itself to in the same run. `op`
  // "put" writes keys prefix<iteration>-<i> (fresh each iteration), "get"
  // reads prefix<i>. Seconds taken; raises the first error.
  double Reference(const std::string& op, const std::string& prefix, const std::vector<uintptr_t>& ptrs,
                   const std::vector<size_t>& sizes, int iterations) {
    std::shared_ptr<Client> c = Get();
    absl::Status first;
    absl::Time t0 = absl::Now();
    {
      py::gil_scoped_release nogil;
      for (int it = 0; it < iterations && first.ok(); ++it) {
        if (op == "put") {
          std::vector<PutItem> items(ptrs.size());
          for (size_t i = 0; i < ptrs.size(); ++i) {
            items[i].key = prefix + std::to_string(it) + "-" + std::to_string(i);
            items[i].value = absl::string_view(AsPointer(ptrs[i]), sizes[i]);
          }
          for (const absl::Status& s : c->BatchPut(items)) {
            if (!s.ok() && first.ok()) first = s;
          }
        } else {
          std::vector<std::string> keys;
          std::vector<absl::Span<char>> spans;
          for (size_t i = 0; i < ptrs.size(); ++i) {
            keys.push_back(prefix + std::to_string(i));
            spans.emplace_back(AsPointer(ptrs[i]), sizes[i]);
          }
          for (const auto& g : c->BatchGet(keys, spans)) {
            if (!g.ok() && first.ok()) first = g.status();
          }
        }
      }
    }
    if (!first.ok()) Throw(first);
    return absl::ToDoubleSeconds(absl::Now() - t0);
  }

  // A read session over `keys` (Client::StartReadSession): holds the
  // client, so it stays usable while the session lives.
  std::shared_ptr<PyReadSession> StartReadSession(const std::vector<std::string>& keys);

  // A write session for keys of `sizes` bytes (Client::StartWriteSession).
  std::shared_ptr<PyWriteSession> StartWriteSession(const std::vector<std::string>& keys,
                                                          const std::vector<uint64_t>& sizes,
                                                          const std::vector<std::string>& groups,
                                                          const std::vector<std::string>& parents,
                                                          const PutOptions& po);

  std::string LocalSegment() { return Get()->local_segment(); }
  bool LocalSegmentMounted() { return Get()->local_segment_mounted(); }
  std::string MetadataUrl() { return Get()->metadata_url(); }

 private:
  std::shared_ptr<Client> Get() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!client_) throw StatusException{static_cast<int>(absl::StatusCode::kFailedPrecondition), "client is closed"};
    return client_;
  }

  static std::string At(const std::vector<std::string>& v, size_t i) { return i < v.size() ? v[i] : ""; }

  void PutRaw(const std::string& key, const char* data, size_t size, const PutOptions& po, const std::string& group,
              const std::string& parent) {
    std::vector<PutItem> items{{key, absl::string_view(data, size), group, parent}};
    std::shared_ptr<Client> c = Get();
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = c->BatchPut(items, po)[0];
    }
    if (!s.ok()) Throw(s);
  }

  py::object GetRaw(const std::string& key, char* data, size_t size) {
    std::shared_ptr<Client> c = Get();
    absl::StatusOr<size_t> r;
    {
      py::gil_scoped_release nogil;
      r = c->Get(key, absl::Span<char>(data, size));
    }
    if (absl::IsNotFound(r.status())) return py::none();
    if (!r.ok()) Throw(r.status());
    return py::int_(*r);
  }

  BatchResult PutItems(const std::vector<PutItem>& items, const PutOptions& po) {
    std::shared_ptr<Client> c = Get();
    std::vector<absl::Status> st;
    {
      py::gil_scoped_release nogil;
      st = c->BatchPut(items, po);
    }
    return FromStatuses(st);
  }

  BatchResult GetSpans(const std::vector<std::string>& keys, const std::vector<absl::Span<char>>& spans,
                       double timeout) {
    std::shared_ptr<Client> c = Get();
    std::vector<absl::StatusOr<size_t>> got;
    {
      py::gil_scoped_release nogil;
      got = c->BatchGet(keys, spans, timeout > 0 ? absl::Seconds(timeout) : absl::ZeroDuration());
    }
    return FromSizes(got);
  }

  BatchResult ScatterSpans(const std::vector<std::string>& keys,
                           const std::vector<std::vector<absl::Span<char>>>& spans, double timeout) {
    std::shared_ptr<Client> c = Get();
    std::vector<absl::StatusOr<size_t>> got;
    {
      py::gil_scoped_release nogil;
      got = c->BatchGetScatter(keys, spans, timeout > 0 ? absl::Seconds(timeout) : absl::ZeroDuration());
    }
    return FromSizes(got);
  }

  std::mutex mu_;
  std::shared_ptr<Client> client_;  // null once closed
};

std::shared_ptr<PyReadSession> PyClient::StartReadSession(const std::vector<std::string>& keys) {
  std::shared_ptr<Client> c = Get();
  std::unique_ptr<tierkv::client::ReadSession> session;
  {
    py::gil_scoped_release nogil;
    session = c->StartReadSession(keys);
  }
  return std::make_shared<PyReadSession>(c, std::move(session));
}

std::shared_ptr<PyWriteSession> PyClient::StartWriteSession(const std::vector<std::string>& keys,
                                                            const std::vector<uint64_t>& sizes,
                                                            const std::vector<std::string>& groups,
                                                            const std::vector<std::string>& parents,
                                                            const PutOptions& po) {
  std::vector<tierkv::client::WriteItem> items(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) items[i] = {keys[i], sizes[i], At(groups, i), At(parents, i)};
  std::shared_ptr<Client> c = Get();
  std::unique_ptr<tierkv::client::WriteSession> session;
  {
    py::gil_scoped_release nogil;
    session = c->StartWriteSession(items, po);
  }
  return std::make_shared<PyWriteSession>(c, std::move(session));
}

PutOptions MakePutOptions(int replicas, const std::string& preferred, bool soft_pin, bool hard_pin) {
  PutOptions po;
  po.replicas = replicas;
  po.preferred_segment = preferred;
  po.soft_pin = soft_pin;
  po.hard_pin = hard_pin;
  return po;
}

// Checks that each key's list of parts has as many sizes as pointers.
void SameShape(const std::vector<std::vector<uintptr_t>>& ptrs, const std::vector<std::vector<size_t>>& sizes) {
  for (size_t i = 0; i < ptrs.size() && i < sizes.size(); ++i) {
    if (ptrs[i].size() != sizes[i].size()) {
      throw StatusException{static_cast<int>(absl::StatusCode::kInvalidArgument),
                            "a key's buffer pointers and sizes differ in number"};
    }
  }
}

// Checks that parallel lists have the lengths of `keys`; INVALID_ARGUMENT
// otherwise (the Python layer turns that into one code per key).
void SameLength(size_t n, std::initializer_list<size_t> others) {
  for (size_t m : others) {
    if (m != n) throw StatusException{static_cast<int>(absl::StatusCode::kInvalidArgument), "lists of unequal length"};
  }
}

}  // namespace

PYBIND11_MODULE(_tierkv, m) {
  m.doc() = "tierkv's C++ client; use the tierkv package, which wraps it.";
  BindPeerEngine(m);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      py::object exc = py::module_::import("tierkv._errors").attr("from_status")(e.code, e.message);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def(
      "discover_metadata",
      [](const std::string& master, double timeout, const std::string& token, const std::string& tls_ca,
         const std::string& tls_cert, const std::string& tls_key) {
        absl::StatusOr<std::string> r;
        {
          py::gil_scoped_release nogil;
          r = tierkv::client::DiscoverMetadata(master, absl::Seconds(timeout), token, {tls_ca, tls_cert, tls_key});
        }
        if (!r.ok()) Throw(r.status());
        return *r;
      },
      py::arg("master"), py::arg("timeout") = 5.0, py::arg("token") = "", py::arg("tls_ca") = "",
      py::arg("tls_cert") = "", py::arg("tls_key") = "",
      "http://host:port of the metadata server of the master at host:port, as it reports it.");
  m.def(
      "read_token_file",
      [](const std::string& path) {
        absl::StatusOr<std::string> r = tierkv::auth::ReadTokenFile(path);
        if (!r.ok()) Throw(r.status());
        return *r;
      },
      py::arg("path"), "The token in a token file: the first word of its first line that is not a comment.");
  m.def(
      "buffer_address",
      [](py::handle obj, bool writable) {
        Buffer b(obj, writable);
        return py::make_tuple(reinterpret_cast<uintptr_t>(b.data()), b.size());
      },
      py::arg("obj"), py::arg("writable") = false, "(address, size) of a C-contiguous buffer.");
  m.def("stored_size", &tierkv::client::StoredSize, "Bytes a value occupies in the store (value + trailer).");
  m.def("value_size", &tierkv::client::ValueSizeOf, py::arg("stored_size"), py::arg("put_id"),
        "The value's bytes of an object of stored_size written by put put_id (/v1/objects' size and put_id).");

  // Python's default is the C++ one.
  m.attr("DEFAULT_REPLICA_CACHE") = ClientOptions().replica_cache;

  py::class_<PyReadSession, std::shared_ptr<PyReadSession>>(m, "_ReadSession")
      .def("sizes", &PyReadSession::Sizes)
      .def("read_ranges",
           [](PyReadSession& s, const std::vector<size_t>& keys, const std::vector<uintptr_t>& ptrs,
              const std::vector<size_t>& sizes, const std::vector<uint64_t>& offsets, double timeout) {
             SameLength(keys.size(), {ptrs.size(), sizes.size(), offsets.size()});
             return s.ReadRanges(keys, ptrs, sizes, offsets, timeout);
           },
           py::arg("keys"), py::arg("ptrs"), py::arg("sizes"), py::arg("offsets"), py::arg("timeout") = 0.0)
      .def("end", &PyReadSession::End);

  py::class_<PyWriteSession, std::shared_ptr<PyWriteSession>>(m, "_WriteSession")
      .def("statuses", &PyWriteSession::Statuses)
      .def("write_ranges",
           [](PyWriteSession& s, const std::vector<size_t>& keys, const std::vector<uintptr_t>& ptrs,
              const std::vector<size_t>& sizes, const std::vector<uint64_t>& offsets, double timeout) {
             SameLength(keys.size(), {ptrs.size(), sizes.size(), offsets.size()});
             return s.WriteRanges(keys, ptrs, sizes, offsets, timeout);
           },
           py::arg("keys"), py::arg("ptrs"), py::arg("sizes"), py::arg("offsets"), py::arg("timeout") = 0.0)
      .def("commit", &PyWriteSession::Commit, py::arg("which") = std::vector<size_t>{})
      .def("revoke", &PyWriteSession::Revoke, py::arg("which") = std::vector<size_t>{});

  py::class_<PyClient>(m, "_Client")
      .def(py::init<const std::string&, const std::string&, std::vector<std::string>, std::vector<std::string>,
                    uint64_t, const std::string&, const std::string&, const std::string&, const std::string&,
                    double, double, bool, int, int, double, int64_t, const std::string&, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("master"), py::arg("metadata"), py::arg("transports"), py::arg("rdma_devices"),
           py::arg("lend_size"), py::arg("lend_name"), py::arg("host"), py::arg("client_id"), py::arg("listen"),
           py::arg("rpc_timeout"), py::arg("transfer_timeout"), py::arg("verify_checksums"),
           py::arg("connections"), py::arg("workers"), py::arg("reply_spin"), py::arg("replica_cache"),
           py::arg("token"), py::arg("tls_ca"), py::arg("tls_cert"), py::arg("tls_key"))
      .def("close", &PyClient::Close)
      .def("put",
           [](PyClient& c, const std::string& key, py::handle value, int replicas, const std::string& preferred,
              bool soft_pin, bool hard_pin, const std::string& group, const std::string& parent) {
             c.Put(key, value, MakePutOptions(replicas, preferred, soft_pin, hard_pin), group, parent);
           })
      .def("put_ptr",
           [](PyClient& c, const std::string& key, uintptr_t ptr, size_t size, int replicas,
              const std::string& preferred, bool soft_pin, bool hard_pin, const std::string& group,
              const std::string& parent) {
             c.PutPtr(key, ptr, size, MakePutOptions(replicas, preferred, soft_pin, hard_pin), group, parent);
           })
      .def("put_parts",
           [](PyClient& c, const std::string& key, const py::list& parts, int replicas, const std::string& preferred,
              bool soft_pin, bool hard_pin) {
             c.PutParts(key, parts, MakePutOptions(replicas, preferred, soft_pin, hard_pin));
           })
      .def("get", &PyClient::GetValue)
      .def("get_into", &PyClient::GetInto)
      .def("get_into_ptr", &PyClient::GetIntoPtr)
      .def("batch_put",
           [](PyClient& c, const std::vector<std::string>& keys, const py::list& values,
              const std::vector<std::string>& groups, const std::vector<std::string>& parents, int replicas,
              const std::string& preferred, bool soft_pin, bool hard_pin) {
             SameLength(keys.size(), {static_cast<size_t>(py::len(values))});
             return c.BatchPut(keys, values, groups, parents, MakePutOptions(replicas, preferred, soft_pin, hard_pin));
           })
      .def("batch_put_parts",
           [](PyClient& c, const std::vector<std::string>& keys, const py::list& parts,
              const std::vector<std::string>& groups, const std::vector<std::string>& parents, int replicas,
              const std::string& preferred, bool soft_pin, bool hard_pin) {
             SameLength(keys.size(), {static_cast<size_t>(py::len(parts))});
             return c.BatchPutParts(keys, parts, groups, parents,
                                    MakePutOptions(replicas, preferred, soft_pin, hard_pin));
           })
      .def("batch_put_ptr_parts",
           [](PyClient& c, const std::vector<std::string>& keys, const std::vector<std::vector<uintptr_t>>& ptrs,
              const std::vector<std::vector<size_t>>& sizes, const std::vector<std::string>& groups,
              const std::vector<std::string>& parents, int replicas, const std::string& preferred, bool soft_pin,
              bool hard_pin) {
             SameLength(keys.size(), {ptrs.size(), sizes.size()});
             SameShape(ptrs, sizes);
             return c.BatchPutPtrParts(keys, ptrs, sizes, groups, parents,
                                       MakePutOptions(replicas, preferred, soft_pin, hard_pin));
           })
      .def("batch_put_ptrs",
           [](PyClient& c, const std::vector<std::string>& keys, const std::vector<uintptr_t>& ptrs,
              const std::vector<size_t>& sizes, const std::vector<std::string>& groups,
              const std::vector<std::string>& parents, int replicas, const std::string& preferred, bool soft_pin,
              bool hard_pin) {
             SameLength(keys.size(), {ptrs.size(), sizes.size()});
             return c.BatchPutPtrs(keys, ptrs, sizes, groups, parents,
                                   MakePutOptions(replicas, preferred, soft_pin, hard_pin));
           })
      .def("batch_get", &PyClient::BatchGet)
      .def("batch_get_into",
           [](PyClient& c, const std::vector<std::string>& keys, const py::list& outs, double timeout) {
             SameLength(keys.size(), {static_cast<size_t>(py::len(outs))});
             return c.BatchGetInto(keys, outs, timeout);
           })
      .def("batch_get_into_ptrs",
           [](PyClient& c, const std::vector<std::string>& keys, const std::vector<uintptr_t>& ptrs,
              const std::vector<size_t>& sizes, double timeout) {
             SameLength(keys.size(), {ptrs.size(), sizes.size()});
             return c.BatchGetIntoPtrs(keys, ptrs, sizes, timeout);
           })
      .def("batch_get_into_parts",
           [](PyClient& c, const std::vector<std::string>& keys, const py::list& outs, double timeout) {
             SameLength(keys.size(), {static_cast<size_t>(py::len(outs))});
             return c.BatchGetIntoParts(keys, outs, timeout);
           })
      .def("batch_get_into_ptr_parts",
           [](PyClient& c, const std::vector<std::string>& keys, const std::vector<std::vector<uintptr_t>>& ptrs,
              const std::vector<std::vector<size_t>>& sizes, double timeout) {
             SameLength(keys.size(), {ptrs.size(), sizes.size()});
             SameShape(ptrs, sizes);
             return c.BatchGetIntoPtrParts(keys, ptrs, sizes, timeout);
           })
      .def("exists", &PyClient::Exists)
      .def("batch_exists", &PyClient::BatchExists)
      .def("prefix_match", &PyClient::PrefixMatch)
      .def("remove", &PyClient::Remove)
      .def("remove_all", &PyClient::RemoveAll)
      .def("register_memory", &PyClient::RegisterMemory)
      .def("unregister_memory", &PyClient::UnregisterMemory)
      .def("stats", &PyClient::Stats)
      .def("start_read_session", &PyClient::StartReadSession, py::arg("keys"))
      .def("start_write_session",
           [](PyClient& c, const std::vector<std::string>& keys, const std::vector<uint64_t>& sizes,
              const std::vector<std::string>& groups, const std::vector<std::string>& parents, int replicas,
              const std::string& preferred, bool soft_pin, bool hard_pin) {
             SameLength(keys.size(), {sizes.size()});
             return c.StartWriteSession(keys, sizes, groups, parents,
                                        MakePutOptions(replicas, preferred, soft_pin, hard_pin));
           })
      .def("cxx_reference", &PyClient::Reference)
      .def_property_readonly("local_segment", &PyClient::LocalSegment)
      .def_property_readonly("local_segment_mounted", &PyClient::LocalSegmentMounted)
      .def_property_readonly("metadata_url", &PyClient::MetadataUrl);
}
