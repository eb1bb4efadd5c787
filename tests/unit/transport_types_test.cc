// Transport value types and helpers that need no peer: the address a
// server advertises for its listen address.
#include "transport/types.h"

#include "tests/support/status_matchers.h"

namespace tierkv::transport {
namespace {

using ::tierkv::testing::StatusIs;

TEST(AdvertiseAddressTest, ASpecificListenAddressIsAdvertisedAsIs) {
  EXPECT_EQ(*ChooseAdvertiseAddress("10.1.2.3", {}, ""), "10.1.2.3");
  EXPECT_EQ(*ChooseAdvertiseAddress("127.0.0.1", {{"eth0", "10.0.0.5", false, true}}, "eth0"), "127.0.0.1");
}

TEST(AdvertiseAddressTest, AWildcardAdvertisesTheDefaultRoutesInterface) {
  std::vector<InterfaceAddress> ifs = {{"lo", "127.0.0.1", true, true},
                                       {"docker0", "172.17.0.1", false, true},
                                       {"ib0", "10.20.0.7", false, false},
                                       {"eth0", "10.0.0.5", false, true}};
  EXPECT_EQ(*ChooseAdvertiseAddress("0.0.0.0", ifs, "eth0"), "10.0.0.5");
  EXPECT_EQ(*ChooseAdvertiseAddress("", ifs, "eth0"), "10.0.0.5");
  // No default route: the first interface that is up and not loopback.
  EXPECT_EQ(*ChooseAdvertiseAddress("0.0.0.0", ifs, ""), "172.17.0.1");
  // A default route over an interface that is down is not taken.
  EXPECT_EQ(*ChooseAdvertiseAddress("0.0.0.0", ifs, "ib0"), "172.17.0.1");
}

TEST(AdvertiseAddressTest, AWildcardWithOnlyLoopbackIsRefusedNamingTheFlag) {
  absl::StatusOr<std::string> a = ChooseAdvertiseAddress("0.0.0.0", {{"lo", "127.0.0.1", true, true}}, "");
  EXPECT_THAT(a, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(a.status().message().find("--host"), std::string::npos) << a.status();
}

TEST(AdvertiseAddressTest, ThisHostResolvesAWildcardToOneOfItsOwnAddresses) {
  absl::StatusOr<std::string> a = ResolveAdvertiseAddress("0.0.0.0");
  if (!a.ok()) GTEST_SKIP() << "this host has no routable interface: " << a.status();
  EXPECT_NE(*a, "0.0.0.0");
  EXPECT_NE(a->rfind("127.", 0), 0u) << *a;
}

}  // namespace
}  // namespace tierkv::transport
