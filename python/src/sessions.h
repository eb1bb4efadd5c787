// Read and write sessions (Client::StartReadSession, StartWriteSession)
// as the module's _ReadSession and _WriteSession. Each holds its client
// weakly: a session left alive (in a traceback, say) must not keep
// _Client.close() waiting, and a call on a session of a closed client
// raises FailedPrecondition.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/client.h"
#include "python/src/common.h"

namespace tierkv::python {

namespace py = pybind11;
using client::Client;

// Runs `f` (which may wait on the network) without the GIL where this
// thread holds it: a destructor runs with or without it.
template <class F>
void WithoutGil(F&& f) {
  if (PyGILState_Check()) {
    py::gil_scoped_release nogil;
    f();
  } else {
    f();
  }
}

// A session's client for one call: FAILED_PRECONDITION once it is closed.
inline std::shared_ptr<Client> LockClient(const std::weak_ptr<Client>& weak) {
  std::shared_ptr<Client> c = weak.lock();
  if (c == nullptr) throw StatusException{static_cast<int>(absl::StatusCode::kFailedPrecondition), "client is closed"};
  return c;
}

// Client::StartReadSession's session for Python. sizes(): per key the
// value's size, or -absl code where it cannot be read. read_ranges(key
// indices, addresses, sizes, offsets): one range each, read into the raw
// address; per range 0 or -absl code, with the messages of failures.
class PyReadSession {
 public:
  PyReadSession(const std::shared_ptr<Client>& client, std::unique_ptr<tierkv::client::ReadSession> session)
      : client_(client), session_(std::move(session)) {}
  ~PyReadSession() {
    if (std::shared_ptr<Client> c = client_.lock()) WithoutGil([&] { c->EndReadSession(*session_); });
  }

  std::vector<int64_t> Sizes() const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < session_->size(); ++i) {
      absl::StatusOr<uint64_t> n = session_->value_size(i);
      out.push_back(n.ok() ? static_cast<int64_t>(*n) : -static_cast<int64_t>(n.status().code()));
    }
    return out;
  }

  BatchResult ReadRanges(const std::vector<size_t>& keys, const std::vector<uintptr_t>& ptrs,
                         const std::vector<size_t>& sizes, const std::vector<uint64_t>& offsets, double timeout) {
    std::vector<tierkv::client::RangeRead> reads(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) reads[i] = {keys[i], offsets[i], absl::Span<char>(AsPointer(ptrs[i]), sizes[i])};
    std::shared_ptr<Client> c = Live();
    std::vector<absl::Status> st;
    {
      py::gil_scoped_release nogil;
      st = c->ReadRanges(*session_, reads, timeout > 0 ? absl::Seconds(timeout) : absl::ZeroDuration());
    }
    return FromStatuses(st);
  }

  // Gives the leases back; reads after it are ABORTED. Idempotent; a
  // no-op once the client is closed (its leases ended with it).
  void End() {
    std::shared_ptr<Client> c = client_.lock();
    if (c == nullptr) return;
    py::gil_scoped_release nogil;
    c->EndReadSession(*session_);
  }

 private:
  std::shared_ptr<Client> Live() const { return LockClient(client_); }

  // Weak: a session left in a traceback must not keep close() waiting.
  std::weak_ptr<Client> client_;
  std::unique_ptr<tierkv::client::ReadSession> session_;
};

// Client::StartWriteSession's session for Python. statuses(): per key 0
// or -absl code, with messages. write_ranges(key indices, addresses,
// sizes, offsets): one range each, written from the raw address; per range
// 0 or -absl code. commit(indices) and revoke(indices): of those keys
// (empty: all); commit answers per key it names.
class PyWriteSession {
 public:
  PyWriteSession(const std::shared_ptr<Client>& client, std::unique_ptr<tierkv::client::WriteSession> session)
      : client_(client), session_(std::move(session)) {}
  // A session dropped uncommitted gives its room back now, not at the
  // master's put timeout.
  ~PyWriteSession() {
    if (std::shared_ptr<Client> c = client_.lock()) WithoutGil([&] { c->RevokeWriteSession(*session_); });
  }

  BatchResult Statuses() const {
    std::vector<absl::Status> st;
    for (size_t i = 0; i < session_->size(); ++i) st.push_back(session_->status(i));
    return FromStatuses(st);
  }

  BatchResult WriteRanges(const std::vector<size_t>& keys, const std::vector<uintptr_t>& ptrs,
                          const std::vector<size_t>& sizes, const std::vector<uint64_t>& offsets, double timeout) {
    std::vector<tierkv::client::RangeWrite> writes(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      writes[i] = {keys[i], offsets[i], absl::string_view(AsPointer(ptrs[i]), sizes[i])};
    }
    std::shared_ptr<Client> c = LockClient(client_);
    std::vector<absl::Status> st;
    {
      py::gil_scoped_release nogil;
      st = c->WriteRanges(*session_, writes, timeout > 0 ? absl::Seconds(timeout) : absl::ZeroDuration());
    }
    return FromStatuses(st);
  }

  BatchResult Commit(const std::vector<size_t>& which) {
    std::shared_ptr<Client> c = LockClient(client_);
    std::vector<absl::Status> st;
    {
      py::gil_scoped_release nogil;
      st = c->CommitWriteSession(*session_, which);
    }
    return FromStatuses(st);
  }

  // A no-op once the client is closed: the master revokes what was never
  // committed itself.
  void Revoke(const std::vector<size_t>& which) {
    std::shared_ptr<Client> c = client_.lock();
    if (c == nullptr) return;
    py::gil_scoped_release nogil;
    c->RevokeWriteSession(*session_, which);
  }

 private:
  // Weak, as PyReadSession's.
  std::weak_ptr<Client> client_;
  std::unique_ptr<tierkv::client::WriteSession> session_;
};

}  // namespace tierkv::python
