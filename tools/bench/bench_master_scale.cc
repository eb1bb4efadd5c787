// tierkv-bench master --scale: the master's per-call cost as the cluster
// grows. The same in-process master (in-memory store) is run twice, with
// 16 segments and with 4,000 (--scale-segments), each mounted over gRPC as
// daemons mount theirs and each on a host of its own; the index is filled
// with --scale-objects objects placed as puts place them; then
// --scale-connections direct-lane connections are opened (each served by a
// master thread of its own) and --threads workers call through all of them
// in turn, so every call wakes a different connection's thread, as it does
// with thousands of clients. PutStart (each followed by an untimed PutEnd),
// GetReplicas and PrefixMatch of one key are timed in phases of --min-time
// seconds. The figures per size and the ratios of the largest to the
// smallest are printed in one run (docs/performance.md); the goal is a p99
// within 2x and a throughput of at least 0.8x.
//
// Both ends of every connection live in this process, so the connections
// are capped by the open-file limit (about half of it); the cap used is
// reported. Direct-lane spinning is off: a connection's next call comes
// only after every other connection's, so a spin would never pay.
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/net/socket.h"
#include "base/status.h"
#include "config/master_config.h"
#include "master/server.h"
#include "nlohmann/json.hpp"
#include "proto/direct_frame.h"
#include "proto/master.grpc.pb.h"
#include "tools/bench/subcommands.h"

namespace tierkv::bench {
namespace {

using direct::DirectMethod;

constexpr uint64_t kValue = 64 << 10;
constexpr int kPreloadBatch = 1000;

std::string ScaleKey(int64_t i) { return absl::StrFormat("scale-%09d", i); }

// One call on a direct-lane connection: frame, send, read the reply.
absl::Status DirectCall(int fd, DirectMethod method, const google::protobuf::Message& req,
                        google::protobuf::Message* resp, std::string* buf) {
  const size_t len = req.ByteSizeLong();
  buf->resize(direct::kHeaderSize + len);
  direct::EncodeCall({method, static_cast<uint32_t>(len)}, buf->data());
  req.SerializeToArray(buf->data() + direct::kHeaderSize, static_cast<int>(len));
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  RETURN_IF_ERROR(net::WriteFull(fd, buf->data(), buf->size(), deadline));
  char header[direct::kHeaderSize];
  RETURN_IF_ERROR(net::ReadFull(fd, header, sizeof header, deadline));
  ASSIGN_OR_RETURN(direct::ReplyHeader reply, direct::DecodeReply(header, 64 << 20));
  buf->resize(reply.message_length + reply.length);
  RETURN_IF_ERROR(net::ReadFull(fd, buf->data(), buf->size(), deadline));
  if (reply.code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code), buf->substr(0, reply.message_length));
  }
  if (resp != nullptr && !resp->ParseFromArray(buf->data() + reply.message_length, static_cast<int>(reply.length))) {
    return absl::InternalError("reply does not parse");
  }
  return absl::OkStatus();
}

struct OpFigures {
  std::vector<double> micros;
  double seconds = 0;
};

nlohmann::json Summary(OpFigures& f, int workers) {
  if (f.micros.empty()) return {{"calls", 0}};
  std::sort(f.micros.begin(), f.micros.end());
  auto at = [&f](double q) { return f.micros[static_cast<size_t>(q * (f.micros.size() - 1))]; };
  return {{"p50_us", at(0.5)},
          {"p99_us", at(0.99)},
          {"calls", f.micros.size()},
          {"per_s", f.seconds > 0 ? f.micros.size() / f.seconds : 0.0},
          {"workers", workers}};
}

// One master with `segments` segments, `objects` objects and `connections`
// connections; the three phases' figures.
absl::StatusOr<nlohmann::json> RunSize(int segments, int64_t objects, int connections, int workers,
                                       double seconds) {
  nlohmann::json out = {{"segments", segments}, {"objects", objects}, {"connections", connections}};
  const std::string max_conns = absl::StrCat("--direct-max-connections=", connections + 64);
  const char* argv[] = {"tierkv-master", "--rpc-port=0", "--http-port=0", "--segment-ttl=86400s",
                        "--direct-spin=0s", "--listen=127.0.0.1", max_conns.c_str()};
  absl::StatusOr<MasterConfig> cfg =
      MasterFlags().Parse(7, argv, nullptr, [](const char*) -> const char* { return nullptr; });
  if (!cfg.ok()) return cfg.status();
  ASSIGN_OR_RETURN(std::unique_ptr<master::MasterServer> server, master::MasterServer::Start(*cfg));
  const std::string address = absl::StrCat("127.0.0.1:", server->rpc_port());
  auto stub = v1::Master::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));

  // Mount as daemons do, over gRPC, a few hundred per call.
  absl::Time t0 = absl::Now();
  const uint64_t capacity = (uint64_t{64} << 40) / static_cast<uint64_t>(segments);
  for (int base = 0; base < segments; base += 500) {
    v1::MountSegmentRequest mount;
    for (int i = base; i < std::min(segments, base + 500); ++i) {
      v1::Segment* s = mount.add_segments();
      s->set_name(absl::StrCat("scale-seg-", i));
      s->set_host(absl::StrCat("scale-host-", i));
      s->set_capacity(capacity);
      s->set_incarnation("scale");
    }
    v1::MountSegmentResponse mounted;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    if (grpc::Status st = stub->MountSegment(&ctx, mount, &mounted); !st.ok()) {
      return absl::UnavailableError(absl::StrCat("mount: ", st.error_message()));
    }
  }
  out["mount_s"] = absl::ToDoubleSeconds(absl::Now() - t0);

  // The objects, placed as puts place them (straight into the index).
  t0 = absl::Now();
  master::ObjectIndex& index = server->master().index();
  for (int64_t base = 0; base < objects; base += kPreloadBatch) {
    std::vector<master::PutItem> items;
    std::vector<std::string> keys;
    for (int64_t i = base; i < std::min(objects, base + kPreloadBatch); ++i) {
      keys.push_back(ScaleKey(i));
      master::PutItem item;
      item.key = keys.back();
      item.size = kValue;
      items.push_back(std::move(item));
    }
    for (const master::PutStartOut& r : index.PutStart(items)) {
      if (!r.status.ok()) return absl::InternalError(absl::StrCat("preload: ", r.status.message()));
    }
    index.PutEnd(keys);
  }
  out["preload_s"] = absl::ToDoubleSeconds(absl::Now() - t0);

  // The connections, each pinged so a master thread holds it.
  t0 = absl::Now();
  std::vector<net::Fd> fds;
  fds.reserve(connections);
  std::string buf;
  for (int i = 0; i < connections; ++i) {
    ASSIGN_OR_RETURN(net::Fd fd, net::Dial(address, absl::Now() + absl::Seconds(10)));
    v1::DirectHello hello;
    if (absl::Status st = DirectCall(fd.get(), DirectMethod::kPing, hello, nullptr, &buf); !st.ok()) {
      return absl::UnavailableError(absl::StrCat("connection ", i, ": ", st.message()));
    }
    fds.push_back(std::move(fd));
  }
  out["connect_s"] = absl::ToDoubleSeconds(absl::Now() - t0);

  // The phases: each worker calls through its share of the connections in
  // turn, one call at a time, for `seconds`.
  const char* names[] = {"PutStart", "GetReplicas", "PrefixMatch"};
  std::atomic<uint64_t> put_serial{0};
  for (int phase = 0; phase < 3; ++phase) {
    std::vector<OpFigures> per(workers);
    std::vector<std::string> errors(workers);
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] {
        std::mt19937_64 rng(w * 7919 + phase);
        std::string b;
        const size_t from = fds.size() * w / workers, to = fds.size() * (w + 1) / workers;
        size_t next = from;
        const absl::Time start = absl::Now(), end = start + absl::Seconds(seconds);
        absl::Time now = start;
        while (now < end && to > from) {
          const int fd = fds[next].get();
          next = next + 1 == to ? from : next + 1;
          absl::Status st;
          const absl::Time t = absl::Now();
          if (phase == 0) {
            v1::PutStartRequest req;
            auto* item = req.add_items();
            const std::string key = absl::StrCat("scale-put-", put_serial.fetch_add(1));
            item->set_key(key);
            item->set_size(kValue);
            v1::PutStartResponse resp;
            st = DirectCall(fd, DirectMethod::kPutStart, req, &resp, &b);
            now = absl::Now();
            if (st.ok() && resp.results(0).status().code() != 0) st = absl::InternalError(resp.results(0).status().message());
            if (st.ok()) {
              v1::KeysRequest end_req;
              end_req.add_keys(key);
              v1::KeysResponse end_resp;
              st = DirectCall(fd, DirectMethod::kPutEnd, end_req, &end_resp, &b);
            }
          } else {
            v1::KeysRequest req;
            req.add_keys(ScaleKey(static_cast<int64_t>(rng() % static_cast<uint64_t>(objects))));
            if (phase == 1) {
              v1::GetReplicasResponse resp;
              st = DirectCall(fd, DirectMethod::kGetReplicas, req, &resp, &b);
              if (st.ok() && (resp.sizes_size() != 1 || resp.sizes(0) == 0)) st = absl::InternalError("lookup missed");
            } else {
              v1::PrefixMatchResponse resp;
              st = DirectCall(fd, DirectMethod::kPrefixMatch, req, &resp, &b);
              if (st.ok() && resp.matched() != 1) st = absl::InternalError("prefix match missed");
            }
            now = absl::Now();
          }
          if (!st.ok()) {
            errors[w] = st.ToString();
            break;
          }
          per[w].micros.push_back(absl::ToDoubleMicroseconds(now - t));
          now = absl::Now();
        }
        per[w].seconds = absl::ToDoubleSeconds(now - start);
      });
    }
    for (std::thread& t : threads) t.join();
    OpFigures all;
    for (int w = 0; w < workers; ++w) {
      if (!errors[w].empty()) return absl::InternalError(absl::StrCat(names[phase], ": ", errors[w]));
      all.micros.insert(all.micros.end(), per[w].micros.begin(), per[w].micros.end());
      all.seconds = std::max(all.seconds, per[w].seconds);
    }
    out[names[phase]] = Summary(all, workers);
  }
  fds.clear();
  server->Shutdown();
  return out;
}

}  // namespace

int RunMasterScale(const BenchConfig& config) {
  std::vector<int> sizes;
  for (absl::string_view part : absl::StrSplit(config.scale_segments, ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1) {
      std::fprintf(stderr, "tierkv-bench: --scale-segments: '%s' is not a count\n", std::string(part).c_str());
      return 2;
    }
    sizes.push_back(n);
  }
  if (sizes.empty()) sizes = {16, 4000};
  // Both ends of each connection are this process's: about half the
  // open-file limit, less what the master and gRPC keep open.
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
    getrlimit(RLIMIT_NOFILE, &lim);
  }
  const int64_t fd_cap = std::max<int64_t>(1, (static_cast<int64_t>(lim.rlim_cur) - 512) / 2);
  const int connections = static_cast<int>(std::min<int64_t>(config.scale_connections, fd_cap));
  const int workers = static_cast<int>(config.threads);
  nlohmann::json out = {{"connections_asked", config.scale_connections},
                        {"connections", connections},
                        {"open_file_limit", lim.rlim_cur},
                        {"objects", config.scale_objects},
                        {"workers", workers},
                        {"phase_s", config.min_time}};
  std::vector<nlohmann::json> results;
  for (int segments : sizes) {
    absl::StatusOr<nlohmann::json> r = RunSize(segments, config.scale_objects, connections, workers, config.min_time);
    if (!r.ok()) {
      std::fprintf(stderr, "tierkv-bench: %d segments: %s\n", segments, r.status().ToString().c_str());
      return 1;
    }
    out["sizes"][absl::StrCat(segments)] = *r;
    results.push_back(*r);
  }
  const nlohmann::json& small = results.front();
  const nlohmann::json& large = results.back();
  bool met = true;
  for (const char* op : {"PutStart", "GetReplicas", "PrefixMatch"}) {
    const double p99 = large[op]["p99_us"].get<double>() / small[op]["p99_us"].get<double>();
    const double rate = large[op]["per_s"].get<double>() / small[op]["per_s"].get<double>();
    out["ratios"][op] = {{"p99", p99}, {"throughput", rate}, {"met", p99 <= 2.0 && rate >= 0.8}};
    met = met && p99 <= 2.0 && rate >= 0.8;
  }
  out["targets"] = {{"p99_ratio_max", 2.0}, {"throughput_ratio_min", 0.8}, {"met", met}};
  if (config.json) {
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("master at scale: %d connections (asked %lld; open-file limit %llu), %lld objects, %d workers\n",
              connections, static_cast<long long>(config.scale_connections),
              static_cast<unsigned long long>(lim.rlim_cur), static_cast<long long>(config.scale_objects), workers);
  std::printf("%-9s %8s %8s %8s | %-11s %10s %10s %10s\n", "segments", "mount s", "fill s", "conn s", "rpc", "p50 us",
              "p99 us", "calls/s");
  for (const nlohmann::json& r : results) {
    for (const char* op : {"PutStart", "GetReplicas", "PrefixMatch"}) {
      std::printf("%-9d %8.2f %8.2f %8.2f | %-11s %10.1f %10.1f %10.0f\n", r["segments"].get<int>(),
                  r["mount_s"].get<double>(), r["preload_s"].get<double>(), r["connect_s"].get<double>(), op,
                  r[op]["p50_us"].get<double>(), r[op]["p99_us"].get<double>(), r[op]["per_s"].get<double>());
    }
  }
  for (const char* op : {"PutStart", "GetReplicas", "PrefixMatch"}) {
    const nlohmann::json& ratio = out["ratios"][op];
    std::printf("%-11s p99 x%.2f (goal <= 2), throughput x%.2f (goal >= 0.8): %s\n", op, ratio["p99"].get<double>(),
                ratio["throughput"].get<double>(), ratio["met"].get<bool>() ? "met" : "MISSED");
  }
  return 0;
}

}  // namespace tierkv::bench
