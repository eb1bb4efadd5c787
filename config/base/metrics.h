// A small metrics registry rendered in the Prometheus text format 0.0.4.
//
// Shaped like prometheus-cpp (which Debian does not package), so code reads
// the same and could switch to it:
//
//   Registry registry;
//   auto& rpcs = BuildCounter().Name("tierkv_rpc_total").Help("RPCs served")
//                    .Register(registry);
//   rpcs.Add({{"method", "PutStart"}}).Increment();
//   auto& latency = BuildHistogram().Name("tierkv_rpc_seconds").Help("...")
//                       .Register(registry);
//   latency.Add({{"method", "PutStart"}}, Histogram::ExponentialBuckets(1e-5, 2, 20))
//       .Observe(0.0003);
//   std::string body = registry.Serialize();
//
// Thread-safe: metrics update with atomics; Add/Remove and Serialize take
// the family's lock. A metric returned by Add lives until Remove or the
// registry's destruction. Collect hooks run at the start of Serialize, so an
// owner can refresh gauges that are cheaper to compute on demand.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/base/mutex.h"

namespace tierkv::metrics {

using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  void Decrement(double v = 1.0) { value_.fetch_sub(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  using BucketBoundaries = std::vector<double>;
  explicit Histogram(BucketBoundaries bounds);
  void Observe(double v);

  // `count` boundaries: start, start*factor, ...
  static BucketBoundaries ExponentialBuckets(double start, double factor, int count);

  const BucketBoundaries& bounds() const { return bounds_; }
  // Per-bucket (not cumulative) counts; the last is the +Inf bucket.
  std::vector<uint64_t> BucketCounts() const;
  double Sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t Count() const;

 private:
  BucketBoundaries bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

template <class T>
class Family {
 public:
  Family(std::string name, std::string help) : name_(std::move(name)), help_(std::move(help)) {}

  // Returns the metric with these labels, creating it on first use. Extra
  // arguments go to the metric's constructor (the bucket boundaries of a
  // histogram) and are ignored when it exists already.
  template <class... Args>
  T& Add(const Labels& labels, Args&&... args) {
    MutexLock lock(&mu_);
    auto& slot = metrics_[labels];
    if (!slot) slot = std::make_unique<T>(std::forward<Args>(args)...);
    return *slot;
  }
  // Drops the metric with these labels (a segment that left, say).
  void Remove(const Labels& labels) {
    MutexLock lock(&mu_);
    metrics_.erase(labels);
  }

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  // Calls fn(labels, metric) for each metric in label order, under the lock.
  template <class Fn>
  void ForEach(Fn fn) {
    MutexLock lock(&mu_);
    for (auto& [labels, metric] : metrics_) fn(labels, *metric);
  }

 private:
  const std::string name_;
  const std::string help_;
  Mutex mu_;
  std::map<Labels, std::unique_ptr<T>> metrics_ ABSL_GUARDED_BY(mu_);
};

class Registry {
 public:
  Family<Counter>& AddCounterFamily(const std::string& name, const std::string& help);
  Family<Gauge>& AddGaugeFamily(const std::string& name, const std::string& help);
  Family<Histogram>& AddHistogramFamily(const std::string& name, const std::string& help);

  // Runs before every Serialize; hooks must not call Serialize.
  void AddCollectHook(std::function<void()> hook);

  // The text exposition format 0.0.4 (Content-Type
  // "text/plain; version=0.0.4"), families in registration order.
  std::string Serialize();

 private:
  struct Entry {
    MetricType type;
    std::unique_ptr<Family<Counter>> counter;
    std::unique_ptr<Family<Gauge>> gauge;
    std::unique_ptr<Family<Histogram>> histogram;
  };
  Mutex mu_;
  std::vector<Entry> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// Builders in prometheus-cpp's style: BuildCounter().Name(..).Help(..).Register(r).
template <class T>
class Builder {
 public:
  Builder& Name(std::string name) {
    name_ = std::move(name);
    return *this;
  }
  Builder& Help(std::string help) {
    help_ = std::move(help);
    return *this;
  }
  Family<T>& Register(Registry& registry);

 private:
  std::string name_;
  std::string help_;
};

inline Builder<Counter> BuildCounter() { return {}; }
inline Builder<Gauge> BuildGauge() { return {}; }
inline Builder<Histogram> BuildHistogram() { return {}; }

template <>
inline Family<Counter>& Builder<Counter>::Register(Registry& r) {
  return r.AddCounterFamily(name_, help_);
}
template <>
inline Family<Gauge>& Builder<Gauge>::Register(Registry& r) {
  return r.AddGaugeFamily(name_, help_);
}
template <>
inline Family<Histogram>& Builder<Histogram>::Register(Registry& r) {
  return r.AddHistogramFamily(name_, help_);
}

}  // namespace tierkv::metrics
