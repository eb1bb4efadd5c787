// What the binding's files share (module.cc, sessions.h): statuses
// crossing into Python and the batch answers of the C++ client.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tierkv::python {

// A C++ status crossing into Python; translated to a tierkv.Error subclass.
struct StatusException {
  int code;
  std::string message;
};

[[noreturn]] inline void Throw(const absl::Status& s) {
  throw StatusException{static_cast<int>(s.code()), std::string(s.message())};
}

// A buffer export held for the length of a call (the exporter cannot free
// or resize it meanwhile).

inline char* AsPointer(uintptr_t p) { return reinterpret_cast<char*>(p); }

// (values, errors): values[i] is a result per key, errors are (i, code, msg).
using BatchResult = std::pair<std::vector<int64_t>, std::vector<std::tuple<size_t, int, std::string>>>;

inline BatchResult FromStatuses(const std::vector<absl::Status>& statuses) {
  BatchResult r;
  r.first.resize(statuses.size());
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i].ok()) continue;
    r.first[i] = -static_cast<int64_t>(statuses[i].code());
    r.second.emplace_back(i, static_cast<int>(statuses[i].code()), std::string(statuses[i].message()));
  }
  return r;
}

inline BatchResult FromSizes(const std::vector<absl::StatusOr<size_t>>& sizes) {
  BatchResult r;
  r.first.resize(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i].ok()) {
      r.first[i] = static_cast<int64_t>(*sizes[i]);
      continue;
    }
    const absl::Status& s = sizes[i].status();
    r.first[i] = -static_cast<int64_t>(s.code());
    r.second.emplace_back(i, static_cast<int>(s.code()), std::string(s.message()));
  }
  return r;
}

}  // namespace tierkv::python
