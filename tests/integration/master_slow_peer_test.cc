// Slow-loris on each of the master's ports, against the real binary: more
// stalled connections than the master has threads for that port (frames
// and headers sent in part, then a byte now and then), and a healthy
// client's calls on the same port must each finish within a bounded wait.
// A stalled peer may cost its own connection (a thread of the direct
// lane's, up to its cap; a slot of the HTTP server's), never anyone
// else's calls. The fixture is master_fixture.h.
#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "tests/integration/master_fixture.h"

namespace tierkv::integration {
namespace {

// The longest a healthy call may take while the stalled peers trickle:
// well under the master's per-request timeouts (10 s), which is what a
// call queued behind a stalled peer would wait.
constexpr absl::Duration kBound = absl::Seconds(3);

// Connections that sent the start of something and now trickle one byte
// of `trickle` (none when empty) every 100 ms, from a thread of their own,
// until destroyed or for 60 s at most.
class Stalled {
 public:
  Stalled(int port, int count, const std::string& prefix, const std::string& trickle) : trickle_(trickle) {
    for (int i = 0; i < count; ++i) {
      auto fd = net::Dial(absl::StrCat("127.0.0.1:", port), absl::Now() + absl::Seconds(5));
      EXPECT_TRUE(fd.ok()) << fd.status();
      if (!fd.ok()) continue;
      (void)::send(fd->get(), prefix.data(), prefix.size(), MSG_NOSIGNAL);
      fds_.push_back(std::move(*fd));
    }
    thread_ = std::thread([this] {
      for (int tick = 0; tick < 600 && !stop_.load(); ++tick) {
        if (!trickle_.empty()) {
          const char c = trickle_[tick % trickle_.size()];
          for (const net::Fd& fd : fds_) (void)::send(fd.get(), &c, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        // A pace, not a wait for a condition: the peer is meant to be slow.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_.load(); });
      }
    });
  }
  ~Stalled() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  const std::string trickle_;
  std::vector<net::Fd> fds_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

// Runs `call` `n` times; each must succeed within kBound.
template <class F>
void EachWithinBound(const char* what, int n, F call) {
  for (int i = 0; i < n; ++i) {
    const absl::Time start = absl::Now();
    absl::Status st = call(i);
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(st.ok()) << what << " #" << i << ": " << st;
    EXPECT_LT(took, kBound) << what << " #" << i << " took " << took;
    if (::testing::Test::HasFailure()) return;
  }
}

std::string DirectHeader(uint32_t length) {
  std::string h(direct::kHeaderSize, '\0');
  direct::EncodeCall({direct::DirectMethod::kGetReplicas, length}, h.data());
  return h;
}

// The RPC port's direct lane: a connection's thread is its own, and past
// --direct-max-connections a client falls back to gRPC; stalled frames
// (half a header, a header and part of its body, two bytes before the
// lane can tell the protocol) take no call of anyone else's.
TEST_F(MasterProcessTest, DirectLaneServesBesideStalledFrames) {
  StartMaster({"--segment-ttl=60s", "--direct-max-connections=8"});
  Mount("seg-a");
  const int port = master_->port("rpc");
  Stalled half_header(port, 8, DirectHeader(64).substr(0, 9), std::string(1, '\0'));
  Stalled half_body(port, 8, DirectHeader(4096) + "\x0a\x03", "x");
  Stalled unread(port, 8, "TK", "");  // the magic's first bytes, and no more
  auto client = NewMasterClient(port);
  ASSERT_NE(client, nullptr);
  EachWithinBound("direct put and lookup", 20, [&](int i) -> absl::Status {
    const std::string key = absl::StrCat("direct-", i);
    v1::PutStartRequest req;
    req.add_items()->set_key(key);
    req.mutable_items(0)->set_size(4096);
    ASSIGN_OR_RETURN(v1::PutStartResponse started, client->PutStart(req));
    if (started.results(0).status().code() != 0) return absl::InternalError(started.results(0).status().message());
    RETURN_IF_ERROR(client->PutEnd({key}).status());
    ASSIGN_OR_RETURN(v1::GetReplicasResponse found, client->GetReplicas({key}));
    return found.sizes(0) == 4096 ? absl::OkStatus() : absl::NotFoundError(key);
  });
}

// gRPC on the same port, served by one thread: stalled HTTP/2 prefaces and
// frames cost it nothing while a healthy stub calls.
TEST_F(MasterProcessTest, GrpcServesBesideStalledHttp2Connections) {
  StartMaster({"--segment-ttl=60s", "--rpc-threads=1"});
  Mount("seg-a");
  const int port = master_->port("rpc");
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  Stalled half_preface(port, 16, preface.substr(0, 10), "\r");
  // The whole preface, then a SETTINGS frame's header and part of its body.
  Stalled half_frame(port, 16, preface + std::string("\x00\x00\x0c\x04\x00\x00\x00\x00\x00\x00\x03", 11),
                     std::string(1, '\0'));
  EachWithinBound("gRPC put and lookup", 20, [&](int i) -> absl::Status {
    const std::string key = absl::StrCat("grpc-", i);
    v1::PutStartRequest req;
    req.add_items()->set_key(key);
    req.mutable_items(0)->set_size(4096);
    v1::PutStartResponse started;
    auto ctx = Ctx();
    if (grpc::Status st = stub_->PutStart(ctx.get(), req, &started); !st.ok()) {
      return absl::UnavailableError(st.error_message());
    }
    if (started.results(0).status().code() != 0) return absl::InternalError(started.results(0).status().message());
    v1::KeysRequest end;
    end.add_keys(key);
    v1::KeysResponse done;
    auto end_ctx = Ctx();
    if (grpc::Status st = stub_->PutEnd(end_ctx.get(), end, &done); !st.ok() || done.status(0).code() != 0) {
      return absl::UnavailableError(absl::StrCat("PutEnd: ", st.error_message(), done.status_size() > 0 ? done.status(0).message() : ""));
    }
    return Get(key).hit ? absl::OkStatus() : absl::NotFoundError(key);
  });
}

// HTTP with two workers: eight requests whose headers trickle in, and four
// whose bodies do, must not hold them while a healthy client asks.
TEST_F(MasterProcessTest, HttpServesBesideTricklingRequests) {
  StartMaster({"--http-threads=2"});
  const int port = master_->port("http");
  Stalled heads(port, 8, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ", "a");
  Stalled bodies(port, 4, "POST /v1/segments HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789", "b");
  httplib::Client healthy("127.0.0.1", port);
  healthy.set_connection_timeout(std::chrono::seconds(5));
  healthy.set_read_timeout(std::chrono::seconds(5));
  EachWithinBound("HTTP GET /health", 10, [&](int i) -> absl::Status {
    // A fresh connection each time, as a probe makes.
    httplib::Client probe("127.0.0.1", port);
    probe.set_read_timeout(std::chrono::seconds(5));
    auto res = (i % 2 == 0 ? probe : healthy).Get("/health");
    if (!res) return absl::UnavailableError(httplib::to_string(res.error()));
    return res->status == 200 ? absl::OkStatus() : absl::InternalError(absl::StrCat("status ", res->status));
  });
}

}  // namespace
}  // namespace tierkv::integration
