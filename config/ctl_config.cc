#include "config/ctl_config.h"

namespace tierkv {

const FlagTable<CtlConfig>& CtlFlags() {
  using C = CtlConfig;
  static const FlagTable<C>* table = new FlagTable<C>(
      "tierkvctl",
      "Operate a tierkv cluster.\n\n"
      "  tierkvctl [flags] segments          segments, capacity, use, liveness\n"
      "  tierkvctl [flags] stats             index and capacity figures, hit rates and their bound\n"
      "  tierkvctl [flags] top               live: per client and key prefix, hit rate vs the\n"
      "                                      bound over the window, capacity, evictions/s\n"
      "  tierkvctl [flags] key <key>         an object's replicas, size, state, lease, pin\n"
      "  tierkvctl [flags] put <key> <file>  store a file's bytes ('-' reads stdin)\n"
      "  tierkvctl [flags] get <key> <file>  fetch a value ('-' writes stdout)\n"
      "  tierkvctl [flags] rm <key>          remove (--force: even while leased)\n"
      "  tierkvctl [flags] doctor            per segment: transport, probe latency, bandwidth\n"
      "  tierkvctl [flags] tenants           per tenant: quota, guaranteed bytes, use, puts refused\n"
      "  tierkvctl [flags] tenants set <tenant> <quota> [<guaranteed>]\n"
      "                                      set a tenant's quota (e.g. 64GiB; 0: none) and the bytes\n"
      "                                      other tenants' puts never evict (role admin)\n"
      "  tierkvctl [flags] tenants clear <tenant>  remove a tenant's limits (role admin)\n"
      "  tierkvctl [flags] ha                the leader, its epoch, its standbys and their lag",
      {
          StringFlag<C>("master", &C::master, "127.0.0.1:50051",
                        "the master's gRPC address (a high-availability group: every master h1:p1,h2:p2, "
                        "or etcd://h:p/<cluster>)"),
          StringFlag<C>("http", &C::http, "127.0.0.1:8080",
                        "the master's HTTP address host:port, or every master's (h1:p1,h2:p2: the leader "
                        "answers), or etcd://h:p/<cluster> (the ports its masters report); spoken over "
                        "HTTPS when --tls-ca is given"),
          StringFlag<C>("token-file", &C::token_file, "",
                        "file whose first word is the token to present to a master running --auth token "
                        "(tenants set and clear need role admin); empty: none"),
          StringFlag<C>("tls-ca", &C::tls_ca, "",
                        "PEM certificates that sign the master's: reach its gRPC port over TLS (a master with "
                        "--tls-cert); empty: plain"),
          StringFlag<C>("tls-cert", &C::tls_cert, "", "with --tls-ca: our PEM certificate, for a master that requires one"),
          StringFlag<C>("tls-key", &C::tls_key, "", "PEM private key of --tls-cert"),
          BoolFlag<C>("json", &C::json, "false", "print JSON instead of a table"),
          StringFlag<C>("transport", &C::transport, "", "transport preference for data (tcp,shm)"),
          IntFlag<C>("replicas", &C::replicas, "1", 1, 8, "put: replicas to write"),
          BoolFlag<C>("force", &C::force, "false", "rm: remove even while leased"),
          DurationFlag<C>("timeout", &C::timeout, "10s", 0.01, 3600, "deadline for each step"),
          DurationFlag<C>("interval", &C::interval, "1s", 0.01, 3600, "top: time between refreshes"),
          IntFlag<C>("iterations", &C::iterations, "0", 0, 1ll << 31,
                     "top: stop after this many refreshes; 0: until Ctrl-C"),
      });
  return *table;
}

}  // namespace tierkv
