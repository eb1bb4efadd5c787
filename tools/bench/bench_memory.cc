// tierkv-bench memory: what a store daemon's memory costs at start.
//
//   - time to ready: an embedded master and one StoreDaemon lending
//     --segment-size, from Start until the segment is mounted, lazily and
//     with --prefault (one start each, not a Google Benchmark case: a start
//     is the thing measured);
//   - prefault bandwidth: Prefault() over a fresh --segment-size region
//     with one thread and with one per CPU (manual time: only the faulting
//     counts, not creating or unmapping the region);
//   - the physical reference in the same run: memcpy and memset over
//     already-faulted buffers (memset is the closer peer: faulting a page in
//     is the kernel zeroing it);
//   - the checksum every value carries, on a 1 MiB value (a get's copy
//     out of a segment on the same host): CRC32C alone and fused with the
//     copy (Crc32cCopy), against memcpy of the same 1 MiB;
//   - a put's copy of 1 MiB into memory not in cache: memcpy against
//     CopyOut and Crc32cCopyOut (non-temporal stores).
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "config/master_config.h"
#include "config/store_config.h"
#include "base/crc32c.h"
#include "config/units.h"
#include "master/server.h"
#include "nlohmann/json.hpp"
#include "store/daemon.h"
#include "tools/bench/harness.h"
#include "tools/bench/subcommands.h"
#include "transport/memory.h"

namespace tierkv::bench {
namespace {

const char* NoEnv(const char*) { return nullptr; }

// Seconds from StoreDaemon::Start until the segment is mounted; < 0 on
// failure (printed).
double TimeToReady(uint64_t size, bool prefault) {
  const char* margv[] = {"tierkv-master", "--rpc-port=0", "--http-port=0"};
  auto mcfg = MasterFlags().Parse(3, margv, nullptr, NoEnv);
  auto master = master::MasterServer::Start(*mcfg);
  if (!master.ok()) {
    std::fprintf(stderr, "tierkv-bench: %s\n", std::string(master.status().message()).c_str());
    return -1;
  }
  std::vector<std::string> args{"tierkv-store",
                                absl::StrCat("--master=127.0.0.1:", (*master)->rpc_port()),
                                absl::StrCat("--metadata=http://127.0.0.1:", (*master)->http_port()),
                                "--port=0", "--http-port=0", absl::StrCat("--segment-size=", size),
                                "--name=bench-memory", "--heartbeat-interval=10ms",
                                prefault ? "--prefault" : "--no-prefault"};
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  auto scfg = StoreFlags().Parse(static_cast<int>(argv.size()), argv.data(), nullptr, NoEnv);
  if (!scfg.ok()) return -1;
  absl::Time start = absl::Now();
  auto daemon = store::StoreDaemon::Start(*scfg);
  if (!daemon.ok()) {
    std::fprintf(stderr, "tierkv-bench: %s\n", std::string(daemon.status().message()).c_str());
    return -1;
  }
  absl::Time deadline = start + absl::Minutes(10);
  while (!(*daemon)->ready() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  double seconds = (*daemon)->ready() ? absl::ToDoubleSeconds(absl::Now() - start) : -1;
  (*daemon)->Stop();
  (*master)->Shutdown();
  return seconds;
}

int Cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

}  // namespace

int RunMemory(const BenchConfig& config) {
  const uint64_t size = config.segment_size;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  double ready_lazy = TimeToReady(size, false);
  double ready_prefault = TimeToReady(size, true);
  if (ready_lazy < 0 || ready_prefault < 0) return 1;

  std::set<int> thread_counts{1, Cpus()};
  for (int threads : thread_counts) {
    benchmark::RegisterBenchmark(absl::StrCat("memory/prefault/threads:", threads).c_str(),
                                 [=](benchmark::State& state) {
                                   for (auto _ : state) {
                                     auto region = transport::SharedRegion::Create(size, {});
                                     if (!region.ok()) {
                                       state.SkipWithError(std::string(region.status().message()).c_str());
                                       break;
                                     }
                                     auto t0 = std::chrono::steady_clock::now();
                                     absl::Status s = transport::Prefault((*region)->data(), size, page, threads);
                                     auto t1 = std::chrono::steady_clock::now();
                                     if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
                                     state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
                                   }
                                   state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * size));
                                 })
        ->UseManualTime();
  }
  // The references use at most 1 GiB per buffer: bandwidth, not capacity.
  const uint64_t ref = std::min<uint64_t>(size, 1ull << 30);
  std::vector<char> src(ref, 's'), dst(ref, 'd');
  benchmark::RegisterBenchmark("reference/memcpy", [&](benchmark::State& state) {
    for (auto _ : state) {
      std::memcpy(dst.data(), src.data(), ref);
      benchmark::ClobberMemory();
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * ref));
  })->UseRealTime();
  benchmark::RegisterBenchmark("reference/memset", [&](benchmark::State& state) {
    for (auto _ : state) {
      std::memset(dst.data(), 0, ref);
      benchmark::ClobberMemory();
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * ref));
  })->UseRealTime();

  constexpr size_t kValue = 1 << 20;
  std::vector<char> value(kValue), landed(kValue);
  for (size_t i = 0; i < kValue; ++i) value[i] = static_cast<char>(i * 131 + (i >> 12));
  auto value_case = [&](const char* name, auto body) {
    benchmark::RegisterBenchmark(name, [&, body](benchmark::State& state) {
      for (auto _ : state) {
        benchmark::DoNotOptimize(body());
        benchmark::ClobberMemory();
      }
      state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kValue));
    })->UseRealTime();
  };
  value_case("value/memcpy", [&] { return std::memcpy(landed.data(), value.data(), kValue); });
  value_case("value/checksum", [&] { return Crc32c(value.data(), kValue); });
  value_case("value/copy-with-checksum", [&] { return Crc32cCopy(0, landed.data(), value.data(), kValue); });
  // A put's copy: 1 MiB values written one after another through the whole
  // reference buffer (up to 1 GiB), so the destination is never in cache,
  // as a store's free extents are not: memcpy against the copies out
  // (non-temporal stores), with and without the checksum.
  auto put_case = [&](const char* name, auto body) {
    benchmark::RegisterBenchmark(name, [&, body](benchmark::State& state) {
      // 64-byte aligned, as a segment's extents are (the streaming paths
      // need it; a large vector's data sits 16 bytes past a page).
      const uint64_t pad = (64 - reinterpret_cast<uintptr_t>(dst.data()) % 64) % 64;
      uint64_t at = 0;
      for (auto _ : state) {
        if (pad + at + kValue > ref) at = 0;
        benchmark::DoNotOptimize(body(dst.data() + pad + at));
        benchmark::ClobberMemory();
        at += kValue;
      }
      state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kValue));
    })->UseRealTime();
  };
  put_case("put/memcpy", [&](char* to) { return std::memcpy(to, value.data(), kValue); });
  put_case("put/copy-out", [&](char* to) {
    CopyOut(to, value.data(), kValue);
    return to;
  });
  put_case("put/copy-out-with-checksum", [&](char* to) { return Crc32cCopyOut(0, to, value.data(), kValue); });
  // The crc32 instruction alone (three lanes), as on CPUs without the fold.
  uint32_t scalar = 0;
  const bool has_scalar = Crc32cExtendVia("sse4.2", &scalar, nullptr, value.data(), kValue);
  if (has_scalar) {
    value_case("value/scalar-checksum", [&] {
      uint32_t crc = 0;
      (void)Crc32cExtendVia("sse4.2", &crc, nullptr, value.data(), kValue);
      return crc;
    });
  }

  Figures f = RunRegistered(config.min_time, config.json, static_cast<int>(config.repetitions));
  auto gbps = [&](const std::string& prefix) { return Best(f, prefix, "bytes_per_second") / 1e9; };
  double memcpy_gbps = gbps("reference/memcpy"), memset_gbps = gbps("reference/memset");
  nlohmann::json prefault = nlohmann::json::object();
  for (int threads : thread_counts) {
    prefault[std::to_string(threads)] = gbps(absl::StrCat("memory/prefault/threads:", threads));
  }
  double best = gbps("memory/prefault/");
  nlohmann::json out{{"segment_bytes", size},
                     {"ready_s", {{"lazy", ready_lazy}, {"prefault", ready_prefault}}},
                     {"prefault_GBps_by_threads", prefault},
                     {"reference", {{"memcpy_GBps", memcpy_gbps}, {"memset_GBps", memset_gbps}}},
                     {"prefault_vs_memcpy", memcpy_gbps > 0 ? best / memcpy_gbps : 0},
                     {"prefault_vs_memset", memset_gbps > 0 ? best / memset_gbps : 0}};
  const double value_copy = gbps("value/memcpy"), value_crc = gbps("value/checksum");
  const double value_fused = gbps("value/copy-with-checksum"), value_scalar = gbps("value/scalar-checksum");
  out["checksum_1mib"] = {{"path", Crc32cPath()},
                          {"memcpy_GBps", value_copy},
                          {"crc32c_GBps", value_crc},
                          {"crc32c_instruction_GBps", value_scalar},
                          {"copy_and_crc32c_GBps", value_fused},
                          {"copy_and_crc32c_vs_memcpy", value_copy > 0 ? value_fused / value_copy : 0}};
  const double put_copy = gbps("put/memcpy"), put_out = gbps("put/copy-out");
  const double put_out_crc = gbps("put/copy-out-with-checksum");
  out["put_copy_1mib"] = {{"memcpy_GBps", put_copy},
                          {"copy_out_GBps", put_out},
                          {"copy_out_and_crc32c_GBps", put_out_crc},
                          {"copy_out_vs_memcpy", put_copy > 0 ? put_out / put_copy : 0},
                          {"copy_out_and_crc32c_vs_memcpy", put_copy > 0 ? put_out_crc / put_copy : 0}};
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("\nsegment %s: ready in %.3f s lazily, %.3f s with --prefault; prefault %.2f GB/s "
                "(%d threads), memcpy %.2f GB/s, memset %.2f GB/s (prefault/memcpy %.2f)\n",
                FormatSize(size).c_str(), ready_lazy, ready_prefault, best, *thread_counts.rbegin(),
                memcpy_gbps, memset_gbps, memcpy_gbps > 0 ? best / memcpy_gbps : 0);
    std::printf("1 MiB value: crc32c %.2f GB/s (%s path; the crc32 instruction alone %.2f), copy with crc32c "
                "%.2f GB/s = %.2fx memcpy %.2f GB/s\n",
                value_crc, Crc32cPath(), value_scalar, value_fused, value_copy > 0 ? value_fused / value_copy : 0,
                value_copy);
    std::printf("1 MiB put into memory not in cache: memcpy %.2f GB/s, copy out %.2f GB/s (%.2fx), copy out with "
                "crc32c %.2f GB/s (%.2fx)\n",
                put_copy, put_out, put_copy > 0 ? put_out / put_copy : 0, put_out_crc,
                put_copy > 0 ? put_out_crc / put_copy : 0);
  }
  return 0;
}

}  // namespace tierkv::bench
