// TestHost: a network namespace joined to the test's own by a veth pair,
// so a daemon can live on its own address and be cut off from the master
// with an nftables rule, then healed. Needs root, iproute2 and nft; Create
// says why when they are missing, and tests skip with that reason.
//
//   ASSERT_OK_AND_ASSIGN(auto host, TestHost::Create(1));
//   ChildProcess::Start("/usr/sbin/ip", host->Exec(BinaryPath("tierkv-store"), {...}));
//   ASSERT_OK(host->Cut());   // every packet in and out of the namespace dropped
//   ASSERT_OK(host->Heal());
//
// Host i gets 10.77.<i>.2; this side of its link is 10.77.<i>.1. The
// destructor deletes the namespace (and with it the veth pair). Each host
// also has a hostname of its own (name()) for the processes Exec starts,
// as separate machines do.
//
// TestNetwork: several hosts on one bridge, like nodes behind a rack
// switch: every host reaches every other and the test's own namespace
// (the bridge's address, gateway()).
//
//   ASSERT_OK_AND_ASSIGN(auto net, TestNetwork::Create(3));
//   net->host(0).address();  // 10.78.<n>.10
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tierkv::testing {

class TestHost {
 public:
  // FAILED_PRECONDITION with the reason when namespaces cannot be made here.
  static absl::StatusOr<std::unique_ptr<TestHost>> Create(int index);
  ~TestHost();

  const std::string& name() const { return name_; }
  const std::string& address() const { return address_; }   // inside the namespace
  const std::string& gateway() const { return gateway_; }   // this side of the link

  // Arguments for /usr/sbin/ip that run `binary args...` inside the
  // namespace (ip execs it in place, so the pid is the binary's).
  std::vector<std::string> Exec(const std::string& binary, const std::vector<std::string>& args) const;

  absl::Status Cut();
  absl::Status Heal();

 private:
  friend class TestNetwork;
  TestHost() = default;
  std::string name_, veth_, address_, gateway_;
};

class TestNetwork {
 public:
  // FAILED_PRECONDITION with the reason when namespaces cannot be made here.
  static absl::StatusOr<std::unique_ptr<TestNetwork>> Create(int hosts);
  ~TestNetwork();

  TestHost& host(int i) { return *hosts_[i]; }
  int size() const { return static_cast<int>(hosts_.size()); }
  const std::string& gateway() const { return gateway_; }

 private:
  TestNetwork() = default;
  std::string bridge_, gateway_;
  std::vector<std::unique_ptr<TestHost>> hosts_;
};

// Runs a shell command; INTERNAL with its output when it fails.
absl::Status RunCommand(const std::string& command);

}  // namespace tierkv::testing
