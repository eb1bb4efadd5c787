// tierkv-bench: master | transfer | store | l1 | memory | ssd | pd. See config/bench_config.cc.
#include <cstdio>
#include <string>

#include "config/bench_config.h"
#include "base/log.h"
#include "tools/bench/subcommands.h"

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  tierkv::BenchConfig config = tierkv::BenchFlags().ParseOrExit(argc, argv, &positional);
  if (positional.size() != 1) {
    tierkv::ExitWithUsageError("tierkv-bench", "expected one subcommand: master, transfer, store, l1, memory, ssd or pd");
  }
  tierkv::SetLogLevel(tierkv::LogLevel::kWarning);
  const std::string& cmd = positional[0];
  if (config.batch == 0) config.batch = cmd == "master" ? 256 : cmd == "transfer" ? 32 : cmd == "l1" ? 256 : cmd == "ssd" ? 32 : 16;
  if (cmd == "master") return tierkv::bench::RunMaster(config);
  if (cmd == "transfer") return tierkv::bench::RunTransfer(config);
  if (cmd == "store") return tierkv::bench::RunStore(config);
  if (cmd == "l1") return tierkv::bench::RunL1(config);
  if (cmd == "memory") return tierkv::bench::RunMemory(config);
  if (cmd == "ssd") return tierkv::bench::RunSsd(config);
  if (cmd == "pd") return tierkv::bench::RunPd(config);
  tierkv::ExitWithUsageError("tierkv-bench", "unknown subcommand '" + cmd + "'");
}
