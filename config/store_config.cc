#include "config/store_config.h"

namespace tierkv {

const FlagTable<StoreConfig>& StoreFlags() {
  using C = StoreConfig;
  static const FlagTable<C>* table = new FlagTable<C>(
      "tierkv-store",
      "A tierkv store daemon: lends a DRAM segment, serves it through the transfer engine, "
      "mounts it at the master.",
      {
          StringFlag<C>("master", &C::master, "127.0.0.1:50051",
                        "the master's gRPC address host:port; with several masters a list h1:p1,h2:p2 or "
                        "etcd://h:p[,h:p]/<cluster> (docs/ha.md)"),
          StringFlag<C>("metadata", &C::metadata, "",
                        "metadata server URL, or a list (the masters' HTTP ports); empty: http://<master "
                        "host>:8080 for one master, asked of the masters for a list or etcd://"),
          StringFlag<C>("token-file", &C::token_file, "",
                        "file whose first word is this daemon's token (role daemon) for a master running "
                        "--auth token; empty: none"),
          StringFlag<C>("tls-ca", &C::tls_ca, "",
                        "PEM certificates that sign the master's: reach its gRPC port over TLS (a master with "
                        "--tls-cert); empty: plain"),
          StringFlag<C>("tls-cert", &C::tls_cert, "",
                        "our PEM certificate: presented to a master that requires one, and served on our HTTP "
                        "port, which is then HTTPS (it must name the address others dial: --host or --listen)"),
          StringFlag<C>("tls-key", &C::tls_key, "", "PEM private key of --tls-cert"),
          ChoiceFlag<C>("auth", &C::auth, "none", {"none", "token", "mtls"},
                        "who may move bytes: none (anyone who reaches the port; only on a loopback --listen "
                        "unless --insecure-allow-remote), token or mtls (a connection needs a data grant from "
                        "the master for this segment; token: we are --token-file to the master, mtls: we are "
                        "--tls-cert); docs/security.md"),
          BoolFlag<C>("insecure-allow-remote", &C::insecure_allow_remote, "false",
                      "serve --auth none on a routable --listen (logged as a warning)"),
          BoolFlag<C>("data-tls", &C::data_tls, "false",
                      "serve the transfer port over TLS with --tls-cert/--tls-key (advertised as tls://host:port; "
                      "clients verify it with their TLS CA); bulk bytes then cost a cipher pass each way"),
          SizeFlag<C>("segment-size", &C::segment_size, "1gib", 1 << 20, 1e15,
                      "DRAM to lend (512mb, 180gb, 1.5tb, 4gib); refused at start (exit 2) when "
                      "this host or cgroup cannot back it with RAM"),
          StringFlag<C>("listen", &C::listen, "127.0.0.1", "address the transfer and HTTP servers bind"),
          StringFlag<C>("host", &C::host, "", "address peers dial (default: --listen; for 0.0.0.0, the default route's interface address)"),
          IntFlag<C>("port", &C::port, "8800", 0, 65535, "transfer server port; 0 picks a free one"),
          IntFlag<C>("http-port", &C::http_port, "0", 0, 65535,
                     "HTTP port for /ready, /health, /metrics; 0 picks a free one"),
          StringFlag<C>("name", &C::name, "", "segment name (default: host:port)"),
          StringFlag<C>("transport", &C::transport, "",
                        "transports to offer, in preference order (tcp,shm); empty offers all"),
          StringFlag<C>("rdma-devices", &C::rdma_devices, "",
                        "RDMA NICs to use, e.g. mlx5_0,mlx5_1 (used by the rdma backend)"),
          BoolFlag<C>("hugepages", &C::hugepages, "false", "back the segment with 2 MiB hugepages"),
          BoolFlag<C>("prefault", &C::prefault, "false",
                      "fault the whole segment in at start, in parallel (one pass at memory "
                      "bandwidth before /ready; no first-touch cost, and the RAM is really taken)"),
          IntFlag<C>("prefault-threads", &C::prefault_threads, "0", 0, 1024,
                     "threads that fault the segment in; 0: one per CPU the daemon may use"),
          BoolFlag<C>("mlock", &C::mlock, "false",
                      "lock the segment in RAM (prefaults first); needs RLIMIT_MEMLOCK above the "
                      "segment size or CAP_IPC_LOCK, else the daemon stops at start saying so"),
          IntFlag<C>("numa-node", &C::numa_node, "-1", -1, 1023,
                     "bind the segment's memory (mbind) and the serving threads (that node's "
                     "CPUs) to this NUMA node; -1 leaves placement to the kernel"),
          DurationFlag<C>("heartbeat-interval", &C::heartbeat_interval, "1s", 0.01, 60,
                          "how often the daemon heartbeats the master"),
          IntFlag<C>("connections", &C::connections, "4", 1, 64, "tcp connections per peer"),
          IntFlag<C>("max-connections", &C::max_connections, "16384", 1, 1 << 20,
                     "tcp connections the transfer server keeps open; more are refused and closed "
                     "(also bounded by the open-file limit)"),
          IntFlag<C>("io-threads", &C::io_threads, "4", 1, 256,
                     "threads of the transfer server, serving every connection"),
          DurationFlag<C>("idle-timeout", &C::idle_timeout, "10m", 0.01, 86400 * 7,
                          "a transfer connection idle this long is closed"),
          DurationFlag<C>("frame-timeout", &C::frame_timeout, "5s", 0.01, 3600,
                          "a transfer frame (header, payload and reply) not finished this long after its first "
                          "byte closes its connection, so a stalled or trickling peer holds nothing longer"),
          DurationFlag<C>("handshake-timeout", &C::handshake_timeout, "10s", 0.01, 3600,
                          "a transfer connection whose TLS handshake or grant challenge is not done this long "
                          "after the accept is closed"),
          StringFlag<C>("ssd-dir", &C::ssd_dir, "",
                        "directory of the SSD tier's file (tierkv-ssd.dat); empty: no SSD tier. A daemon "
                        "restarted on the same directory finds its records again"),
          SizeFlag<C>("ssd-size", &C::ssd_size, "0", 0, 1e16,
                      "bytes of the SSD tier's file (reserved at start); needed with --ssd-dir"),
          SizeFlag<C>("ssd-region-size", &C::ssd_region_size, "16mib", 64 << 10, 1 << 30,
                      "the SSD tier's unit of space reclaim, a multiple of 4 KiB; also its largest value"),
          DoubleFlag<C>("ssd-high-watermark", &C::ssd_high_watermark, "0.95", 0.01, 1,
                        "share of SSD regions in use above which the oldest are reclaimed"),
          DoubleFlag<C>("ssd-low-watermark", &C::ssd_low_watermark, "0.90", 0.01, 1,
                        "share of SSD regions in use that reclaim brings the tier down to"),
          DurationFlag<C>("ssd-slow-io", &C::ssd_slow_io, "5s", 0.001, 3600,
                          "an SSD batch slower than this marks the tier failed (a dying disk)"),
          BoolFlag<C>("ssd-direct", &C::ssd_direct, "true",
                      "open the SSD file with O_DIRECT (falls back to buffered, logged, where the "
                      "file system refuses it, as tmpfs does)"),
      },
      [](const C& c) -> absl::Status {
        if (c.auth == "token" && c.token_file.empty()) {
          return absl::InvalidArgumentError("--auth token needs --token-file (this daemon's token, role daemon)");
        }
        if (c.auth == "mtls" && (c.tls_ca.empty() || c.tls_cert.empty() || c.tls_key.empty())) {
          return absl::InvalidArgumentError(
              "--auth mtls needs --tls-ca, --tls-cert and --tls-key (this daemon's certificate, role daemon)");
        }
        if (c.tls_cert.empty() != c.tls_key.empty()) {
          return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
        }
        if (c.data_tls && c.tls_cert.empty()) {
          return absl::InvalidArgumentError("--data-tls needs --tls-cert and --tls-key (the transfer port's certificate)");
        }
        if (!c.ssd_dir.empty() && c.ssd_size == 0) {
          return absl::InvalidArgumentError("--ssd-size: needed with --ssd-dir");
        }
        if (c.ssd_region_size % 4096 != 0) {
          return absl::InvalidArgumentError("--ssd-region-size: must be a multiple of 4 KiB");
        }
        if (!c.ssd_dir.empty() && c.ssd_size < 2 * c.ssd_region_size) {
          return absl::InvalidArgumentError("--ssd-size: must hold at least 2 regions (--ssd-region-size)");
        }
        if (c.ssd_low_watermark > c.ssd_high_watermark) {
          return absl::InvalidArgumentError("--ssd-low-watermark: above --ssd-high-watermark");
        }
        return absl::OkStatus();
      });
  return *table;
}

}  // namespace tierkv
