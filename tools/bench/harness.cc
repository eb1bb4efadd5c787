#include "tools/bench/harness.h"

#include <algorithm>

namespace tierkv::bench {
namespace {

// Collects counters; prints through Google Benchmark's console reporter
// unless quiet.
class Collector : public benchmark::ConsoleReporter {
 public:
  explicit Collector(bool quiet) : quiet_(quiet) {}
  bool ReportContext(const Context& context) override {
    return quiet_ ? true : ConsoleReporter::ReportContext(context);
  }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name != "median") continue;
      if (run.error_occurred) {
        figures_[run.benchmark_name()]["error"] = 1;
        continue;
      }
      std::string name = run.benchmark_name();
      // "x/real_time_median" and "x/real_time" report the same case.
      if (size_t at = name.rfind("_median"); at != std::string::npos) name.erase(at);
      // With repetitions, the median (reported after the runs) wins.
      auto& f = figures_[name];
      f["real_time_ns"] = run.GetAdjustedRealTime();
      for (const auto& [name, counter] : run.counters) f[name] = counter.value;
    }
    if (!quiet_) ConsoleReporter::ReportRuns(runs);
  }
  Figures figures_;

 private:
  bool quiet_;
};

}  // namespace

Figures RunRegistered(double min_time, bool quiet, int repetitions) {
  std::string min_time_flag = "--benchmark_min_time=" + std::to_string(min_time);
  std::string reps_flag = "--benchmark_repetitions=" + std::to_string(repetitions);
  const char* argv[] = {"tierkv-bench", min_time_flag.c_str(), reps_flag.c_str(),
                        "--benchmark_enable_random_interleaving=true", nullptr};
  int argc = repetitions > 1 ? 4 : 2;
  benchmark::Initialize(&argc, const_cast<char**>(argv));
  Collector collector(quiet);
  benchmark::RunSpecifiedBenchmarks(&collector);
  benchmark::ClearRegisteredBenchmarks();
  return collector.figures_;
}

void LatencyRecorder::Publish(benchmark::State& state) {
  if (micros_.empty()) return;
  std::sort(micros_.begin(), micros_.end());
  auto at = [&](double q) { return micros_[static_cast<size_t>(q * (micros_.size() - 1))]; };
  state.counters["p50_us"] = benchmark::Counter(at(0.50), benchmark::Counter::kAvgThreads);
  state.counters["p99_us"] = benchmark::Counter(at(0.99), benchmark::Counter::kAvgThreads);
}

double Best(const Figures& f, const std::string& prefix, const std::string& counter) {
  double best = 0;
  for (const auto& [name, c] : f) {
    if (name.rfind(prefix, 0) == 0 && c.contains(counter)) best = std::max(best, c.at(counter));
  }
  return best;
}

}  // namespace tierkv::bench
