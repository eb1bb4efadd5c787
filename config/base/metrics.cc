#include "config/base/metrics.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace tierkv::metrics {
namespace {

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  std::ostringstream out;
  out.precision(17);
  out << v;
  return out.str();
}

void AppendEscaped(std::string* out, const std::string& s, bool quote) {
  for (char c : s) {
    if (c == '\\') {
      *out += "\\\\";
    } else if (c == '\n') {
      *out += "\\n";
    } else if (quote && c == '"') {
      *out += "\\\"";
    } else {
      *out += c;
    }
  }
}

void AppendSample(std::string* out, const std::string& name, const Labels& labels,
                  const std::pair<std::string, std::string>* extra, double value) {
  *out += name;
  if (!labels.empty() || extra != nullptr) {
    *out += '{';
    bool first = true;
    auto add = [&](const std::string& k, const std::string& v) {
      if (!first) *out += ',';
      first = false;
      *out += k;
      *out += "=\"";
      AppendEscaped(out, v, true);
      *out += '"';
    };
    for (const auto& [k, v] : labels) add(k, v);
    if (extra != nullptr) add(extra->first, extra->second);
    *out += '}';
  }
  *out += ' ';
  *out += FormatValue(value);
  *out += '\n';
}

void AppendHeader(std::string* out, const std::string& name, const std::string& help,
                  const char* type) {
  *out += "# HELP " + name + ' ';
  AppendEscaped(out, help, false);
  *out += "\n# TYPE " + name + ' ' + type + '\n';
}

}  // namespace

Histogram::Histogram(BucketBoundaries bounds)
    : bounds_(std::move(bounds)), counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  std::sort(bounds_.begin(), bounds_.end());
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::BucketBoundaries Histogram::ExponentialBuckets(double start, double factor,
                                                          int count) {
  BucketBoundaries b;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

std::vector<uint64_t> Histogram::BucketCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  for (size_t i = 0; i < out.size(); ++i) out[i] = counts_[i].load(std::memory_order_relaxed);
  return out;
}

uint64_t Histogram::Count() const {
  uint64_t n = 0;
  for (uint64_t c : BucketCounts()) n += c;
  return n;
}

Family<Counter>& Registry::AddCounterFamily(const std::string& name, const std::string& help) {
  MutexLock lock(&mu_);
  families_.push_back({MetricType::kCounter, std::make_unique<Family<Counter>>(name, help),
                       nullptr, nullptr});
  return *families_.back().counter;
}

Family<Gauge>& Registry::AddGaugeFamily(const std::string& name, const std::string& help) {
  MutexLock lock(&mu_);
  families_.push_back(
      {MetricType::kGauge, nullptr, std::make_unique<Family<Gauge>>(name, help), nullptr});
  return *families_.back().gauge;
}

Family<Histogram>& Registry::AddHistogramFamily(const std::string& name,
                                                const std::string& help) {
  MutexLock lock(&mu_);
  families_.push_back({MetricType::kHistogram, nullptr, nullptr,
                       std::make_unique<Family<Histogram>>(name, help)});
  return *families_.back().histogram;
}

void Registry::AddCollectHook(std::function<void()> hook) {
  MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Serialize() {
  std::vector<std::function<void()>> hooks;
  {
    MutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (auto& hook : hooks) hook();

  std::string out;
  MutexLock lock(&mu_);
  for (Entry& e : families_) {
    switch (e.type) {
      case MetricType::kCounter:
        AppendHeader(&out, e.counter->name(), e.counter->help(), "counter");
        e.counter->ForEach([&](const Labels& l, Counter& c) {
          AppendSample(&out, e.counter->name(), l, nullptr, c.Value());
        });
        break;
      case MetricType::kGauge:
        AppendHeader(&out, e.gauge->name(), e.gauge->help(), "gauge");
        e.gauge->ForEach([&](const Labels& l, Gauge& g) {
          AppendSample(&out, e.gauge->name(), l, nullptr, g.Value());
        });
        break;
      case MetricType::kHistogram: {
        const std::string& name = e.histogram->name();
        AppendHeader(&out, name, e.histogram->help(), "histogram");
        e.histogram->ForEach([&](const Labels& l, Histogram& h) {
          std::vector<uint64_t> counts = h.BucketCounts();
          uint64_t cumulative = 0;
          for (size_t i = 0; i < counts.size(); ++i) {
            cumulative += counts[i];
            std::pair<std::string, std::string> le{
                "le", i < h.bounds().size() ? FormatValue(h.bounds()[i]) : "+Inf"};
            AppendSample(&out, name + "_bucket", l, &le, static_cast<double>(cumulative));
          }
          AppendSample(&out, name + "_sum", l, nullptr, h.Sum());
          AppendSample(&out, name + "_count", l, nullptr, static_cast<double>(cumulative));
        });
        break;
      }
    }
  }
  return out;
}

}  // namespace tierkv::metrics
