#include "transport/host_memory.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "config/units.h"

namespace tierkv::transport {
namespace {

using Inode = std::pair<dev_t, ino_t>;

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::optional<uint64_t> ReadNumber(const std::string& path) {
  std::optional<std::string> text = ReadFile(path);
  uint64_t v = 0;
  if (!text || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v)) return std::nullopt;
  return v;
}

// "name value" lines (cgroup memory.stat).
uint64_t StatField(const std::string& text, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, ' ');
    uint64_t v = 0;
    if (kv.first == name && absl::SimpleAtoi(kv.second, &v)) return v;
  }
  return 0;
}

void AddPromises(pid_t pid, std::set<Inode>* seen, uint64_t* total) {
  std::string dir = absl::StrCat("/proc/", pid, "/fd");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;  // gone, or not ours to read
  const std::string want = absl::StrCat("/memfd:", kSegmentMemfdName, " (deleted)");
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::string link = absl::StrCat(dir, "/", e->d_name);
    char target[128];
    ssize_t n = readlink(link.c_str(), target, sizeof target - 1);
    if (n <= 0 || static_cast<size_t>(n) != want.size() || std::memcmp(target, want.data(), n) != 0) continue;
    struct stat st;
    if (stat(link.c_str(), &st) != 0 || !seen->insert({st.st_dev, st.st_ino}).second) continue;
    uint64_t backed = static_cast<uint64_t>(st.st_blocks) * 512;
    uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size > backed) *total += size - backed;
  }
  closedir(d);
}

uint64_t PromisedOnHost() {
  std::set<Inode> seen;
  uint64_t total = 0;
  DIR* d = opendir("/proc");
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) {
    int pid = 0;
    if (absl::SimpleAtoi(e->d_name, &pid) && pid > 0) AddPromises(pid, &seen, &total);
  }
  closedir(d);
  return total;
}

// Room under one cgroup directory's limit: the limit less what is charged
// that reclaim cannot give back (file cache can be reclaimed; tmpfs
// pages sit on the anon lists and cannot).
std::optional<uint64_t> RoomUnder(const std::string& dir, bool v2) {
  std::optional<std::string> limit_text = ReadFile(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
  uint64_t limit = 0;
  if (!limit_text || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*limit_text), &limit)) return std::nullopt;
  if (limit >= (1ull << 60)) return std::nullopt;  // v1 spells "unlimited" as a huge number
  uint64_t usage = ReadNumber(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes")).value_or(0);
  std::string stat = ReadFile(dir + "/memory.stat").value_or("");
  uint64_t file = v2 ? StatField(stat, "active_file") + StatField(stat, "inactive_file")
                     : StatField(stat, "total_active_file") + StatField(stat, "total_inactive_file");
  uint64_t pinned = usage > file ? usage - file : 0;
  return limit > pinned ? limit - pinned : 0;
}

// The tightest limit over this process's memory cgroup and its ancestors.
void ReadCgroupRoom(HostMemory* out) {
  std::string self = ReadFile("/proc/self/cgroup").value_or("");
  for (absl::string_view line : absl::StrSplit(self, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    bool v2 = f[0] == "0" && f[1].empty();
    bool v1 = false;
    for (absl::string_view c : absl::StrSplit(f[1], ',')) v1 |= c == "memory";
    if (!v1 && !v2) continue;
    std::string base = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    std::string dir = base + std::string(f[2]);
    // Inside a container the hierarchy is often mounted at its own root.
    if (access(dir.c_str(), F_OK) != 0) dir = base;
    while (true) {
      std::string file = dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes");
      if (std::optional<uint64_t> room = RoomUnder(dir, v2);
          room && (!out->cgroup_room || *room < *out->cgroup_room)) {
        out->cgroup_room = room;
        out->cgroup_limit_file = file;
      }
      if (dir.size() <= base.size()) break;
      dir = dir.substr(0, dir.rfind('/'));
      if (dir.size() < base.size()) dir = base;
    }
  }
}

}  // namespace

std::map<std::string, uint64_t> ParseMeminfo(absl::string_view text) {
  std::map<std::string, uint64_t> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, absl::MaxSplits(':', 1));
    std::vector<absl::string_view> value = absl::StrSplit(kv.second, ' ', absl::SkipEmpty());
    uint64_t v = 0;
    if (value.empty() || !absl::SimpleAtoi(value[0], &v)) continue;
    out[std::string(kv.first)] = value.size() > 1 && value[1] == "kB" ? v * 1024 : v;
  }
  return out;
}

uint64_t PromisedBytesOfProcess(pid_t pid) {
  std::set<Inode> seen;
  uint64_t total = 0;
  AddPromises(pid, &seen, &total);
  return total;
}

absl::StatusOr<HostMemory> HostMemory::Read() {
  std::optional<std::string> meminfo = ReadFile("/proc/meminfo");
  if (!meminfo) return absl::UnavailableError("cannot read /proc/meminfo");
  std::map<std::string, uint64_t> m = ParseMeminfo(*meminfo);
  if (!m.contains("MemAvailable")) return absl::UnavailableError("/proc/meminfo has no MemAvailable");
  HostMemory h;
  h.mem_available = m["MemAvailable"];
  h.overcommit_mode = static_cast<int>(ReadNumber("/proc/sys/vm/overcommit_memory").value_or(0));
  if (m["CommitLimit"] > m["Committed_AS"]) h.commit_room = m["CommitLimit"] - m["Committed_AS"];
  ReadCgroupRoom(&h);
  h.promised = PromisedOnHost();
  return h;
}

absl::Status HostMemory::CheckFits(uint64_t size) const {
  auto less_promised = [&](uint64_t room) { return room > promised ? room - promised : 0; };
  uint64_t room = less_promised(mem_available);
  std::string why = absl::StrCat("MemAvailable ", FormatSize(mem_available));
  if (cgroup_room && less_promised(*cgroup_room) < room) {
    room = less_promised(*cgroup_room);
    why = absl::StrCat(FormatSize(*cgroup_room), " left under the cgroup limit in ", cgroup_limit_file);
  }
  if (overcommit_mode == 2 && less_promised(commit_room) < room) {
    room = less_promised(commit_room);
    why = absl::StrCat("CommitLimit - Committed_AS ", FormatSize(commit_room), " (vm.overcommit_memory=2)");
  }
  if (size <= room) return absl::OkStatus();
  if (promised > 0) absl::StrAppend(&why, ", less ", FormatSize(promised), " promised to other tierkv segments");
  return absl::ResourceExhaustedError(absl::StrCat("a segment of ", FormatSize(size),
                                                   " cannot be backed by RAM here: ", FormatSize(room),
                                                   " can be had (", why, ")"));
}

}  // namespace tierkv::transport
