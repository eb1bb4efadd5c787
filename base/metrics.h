// Metrics: prometheus-cpp's core (families, counters, gauges, histograms
// and its text serializer), plus what tierkv adds around it: collect hooks
// and a registry that renders itself for our HttpServer's /metrics.
//
//   Registry registry;
//   auto& rpcs = BuildCounter().Name("tierkv_rpc_total").Help("RPCs served")
//                    .Register(registry);
//   rpcs.Add({{"method", "PutStart"}}).Increment();
//   auto& latency = BuildHistogram().Name("tierkv_rpc_seconds").Help("...")
//                       .Register(registry);
//   latency.Add({{"method", "PutStart"}}, ExponentialBuckets(1e-5, 2, 20))
//       .Observe(0.0003);
//   std::string body = registry.Serialize();  // text format 0.0.4
//
// Thread-safe (prometheus-cpp's guarantees): metrics update with atomics;
// Add, Remove and Serialize take the family's lock. A metric returned by
// Add lives until it is removed or the registry is destroyed. Collect hooks
// run at the start of Serialize, so an owner can refresh gauges that are
// cheaper to compute on demand. Label names must be valid Prometheus names
// (prometheus-cpp throws otherwise: ours are fixed in the code).
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/labels.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/mutex.h"

namespace tierkv::metrics {

using Labels = prometheus::Labels;
using Counter = prometheus::Counter;
using Gauge = prometheus::Gauge;
using Histogram = prometheus::Histogram;
template <class T>
using Family = prometheus::Family<T>;

// `count` bucket boundaries: start, start*factor, ...
Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count);

// HELP text with backslashes and newlines escaped (\\, \n).
std::string EscapeHelp(const std::string& help);

// Drops the metric with these labels from `family`, if it has one (a
// segment that left, say).
template <class T>
void RemoveLabels(Family<T>& family, const Labels& labels) {
  if (family.Has(labels)) family.Remove(&family.Add(labels));
}

class Registry {
 public:
  // The prometheus-cpp registry, for code that registers with it directly.
  prometheus::Registry& core() { return *core_; }

  // Runs before every Serialize; hooks must not call Serialize.
  void AddCollectHook(std::function<void()> hook);

  // The text exposition format 0.0.4 (Content-Type
  // "text/plain; version=0.0.4"), by prometheus-cpp's TextSerializer.
  std::string Serialize();
  // Runs the hooks, then collects every family.
  std::vector<prometheus::MetricFamily> Collect();

 private:
  std::shared_ptr<prometheus::Registry> core_ = std::make_shared<prometheus::Registry>();
  Mutex mu_;
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// One exposition over several registries (the engines of one process, an
// embedded master): families of one name are merged, and every metric of a
// source also carries that source's labels, so two engines' series stay
// apart (a name exported twice would be invalid text).
struct Source {
  Registry* registry;
  Labels labels;  // e.g. {{"engine", "a"}}; may be empty
};
std::string SerializeAll(const std::vector<Source>& sources);

// prometheus-cpp's builders, registering with our Registry:
// BuildCounter().Name(..).Help(..).Register(r).
template <class T>
class Builder {
 public:
  Builder& Name(const std::string& name) {
    build_.Name(name);
    return *this;
  }
  // prometheus-cpp writes HELP text as given: escaped here, so a backslash
  // or newline in it cannot break the exposition format.
  Builder& Help(const std::string& help) {
    build_.Help(EscapeHelp(help));
    return *this;
  }
  Family<T>& Register(Registry& registry) { return build_.Register(registry.core()); }

 private:
  prometheus::detail::Builder<T> build_;
};

inline Builder<Counter> BuildCounter() { return {}; }
inline Builder<Gauge> BuildGauge() { return {}; }
inline Builder<Histogram> BuildHistogram() { return {}; }

}  // namespace tierkv::metrics
