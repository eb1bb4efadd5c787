// The master's direct frames, and a client of a master without the
// direct lane (it uses gRPC).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "client/master_client.h"
#include "proto/direct_frame.h"
#include "proto/master.grpc.pb.h"
#include "tests/support/status_matchers.h"

namespace tierkv {
namespace {

using direct::DirectMethod;

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

}  // namespace
}  // namespace tierkv
