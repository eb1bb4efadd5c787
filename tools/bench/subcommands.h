// tierkv-bench's subcommands; each returns the process exit status.
#pragma once

#include "config/bench_config.h"

namespace tierkv::bench {

int RunMaster(const BenchConfig& config);
// tierkv-bench master --ha (bench_ha.cc).
int RunHa(const BenchConfig& config);
int RunTransfer(const BenchConfig& config);
int RunStore(const BenchConfig& config);
int RunL1(const BenchConfig& config);
int RunMemory(const BenchConfig& config);
int RunSsd(const BenchConfig& config);
int RunPd(const BenchConfig& config);

}  // namespace tierkv::bench
