#include "base/metrics.h"

#include <prometheus/text_serializer.h>

#include <iterator>
#include <map>
#include <sstream>

namespace tierkv::metrics {

Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count) {
  Histogram::BucketBoundaries b;
  b.reserve(count > 0 ? count : 0);
  for (int i = 0; i < count; ++i, start *= factor) b.push_back(start);
  return b;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void Registry::AddCollectHook(std::function<void()> hook) {
  MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::vector<prometheus::MetricFamily> Registry::Collect() {
  std::vector<std::function<void()>> hooks;
  {
    MutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (const auto& h : hooks) h();
  return core_->Collect();
}

std::string Registry::Serialize() {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, Collect());
  return out.str();
}

std::string SerializeAll(const std::vector<Source>& sources) {
  std::vector<prometheus::MetricFamily> merged;
  std::map<std::string, size_t> at;  // family name -> index in merged
  for (const Source& src : sources) {
    for (prometheus::MetricFamily& f : src.registry->Collect()) {
      for (prometheus::ClientMetric& m : f.metric) {
        for (const auto& [k, v] : src.labels) m.label.push_back({k, v});
      }
      auto [it, fresh] = at.try_emplace(f.name, merged.size());
      if (fresh) {
        merged.push_back(std::move(f));
      } else {
        auto& into = merged[it->second].metric;
        into.insert(into.end(), std::make_move_iterator(f.metric.begin()), std::make_move_iterator(f.metric.end()));
      }
    }
  }
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, merged);
  return out.str();
}

}  // namespace tierkv::metrics
