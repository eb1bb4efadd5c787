#include "transport/numa.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status.h"

namespace tierkv::transport {
namespace {

constexpr int kMpolBind = 2;           // MPOL_BIND in <linux/mempolicy.h>
constexpr int kMaxNodes = 1024;        // bits in the node masks we pass

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text) {
  std::vector<int> out;
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> range = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0, hi = 0;
    bool ok = absl::SimpleAtoi(range.first, &lo) && lo >= 0;
    hi = lo;
    if (ok && !range.second.empty()) ok = absl::SimpleAtoi(range.second, &hi) && hi >= lo;
    if (ok && part.find('-') != absl::string_view::npos && range.second.empty()) ok = false;
    if (!ok || hi >= (1 << 20)) {
      return absl::InvalidArgumentError(absl::StrCat("bad cpu list '", text, "' at '", part, "'"));
    }
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

absl::StatusOr<NumaTopology> NumaTopology::Load(const std::string& root) {
  NumaTopology t;
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) {
    std::vector<int> all;
    for (int c = 0; c < static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)); ++c) all.push_back(c);
    t.cpus_[0] = std::move(all);
    return t;
  }
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    std::string name = entry.path().filename().string();
    int node = 0;
    if (name.rfind("node", 0) != 0 || !absl::SimpleAtoi(name.substr(4), &node)) continue;
    ASSIGN_OR_RETURN(std::string list, ReadFile(entry.path().string() + "/cpulist"));
    absl::StatusOr<std::vector<int>> cpus = ParseCpuList(list);
    if (!cpus.ok()) return Annotate(cpus.status(), entry.path().string());
    t.cpus_[node] = std::move(*cpus);
  }
  if (ec) return ErrnoToStatus(ec.value(), absl::StrCat("listing ", root));
  if (t.cpus_.empty()) return absl::FailedPreconditionError(absl::StrCat("no NUMA node under ", root));
  return t;
}

absl::Status NumaTopology::Check(int node) const {
  if (cpus_.contains(node)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("no such NUMA node ", node, " on this host (nodes: ", NodeList(), ")"));
}

const std::vector<int>& NumaTopology::cpus(int node) const {
  static const std::vector<int> kNone;
  auto it = cpus_.find(node);
  return it == cpus_.end() ? kNone : it->second;
}

std::vector<int> NumaTopology::nodes() const {
  std::vector<int> out;
  for (const auto& [node, cpus] : cpus_) out.push_back(node);
  return out;
}

std::string NumaTopology::NodeList() const { return absl::StrJoin(nodes(), ", "); }

absl::Status BindMemory(void* addr, uint64_t len, int node) {
  if (node < 0 || node >= kMaxNodes) return absl::InvalidArgumentError(absl::StrCat("NUMA node ", node));
  unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
  // maxnode counts one past the highest bit the kernel should read.
  if (syscall(SYS_mbind, addr, len, kMpolBind, mask, kMaxNodes + 1, 0) == 0) return absl::OkStatus();
  int err = errno;
  if (err == ENOSYS && node == 0) return absl::OkStatus();  // no NUMA: all memory is node 0
  return ErrnoToStatus(err, absl::StrCat("binding memory to NUMA node ", node, " (mbind)"));
}

std::optional<int> NodeOfMemory(const void* addr, uint64_t len, int samples) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t pages = std::max<uint64_t>(1, len / page);
  samples = static_cast<int>(std::min<uint64_t>(pages, std::max(samples, 1)));
  std::vector<void*> at(samples);
  std::vector<int> status(samples, -1);
  uintptr_t base = reinterpret_cast<uintptr_t>(addr) & ~(page - 1);
  for (int i = 0; i < samples; ++i) {
    at[i] = reinterpret_cast<void*>(base + (pages * i / samples) * page);
  }
  // move_pages with no target nodes only reports where each page is.
  if (syscall(SYS_move_pages, 0, samples, at.data(), nullptr, status.data(), 0) != 0) {
    return errno == ENOSYS ? std::optional<int>(0) : std::nullopt;
  }
  std::map<int, int> votes;
  for (int s : status) {
    if (s >= 0) ++votes[s];
  }
  if (votes.empty()) return std::nullopt;
  return std::max_element(votes.begin(), votes.end(),
                          [](const auto& a, const auto& b) { return a.second < b.second; })
      ->first;
}

int CurrentNode() {
  unsigned cpu = 0, node = 0;
  if (syscall(SYS_getcpu, &cpu, &node, nullptr) != 0) return 0;
  return static_cast<int>(node);
}

absl::StatusOr<std::vector<int>> PinThisThread(const std::vector<int>& cpus) {
  if (cpus.empty()) return absl::InvalidArgumentError("pinning to an empty set of CPUs");
  cpu_set_t old_set, new_set;
  CPU_ZERO(&old_set);
  CPU_ZERO(&new_set);
  if (sched_getaffinity(0, sizeof old_set, &old_set) != 0) return ErrnoToStatus(errno, "sched_getaffinity");
  for (int c : cpus) {
    if (c < CPU_SETSIZE) CPU_SET(c, &new_set);
  }
  if (sched_setaffinity(0, sizeof new_set, &new_set) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("pinning threads to CPUs ", absl::StrJoin(cpus, ",")));
  }
  std::vector<int> previous;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &old_set)) previous.push_back(c);
  }
  return previous;
}

}  // namespace tierkv::transport
