// The master's direct frames, the lane's limits on connections (in
// process, with caps small enough to reach), peer names, and a client of a
// master without the direct lane (it uses gRPC).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include <arpa/inet.h>
#include <netinet/in.h>

#include "client/master_client.h"
#include "base/status.h"
#include "master/direct_lane.h"
#include "master/replication.h"
#include "master/persistence.h"
#include "proto/direct_frame.h"
#include "proto/master.grpc.pb.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "base/net/socket.h"

namespace tierkv {
namespace {

using direct::DirectMethod;
using ::tierkv::testing::StaysFalse;
using ::tierkv::testing::WaitFor;

TEST(DirectFrameTest, CallsAndRepliesRoundTrip) {
  char h[direct::kHeaderSize];
  direct::EncodeCall({DirectMethod::kPrefixMatch, 1234}, h);
  auto call = direct::DecodeCall(h, 4096);
  ASSERT_OK(call.status());
  EXPECT_EQ(call->method, DirectMethod::kPrefixMatch);
  EXPECT_EQ(call->length, 1234u);
  // Not a prefix of the HTTP/2 preface, which is how the port tells them apart.
  EXPECT_NE(std::string(h, 4), std::string("PRI ", 4));

  direct::EncodeReply({5, 17, 0}, h);
  auto reply = direct::DecodeReply(h, 4096);
  ASSERT_OK(reply.status());
  EXPECT_EQ(reply->code, 5);
  EXPECT_EQ(reply->message_length, 17u);
  direct::EncodeReply({0, 0, 4096}, h);
  ASSERT_OK(direct::DecodeReply(h, 4096).status());
}

TEST(DirectFrameTest, BadHeadersAreRefusedWithTheReason) {
  char h[direct::kHeaderSize];
  direct::EncodeCall({DirectMethod::kGetReplicas, 4097}, h);
  absl::Status s = direct::DecodeCall(h, 4096).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_EQ(s.message(), "GetReplicas: a request of 4097 bytes exceeds the master's limit of 4096");
  h[4] = 0;
  EXPECT_EQ(direct::DecodeCall(h, 1 << 20).status().message(), "unknown direct method 0");
  h[4] = direct::kMaxMethod + 1;
  EXPECT_TRUE(absl::IsInvalidArgument(direct::DecodeCall(h, 1 << 20).status()));
  std::memcpy(h, "PRI ", 4);
  EXPECT_EQ(direct::DecodeCall(h, 1 << 20).status().message(), "not a direct call frame (bad magic)");

  direct::EncodeReply({17, 0, 0}, h);
  EXPECT_EQ(direct::DecodeReply(h, 4096).status().message(), "direct reply with unknown code 17");
  direct::EncodeReply({3, 0, 8}, h);
  EXPECT_EQ(direct::DecodeReply(h, 4096).status().message(), "direct error reply with a response");
  direct::EncodeReply({3, direct::kMaxMessage + 1, 0}, h);
  EXPECT_TRUE(absl::IsResourceExhausted(direct::DecodeReply(h, 4096).status()));
  direct::EncodeReply({0, 0, 4097}, h);
  EXPECT_TRUE(absl::IsResourceExhausted(direct::DecodeReply(h, 4096).status()));
  direct::EncodeCall({DirectMethod::kPing, 0}, h);
  EXPECT_TRUE(absl::IsInvalidArgument(direct::DecodeReply(h, 4096).status()));
}

// A master that speaks only gRPC (as one built before the direct lane):
// the client's ping is closed, and its calls go over gRPC.
class GrpcOnlyMaster final : public v1::Master::Service {
 public:
  grpc::Status Exists(grpc::ServerContext*, const v1::KeysRequest* req, v1::ExistsResponse* resp) override {
    calls.fetch_add(1);
    for (int i = 0; i < req->keys_size(); ++i) resp->add_present(req->keys(i) == "there");
    return grpc::Status::OK;
  }
  grpc::Status PutStart(grpc::ServerContext*, const v1::PutStartRequest* req, v1::PutStartResponse* resp) override {
    calls.fetch_add(1);
    for (int i = 0; i < req->items_size(); ++i) resp->add_results();
    return grpc::Status::OK;
  }
  std::atomic<int> calls{0};
};

TEST(DirectChannelTest, AMasterWithoutTheLaneIsServedOverGrpc) {
  GrpcOnlyMaster service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  client::MasterClientOptions o;
  o.rpc_timeout = absl::Seconds(5);
  auto c = client::MasterClient::Create(absl::StrCat("127.0.0.1:", port), o);
  ASSERT_OK(c.status());
  absl::Time start = absl::Now();
  auto present = (*c)->Exists({"there", "not"});
  ASSERT_OK(present.status());
  EXPECT_EQ(*present, (std::vector<bool>{true, false}));
  // A put is not a call that may be sent twice; it is sent once, over gRPC.
  v1::PutStartRequest req;
  req.add_items()->set_key("k");
  ASSERT_OK((*c)->PutStart(req).status());
  EXPECT_EQ(service.calls.load(), 2);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // no call waited on the missing lane
  server->Shutdown();
}


TEST(DirectPeerTest, PeersAreNamedAsGrpcNamesThem) {
  sockaddr_storage a{};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a);
  v4->sin_family = AF_INET;
  v4->sin_port = htons(4242);
  inet_pton(AF_INET, "10.1.2.3", &v4->sin_addr);
  EXPECT_EQ(master::PeerName(a), "ipv4:10.1.2.3:4242");
  sockaddr_storage b{};
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&b);
  v6->sin6_family = AF_INET6;
  v6->sin6_port = htons(7);
  inet_pton(AF_INET6, "::ffff:10.1.2.3", &v6->sin6_addr);
  EXPECT_EQ(master::PeerName(b), "ipv4:10.1.2.3:7");  // an IPv4 client of a dual-stack port
  inet_pton(AF_INET6, "fe80::1", &v6->sin6_addr);
  EXPECT_EQ(master::PeerName(b), "ipv6:[fe80::1]:7");
  EXPECT_EQ(master::GrpcPeerName("ipv4:1.2.3.4:5"), "ipv4:1.2.3.4:5");
  EXPECT_EQ(master::GrpcPeerName("fd:notanumber"), "fd:notanumber");

  int port = 0;
  auto listener = net::Listen("127.0.0.1", 0, &port);
  ASSERT_OK(listener.status());
  auto dialed = net::Dial(absl::StrCat("127.0.0.1:", port), absl::Now() + absl::Seconds(5));
  ASSERT_OK(dialed.status());
  net::Fd accepted(::accept(listener->get(), nullptr, nullptr));
  ASSERT_TRUE(accepted.valid());
  sockaddr_in local{};
  socklen_t len = sizeof local;
  ASSERT_EQ(getsockname(dialed->get(), reinterpret_cast<sockaddr*>(&local), &len), 0);
  EXPECT_EQ(master::GrpcPeerName(absl::StrCat("fd:", accepted.get())),
            absl::StrCat("ipv4:127.0.0.1:", ntohs(local.sin_port)));
}

// A direct lane in this process, with caps small enough to reach.
class DirectLaneTest : public ::testing::Test {
 protected:
  void StartLane(master::DirectLane::Options o) {
    master::MasterOptions mo;
    auto m = master::Master::Create(mo, master::NewMemStore(), &clock_);
    ASSERT_OK(m.status());
    master_ = std::move(*m);
    metrics_ = std::make_unique<master::rpc::RpcMetrics>(master_.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(&unimplemented_);
    grpc_ = builder.BuildAndStart();
    ASSERT_NE(grpc_, nullptr);
    auto listener = net::Listen("127.0.0.1", 0, &port_);
    ASSERT_OK(listener.status());
    lane_ = std::make_unique<master::DirectLane>(master_.get(), metrics_.get(), o);
    lane_->Start(std::move(*listener), grpc_.get());
  }
  void TearDown() override {
    if (lane_) lane_->StopAccepting();
    if (grpc_) grpc_->Shutdown();
    if (lane_) lane_->Stop();
  }
  net::Fd Connect() {
    auto fd = net::Dial(absl::StrCat("127.0.0.1:", port_), absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(fd.ok()) << fd.status();
    return fd.ok() ? std::move(*fd) : net::Fd();
  }
  // A ping's answer on `fd`: its status, or the read's error.
  absl::Status Ping(int fd) {
    char h[direct::kHeaderSize];
    direct::EncodeCall({DirectMethod::kPing, 0}, h);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    RETURN_IF_ERROR(net::WriteFull(fd, h, sizeof h, deadline));
    RETURN_IF_ERROR(net::ReadFull(fd, h, sizeof h, deadline));
    ASSIGN_OR_RETURN(direct::ReplyHeader r, direct::DecodeReply(h, 1 << 20));
    std::string message(r.message_length, '\0');
    RETURN_IF_ERROR(net::ReadFull(fd, message.data(), message.size(), deadline));
    return r.code == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(r.code), message);
  }
  // True once the lane has closed `fd` (EOF within 5 s).
  static bool Closed(int fd) {
    char c;
    return absl::IsUnavailable(net::ReadFull(fd, &c, 1, absl::Now() + absl::Seconds(5)));
  }

  ManualClock clock_;
  std::unique_ptr<master::Master> master_;
  std::unique_ptr<master::rpc::RpcMetrics> metrics_;
  v1::Master::Service unimplemented_;
  std::unique_ptr<grpc::Server> grpc_;
  std::unique_ptr<master::DirectLane> lane_;
  int port_ = 0;
};

// Silent connections past the cap on unread ones push the oldest out: a
// flood of them never locks a new client out.
TEST_F(DirectLaneTest, SilentConnectionsPastTheirCapMakeRoomForNewOnes) {
  master::DirectLane::Options o;
  o.max_unread = 2;
  StartLane(o);
  // Accepted in this order (each silent one holds a thread of its own).
  net::Fd silent1 = Connect();
  ASSERT_OK(WaitFor("the lane to accept the first silent connection", absl::Seconds(5),
                    [&] { return lane_->threads().started == 1; }));
  net::Fd silent2 = Connect();
  ASSERT_OK(WaitFor("the lane to accept the second silent connection", absl::Seconds(5),
                    [&] { return lane_->threads().started == 2; }));
  net::Fd client = Connect();
  EXPECT_OK(Ping(client.get()));
  EXPECT_TRUE(Closed(silent1.get()));
  EXPECT_OK(Ping(silent2.get()));  // still served once it speaks
  EXPECT_OK(Ping(client.get()));
}

TEST_F(DirectLaneTest, SilentConnectionsAreClosedAfterTheFirstBytesTimeout) {
  master::DirectLane::Options o;
  o.first_bytes_timeout = absl::Milliseconds(100);
  StartLane(o);
  net::Fd silent = Connect();
  EXPECT_TRUE(Closed(silent.get()));
  net::Fd client = Connect();
  EXPECT_OK(Ping(client.get()));
}

TEST_F(DirectLaneTest, ConnectionsPastTheCapAreToldSoAndOthersKeepTheirs) {
  master::DirectLane::Options o;
  o.max_connections = 1;
  StartLane(o);
  net::Fd first = Connect();
  ASSERT_OK(Ping(first.get()));
  net::Fd second = Connect();
  absl::Status s = Ping(second.get());
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Closed(second.get()));
  EXPECT_OK(Ping(first.get()));
  first = net::Fd();  // its place frees once the lane sees it go
  absl::Status third = absl::UnknownError("not tried");
  EXPECT_OK(WaitFor("a new connection to be served once the first closed", absl::Seconds(5), [&] {
    net::Fd fd = Connect();
    third = Ping(fd.get());
    return third.ok();
  }));
  EXPECT_OK(third);
}

// A standby's side of a replication stream (kReplicate), in raw frames.
class DirectStreamTest : public DirectLaneTest {
 protected:
  static absl::Status Call(int fd, uint64_t next_seq) {
    v1::PullRequest req;
    req.set_standby("standby-1");
    req.set_epoch(7);
    req.set_next_seq(next_seq);
    std::string out(direct::kHeaderSize, '\0');
    direct::EncodeCall({DirectMethod::kReplicate, static_cast<uint32_t>(req.ByteSizeLong())}, out.data());
    req.AppendToString(&out);
    return net::WriteFull(fd, out.data(), out.size(), absl::Now() + absl::Seconds(5));
  }
  // The next frame on `fd`: its batches' sequences, or its error.
  static absl::StatusOr<std::vector<uint64_t>> Frame(int fd) {
    char h[direct::kHeaderSize];
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    RETURN_IF_ERROR(net::ReadFull(fd, h, sizeof h, deadline));
    ASSIGN_OR_RETURN(direct::ReplyHeader r, direct::DecodeReply(h, 1 << 20));
    std::string in(r.message_length + r.length, '\0');
    RETURN_IF_ERROR(net::ReadFull(fd, in.data(), in.size(), deadline));
    if (r.code != 0) return absl::Status(static_cast<absl::StatusCode>(r.code), in);
    v1::PullResponse resp;
    if (!resp.ParseFromArray(in.data(), static_cast<int>(r.length))) return absl::DataLossError("unparsable");
    std::vector<uint64_t> seqs;
    for (const v1::ReplBatch& b : resp.batches()) seqs.push_back(b.seq());
    return seqs;
  }
  // True once the lane has closed `fd`, past any frames still unread.
  static bool ClosedAfterFrames(int fd) {
    for (;;) {
      absl::StatusOr<std::vector<uint64_t>> f = Frame(fd);
      if (!f.ok()) return absl::IsUnavailable(f.status());
    }
  }
};

TEST_F(DirectStreamTest, AMasterLeadingNoStandbysRefusesAStream) {
  StartLane(master::DirectLane::Options());
  net::Fd fd = Connect();
  ASSERT_OK(Call(fd.get(), 1));
  absl::StatusOr<std::vector<uint64_t>> refused = Frame(fd.get());
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_TRUE(Closed(fd.get()));
}

// Served from a leader's log: batches pushed as they commit, each semi-sync
// write returning on the standby's acknowledgement.
TEST_F(DirectStreamTest, ALeaderPushesBatchesAndReadsAcknowledgements) {
  auto store = master::NewMemStore();
  master::ReplicationOptions ro;
  ro.epoch = 7;
  ro.sync_timeout = absl::Seconds(30);
  master::ReplicationLog log(ro, store.get());
  store->SetReplicator(&log);
  for (int i = 0; i < 3; ++i) ASSERT_OK(store->Write({{absl::StrCat("o/", i), "v", false}}));
  master::DirectLane::Options o;
  o.replication = &log;
  StartLane(o);
  net::Fd fd = Connect();
  ASSERT_OK(Call(fd.get(), 1));
  absl::StatusOr<std::vector<uint64_t>> first = Frame(fd.get());
  ASSERT_OK(first.status());
  EXPECT_EQ(*first, (std::vector<uint64_t>{1, 2, 3}));
  ASSERT_OK(Call(fd.get(), 4));  // all three applied: caught up
  ASSERT_OK(WaitFor("the log to go semi-sync", absl::Seconds(5), [&] { return log.State().sync == "semi-sync"; }));
  ASSERT_EQ(log.State().sync, "semi-sync");
  std::atomic<bool> written{false};
  std::thread writer([&] {
    EXPECT_OK(store->Write({{"o/next", "v", false}}));
    written = true;
  });
  absl::StatusOr<std::vector<uint64_t>> next = Frame(fd.get());
  while (next.ok() && next->empty()) next = Frame(fd.get());  // heartbeats
  ASSERT_OK(next.status());
  EXPECT_EQ(*next, (std::vector<uint64_t>{4}));
  EXPECT_OK(StaysFalse("a semi-sync write returned before its acknowledgement", absl::Milliseconds(50),
                       [&] { return written.load(); }));
  ASSERT_OK(Call(fd.get(), 5));
  writer.join();
  EXPECT_TRUE(written.load());
  ASSERT_EQ(log.State().standbys.size(), 1u);
  EXPECT_EQ(log.State().standbys[0].acked, 4u);
  // Acknowledging what was never sent ends the stream.
  ASSERT_OK(Call(fd.get(), 99));
  EXPECT_TRUE(ClosedAfterFrames(fd.get()));
  // So does the log's close (the leader was deposed).
  net::Fd again = Connect();
  ASSERT_OK(Call(again.get(), 5));
  log.Close();
  EXPECT_TRUE(ClosedAfterFrames(again.get()));
  lane_->Stop();  // its threads are done with the log before the log goes
  store->SetReplicator(nullptr);
}

// A connection calling back to back is polled for its next call after
// each reply; one calling every 10 ms never is; with the spin off (the
// default of these options) nothing is.
TEST_F(DirectLaneTest, OnlyAConnectionCallingBackToBackIsSpunFor) {
  master::DirectLane::Options o;
  o.spin = absl::Milliseconds(1);
  StartLane(o);
  net::Fd quick = Connect();
  // Bursts of 200 until one was spun for (at most 20: on a loaded machine
  // this thread may be off its core for the 2 ms that heat a connection).
  int pings = 0;
  for (int burst = 0; burst < 20 && lane_->spins().call == 0; ++burst) {
    for (int i = 0; i < 200; ++i, ++pings) ASSERT_OK(Ping(quick.get()));
  }
  // Closed, and its thread done with it: no spin of it is still to end.
  quick = net::Fd();
  ASSERT_OK(WaitFor("the lane to see the quick connection close", absl::Seconds(5),
                    [&] { return lane_->threads().connections == 0; }));
  const net::ServerSpin::Counts after_quick = lane_->spins();
  EXPECT_GT(after_quick.call, 0u);
  EXPECT_LE(after_quick.call + after_quick.idle, static_cast<uint64_t>(pings));
  net::Fd slow = Connect();
  auto spun = [&] {
    const net::ServerSpin::Counts now = lane_->spins();
    return now.call != after_quick.call || now.idle != after_quick.idle || now.capped != after_quick.capped;
  };
  for (int i = 0; i < 10; ++i) {
    ASSERT_OK(Ping(slow.get()));
    // The 10 ms between its calls.
    EXPECT_OK(StaysFalse("a connection calling every 10 ms was spun for", absl::Milliseconds(10), spun));
  }
  const net::ServerSpin::Counts after_slow = lane_->spins();
  EXPECT_EQ(after_slow.call, after_quick.call);
  EXPECT_EQ(after_slow.idle, after_quick.idle);
  EXPECT_EQ(after_slow.capped, after_quick.capped);
}

// A thread whose connection closed serves the next one: clients that
// reconnect for every call start no thread each. With no spare threads
// kept, every connection starts one.
TEST_F(DirectLaneTest, AThreadWhoseConnectionClosedServesTheNext) {
  for (const size_t spare : {size_t{16}, size_t{0}}) {
    SCOPED_TRACE(spare);
    TearDown();  // the previous round's lane
    lane_.reset();
    grpc_.reset();
    master::DirectLane::Options o;
    o.spare_threads = spare;
    StartLane(o);
    constexpr int kConnections = 40;
    for (int i = 0; i < kConnections; ++i) {
      net::Fd fd = Connect();
      ASSERT_OK(Ping(fd.get()));
      fd = net::Fd();
      // Until the lane has seen it close (bounded: 5 s).
      ASSERT_OK(WaitFor("the lane to see the connection close", absl::Seconds(5),
                        [&] { return lane_->threads().connections == 0; }));
    }
    const master::DirectLane::ThreadCounts n = lane_->threads();
    if (spare == 0) {
      EXPECT_EQ(n.started, static_cast<uint64_t>(kConnections));
    } else {
      // One, or a few where a connection arrived before the last thread
      // was back waiting.
      EXPECT_GE(n.started, 1u);
      EXPECT_LE(n.started, 4u);
      EXPECT_LE(n.alive, static_cast<int64_t>(n.started));
    }
  }
}

TEST_F(DirectLaneTest, NothingSpinsWithTheSpinOff) {
  StartLane({});
  net::Fd fd = Connect();
  for (int i = 0; i < 100; ++i) ASSERT_OK(Ping(fd.get()));
  const net::ServerSpin::Counts none = lane_->spins();
  EXPECT_EQ(none.call + none.idle + none.capped, 0u);
}

}  // namespace
}  // namespace tierkv
