// tierkv-bench transfer: the transfer engine's throughput for batched
// one-sided reads and writes, and in the same run the physical reference:
// a raw socket pump over as many loopback connections (tcp), or plain
// memcpy with as many threads (shm). With tcp, the same reads and writes
// again while 4, 64 and 1,024 other connections trickle a request header
// one byte a second (slow-loris), as ratios to the figures without them.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tools/bench/harness.h"
#include "tools/bench/subcommands.h"
#include "transport/engine.h"
#include "transport/memory.h"
#include "base/net/socket.h"
#include "transport/tcp/wire.h"
#ifdef TIERKV_HAVE_CUDA
#include "transport/cuda/cuda_backend.h"
#endif

namespace tierkv::bench {
namespace {

using transport::Op;
using transport::Request;

// A connected loopback TCP pair (client end, server end), blocking.
std::pair<int, int> LoopbackPair() {
  int bound = 0;
  auto listener = net::Listen("127.0.0.1", 0, &bound);
  auto client = net::Dial(absl::StrCat("127.0.0.1:", bound), absl::Now() + absl::Seconds(5));
  int server = accept(listener->get(), nullptr, nullptr);
  int c = client->release();
  int flags = 0;
  ioctl(c, FIONBIO, &flags);  // back to blocking
  int one = 1;
  setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return {c, server};
}

// Sends `block`-sized chunks walking a `span`-byte source and receives into
// a `span`-byte destination: the same memory footprint as the engine's
// batches, so neither side enjoys warmer caches.
void RegisterTcpPump(uint64_t block, uint64_t span, int connections) {
  benchmark::RegisterBenchmark("reference/tcp_pump", [block, span](benchmark::State& state) {
    auto [tx, rx] = LoopbackPair();
    std::vector<char> src(span, 'p');
    std::atomic<bool> stop{false};
    std::thread receiver([rx = rx, span, block, &stop] {
      std::vector<char> dst(span);
      uint64_t off = 0;
      while (!stop.load()) {
        if (off + block > span) off = 0;
        ssize_t n = recv(rx, dst.data() + off, block, 0);
        if (n <= 0) break;
        off += n;
      }
    });
    uint64_t base = 0;
    for (auto _ : state) {
      if (base + block > span) base = 0;
      size_t off = 0;
      while (off < block) {
        ssize_t n = send(tx, src.data() + base + off, block - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += n;
      }
      base += block;
    }
    stop.store(true);
    shutdown(tx, SHUT_RDWR);
    receiver.join();
    close(tx);
    close(rx);
    state.SetBytesProcessed(state.iterations() * block);
  })->UseRealTime()->Threads(connections);
}

void RegisterMemcpy(uint64_t block, int threads) {
  for (int t : {1, threads}) {
    benchmark::RegisterBenchmark("reference/memcpy", [block](benchmark::State& state) {
      // Buffers much larger than the caches, walked block by block.
      constexpr uint64_t kSpan = 256 << 20;
      uint64_t span = std::max<uint64_t>(kSpan / state.threads(), block);
      std::vector<char> src(span, 's'), dst(span, 'd');
      uint64_t off = 0;
      for (auto _ : state) {
        if (off + block > span) off = 0;
        std::memcpy(dst.data() + off, src.data() + off, block);
        benchmark::DoNotOptimize(dst.data());
        off += block;
      }
      state.SetBytesProcessed(state.iterations() * block);
    })->UseRealTime()->Threads(t);
  }
}

// `connections` loopback connections to `port`, each sending the bytes of
// a request header one a second, spread over the second; one the server
// closes (its frame deadline) is opened again, so as many trickle
// throughout.
class Trickle {
 public:
  Trickle(int port, int connections) : port_(port), fds_(connections), sent_(connections, 0) {
    transport::tcp::RequestHeader h;
    h.op = transport::tcp::WireOp::kPing;
    transport::tcp::EncodeRequest(h, header_);
    for (net::Fd& fd : fds_) fd = Open();
    thread_ = std::thread([this] { Run(); });
  }
  ~Trickle() {
    stop_ = true;
    thread_.join();
  }

 private:
  static constexpr int kTicks = 50;  // per second
  net::Fd Open() {
    absl::StatusOr<net::Fd> fd = net::Dial(absl::StrCat("127.0.0.1:", port_), absl::Now() + absl::Seconds(5));
    return fd.ok() ? std::move(*fd) : net::Fd();
  }
  void Run() {
    const size_t n = fds_.size();
    for (uint64_t tick = 0; !stop_; ++tick) {
      const absl::Time until = absl::Now() + absl::Seconds(1) / kTicks;
      const size_t slot = tick % kTicks;
      for (size_t i = slot * n / kTicks; i < (slot + 1) * n / kTicks; ++i) {
        const char c = static_cast<char>(header_[sent_[i] % transport::tcp::kRequestSize]);
        if (fds_[i].valid() && (::send(fds_[i].get(), &c, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1 || errno == EAGAIN)) {
          ++sent_[i];
          continue;
        }
        fds_[i] = Open();
        sent_[i] = 0;
      }
      absl::SleepFor(until - absl::Now());
    }
  }
  const int port_;
  std::vector<net::Fd> fds_;
  std::vector<uint64_t> sent_;
  uint8_t header_[transport::tcp::kRequestSize];
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Times engine->Transfer(reqs) per iteration; the first failure ends the
// benchmark with its message.
void TimeTransfers(benchmark::State& state, transport::TransferEngine* engine, const std::vector<Request>& reqs) {
  uint64_t bytes = 0;
  for (const Request& r : reqs) bytes += r.length;
  for (auto _ : state) {
    for (const absl::Status& s : engine->Transfer(reqs)) {
      if (!s.ok()) {
        state.SkipWithError(std::string(s.message()).c_str());
        return;
      }
    }
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.SetItemsProcessed(state.iterations() * reqs.size());
}

#ifdef TIERKV_HAVE_CUDA
// GPU memory served by one engine, read and written by another through the
// cuda backend, against cudaMemcpy of the same blocks in the same run:
// device-to-device, and device-to-host into pinned memory.
int RunCudaTransfer(const BenchConfig& config) {
  absl::StatusOr<int> gpus = transport::cuda::DeviceCount();
  if (!gpus.ok()) {
    std::fprintf(stderr, "tierkv-bench: --transport cuda: %s\n", std::string(gpus.status().message()).c_str());
    return 1;
  }
  const uint64_t block = config.block;
  const int batch = static_cast<int>(config.batch);
  const uint64_t span = block * batch;
  auto remote = transport::cuda::DeviceAlloc(span, 0);
  auto local_dev = transport::cuda::DeviceAlloc(span, 0);
  auto local_host = transport::cuda::PinnedAlloc(span);
  if (!remote.ok() || !local_dev.ok() || !local_host.ok()) {
    std::fprintf(stderr, "tierkv-bench: cannot allocate %llu bytes of GPU and pinned memory\n",
                 static_cast<unsigned long long>(span));
    return 1;
  }
  auto metadata = transport::NewInMemoryMetadata();
  auto server = transport::TransferEngine::Create({.metadata = metadata, .transports = {"cuda"}});
  auto client = transport::TransferEngine::Create({.metadata = metadata, .transports = {"cuda"}});
  if (!server.ok() || !client.ok()) {
    std::fprintf(stderr, "tierkv-bench: cannot start the engines: %s\n",
                 std::string((server.ok() ? client.status() : server.status()).message()).c_str());
    return 1;
  }
  (void)(*server)->RegisterMemory(*remote, span, "cuda:0");
  (void)(*server)->ServeSegment("bench", {*remote});
  (void)(*client)->RegisterMemory(*local_dev, span, "cuda:0");
  (void)(*client)->RegisterMemory(*local_host, span, "cpu:0");
  transport::TransferEngine* engine = client->get();
  struct Case {
    const char* name;
    char* local;
    Op op;
  };
  for (const Case& c : {Case{"engine/d2d_read", static_cast<char*>(*local_dev), Op::kRead},
                        Case{"engine/d2d_write", static_cast<char*>(*local_dev), Op::kWrite},
                        Case{"engine/d2h_read", static_cast<char*>(*local_host), Op::kRead}}) {
    benchmark::RegisterBenchmark(c.name, [engine, c, block, batch](benchmark::State& state) {
      std::vector<Request> reqs;
      for (int i = 0; i < batch; ++i) reqs.push_back({c.op, c.local + i * block, "bench", i * block, block});
      TimeTransfers(state, engine, reqs);
    })->UseRealTime();
  }
  for (const Case& c : {Case{"reference/cudaMemcpy_d2d", static_cast<char*>(*local_dev), Op::kRead},
                        Case{"reference/cudaMemcpy_d2h", static_cast<char*>(*local_host), Op::kRead}}) {
    char* src = static_cast<char*>(*remote);
    benchmark::RegisterBenchmark(c.name, [c, src, block, batch](benchmark::State& state) {
      for (auto _ : state) {
        for (int i = 0; i < batch; ++i) {
          if (!transport::cuda::Copy(c.local + i * block, src + i * block, block).ok()) {
            state.SkipWithError("cudaMemcpy failed");
            return;
          }
        }
      }
      state.SetBytesProcessed(state.iterations() * batch * block);
    })->UseRealTime();
  }
  Figures f = RunRegistered(config.min_time, config.json, static_cast<int>(config.repetitions));
  auto gbps = [&](const std::string& prefix) { return Best(f, prefix, "bytes_per_second") / 1e9; };
  double d2d = gbps("engine/d2d_read"), d2d_w = gbps("engine/d2d_write"), d2h = gbps("engine/d2h_read");
  double ref_d2d = gbps("reference/cudaMemcpy_d2d"), ref_d2h = gbps("reference/cudaMemcpy_d2h");
  nlohmann::json out{{"transport", "cuda"},
                     {"block_bytes", block},
                     {"batch", batch},
                     {"d2d_read_GBps", d2d},
                     {"d2d_write_GBps", d2d_w},
                     {"d2h_read_GBps", d2h},
                     {"reference", {{"cudaMemcpy_d2d_GBps", ref_d2d}, {"cudaMemcpy_d2h_GBps", ref_d2h}}},
                     {"d2d_ratio", ref_d2d > 0 ? d2d / ref_d2d : 0},
                     {"d2h_ratio", ref_d2h > 0 ? d2h / ref_d2h : 0}};
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("\ncuda: d2d read %.1f GB/s (cudaMemcpy %.1f, ratio %.2f), d2h read %.1f GB/s (cudaMemcpy %.1f, ratio %.2f)\n",
                d2d, ref_d2d, ref_d2d > 0 ? d2d / ref_d2d : 0, d2h, ref_d2h, ref_d2h > 0 ? d2h / ref_d2h : 0);
  }
  transport::cuda::DeviceFree(*remote);
  transport::cuda::DeviceFree(*local_dev);
  transport::cuda::PinnedFree(*local_host);
  return 0;
}
#endif

}  // namespace

int RunTransfer(const BenchConfig& config) {
  if (config.transport == "cuda") {
#ifdef TIERKV_HAVE_CUDA
    return RunCudaTransfer(config);
#else
    ExitWithUsageError("tierkv-bench", "--transport cuda: this build has no CUDA (nvcc was not found at configure time)");
#endif
  }
  const uint64_t block = config.block;
  const int batch = static_cast<int>(config.batch);
  const int threads = static_cast<int>(config.threads);
  if (config.transport != "tcp" && config.transport != "shm") {
    ExitWithUsageError("tierkv-bench", "--transport must be tcp, shm or cuda for transfer");
  }
  // Each thread works on its own area of the segment.
  uint64_t per_thread = block * batch;
  uint64_t size = per_thread * threads;
  auto metadata = transport::NewInMemoryMetadata();
  auto region = transport::SharedRegion::Create(size, {.prefault = true});
  if (!region.ok()) {
    std::fprintf(stderr, "tierkv-bench: %s\n", std::string(region.status().message()).c_str());
    return 1;
  }
  transport::EngineOptions so;
  so.metadata = metadata;
  so.transports = {config.transport};
  auto server = transport::TransferEngine::Create(so);
  transport::EngineOptions co = so;
  co.backend.connections = static_cast<int>(config.connections);
  co.workers = config.client_workers();
  auto client = transport::TransferEngine::Create(co);
  if (!server.ok() || !client.ok()) {
    std::fprintf(stderr, "tierkv-bench: cannot start the engines\n");
    return 1;
  }
  (void)(*server)->RegisterMemory((*region)->data(), size, "cpu:0", (*region)->fd());
  (void)(*server)->ServeSegment("bench", {(*region)->data()});
  transport::TransferEngine* engine = client->get();

  for (Op op : {Op::kRead, Op::kWrite}) {
    std::string name = absl::StrCat("engine/", op == Op::kRead ? "read" : "write");
    benchmark::RegisterBenchmark(name.c_str(), [engine, op, block, batch, per_thread](benchmark::State& state) {
      std::vector<char> local(per_thread, 'l');
      uint64_t base = state.thread_index() * per_thread;
      std::vector<Request> reqs;
      for (int i = 0; i < batch; ++i) reqs.push_back({op, local.data() + i * block, "bench", base + i * block, block});
      TimeTransfers(state, engine, reqs);
    })->UseRealTime()->Threads(threads);
  }
  const std::vector<int> trickles = {4, 64, 1024};
  if (config.transport == "tcp") {
    const int port = (*server)->port();
    for (int trickling : trickles) {
      for (Op op : {Op::kRead, Op::kWrite}) {
        std::string name = absl::StrCat("trickle:", trickling, op == Op::kRead ? "/read" : "/write");
        benchmark::RegisterBenchmark(name.c_str(), [engine, op, block, batch, per_thread, port,
                                                    trickling](benchmark::State& state) {
          // One trickling load per run, up before the timed loop starts
          // (its start is a barrier for every thread).
          static std::unique_ptr<Trickle> load;
          if (state.thread_index() == 0) load = std::make_unique<Trickle>(port, trickling);
          std::vector<char> local(per_thread, 'l');
          uint64_t base = state.thread_index() * per_thread;
          std::vector<Request> reqs;
          for (int i = 0; i < batch; ++i) reqs.push_back({op, local.data() + i * block, "bench", base + i * block, block});
          TimeTransfers(state, engine, reqs);
          if (state.thread_index() == 0) load.reset();
        })->UseRealTime()->Threads(threads);
      }
    }
    RegisterTcpPump(block, per_thread, static_cast<int>(config.connections));
  } else {
    RegisterMemcpy(block, threads);
  }
  Figures f = RunRegistered(config.min_time, config.json, static_cast<int>(config.repetitions));

  auto gbps = [&](const std::string& prefix) { return Best(f, prefix, "bytes_per_second") / 1e9; };
  auto rps = [&](const std::string& prefix) { return Best(f, prefix, "items_per_second"); };
  double read = gbps("engine/read"), write = gbps("engine/write");
  nlohmann::json out{{"transport", config.transport},
                     {"block_bytes", block},
                     {"batch", batch},
                     {"threads", threads},
                     {"connections", config.connections},
                     {"read_GBps", read},
                     {"write_GBps", write},
                     {"read_requests_per_s", rps("engine/read")},
                     {"write_requests_per_s", rps("engine/write")}};
  double reference = 0, target = 0;
  if (config.transport == "tcp") {
    reference = gbps("reference/tcp_pump");
    target = 0.9;
    out["reference"] = {{"raw_tcp_pump_GBps", reference}};
    // Throughput while connections trickle, as ratios to none (goal >= 0.9).
    for (int trickling : trickles) {
      const std::string at = absl::StrCat("trickle:", trickling);
      double r = gbps(at + "/read"), w = gbps(at + "/write");
      out["trickling"][std::to_string(trickling)] = {{"read_GBps", r},
                                                     {"write_GBps", w},
                                                     {"read_ratio", read > 0 ? r / read : 0},
                                                     {"write_ratio", write > 0 ? w / write : 0}};
    }
  } else {
    double single = 0, multi = 0;
    for (const auto& [name, c] : f) {
      if (name.rfind("reference/memcpy", 0) != 0 || !c.contains("bytes_per_second")) continue;
      double v = c.at("bytes_per_second") / 1e9;
      (name.find("threads:1") != std::string::npos && threads > 1 ? single : multi) = v;
    }
    if (threads == 1) single = multi;
    reference = multi;
    target = 0.8;
    out["reference"] = {{"memcpy_1_thread_GBps", single}, {"memcpy_threads_GBps", multi}};
  }
  double ratio = reference > 0 ? std::min(read, write) / reference : 0;
  out["read_ratio"] = reference > 0 ? read / reference : 0;
  out["write_ratio"] = reference > 0 ? write / reference : 0;
  out["ratio_to_reference"] = ratio;  // the worse direction
  out["target_ratio"] = target;
  out["target_met"] = ratio >= target;
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("\n%s: read %.2f GB/s, write %.2f GB/s; reference %.2f GB/s; ratio %.2f (target >= %.2f: %s)\n",
                config.transport.c_str(), read, write, reference, ratio, target,
                ratio >= target ? "met" : "MISSED");
    if (out.contains("trickling")) {
      for (const auto& [n, t] : out["trickling"].items()) {
        std::printf("  with %s connections trickling: read %.2fx, write %.2fx of none (goal >= 0.90)\n", n.c_str(),
                    t["read_ratio"].get<double>(), t["write_ratio"].get<double>());
      }
    }
  }
  return 0;
}

}  // namespace tierkv::bench
