#include "config/base/metrics.h"

#include <prometheus/text_serializer.h>

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

std::string Registry::Serialize() {
  std::vector<std::function<void()>> hooks;
  {
    MutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (const auto& h : hooks) h();
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, core_->Collect());
  return out.str();
}

}  // namespace tierkv::metrics
