// tierkv-bench ssd: the store daemon's SSD tier (store/ssd_tier.h) against
// a raw io_uring loop on the same file system, in the same run.
//
// For 1 MiB and 64 KiB blocks: sequential and random writes and reads of
// --ssd-size / 2 bytes. The raw loop keeps --batch O_DIRECT requests in
// flight on one ring (a sliding window), over a file of its own in
// --ssd-dir; the tier is called from --threads threads with --batch /
// --threads values per WriteBatch / ReadBatch call (so as many requests are
// in flight), each call one submission, values checked by CRC32C and
// copied out. The tier appends every record, so its random write (keys in
// shuffled order) lands sequentially on disk; its random read is keys in
// shuffled order. Figures are value bytes per second, medians of
// --repetitions interleaved runs; `ratio` is tier / raw.
#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <random>
#include <thread>
#include <atomic>
#include <functional>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "nlohmann/json.hpp"
#include "base/io/file_io.h"
#include "store/ssd_tier.h"
#include "tools/bench/subcommands.h"

namespace tierkv::bench {
namespace {

using io::AlignedBuffer;

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One pass of the raw loop: `offsets.size()` requests of `block` bytes,
// `depth` in flight. Bytes per second, or < 0 on an error (printed).
double RawPass(int fd, bool write, uint64_t block, const std::vector<uint64_t>& offsets, unsigned depth,
               std::vector<AlignedBuffer>& bufs) {
  io_uring ring;
  if (int rc = io_uring_queue_init(depth, &ring, 0); rc < 0) {
    std::fprintf(stderr, "io_uring_queue_init: %s\n", strerror(-rc));
    return -1;
  }
  auto start = std::chrono::steady_clock::now();
  size_t next = 0, done = 0;
  bool ok = true;
  auto submit = [&](size_t slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (write) {
      io_uring_prep_write(sqe, fd, bufs[slot].data(), static_cast<unsigned>(block), offsets[next]);
    } else {
      io_uring_prep_read(sqe, fd, bufs[slot].data(), static_cast<unsigned>(block), offsets[next]);
    }
    io_uring_sqe_set_data64(sqe, slot);
    ++next;
  };
  for (size_t slot = 0; slot < depth && next < offsets.size(); ++slot) submit(slot);
  io_uring_submit(&ring);
  while (done < offsets.size() && ok) {
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(&ring, &cqe) < 0) break;
    if (cqe->res != static_cast<int>(block)) {
      std::fprintf(stderr, "raw %s: %s\n", write ? "write" : "read", cqe->res < 0 ? strerror(-cqe->res) : "short");
      ok = false;
    }
    size_t slot = io_uring_cqe_get_data64(cqe);
    io_uring_cqe_seen(&ring, cqe);
    ++done;
    if (next < offsets.size()) {
      submit(slot);
      io_uring_submit(&ring);
    }
  }
  double secs = Seconds(start);
  io_uring_queue_exit(&ring);
  return ok ? static_cast<double>(block * offsets.size()) / secs : -1;
}

struct CaseResult {
  std::vector<double> raw, tier;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Raw: seq write, seq read, rand write, rand read over one file.
bool RunRaw(const std::string& dir, uint64_t volume, uint64_t block, unsigned depth, std::mt19937_64& rng,
            std::map<std::string, CaseResult>& out, const std::string& suffix) {
  std::string path = dir + "/tierkv-bench-raw.dat";
  std::filesystem::remove(path);
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) {
    std::fprintf(stderr, "%s: %s (the raw loop needs O_DIRECT)\n", path.c_str(), strerror(errno));
    return false;
  }
  uint64_t n = volume / block;
  if (posix_fallocate(fd, 0, static_cast<off_t>(n * block)) != 0) {
    std::fprintf(stderr, "%s: cannot allocate %llu bytes\n", path.c_str(), static_cast<unsigned long long>(n * block));
    close(fd);
    return false;
  }
  std::vector<AlignedBuffer> bufs;
  for (unsigned i = 0; i < depth; ++i) {
    bufs.emplace_back(block);
    for (uint64_t j = 0; j < block; j += 8) *reinterpret_cast<uint64_t*>(bufs.back().data() + j) = rng();
  }
  std::vector<uint64_t> seq(n), rnd(n);
  for (uint64_t i = 0; i < n; ++i) seq[i] = i * block;
  rnd = seq;
  std::shuffle(rnd.begin(), rnd.end(), rng);
  double r[4] = {RawPass(fd, true, block, seq, depth, bufs), RawPass(fd, false, block, seq, depth, bufs),
                 RawPass(fd, true, block, rnd, depth, bufs), RawPass(fd, false, block, rnd, depth, bufs)};
  close(fd);
  std::filesystem::remove(path);
  const char* names[4] = {"seq_write", "seq_read", "rand_write", "rand_read"};
  for (int i = 0; i < 4; ++i) {
    if (r[i] < 0) return false;
    out[absl::StrCat(names[i], "_", suffix)].raw.push_back(r[i]);
  }
  return true;
}

// Writes zeros over the whole file, so its blocks are written (as the
// raw loop's random writes find them) and it holds no record.
bool ZeroFile(const std::string& path, uint64_t size) {
  int fd = open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return false;
  AlignedBuffer zeros(1 << 20);
  bool ok = true;
  for (uint64_t off = 0; ok && off + (1 << 20) <= size; off += 1 << 20) {
    ok = pwrite(fd, zeros.data(), 1 << 20, static_cast<off_t>(off)) == (1 << 20);
  }
  close(fd);
  return ok;
}

// Runs fn(thread, first, count) over [0, n) in chunks of `chunk`, on
// `threads` threads taking chunks in turn; false if any call did.
bool Parallel(uint64_t n, uint64_t chunk, int threads, const std::function<bool(int, uint64_t, uint64_t)>& fn) {
  std::atomic<uint64_t> next{0};
  std::atomic<bool> ok{true};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint64_t b; ok && (b = next.fetch_add(chunk)) < n;) {
        if (!fn(t, b, std::min(chunk, n - b))) ok = false;
      }
    });
  }
  for (std::thread& t : pool) t.join();
  return ok;
}

// Tier: write in key order, read in key order, read shuffled; then a fresh
// tier written in shuffled key order over a file already written once (the
// tier's steady state: reclaimed regions are rewritten; the raw loop's
// random writes likewise land on written blocks). `threads` callers, each with
// batch / threads values per call, so as many requests are in flight as in
// the raw loop.
bool RunTier(const std::string& dir, uint64_t file_size, uint64_t volume, uint64_t block, unsigned batch,
             int threads, std::mt19937_64& rng, std::map<std::string, CaseResult>& out, const std::string& suffix,
             bool* direct) {
  uint64_t n = volume / block;
  uint64_t per_call = std::max<uint64_t>(1, batch / threads);
  std::vector<std::vector<AlignedBuffer>> values(threads);  // each thread's own
  for (auto& vs : values) {
    for (uint64_t i = 0; i < per_call; ++i) {
      vs.emplace_back(block);
      for (uint64_t j = 0; j < block; j += 8) *reinterpret_cast<uint64_t*>(vs.back().data() + j) = rng();
    }
  }
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::vector<uint64_t> shuffled = order;
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  std::string path = dir + "/tierkv-bench-tier.dat";
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 0) std::filesystem::remove(path);
    if (pass == 1 && !ZeroFile(path, file_size)) return false;
    auto file = io::OpenUringFile({.path = path, .size = file_size / io::kIoAlign * io::kIoAlign});
    if (!file.ok()) {
      std::fprintf(stderr, "%s\n", file.status().ToString().c_str());
      return false;
    }
    *direct = (*file)->direct();
    auto tier = store::SsdTier::Open(std::move(*file), {.high_watermark = 1, .low_watermark = 1});
    if (!tier.ok()) {
      std::fprintf(stderr, "%s\n", tier.status().ToString().c_str());
      return false;
    }
    const std::vector<uint64_t>& wo = pass == 0 ? order : shuffled;
    auto start = std::chrono::steady_clock::now();
    bool ok = Parallel(n, per_call, threads, [&](int t, uint64_t b, uint64_t count) {
      std::vector<AlignedBuffer>& vs = values[t];
      std::vector<store::SsdWrite> w;
      for (uint64_t i = 0; i < count; ++i) w.push_back({absl::StrCat("block-", wo[b + i]), vs[i].data(), block});
      for (const absl::Status& s : (*tier)->WriteBatch(w)) {
        if (!s.ok()) {
          std::fprintf(stderr, "tier write: %s\n", s.ToString().c_str());
          return false;
        }
      }
      return true;
    });
    if (!ok) return false;
    double secs = Seconds(start);
    out[absl::StrCat(pass == 0 ? "seq_write_" : "rand_write_", suffix)].tier.push_back(n * block / secs);
    if (pass == 1) break;
    for (int rp = 0; rp < 2; ++rp) {
      const std::vector<uint64_t>& ro = rp == 0 ? order : shuffled;
      start = std::chrono::steady_clock::now();
      ok = Parallel(n, per_call, threads, [&](int t, uint64_t b, uint64_t count) {
        std::vector<AlignedBuffer>& vs = values[t];
        std::vector<store::SsdRead> r;
        for (uint64_t i = 0; i < count; ++i) r.push_back({absl::StrCat("block-", ro[b + i]), vs[i].data(), block});
        for (const absl::StatusOr<uint64_t>& got : (*tier)->ReadBatch(r)) {
          if (!got.ok()) {
            std::fprintf(stderr, "tier read: %s\n", got.status().ToString().c_str());
            return false;
          }
        }
        return true;
      });
      if (!ok) return false;
      secs = Seconds(start);
      out[absl::StrCat(rp == 0 ? "seq_read_" : "rand_read_", suffix)].tier.push_back(n * block / secs);
    }
  }
  std::filesystem::remove(path);
  return true;
}

}  // namespace

int RunSsd(const BenchConfig& config) {
  std::string dir = config.ssd_dir.empty() ? (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") : config.ssd_dir;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  uint64_t volume = config.ssd_size / 2;
  unsigned batch = static_cast<unsigned>(config.batch);
  std::mt19937_64 rng(42);
  std::map<std::string, CaseResult> results;
  bool direct = false;
  for (int rep = 0; rep < config.repetitions; ++rep) {
    for (uint64_t block : {uint64_t{1} << 20, uint64_t{64} << 10}) {
      std::string suffix = block == (1u << 20) ? "1mib" : "64kib";
      // Alternate which runs first, so neither always meets a warmer disk.
      bool raw_first = rep % 2 == 0;
      for (int k = 0; k < 2; ++k) {
        bool ok = (k == 0) == raw_first ? RunRaw(dir, volume, block, batch, rng, results, suffix)
                                        : RunTier(dir, config.ssd_size, volume, block, batch,
                                                  static_cast<int>(config.threads), rng, results, suffix, &direct);
        if (!ok) return 1;
      }
    }
  }
  nlohmann::json j;
  j["dir"] = dir;
  j["direct"] = direct;
  j["batch"] = batch;
  j["threads"] = config.threads;
  j["bytes_per_case"] = volume;
  if (!config.json) {
    std::printf(
        "SSD tier vs raw io_uring in %s (O_DIRECT %s, %u in flight, tier on %lld threads, %llu MiB per case, "
        "median of %lld)\n",
        dir.c_str(), direct ? "on" : "off", batch, static_cast<long long>(config.threads),
        static_cast<unsigned long long>(volume >> 20), static_cast<long long>(config.repetitions));
    std::printf("%-18s %12s %12s %8s\n", "case", "raw GB/s", "tier GB/s", "ratio");
  }
  for (const auto& [name, r] : results) {
    double raw = Median(r.raw), tier = Median(r.tier);
    j["cases"][name] = {{"raw_bytes_per_second", raw}, {"tier_bytes_per_second", tier},
                        {"ratio", raw > 0 ? tier / raw : 0}};
    if (!config.json) std::printf("%-18s %12.2f %12.2f %8.2f\n", name.c_str(), raw / 1e9, tier / 1e9, raw > 0 ? tier / raw : 0);
  }
  if (config.json) std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace tierkv::bench
