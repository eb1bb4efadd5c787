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
      if (run.error_occurred) {
        figures_[run.benchmark_name()]["error"] = 1;
        continue;
      }
      auto& f = figures_[run.benchmark_name()];
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

Figures RunRegistered(double min_time, bool quiet) {
  std::string min_time_flag = "--benchmark_min_time=" + std::to_string(min_time);
  const char* argv[] = {"tierkv-bench", min_time_flag.c_str(), nullptr};
  int argc = 2;
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

}  // namespace tierkv::bench
