// A master for the fuzz targets: in-memory store, manual clock, two live
// segments, so requests reach the index's real paths.
#pragma once

#include <memory>

#include "base/clock.h"
#include "master/master.h"
#include "master/persistence.h"

namespace tierkv::fuzz {

inline std::unique_ptr<master::Master> NewFuzzMaster(ManualClock* clock) {
  master::MasterOptions options;
  options.max_pending_per_client = 1024;
  auto m = master::Master::Create(options, master::NewMemStore(), clock);
  if (!m.ok()) std::abort();
  (*m)->Mount({{"seg-a", "host-a", 1 << 20, "inc-a", "tcp://127.0.0.1:1"},
               {"seg-b", "host-b", 1 << 20, "inc-b", "tcp://127.0.0.1:2"}});
  return std::move(*m);
}

}  // namespace tierkv::fuzz
