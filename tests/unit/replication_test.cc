// The leader's replication log and a standby's copier (master/replication.h):
// ordering, acknowledgement, the semi-sync wait and its degraded mode, the
// "ahead" mark, and a copy that converges on the leader's store over a real
// gRPC server on loopback, pulled or streamed, while the leader keeps
// writing.
#include "master/replication.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/direct_frame.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "base/net/socket.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StaysFalse;
using ::tierkv::testing::WaitFor;

// Every key but the master's own "h/" ones.
std::map<std::string, std::string> Contents(IndexStore* store) {
  std::map<std::string, std::string> out;
  EXPECT_OK(store->Scan("", [&](absl::string_view k, absl::string_view v) {
    if (!absl::StartsWith(k, kHaPrefix)) out.emplace(std::string(k), std::string(v));
    return true;
  }));
  return out;
}

v1::PullResponse Pull(ReplicationLog* log, uint64_t epoch, uint64_t next, uint32_t wait_ms = 0) {
  v1::PullRequest req;
  req.set_standby("standby-1");
  req.set_epoch(epoch);
  req.set_next_seq(next);
  req.set_wait_ms(wait_ms);
  v1::PullResponse resp;
  log->Pull(req, &resp);
  return resp;
}

// Counts marks made and removed, answering `answer` to both (a mark made
// answers its count as its revision).
struct Marks {
  std::atomic<int> ahead{0}, behind{0};
  absl::Status answer;
  void Install(ReplicationOptions* o) {
    o->mark_ahead = [this]() -> absl::StatusOr<int64_t> {
      const int n = ++ahead;
      if (!answer.ok()) return answer;
      return int64_t{n};
    };
    o->unmark_ahead = [this](int64_t) {
      ++behind;
      return answer;
    };
  }
};

TEST(ReplicationLogTest, PullHandsBatchesInOrderAndEachPullAcknowledgesWhatCameBefore) {
  auto store = NewMemStore();
  Marks marks;
  ReplicationOptions o;
  o.epoch = 7;
  o.sync_timeout = absl::Seconds(30);
  marks.Install(&o);
  ReplicationLog log(o, store.get());
  store->SetReplicator(&log);
  // Caught up before any write: writes wait for this standby from now on.
  EXPECT_FALSE(Pull(&log, 7, 1).snapshot_needed());
  EXPECT_EQ(log.State().sync, "semi-sync");

  std::atomic<int> done{0};
  std::thread writer([&] {
    EXPECT_OK(store->Write({{"o/a", "1", false}, {"o/b", "2", false}}));
    done = 1;
    EXPECT_OK(store->Write({{"o/a", "", true}, {"h/pos", "never copied", false}}));
    done = 2;
  });
  v1::PullResponse first = Pull(&log, 7, 1, 5000);
  ASSERT_EQ(first.batches_size(), 1);
  EXPECT_EQ(first.epoch(), 7u);
  EXPECT_EQ(first.batches(0).seq(), 1u);
  ASSERT_EQ(first.batches(0).mutations_size(), 2);
  EXPECT_EQ(first.batches(0).mutations(1).key(), "o/b");
  EXPECT_OK(StaysFalse("a write returned before a standby had it", absl::Milliseconds(50),
                       [&] { return done.load() > 0; }));
  v1::PullResponse second = Pull(&log, 7, 2, 5000);  // acknowledges batch 1
  ASSERT_EQ(second.batches_size(), 1);
  EXPECT_EQ(second.batches(0).seq(), 2u);
  ASSERT_EQ(second.batches(0).mutations_size(), 1) << "h/ keys are the master's own";
  EXPECT_TRUE(second.batches(0).mutations(0).remove());
  Pull(&log, 7, 3);  // acknowledges batch 2
  writer.join();
  EXPECT_EQ(done.load(), 2);
  EXPECT_EQ(marks.ahead.load(), 0);
  ReplicationState st = log.State();
  EXPECT_EQ(st.last_seq, 2u);
  ASSERT_EQ(st.standbys.size(), 1u);
  EXPECT_EQ(st.standbys[0].acked, 2u);
  store->SetReplicator(nullptr);
}

TEST(ReplicationLogTest, WithNoStandbyAnsweringWritesGoOnMarkedAheadUntilOneCatchesUp) {
  auto store = NewMemStore();
  Marks marks;
  ReplicationOptions o;
  o.epoch = 3;
  o.sync_timeout = absl::Milliseconds(100);
  marks.Install(&o);
  ReplicationLog log(o, store.get());
  store->SetReplicator(&log);

  // No standby yet: acknowledged at once, after marking the leader ahead.
  EXPECT_OK(store->Write({{"o/1", "x", false}}));
  EXPECT_EQ(marks.ahead.load(), 1);
  EXPECT_EQ(log.State().sync, "degraded");
  Pull(&log, 3, 2);  // a standby has everything: writes wait again
  EXPECT_EQ(log.State().sync, "degraded") << "until the mark is gone, no standby may take over";
  log.UnmarkIfSynced();
  EXPECT_EQ(marks.behind.load(), 1);
  EXPECT_EQ(log.State().sync, "semi-sync");

  // It stops answering: the write waits out the timeout, then goes on.
  const absl::Time start = absl::Now();
  EXPECT_OK(store->Write({{"o/2", "y", false}}));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(log.State().sync, "degraded");
  EXPECT_EQ(marks.ahead.load(), 2);
  const absl::Time second = absl::Now();
  EXPECT_OK(store->Write({{"o/3", "z", false}}));
  EXPECT_LT(absl::Now() - second, absl::Milliseconds(100)) << "degraded writes do not wait";
  EXPECT_EQ(marks.ahead.load(), 2) << "marked once per degraded spell";
  EXPECT_EQ(log.State().degraded_writes, 3u);
  store->SetReplicator(nullptr);
}

TEST(ReplicationLogTest, AWriteNoStandbyHasIsRefusedWhenTheMarkCannotBeMade) {
  auto store = NewMemStore();
  Marks marks;
  marks.answer = absl::UnavailableError("etcd unreachable");
  ReplicationOptions o;
  marks.Install(&o);
  o.sync_timeout = absl::Milliseconds(300);
  ReplicationLog log(o, store.get());
  store->SetReplicator(&log);
  const absl::Time start = absl::Now();  // no later than the failed mark
  absl::Status s = store->Write({{"o/1", "x", false}});
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("etcd unreachable"), std::string::npos) << s;
  EXPECT_EQ(marks.ahead.load(), 1);
  // The writes right behind it get the same answer without asking etcd
  // again (each ask may take the etcd call's whole deadline).
  s = store->Write({{"o/2", "x", false}});
  EXPECT_NE(s.message().find("etcd unreachable"), std::string::npos) << s;
  EXPECT_EQ(marks.ahead.load(), 1);
  // After sync_timeout the next write asks again, and goes on once marked.
  marks.answer = absl::OkStatus();
  EXPECT_OK(WaitFor("a write to ask etcd again", absl::Seconds(5), [&] {
    s = store->Write({{"o/3", "x", false}});
    return marks.ahead.load() > 1;
  }));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300)) << "etcd asked again within sync_timeout";
  EXPECT_OK(s);
  EXPECT_EQ(marks.ahead.load(), 2);
  store->SetReplicator(nullptr);
}

TEST(ReplicationLogTest, ClosingFailsTheWritesWaitingForAStandby) {
  auto store = NewMemStore();
  ReplicationOptions o;
  o.epoch = 1;
  o.sync_timeout = absl::Seconds(30);
  ReplicationLog log(o, store.get());
  store->SetReplicator(&log);
  Pull(&log, 1, 1);
  absl::Status result;
  std::thread writer([&] { result = store->Write({{"o/1", "x", false}}); });
  ASSERT_OK(WaitFor("the write to be appended, waiting for a standby", absl::Seconds(5),
                    [&] { return log.LastAppended() == 1; }));
  log.Close();
  writer.join();
  EXPECT_TRUE(absl::IsUnavailable(result)) << result;
  EXPECT_NE(result.message().find(kNotLeader), std::string::npos) << result;
  EXPECT_TRUE(absl::IsUnavailable(store->Write({{"o/2", "x", false}})));
  store->SetReplicator(nullptr);
}

TEST(ReplicationLogTest, APositionOutsideTheLogAsksForASnapshot) {
  auto store = NewMemStore();
  ReplicationOptions o;
  o.epoch = 5;
  o.semi_sync = false;
  o.max_log_bytes = 1024;  // a few batches
  ReplicationLog log(o, store.get());
  store->SetReplicator(&log);
  for (int i = 0; i < 50; ++i) ASSERT_OK(store->Write({{absl::StrCat("o/", i), std::string(100, 'v'), false}}));
  EXPECT_TRUE(Pull(&log, 4, 51).snapshot_needed()) << "another epoch";
  EXPECT_TRUE(Pull(&log, 5, 60).snapshot_needed()) << "ahead of the log";
  EXPECT_TRUE(Pull(&log, 5, 1).snapshot_needed()) << "trimmed from the log";
  EXPECT_TRUE(Pull(&log, 5, 0).snapshot_needed()) << "no position";
  v1::PullResponse tail = Pull(&log, 5, 50);
  EXPECT_FALSE(tail.snapshot_needed());
  ASSERT_EQ(tail.batches_size(), 1);
  EXPECT_EQ(tail.batches(0).seq(), 50u);
  store->SetReplicator(nullptr);
}

// The standby's end of a replication stream, served by log->Stream on the
// other end of a socket pair: frames are read and acknowledged by hand.
class StreamPeer {
 public:
  StreamPeer(ReplicationLog* log, uint64_t epoch, uint64_t next, uint32_t page_bytes) {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    mine_ = fds[0];
    v1::PullRequest first;
    first.set_standby("standby-1");
    first.set_epoch(epoch);
    first.set_next_seq(next);
    first.set_max_bytes(page_bytes);
    leader_ = std::thread([log, fd = fds[1], first] {
      log->Stream(fd, first);
      ::close(fd);
    });
  }
  ~StreamPeer() {
    ::shutdown(mine_, SHUT_RDWR);
    leader_.join();
    ::close(mine_);
  }
  // The next frame, or nothing if none comes within `wait`.
  std::optional<v1::PullResponse> Frame(std::chrono::milliseconds wait) {
    pollfd p{mine_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(wait.count())) != 1) return std::nullopt;
    char h[direct::kHeaderSize];
    if (!net::RecvAll(mine_, h, sizeof h).ok()) return std::nullopt;
    absl::StatusOr<direct::ReplyHeader> reply = direct::DecodeReply(h, 64 << 20);
    EXPECT_OK(reply.status());
    if (!reply.ok()) return std::nullopt;
    std::string body(reply->length, '\0');
    EXPECT_OK(net::RecvAll(mine_, body.data(), body.size()));
    v1::PullResponse resp;
    EXPECT_TRUE(resp.ParseFromString(body));
    return resp;
  }
  // Whether a frame (or the end) is waiting to be read.
  bool Readable() {
    pollfd p{mine_, POLLIN, 0};
    return ::poll(&p, 1, 0) == 1;
  }
  // The next frame that carries batches, skipping heartbeats.
  std::optional<v1::PullResponse> Batches(std::chrono::milliseconds wait) {
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      std::optional<v1::PullResponse> f = Frame(left);
      if (!f.has_value() || f->batches_size() > 0) return f;
    }
  }
  void Ack(uint64_t next_seq) {
    v1::PullRequest ack;
    ack.set_standby("standby-1");
    ack.set_next_seq(next_seq);
    std::string out(direct::kHeaderSize + ack.ByteSizeLong(), '\0');
    direct::EncodeCall({direct::DirectMethod::kReplicate, static_cast<uint32_t>(ack.ByteSizeLong())}, out.data());
    ack.SerializeToArray(out.data() + direct::kHeaderSize, static_cast<int>(ack.ByteSizeLong()));
    ASSERT_EQ(::send(mine_, out.data(), out.size(), MSG_NOSIGNAL), static_cast<ssize_t>(out.size()));
  }

 private:
  int mine_ = -1;
  std::thread leader_;
};

// Async: a caught-up stream keeps one frame in flight, so the batches
// committed while the standby applies the last frame go out together once
// it acknowledges; a standby catching up is sent page after page without
// waiting for acknowledgements.
TEST(ReplicationLogTest, AnAsyncStreamSendsWhatCommittedMeanwhileInOneFrameAndABacklogWithoutWaiting) {
  auto store = NewMemStore();
  ReplicationOptions o;
  o.epoch = 2;
  o.semi_sync = false;
  ReplicationLog log(o, store.get());
  store->SetReplicator(&log);
  // The backlog: 40 batches, a page (the smallest) each.
  for (int i = 0; i < 40; ++i) ASSERT_OK(store->Write({{absl::StrCat("o/old", i), "v", false}}));
  {
    StreamPeer peer(&log, 2, 1, 1);
    const auto began = std::chrono::steady_clock::now();
    for (uint64_t seq = 1; seq <= 40; ++seq) {
      std::optional<v1::PullResponse> f = peer.Batches(std::chrono::seconds(5));
      ASSERT_TRUE(f.has_value()) << "batch " << seq << " never came";
      ASSERT_EQ(f->batches_size(), 1);
      EXPECT_EQ(f->batches(0).seq(), seq);
    }
    // Had each page waited for an acknowledgement (never sent), every one
    // would have waited out a 200 ms heartbeat: 40 of them take 8 s.
    EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(4));
    peer.Ack(41);
  }

  StreamPeer peer(&log, 2, 41, 0);  // the default page: many batches a frame
  ASSERT_OK(store->Write({{"o/a", "1", false}}));
  std::optional<v1::PullResponse> one = peer.Batches(std::chrono::seconds(5));
  ASSERT_TRUE(one.has_value());
  ASSERT_EQ(one->batches_size(), 1);
  EXPECT_EQ(one->batches(0).seq(), 41u);
  const auto sent = std::chrono::steady_clock::now();
  // Three more commit, 10 ms apart, before the standby acknowledges batch
  // 41: a sender that did not wait would send each on its own. (Within
  // 150 ms of batch 41 not even a heartbeat is due.)
  auto sent_early = [&] {
    return peer.Readable() && std::chrono::steady_clock::now() - sent < std::chrono::milliseconds(150);
  };
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(store->Write({{absl::StrCat("o/b", i), "2", false}}));
    EXPECT_OK(StaysFalse("a frame sent before batch 41 was acknowledged", absl::Milliseconds(10), sent_early));
  }
  const bool in_time = std::chrono::steady_clock::now() - sent < std::chrono::milliseconds(150);
  peer.Ack(42);
  std::optional<v1::PullResponse> rest = peer.Batches(std::chrono::seconds(5));
  ASSERT_TRUE(rest.has_value());
  ASSERT_GE(rest->batches_size(), 1);
  EXPECT_EQ(rest->batches(0).seq(), 42u);
  // A sender that stops waiting at its 200 ms heartbeat may have sent
  // sooner when this machine stalled the writes past it.
  if (in_time) {
    EXPECT_EQ(rest->batches_size(), 3) << "the batches committed meanwhile went out one by one";
  } else {
    std::printf("writes took over 150 ms on this machine; the frame's size is not judged\n");
  }
  store->SetReplicator(nullptr);
}

// A leader store behind a real MasterHa server, and a writer changing it.
// Streamed (the parameter): the copier dials a front port that, as the
// master's direct lane does, serves a connection whose first call is a
// kReplicate stream from the log and hands any other to the gRPC server;
// else the port is gRPC's alone, and the copier falls back to pulling.
class CopierTest : public ::testing::TestWithParam<bool> {
 protected:
  void StartLeader(uint64_t epoch, bool semi_sync = false) {
    std::unique_ptr<ReplicationLog> old;
    std::unique_ptr<grpc::Server> old_server;
    {
      MutexLock lock(&streams_mu_);  // the acceptor hands nothing to either now
      old = std::move(log_);
      old_server = std::move(server_);
    }
    if (old_server) old_server->Shutdown();
    old_server.reset();
    if (old) old->Close();
    JoinStreams();
    leader_->SetReplicator(nullptr);
    old.reset();
    ReplicationOptions o;
    o.epoch = epoch;
    o.semi_sync = semi_sync;
    o.sync_timeout = absl::Seconds(30);  // never degrades within a test
    o.max_log_bytes = 64 << 20;
    o.spin = Spin();
    auto log = std::make_unique<ReplicationLog>(o, leader_.get());
    leader_->SetReplicator(log.get());
    service_ = NewMasterHaService(log.get());
    {
      MutexLock lock(&streams_mu_);
      log_ = std::move(log);
    }
    grpc::ServerBuilder b;
    if (!GetParam()) {
      b.AddListeningPort(port_ == 0 ? "127.0.0.1:0" : absl::StrCat("127.0.0.1:", port_),
                         grpc::InsecureServerCredentials(), &port_);
    }
    b.RegisterService(service_.get());
    std::unique_ptr<grpc::Server> server = b.BuildAndStart();
    ASSERT_NE(server, nullptr);
    {
      MutexLock lock(&streams_mu_);
      server_ = std::move(server);
    }
    if (GetParam() && !front_.valid()) {
      absl::StatusOr<net::Fd> l = net::Listen("127.0.0.1", 0, &port_);
      ASSERT_OK(l.status());
      front_ = std::move(*l);
      acceptor_ = std::thread([this] { Accept(); });
    }
  }
  // Streams poll before sleeping, as masters do by default (--direct-spin).
  absl::Duration Spin() const { return GetParam() ? absl::Microseconds(100) : absl::ZeroDuration(); }
  void Accept() {
    for (;;) {
      const int fd = ::accept4(front_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;  // shut down
      uint32_t magic = 0;
      if (::recv(fd, &magic, 4, MSG_PEEK | MSG_WAITALL) != 4 || magic != direct::kCallMagic) {
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);  // as gRPC accepts its own
        MutexLock lock(&streams_mu_);
        if (server_ == nullptr) {
          ::close(fd);  // between leaders
        } else {
          grpc::AddInsecureChannelFromFd(server_.get(), fd);
        }
        continue;
      }
      char h[direct::kHeaderSize];
      v1::PullRequest first;
      std::string body;
      absl::StatusOr<direct::CallHeader> call;
      if (!net::RecvAll(fd, h, sizeof h).ok() || !(call = direct::DecodeCall(h, 1 << 20)).ok() ||
          (body.resize(call->length), !net::RecvAll(fd, body.data(), body.size()).ok()) ||
          !first.ParseFromString(body)) {
        ::close(fd);
        continue;
      }
      MutexLock lock(&streams_mu_);
      if (log_ == nullptr) {  // between leaders
        ::close(fd);
        continue;
      }
      ++streams_;
      stream_threads_.emplace_back([fd, first, log = log_.get()] {
        log->Stream(fd, first);
        ::close(fd);
      });
    }
  }
  void JoinStreams() {
    std::vector<std::thread> threads;
    {
      MutexLock lock(&streams_mu_);
      threads.swap(stream_threads_);
    }
    for (std::thread& t : threads) t.join();
  }
  void TearDown() override {
    StopWriter();
    if (front_.valid()) ::shutdown(front_.get(), SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    if (server_) server_->Shutdown();
    if (log_) log_->Close();
    JoinStreams();
    leader_->SetReplicator(nullptr);
  }
  // Puts and removes random keys until StopWriter.
  void StartWriter() {
    writer_ = std::thread([this] {
      std::mt19937 rng(42);
      for (int i = 0; i < 200000 && !stop_; ++i) {
        const std::string k = absl::StrCat("o/", rng() % 3000);
        const bool remove = rng() % 4 == 0;
        ASSERT_OK(leader_->Write({{k, remove ? "" : absl::StrCat("v", i, std::string(rng() % 200, 'x')), remove}}));
      }
    });
  }
  void StopWriter() {
    stop_ = true;
    if (writer_.joinable()) writer_.join();
    stop_ = false;
  }
  // Until the copier has every batch the leader's log holds.
  absl::Status WaitCaughtUp(StandbyCopier* copier) {
    return WaitFor("the copier to catch up with the leader's log", absl::Seconds(10), [&] {
      const ReplPosition p = copier->position();
      const ReplicationState st = log_->State();
      return p.valid && p.epoch == st.epoch && p.seq == st.last_seq;
    });
  }
  // Until the copier has copied past `seq` of `epoch` (while the writer
  // goes on).
  absl::Status WaitCopiedPast(StandbyCopier* copier, uint64_t epoch, uint64_t seq) {
    return WaitFor(absl::StrCat("the copier to copy past batch ", seq, " of epoch ", epoch), absl::Seconds(10), [&] {
      const ReplPosition p = copier->position();
      return p.valid && p.epoch == epoch && p.seq > seq;
    });
  }
  // The copier took the path the parameter gives: batches came by stream
  // (and a stream was opened), or none did. Writes after the catch-up make
  // the check independent of timing: a snapshot that outlasts the writer
  // leaves no tail for a stream to carry.
  void ExpectCopiedAsAsked(StandbyCopier* copier, IndexStore* standby) {
    for (int i = 0; i < 20; ++i) ASSERT_OK(leader_->Write({{absl::StrCat("o/after/", i), "after", false}}));
    ASSERT_OK(WaitCaughtUp(copier));
    EXPECT_EQ(Contents(standby), Contents(leader_.get()));
    if (GetParam()) {
      EXPECT_GT(copier->streamed(), 0u);
      EXPECT_GT(streams_.load(), 0);
    } else {
      EXPECT_EQ(copier->streamed(), 0u);
    }
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  std::unique_ptr<IndexStore> leader_ = NewMemStore();
  std::unique_ptr<ReplicationLog> log_;
  std::unique_ptr<v1::MasterHa::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  net::Fd front_;
  std::thread acceptor_;
  Mutex streams_mu_;
  std::vector<std::thread> stream_threads_;
  std::atomic<int> streams_{0};
  std::thread writer_;
  std::atomic<bool> stop_{false};
};

INSTANTIATE_TEST_SUITE_P(PulledOrStreamed, CopierTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Streamed" : "Pulled"; });

TEST_P(CopierTest, ACopyTakenWhileTheLeaderWritesConvergesOnItsStore) {
  for (int i = 0; i < 2000; ++i) ASSERT_OK(leader_->Write({{absl::StrCat("o/", i), std::string(300, 'a'), false}}));
  StartLeader(1);
  auto standby = NewMemStore();
  ASSERT_OK(standby->Write({{"o/stale", "gone after the snapshot", false}}));
  StartWriter();
  // Small pages: the snapshot takes many pages while the writer goes on.
  StandbyCopier copier(standby.get(), "s1", 16 << 10, Spin());
  copier.Follow(address());
  ASSERT_OK(WaitFor("the copier to take its snapshot while the leader writes", absl::Seconds(10),
                    [&] { return copier.snapshots() > 0; }));
  StopWriter();
  ASSERT_OK(WaitCaughtUp(&copier));
  EXPECT_EQ(copier.snapshots(), 1u);
  EXPECT_EQ(Contents(standby.get()), Contents(leader_.get()));
  EXPECT_TRUE(ReadPosition(standby.get()).valid);
  ExpectCopiedAsAsked(&copier, standby.get());
}

TEST_P(CopierTest, ARestartedCopierResumesWhereItWasAndANewEpochTakesASnapshot) {
  StartLeader(1);
  auto standby = NewMemStore();
  {
    StandbyCopier copier(standby.get(), "s1", StandbyCopier::kDefaultPageBytes, Spin());
    copier.Follow(address());
    StartWriter();
    ASSERT_OK(WaitCopiedPast(&copier, 1, 0));
    StopWriter();
    ASSERT_OK(WaitCaughtUp(&copier));
  }
  // Stopped and started again on the same store: pulls on, no snapshot.
  const uint64_t stopped_at = ReadPosition(standby.get()).seq;
  StartWriter();
  {
    StandbyCopier copier(standby.get(), "s1", StandbyCopier::kDefaultPageBytes, Spin());
    copier.Follow(address());
    ASSERT_OK(WaitCopiedPast(&copier, 1, stopped_at));
    StopWriter();
    ASSERT_OK(WaitCaughtUp(&copier));
    EXPECT_EQ(copier.snapshots(), 0u);
    EXPECT_EQ(Contents(standby.get()), Contents(leader_.get()));

    // A new leader epoch (same store, as after a failover): a snapshot.
    StartLeader(2);
    StartWriter();
    ASSERT_OK(WaitCopiedPast(&copier, 2, 0));
    StopWriter();
    ASSERT_OK(WaitCaughtUp(&copier));
    EXPECT_EQ(copier.snapshots(), 1u);
    EXPECT_EQ(Contents(standby.get()), Contents(leader_.get()));
    EXPECT_EQ(copier.position().epoch, 2u);
    ExpectCopiedAsAsked(&copier, standby.get());
  }
}

// Semi-sync over either path: once the copier has caught up, every write
// returns only after the copier's store holds it.
TEST_P(CopierTest, ASemiSyncWriteReturnsOnceTheStandbyHasIt) {
  StartLeader(1, /*semi_sync=*/true);
  auto standby = NewMemStore();
  StandbyCopier copier(standby.get(), "s1", StandbyCopier::kDefaultPageBytes, Spin());
  copier.Follow(address());
  ASSERT_OK(leader_->Write({{"o/first", "1", false}}));
  ASSERT_OK(WaitCaughtUp(&copier));
  ASSERT_OK(WaitFor("the log to go semi-sync", absl::Seconds(5), [&] { return log_->State().sync == "semi-sync"; }));
  ASSERT_EQ(log_->State().sync, "semi-sync");
  for (int i = 0; i < 100; ++i) {
    const std::string k = absl::StrCat("o/k", i);
    ASSERT_OK(leader_->Write({{k, absl::StrCat("v", i), false}}));
    absl::StatusOr<std::string> there = standby->Get(k);
    ASSERT_OK(there.status()) << k << " was acknowledged before the standby had it";
    EXPECT_EQ(*there, absl::StrCat("v", i));
  }
  EXPECT_EQ(log_->State().degraded_writes, 1u);  // the first, before any standby
  ExpectCopiedAsAsked(&copier, standby.get());
}

// A decided answer waits on a gate that closed by itself (the lease went
// unconfirmed) and goes out once it opens again; never across a Close
// (the leader stepped down, even if a later term opened the gate).
TEST(ServingGateTest, AnAnswerWaitsForTheLeaseToBeConfirmedButNotAcrossAStepDown) {
  using std::chrono::steady_clock;
  ServingGate gate;
  EXPECT_TRUE(absl::IsUnavailable(gate.Check()));
  gate.OpenUntil(steady_clock::now() + std::chrono::seconds(10));
  EXPECT_OK(gate.Check());
  EXPECT_OK(gate.AwaitOpen(absl::Now()));

  // Without a grace a lapsed gate refuses at once, whatever the deadline.
  gate.OpenUntil(steady_clock::now() - std::chrono::milliseconds(1));
  absl::Time start = absl::Now();
  EXPECT_TRUE(absl::IsUnavailable(gate.AwaitOpen(start + absl::Seconds(10))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  gate.set_grace(absl::Seconds(10));

  // Lapsed by time: the wait ends OK when the gate opens again.
  gate.OpenUntil(steady_clock::now() - std::chrono::milliseconds(1));
  EXPECT_TRUE(absl::IsUnavailable(gate.Check()));
  std::atomic<bool> answered{false};
  std::thread confirm([&] {
    EXPECT_OK(StaysFalse("an answer went out while the gate was lapsed", absl::Milliseconds(50),
                         [&] { return answered.load(); }));
    gate.OpenUntil(steady_clock::now() + std::chrono::seconds(10));
  });
  absl::Status confirmed = gate.AwaitOpen(absl::Now() + absl::Seconds(10));
  answered = true;
  confirm.join();
  EXPECT_OK(confirmed);

  // Not confirmed before the deadline.
  gate.OpenUntil(steady_clock::now() - std::chrono::milliseconds(1));
  start = absl::Now();
  absl::Status late = gate.AwaitOpen(start + absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsUnavailable(late)) << late;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));

  // Closed for good, then opened for a new term: the old answer is refused.
  std::atomic<bool> waiting{false};
  answered = false;
  std::thread step_down([&] {
    while (!waiting) std::this_thread::yield();
    // The wait has begun, and holds the answer.
    EXPECT_OK(StaysFalse("an answer went out while the gate was lapsed", absl::Milliseconds(200),
                         [&] { return answered.load(); }));
    gate.Close();
    gate.OpenUntil(steady_clock::now() + std::chrono::seconds(10));
  });
  waiting = true;
  absl::Status refused = gate.AwaitOpen(absl::Now() + absl::Seconds(10));
  answered = true;
  step_down.join();
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_NE(refused.message().find("not the leader"), std::string::npos) << refused;
  EXPECT_OK(gate.Check());
}

TEST(ReplPositionTest, AnIncompleteSnapshotLeavesNoPosition) {
  auto store = NewMemStore();
  EXPECT_FALSE(ReadPosition(store.get()).valid);
  ASSERT_OK(store->Write({{kHaPositionKey, EncodePosition({9, 12, true}), false}}));
  ReplPosition p = ReadPosition(store.get());
  EXPECT_TRUE(p.valid);
  EXPECT_EQ(p.epoch, 9u);
  EXPECT_EQ(p.seq, 12u);
  ASSERT_OK(store->Write({{kHaSnapshotKey, "1", false}}));
  EXPECT_FALSE(ReadPosition(store.get()).valid);
  EXPECT_FALSE(ParsePosition("9").valid);
  EXPECT_FALSE(ParsePosition("a b").valid);
  EXPECT_TRUE(ReplPosition({1, 5, true}) < ReplPosition({2, 0, true}));
  EXPECT_TRUE(ReplPosition({2, 1, true}) < ReplPosition({2, 3, true}));
}

}  // namespace
}  // namespace tierkv::master
