// tierkv-bench's configuration: one table for every subcommand's flags.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "config/flags.h"

namespace tierkv {

struct BenchConfig {
  bool json = false;
  double min_time = 0;         // seconds per Google Benchmark case
  int64_t objects = 0;         // master memory measurement
  int64_t batch = 0;           // keys per batched call / requests per transfer batch
  int64_t threads = 0;         // client threads
  uint64_t block = 0;          // transfer block size
  uint64_t value = 0;          // store value size
  std::string transport;       // transfer/store: tcp, shm, ...
  int64_t connections = 0;     // transfer: tcp connections per peer
  int64_t workers = 0;         // transfer/store: the client engine's workers (0: its default)
  int64_t repetitions = 0;     // interleaved repetitions; medians are reported
  std::string l1_device;       // l1: auto, cpu, cuda:<n>
  uint64_t segment_size = 0;   // memory: bytes a daemon lends / a region prefaulted
  std::string ssd_dir;         // ssd: where the files go (default $TMPDIR or /tmp)
  uint64_t ssd_size = 0;       // ssd: the tier's file; half of it is written per case
  std::string peer;            // store: none, or redis (a peer store measured beside ours)
  int64_t replica_cache = -1;  // store: the client's replica cache entries (0: off, -1: its default)
  bool auth_compare = false;   // store: also a cluster running --auth token, same cases
  bool tls_compare = false;    // store: also a cluster with TLS on every port, same cases
  bool extent_grants = false;  // master: segments with data keys, so every answer carries signed extent grants
  absl::Duration reply_spin;   // master/store: the client's busy-poll for replies
  absl::Duration direct_spin;  // master/store: the embedded master's --direct-spin
  bool ha = false;             // master: the high-availability figures instead
  int64_t ha_kills = 0;        // master --ha: leader kills for the failover figures
  std::string ha_objects;      // master --ha: index sizes whose promotion is timed
  bool scale = false;              // master: the scale figures instead (16 vs 4,000 segments)
  std::string scale_segments;      // master --scale: segment counts, smallest first
  int64_t scale_objects = 0;       // master --scale: objects in the index
  int64_t scale_connections = 0;   // master --scale: direct-lane connections calling

  // The client engine's worker threads for transfer and store: --workers,
  // or by default one per connection or client thread, whichever is more.
  int client_workers() const {
    return static_cast<int>(workers > 0 ? workers : std::max(connections, threads));
  }
};

const FlagTable<BenchConfig>& BenchFlags();

}  // namespace tierkv
