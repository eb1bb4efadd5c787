#include "config/bench_config.h"

namespace tierkv {

const FlagTable<BenchConfig>& BenchFlags() {
  using C = BenchConfig;
  static const FlagTable<C>* table = new FlagTable<C>(
      "tierkv-bench",
      "Benchmarks: tierkv-bench master|transfer|store|l1|memory|ssd|pd [flags]. Each prints a table, or one JSON "
      "object with --json, with the physical reference measured in the same run.",
      {
          BoolFlag<C>("json", &C::json, "false", "print one JSON object with the figures"),
          DoubleFlag<C>("min-time", &C::min_time, "1", 0.01, 600, "seconds per measured case"),
          IntFlag<C>("objects", &C::objects, "1000000", 1000, 100'000'000,
                     "master: objects for the memory-per-object figure"),
          IntFlag<C>("batch", &C::batch, "0", 0, 65536,
                     "keys per batched call / requests per batch (0: 256 for master, 32 for "
                     "transfer, 16 for store, 256 pages for l1, 32 in flight for ssd)"),
          IntFlag<C>("threads", &C::threads, "2", 1, 256, "client threads"),
          SizeFlag<C>("block", &C::block, "1mib", 1, 1u << 30, "transfer: bytes per request; l1: bytes per page"),
          SizeFlag<C>("value", &C::value, "1mib", 1, 1u << 30, "store: bytes per value"),
          StringFlag<C>("transport", &C::transport, "tcp", "transfer: tcp, shm or cuda (GPU memory); store: tcp or shm"),
          IntFlag<C>("connections", &C::connections, "4", 1, 64, "transfer/store: tcp connections per peer"),
          IntFlag<C>("workers", &C::workers, "0", 0, 256,
                     "transfer/store: the client engine's worker threads (0: max(connections, threads))"),
          SizeFlag<C>("segment-size", &C::segment_size, "1gib", 1 << 20, 1e13,
                      "memory: the segment a daemon lends (time to ready) and the region prefaulted"),
          StringFlag<C>("l1-device", &C::l1_device, "auto", "l1: the engine's L1 device (auto, cpu, cuda:<n>)"),
          StringFlag<C>("ssd-dir", &C::ssd_dir, "", "ssd: directory on the file system to measure (default $TMPDIR or /tmp)"),
          SizeFlag<C>("ssd-size", &C::ssd_size, "1gib", 8 << 20, 1e13,
                      "ssd: the tier's file; each case writes and reads half of it"),
          ChoiceFlag<C>("peer", &C::peer, "none", {"none", "redis"},
                        "store: also run the same workload against a redis-server started on a loopback port "
                        "(pipelined to --batch, and unpipelined), printed beside ours"),
          BoolFlag<C>("auth-compare", &C::auth_compare, "false",
                      "store: also run the same cases against a second embedded cluster running --auth token "
                      "(bearer tokens at the master, data grants at the daemon), printed as with/without"),
          BoolFlag<C>("extent-grants", &C::extent_grants, "false",
                      "master: mount the segments with data keys, as daemons running --auth token do, so every "
                      "PutStart and GetReplicas answer carries signed extent grants (run with and without)"),
          BoolFlag<C>("tls-compare", &C::tls_compare, "false",
                      "store: also run the same cases against a second embedded cluster with TLS on every port "
                      "(the master's, and the daemon's transfer port with --data-tls), printed as with/without"),
          IntFlag<C>("replica-cache", &C::replica_cache, "-1", -1, 1 << 24,
                     "store: keys whose replicas the client remembers while their read lease runs (0: off; "
                     "-1: the library's default)"),
          DurationFlag<C>("reply-spin", &C::reply_spin, "50us", 0, 1,
                          "master/store: how long a client call busy-polls for its reply before sleeping "
                          "(0s: never, as before; the library's default is 50us)"),
          DurationFlag<C>("direct-spin", &C::direct_spin, "100us", 0, 0.001,
                          "master (also --ha), store: the embedded masters' --direct-spin, how long a direct lane "
                          "polls a connection calling back to back for the next call (0s: never)"),
          BoolFlag<C>("ha", &C::ha, "false",
                      "master: the high-availability figures instead (docs/ha.md; needs /usr/bin/etcd): put rate "
                      "of a semi-synchronous leader and standby against a single master, failover time over "
                      "--ha-kills leader kills and the acknowledged puts lost, promotion time per --ha-objects"),
          IntFlag<C>("ha-kills", &C::ha_kills, "20", 0, 1000,
                     "master --ha: SIGKILLs of the leader (each replaced, the killed master restarted as a standby)"),
          StringFlag<C>("ha-objects", &C::ha_objects, "1000000,10000000",
                        "master --ha: index sizes (objects) whose promotion to leader is timed; empty: none"),
          BoolFlag<C>("scale", &C::scale, "false",
                      "master: the scale figures instead: PutStart, GetReplicas and PrefixMatch p50/p99 and "
                      "throughput of one in-process master with each of --scale-segments segments, "
                      "--scale-objects objects and --scale-connections direct-lane connections, and the ratios "
                      "of the largest to the smallest (goal: p99 within 2x, throughput at least 0.8x)"),
          StringFlag<C>("scale-segments", &C::scale_segments, "16,4000",
                        "master --scale: segment counts (each on a host of its own), smallest first"),
          IntFlag<C>("scale-objects", &C::scale_objects, "1000000", 1000, 100'000'000,
                     "master --scale: objects placed in the index before the calls are timed"),
          IntFlag<C>("scale-connections", &C::scale_connections, "10000", 1, 1 << 20,
                     "master --scale: direct-lane connections the workers (--threads) call through in turn "
                     "(capped by about half the open-file limit: both ends are this process's)"),
          IntFlag<C>("repetitions", &C::repetitions, "3", 1, 100,
                     "interleaved repetitions of each case; medians are reported"),
      });
  return *table;
}

}  // namespace tierkv
