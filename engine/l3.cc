#include "engine/l3.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierkv::engine {

absl::StatusOr<size_t> InMemoryL3::PrefixMatch(const std::vector<std::string>& keys) {
  MutexLock lock(&mu_);
  if (down_) return absl::UnavailableError("store down");
  size_t n = 0;
  while (n < keys.size() && data_.contains(keys[n])) ++n;
  return n;
}

std::vector<absl::Status> InMemoryL3::Get(const std::vector<std::string>& keys,
                                          const std::vector<absl::Span<char>>& outs, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  absl::Duration took = absl::ZeroDuration();
  std::vector<absl::Status> st(keys.size());
  {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (down_) {
      st[i] = absl::UnavailableError("store down");
      continue;
    }
    if (latency_ > absl::ZeroDuration()) {
      if (took + latency_ > timeout) {
        st[i] = absl::DeadlineExceededError(absl::StrCat(keys[i], ": not read within ", absl::FormatDuration(timeout)));
        took = timeout;
        continue;
      }
      took += latency_;
    }
    auto it = data_.find(keys[i]);
    if (it == data_.end()) {
      st[i] = absl::NotFoundError(keys[i]);
    } else if (it->second.size() != outs[i].size()) {
      st[i] = absl::DataLossError(absl::StrCat(keys[i], ": size mismatch"));
    } else {
      std::memcpy(outs[i].data(), it->second.data(), it->second.size());
    }
  }
  }
  // The modelled transfer time passes outside the lock.
  absl::SleepFor(took - (absl::Now() - start));
  return st;
}

std::vector<absl::Status> InMemoryL3::Put(const std::vector<L3Put>& items) {
  MutexLock lock(&mu_);
  std::vector<absl::Status> st(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    if (down_) {
      st[i] = absl::UnavailableError("store down");
    } else if (data_.contains(items[i].key)) {
      st[i] = absl::AlreadyExistsError(items[i].key);
    } else if (data_.size() >= max_keys_) {
      st[i] = absl::ResourceExhaustedError("full");
    } else {
      data_[items[i].key] = std::string(items[i].value);
    }
  }
  return st;
}

void InMemoryL3::Drop(const std::string& key) {
  MutexLock lock(&mu_);
  data_.erase(key);
}

void InMemoryL3::SetLatency(absl::Duration per_key) {
  MutexLock lock(&mu_);
  latency_ = per_key;
}

void InMemoryL3::SetUnavailable(bool down) {
  MutexLock lock(&mu_);
  down_ = down;
}

size_t InMemoryL3::size() {
  MutexLock lock(&mu_);
  return data_.size();
}

absl::StatusOr<size_t> TierkvL3::PrefixMatch(const std::vector<std::string>& keys) {
  return client_->PrefixMatch(keys);
}

std::vector<absl::Status> TierkvL3::Get(const std::vector<std::string>& keys,
                                        const std::vector<absl::Span<char>>& outs, absl::Duration timeout) {
  std::vector<absl::StatusOr<size_t>> got = client_->BatchGet(keys, outs, timeout);
  std::vector<absl::Status> st(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!got[i].ok()) {
      st[i] = got[i].status();
    } else if (*got[i] != outs[i].size()) {
      st[i] = absl::DataLossError(absl::StrCat(keys[i], ": size mismatch"));
    }
  }
  return st;
}

std::vector<absl::Status> TierkvL3::Put(const std::vector<L3Put>& items) {
  std::vector<client::PutItem> puts;
  puts.reserve(items.size());
  for (const L3Put& it : items) {
    puts.push_back({it.key, it.value, it.group, parent_keys_ ? it.parent_key : ""});
  }
  return client_->BatchPut(puts);
}

}  // namespace tierkv::engine
