// A thin layer over Google Benchmark for tierkv-bench: cases are
// registered with benchmark::RegisterBenchmark, run once, and their
// counters collected so a subcommand can print a table or one JSON object
// and compute ratios against the physical reference measured in the same
// run.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "benchmark/benchmark.h"

namespace tierkv::bench {

// name -> counter name -> value ("items_per_second", "p50_us", ...).
using Figures = std::map<std::string, std::map<std::string, double>>;

// Runs every registered case for at least `min_time` seconds each and
// returns their counters. Prints Google Benchmark's table unless `quiet`.
// With repetitions > 1 the cases run interleaved in random order and the
// medians are returned, so a ratio between two cases is not skewed by a
// burst of noise on this shared machine landing on one of them.
Figures RunRegistered(double min_time, bool quiet, int repetitions = 1);

// The largest `counter` among the cases whose names start with `prefix`
// (a case's name gains suffixes such as "/real_time"); 0 when none has it.
double Best(const Figures& f, const std::string& prefix, const std::string& counter);

// Records per-operation latencies on one benchmark thread and publishes
// p50/p99 (microseconds) as thread-averaged counters.
class LatencyRecorder {
 public:
  void Add(absl::Duration d) { micros_.push_back(absl::ToDoubleMicroseconds(d)); }
  void Publish(benchmark::State& state);

 private:
  std::vector<double> micros_;
};

}  // namespace tierkv::bench
