#include "transport/types.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/log.h"

namespace tierkv::transport {

std::string Location::ToString() const {
  return absl::StrCat(kind == kCpu ? "cpu:" : "cuda:", index);
}

absl::StatusOr<Location> ParseLocation(absl::string_view text) {
  Location loc;
  absl::string_view rest;
  if (absl::ConsumePrefix(&text, "cpu:")) {
    loc.kind = Location::kCpu;
  } else if (absl::ConsumePrefix(&text, "cuda:")) {
    loc.kind = Location::kCuda;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("location '", text, "' is not cpu:<numa> or cuda:<device>"));
  }
  if (!absl::SimpleAtoi(text, &loc.index) || loc.index < 0 || loc.index > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("bad location index '", text, "'"));
  }
  return loc;
}

namespace {

bool IsWildcard(const std::string& listen) { return listen.empty() || listen == "0.0.0.0"; }

// The interface that carries the default IPv4 route, or "".
std::string DefaultRouteInterface() {
  std::ifstream f("/proc/net/route");
  std::string line;
  std::getline(f, line);  // header
  while (std::getline(f, line)) {
    std::istringstream fields(line);
    std::string iface, destination, gateway;
    if (fields >> iface >> destination >> gateway && destination == "00000000") return iface;
  }
  return "";
}

}  // namespace

absl::StatusOr<std::string> ChooseAdvertiseAddress(const std::string& listen,
                                                   const std::vector<InterfaceAddress>& interfaces,
                                                   const std::string& default_route_interface) {
  if (!IsWildcard(listen)) return listen;
  const InterfaceAddress* pick = nullptr;
  for (const InterfaceAddress& a : interfaces) {
    if (!a.up || a.loopback) continue;
    if (a.interface == default_route_interface) {
      pick = &a;
      break;
    }
    if (pick == nullptr) pick = &a;
  }
  if (pick == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "listening on the wildcard address ", listen.empty() ? "0.0.0.0" : listen,
        " but no interface other than loopback has an IPv4 address to advertise; set --host to the address peers dial"));
  }
  return pick->address;
}

absl::StatusOr<std::string> ResolveAdvertiseAddress(const std::string& listen) {
  if (!IsWildcard(listen)) return listen;
  std::vector<InterfaceAddress> interfaces;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      char text[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text);
      interfaces.push_back({i->ifa_name, text, (i->ifa_flags & IFF_LOOPBACK) != 0, (i->ifa_flags & IFF_UP) != 0});
    }
    freeifaddrs(list);
  }
  const std::string route = DefaultRouteInterface();
  absl::StatusOr<std::string> chosen = ChooseAdvertiseAddress(listen, interfaces, route);
  if (chosen.ok()) {
    std::string iface;
    for (const InterfaceAddress& a : interfaces) {
      if (a.address == *chosen) iface = a.interface;
    }
    TKV_LOG(INFO) << "listening on " << (listen.empty() ? "0.0.0.0" : listen) << "; advertising " << *chosen
                  << " (interface " << iface << (iface == route ? ", the default route's" : "")
                  << "); set --host to choose another";
  }
  return chosen;
}

}  // namespace tierkv::transport
