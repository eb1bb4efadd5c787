// tierkv-bench l1: the engine's page copies between L2 (host) and L1 (the
// device pool) as the cache issues them, one copy per page and one wait
// per batch, against one copy of the same bytes in the same run: cudaMemcpy
// between pinned host memory and the GPU (the bus's figure), or memcpy
// when L1 is host memory.
#include <cstdio>
#include <cstring>

#include "engine/device.h"
#include "nlohmann/json.hpp"
#include "tools/bench/harness.h"
#include "tools/bench/subcommands.h"
#include "transport/memory.h"
#ifdef TIERKV_HAVE_CUDA
#include "transport/cuda/cuda_backend.h"
#endif

namespace tierkv::bench {

int RunL1(const BenchConfig& config) {
  absl::StatusOr<std::unique_ptr<engine::Device>> device = engine::NewDevice(config.l1_device);
  if (!device.ok()) {
    std::fprintf(stderr, "tierkv-bench: --l1-device: %s\n", std::string(device.status().message()).c_str());
    return 1;
  }
  engine::Device* dev = device->get();
  const uint64_t page = config.block;
  const int batch = static_cast<int>(config.batch);
  const uint64_t bytes = page * batch;
  auto l2 = transport::SharedRegion::Create(bytes, {.prefault = true});
  absl::StatusOr<char*> l1 = dev->Allocate(bytes);
  if (!l2.ok() || !l1.ok()) {
    std::fprintf(stderr, "tierkv-bench: %s\n",
                 std::string((l2.ok() ? l1.status() : l2.status()).message()).c_str());
    return 1;
  }
  char* host = (*l2)->data();
  bool pinned = dev->host_addressable() || dev->RegisterHost(host, bytes).ok();
  std::memset(host, 'k', bytes);
  (void)dev->CopyIn(*l1, host, bytes);
  (void)dev->Sync();

  for (bool in : {true, false}) {
    benchmark::RegisterBenchmark(in ? "engine/restore_L2_to_L1" : "engine/store_L1_to_L2",
                                 [=, l1 = *l1](benchmark::State& state) {
                                   for (auto _ : state) {
                                     for (int i = 0; i < batch; ++i) {
                                       absl::Status s = in ? dev->CopyIn(l1 + i * page, host + i * page, page)
                                                           : dev->CopyOut(host + i * page, l1 + i * page, page);
                                       if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
                                     }
                                     if (absl::Status s = dev->Sync(); !s.ok()) {
                                       state.SkipWithError(std::string(s.message()).c_str());
                                     }
                                   }
                                   state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
                                   state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * batch));
                                 })
        ->UseRealTime();
    benchmark::RegisterBenchmark(in ? "reference/one_copy_in" : "reference/one_copy_out",
                                 [=, l1 = *l1](benchmark::State& state) {
                                   char* dst = in ? l1 : host;
                                   const char* src = in ? host : l1;
                                   for (auto _ : state) {
                                     if (dev->host_addressable()) {
                                       std::memcpy(dst, src, bytes);
                                       benchmark::ClobberMemory();
                                     } else {
#ifdef TIERKV_HAVE_CUDA
                                       if (!transport::cuda::Copy(dst, src, bytes).ok()) {
                                         state.SkipWithError("cudaMemcpy failed");
                                       }
#endif
                                     }
                                   }
                                   state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
                                 })
        ->UseRealTime();
  }
  Figures f = RunRegistered(config.min_time, config.json, static_cast<int>(config.repetitions));
  auto gbps = [&](const std::string& prefix) { return Best(f, prefix, "bytes_per_second") / 1e9; };
  double restore = gbps("engine/restore_L2_to_L1"), store = gbps("engine/store_L1_to_L2");
  double ref_in = gbps("reference/one_copy_in"), ref_out = gbps("reference/one_copy_out");
  nlohmann::json out{{"device", dev->name()},
                     {"page_bytes", page},
                     {"pages_per_batch", batch},
                     {"l2_pinned", pinned},
                     {"restore_GBps", restore},
                     {"store_GBps", store},
                     {"reference", {{"one_copy_in_GBps", ref_in}, {"one_copy_out_GBps", ref_out}}},
                     {"restore_ratio", ref_in > 0 ? restore / ref_in : 0},
                     {"store_ratio", ref_out > 0 ? store / ref_out : 0}};
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("\nl1 on %s, %d pages of %llu bytes per batch%s: restore %.2f GB/s (one copy %.2f, ratio %.2f), "
                "store %.2f GB/s (one copy %.2f, ratio %.2f)\n",
                dev->name().c_str(), batch, static_cast<unsigned long long>(page), pinned ? "" : " (L2 not pinned)",
                restore, ref_in, ref_in > 0 ? restore / ref_in : 0, store, ref_out, ref_out > 0 ? store / ref_out : 0);
  }
  if (pinned && !dev->host_addressable()) dev->UnregisterHost(host);
  dev->Free(*l1, bytes);
  return 0;
}

}  // namespace tierkv::bench
