// The rdma backend: one-sided RDMA READ/WRITE over reliable-connected
// queue pairs, on every NIC at once. docs/rdma.md describes the design:
//
// - Devices: BackendOptions::rdma_devices (--rdma-devices, TIERKV_RDMA_DEVICES)
//   or, when empty, every active port. Each registered buffer is registered
//   with every device; its descriptor key carries the address and one rkey
//   per device.
// - Connection: Prepare creates one QP per local device and exchanges QP
//   addresses (QPN, LID, GID, PSN, MTU) with the serving backend over the
//   tcp control channel; local device i pairs with remote device i mod n.
// - Post: each slice is cut into chunks (RdmaOptions::chunk) striped over
//   the QPs, at most max_outstanding work requests per QP; completions are
//   polled by one thread per device. A chunk prefers devices on the local
//   buffer's NUMA node.
// - Failures never abort: a QP whose request failed is torn down and
//   re-established (a new handshake) on next use; the chunk is retried on
//   another device (up to `retries` times); a device failing
//   `pause_after` requests in a row is paused for `pause`; after the
//   retries the slice fails UNAVAILABLE naming the device and the peer.
//   At the deadline, outstanding requests are flushed (QP to error) before
//   Post returns, so no NIC writes into memory the caller got back.
#pragma once

#include <memory>

#include "transport/rdma/verbs.h"
#include "transport/registry.h"

namespace tierkv::transport::rdma {

struct RdmaOptions {
  uint64_t chunk = 1 << 20;  // bytes per work request
  int max_outstanding = 32;  // per QP
  int retries = 3;           // per chunk, each on another device where possible
  int pause_after = 3;       // consecutive failed requests before a device is paused
  absl::Duration pause = absl::Seconds(5);
};

// UNAVAILABLE when `verbs` has no usable device (none active, or none of
// those named in options.rdma_devices).
absl::StatusOr<std::unique_ptr<Backend>> NewRdmaBackend(const BackendOptions& options,
                                                        std::shared_ptr<Verbs> verbs,
                                                        RdmaOptions rdma = {});

}  // namespace tierkv::transport::rdma
