#include "config/tierkv_config.h"

namespace tierkv {

const FlagTable<TierkvConfig>& TierkvFlags() {
  using C = TierkvConfig;
  static const FlagTable<C>* table = new FlagTable<C>(
      "tierkv",
      "The embedded inference engine with tierkv as its offload tier.\n\n"
      "  tierkv demo                 an embedded cluster serving a trace slice: the small model\n"
      "                              first, then synthetic mode; prints hit rates, serves /metrics\n"
      "  tierkv replay --trace FILE  replay a JSONL trace (against --master, or an embedded cluster)\n"
      "  tierkv sim --trace FILE     page-level hit rates of the store's eviction policies, LRU and\n"
      "                              Belady's optimum at --capacity, offline (no cluster)",
      {
          StringFlag<C>("master", &C::master, "",
                        "cluster master host:port, a list h1:p1,h2:p2, or etcd://h:p/<cluster>; empty starts an "
                        "embedded cluster"),
          StringFlag<C>("metadata", &C::metadata, "", "metadata URL http://host:port or a list (default: master host, port 8080; asked of the "
                        "masters for a list or etcd://)"),
          StringFlag<C>("token-file", &C::token_file, "",
                        "with --master: file whose first word is the token (role client) for a master running "
                        "--auth token; empty: none"),
          StringFlag<C>("tls-ca", &C::tls_ca, "",
                        "PEM certificates that sign the master's: reach its gRPC port over TLS (a master with "
                        "--tls-cert); empty: plain"),
          StringFlag<C>("tls-cert", &C::tls_cert, "", "with --tls-ca: our PEM certificate, for a master that requires one"),
          StringFlag<C>("tls-key", &C::tls_key, "", "PEM private key of --tls-cert"),
          StringFlag<C>("trace", &C::trace, "data/synthetic_trace.jsonl",
                        "JSONL request trace; a relative path not found here is looked up in the source tree and share/tierkv"),
          IntFlag<C>("offset", &C::offset, "0", 0, 1e9, "skip this many trace requests"),
          IntFlag<C>("requests", &C::requests, "0", 0, 1e9, "replay at most this many (0: all)"),
          ChoiceFlag<C>("mode", &C::mode, "synthetic", {"synthetic", "model"}, "replay: model (the small transformer) or synthetic"),
          IntFlag<C>("model-requests", &C::model_requests, "24", 0, 1e6, "demo: requests served by the small model first"),
          IntFlag<C>("max-prompt-tokens", &C::max_prompt_tokens, "0", 0, 1e9,
                     "cut prompts to this many tokens (0: whole; model mode defaults to 1536)"),
          IntFlag<C>("page-tokens", &C::page_tokens, "64", 1, 65536, "tokens per KV page"),
          IntFlag<C>("l1-pages", &C::l1_pages, "4096", 1, 1e8, "L1 (device pool) pages"),
          IntFlag<C>("l2-pages", &C::l2_pages, "16384", 1, 1e8, "L2 (host pool) pages"),
          StringFlag<C>("l1-device", &C::l1_device, "auto",
                        "where L1 lives and attention runs: auto (the first GPU if usable, else cpu), cpu, cuda:<n>"),
          SizeFlag<C>("kv-bytes-per-token", &C::kv_bytes_per_token, "64", 8, 1 << 24,
                      "synthetic mode: KV bytes per token"),
          DoubleFlag<C>("tokens-per-s", &C::tokens_per_s, "0", 0, 1e12,
                        "compute cost model; 0 uses what the small model measured"),
          StringFlag<C>("prefetch", &C::prefetch, "wait_complete", "best_effort, wait_complete or timeout"),
          DurationFlag<C>("prefetch-timeout", &C::prefetch_timeout, "200ms", 0.0001, 60, "the timeout policy's bound"),
          StringFlag<C>("write-policy", &C::write_policy, "write_through",
                        "write_through, write_through_selective or write_back"),
          IntFlag<C>("selective-hits", &C::selective_hits, "2", 1, 1000, "write_through_selective: hits before offload"),
          IntFlag<C>("tp", &C::tp, "1", 1, 64, "tensor-parallel ranks (keys per page)"),
          IntFlag<C>("window", &C::window, "50", 1, 1e6, "requests in the sliding-window hit rate"),
          BoolFlag<C>("parent-keys", &C::parent_keys, "true",
                      "pass parent keys with puts (prefix-aware eviction); off gives plain LRU"),
          ChoiceFlag<C>("eviction-policy", &C::eviction_policy, "chain", {"chain", "prefix", "lru"},
                        "the embedded master's eviction: chain, prefix or lru (as tierkv-master's flag)"),
          StringFlag<C>("capacity", &C::capacity, "",
                        "store capacity as a share of the bytes the trace writes (0.1 = 10 %); sim: a list "
                        "(default 0.05,0.1,0.25,0.5); replay: one value, sizing the embedded cluster (overrides "
                        "--store-size)"),
          StringFlag<C>("ssd-capacity", &C::ssd_capacity, "",
                        "replay: give each embedded daemon an SSD tier (in a temporary directory) holding "
                        "this share of the bytes the trace writes, split over the daemons; empty: none"),
          ChoiceFlag<C>("ssd-admission", &C::ssd_admission, "read", {"read", "all"},
                        "the embedded master's --ssd-admission: which evicted pages move to SSD"),
          IntFlag<C>("daemons", &C::daemons, "2", 1, 64, "embedded cluster: store daemons"),
          SizeFlag<C>("store-size", &C::store_size, "1gib", 1 << 20, 1e13, "embedded cluster: DRAM per daemon"),
          StringFlag<C>("transport", &C::transport, "", "transport preference (tcp,shm); empty = auto"),
          ChoiceFlag<C>("pd", &C::pd, "", {"", "1P1D", "2P1D"},
                        "replay: prefill-to-decode disaggregation (docs/pd.md): N prefill engines and one decode "
                        "engine in this process, each with a transfer engine in peer mode; decode restores the "
                        "prefix from the store and takes the rest from a prefill, which pushes each page as it "
                        "is computed"),
          BoolFlag<C>("json", &C::json, "false", "print one JSON object with the results"),
          BoolFlag<C>("progress", &C::progress, "true", "draw a progress bar on stderr"),
          StringFlag<C>("csv", &C::csv, "", "write the windowed hit rate as CSV here"),
          StringFlag<C>("svg", &C::svg, "", "write an SVG plot here: replay, the windowed hit rate; sim, hit rate against capacity per policy"),
          IntFlag<C>("metrics-port", &C::metrics_port, "0", 0, 65535, "serve /metrics here while running (0: a free port)"),
      });
  return *table;
}

}  // namespace tierkv
