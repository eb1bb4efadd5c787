#include "tests/support/netns.h"

#include <unistd.h>

#include <array>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace tierkv::testing {

absl::Status RunCommand(const std::string& command) {
  std::string full = command + " 2>&1";
  FILE* p = ::popen(full.c_str(), "r");
  if (p == nullptr) return absl::InternalError(absl::StrCat("cannot run: ", command));
  std::string out;
  std::array<char, 512> buf;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) out.append(buf.data(), n);
  int rc = ::pclose(p);
  if (rc != 0) return absl::InternalError(absl::StrCat(command, " failed (", rc, "): ", out));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TestHost>> TestHost::Create(int index) {
  if (::geteuid() != 0) return absl::FailedPreconditionError("network namespaces need root");
  for (const char* tool : {"/usr/sbin/ip", "/usr/sbin/nft"}) {
    if (::access(tool, X_OK) != 0) return absl::FailedPreconditionError(absl::StrCat(tool, " is not installed"));
  }
  std::unique_ptr<TestHost> h(new TestHost());
  // Unique per process, so parallel tests never collide.
  h->name_ = absl::StrCat("tkv", ::getpid() % 100000, "h", index);
  h->veth_ = absl::StrCat("tkv", ::getpid() % 100000, "v", index);
  int subnet = (::getpid() + index) % 250 + 1;
  h->address_ = absl::StrCat("10.77.", subnet, ".2");
  h->gateway_ = absl::StrCat("10.77.", subnet, ".1");
  const std::string& ns = h->name_;
  const std::string& v = h->veth_;
  absl::Status s = RunCommand(absl::StrCat("ip netns add ", ns));
  if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("cannot create a network namespace: ", s.message()));
  for (const std::string& cmd : {
           absl::StrCat("ip link add ", v, "a type veth peer name ", v, "b"),
           absl::StrCat("ip link set ", v, "b netns ", ns),
           absl::StrCat("ip addr add ", h->gateway_, "/24 dev ", v, "a"),
           absl::StrCat("ip link set ", v, "a up"),
           absl::StrCat("ip netns exec ", ns, " ip addr add ", h->address_, "/24 dev ", v, "b"),
           absl::StrCat("ip netns exec ", ns, " ip link set ", v, "b up"),
           absl::StrCat("ip netns exec ", ns, " ip link set lo up"),
       }) {
    if (s = RunCommand(cmd); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot set up the test host: ", s.message()));
    }
  }
  return h;
}

TestHost::~TestHost() {
  (void)RunCommand(absl::StrCat("ip netns del ", name_));
  (void)RunCommand(absl::StrCat("ip link del ", veth_, "a"));
}

std::vector<std::string> TestHost::Exec(const std::string& binary, const std::vector<std::string>& args) const {
  // ip execs unshare, which execs sh, which sets the hostname and execs the
  // binary: the pid stays the binary's, and its hostname is the host's.
  std::vector<std::string> out{"netns", "exec", name_, "/usr/bin/unshare", "--uts", "/bin/sh", "-c",
                               "hostname \"$0\" && exec \"$@\"", name_, binary};
  out.insert(out.end(), args.begin(), args.end());
  return out;
}

absl::StatusOr<std::unique_ptr<TestNetwork>> TestNetwork::Create(int hosts) {
  if (::geteuid() != 0) return absl::FailedPreconditionError("network namespaces need root");
  for (const char* tool : {"/usr/sbin/ip", "/usr/sbin/nft", "/usr/bin/unshare"}) {
    if (::access(tool, X_OK) != 0) return absl::FailedPreconditionError(absl::StrCat(tool, " is not installed"));
  }
  std::unique_ptr<TestNetwork> n(new TestNetwork());
  const int id = ::getpid() % 100000;
  const std::string subnet = absl::StrCat("10.78.", ::getpid() % 250 + 1, ".");
  n->bridge_ = absl::StrCat("tkv", id, "br");
  n->gateway_ = subnet + "1";
  absl::Status s = RunCommand(absl::StrCat("ip link add ", n->bridge_, " type bridge"));
  if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("cannot create a bridge: ", s.message()));
  for (const std::string& cmd : {absl::StrCat("ip addr add ", n->gateway_, "/24 dev ", n->bridge_),
                                 absl::StrCat("ip link set ", n->bridge_, " up")}) {
    if (s = RunCommand(cmd); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot set up the bridge: ", s.message()));
    }
  }
  for (int i = 0; i < hosts; ++i) {
    std::unique_ptr<TestHost> h(new TestHost());
    h->name_ = absl::StrCat("tkv", id, "n", i);
    h->veth_ = absl::StrCat("tkv", id, "w", i);
    h->address_ = absl::StrCat(subnet, 10 + i);
    h->gateway_ = n->gateway_;
    const std::string& ns = h->name_;
    const std::string& v = h->veth_;
    s = RunCommand(absl::StrCat("ip netns add ", ns));
    if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("cannot create a network namespace: ", s.message()));
    n->hosts_.push_back(std::move(h));  // from here the destructor cleans it up
    for (const std::string& cmd : {
             absl::StrCat("ip link add ", v, "a type veth peer name ", v, "b"),
             absl::StrCat("ip link set ", v, "a master ", n->bridge_),
             absl::StrCat("ip link set ", v, "a up"),
             absl::StrCat("ip link set ", v, "b netns ", ns),
             absl::StrCat("ip netns exec ", ns, " ip addr add ", n->hosts_.back()->address_, "/24 dev ", v, "b"),
             absl::StrCat("ip netns exec ", ns, " ip link set ", v, "b up"),
             absl::StrCat("ip netns exec ", ns, " ip link set lo up"),
         }) {
      if (s = RunCommand(cmd); !s.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("cannot set up test host ", i, ": ", s.message()));
      }
    }
  }
  return n;
}

TestNetwork::~TestNetwork() {
  hosts_.clear();  // each deletes its namespace and veth pair
  (void)RunCommand(absl::StrCat("ip link del ", bridge_));
}

absl::Status TestHost::Cut() {
  return RunCommand(absl::StrCat(
      "ip netns exec ", name_,
      " nft 'add table inet tierkv_cut; "
      "add chain inet tierkv_cut cut_input { type filter hook input priority 0; policy drop; }; "
      "add chain inet tierkv_cut cut_output { type filter hook output priority 0; policy drop; }'"));
}

absl::Status TestHost::Heal() {
  return RunCommand(absl::StrCat("ip netns exec ", name_, " nft delete table inet tierkv_cut"));
}

}  // namespace tierkv::testing
