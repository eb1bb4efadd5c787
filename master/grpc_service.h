// The gRPC face of the master: converts wire messages to the master's
// types and back, enforces request limits, and records per-RPC metrics.
//
// Limits: a request with more than `max_batch` items is refused whole with
// RESOURCE_EXHAUSTED; per-item problems (bad keys, sizes) come back as that
// item's status, so one bad key never fails a batch.
#pragma once

#include <memory>

#include "master/master.h"
#include "proto/master.grpc.pb.h"

namespace tierkv::master {

struct ServiceLimits {
  size_t max_batch = 65536;
};

// Thread-safe; `master` must outlive it.
std::unique_ptr<grpc::Service> NewMasterService(Master* master, ServiceLimits limits);

}  // namespace tierkv::master
