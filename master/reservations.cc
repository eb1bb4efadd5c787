#include "master/reservations.h"

#include <algorithm>
#include <limits>

namespace tierkv::master {

void Reservations::Expire(Held& h, int64_t now_ms) {
  // Leases are taken with about the same length, so expiries come in
  // order; one out of order only ends a little late.
  while (!h.by_expiry.empty() && h.by_expiry.front().first <= now_ms) {
    h.total -= h.by_expiry.front().second;
    h.by_expiry.pop_front();
  }
}

uint64_t Reservations::Room(const std::string& client, int64_t now_ms) {
  if (cap_ == 0) return std::numeric_limits<uint64_t>::max();
  MutexLock lock(&mu_);
  auto it = clients_.find(client);
  if (it == clients_.end()) return cap_;
  Expire(it->second, now_ms);
  if (it->second.total == 0) {
    clients_.erase(it);
    return cap_;
  }
  return cap_ > it->second.total ? cap_ - it->second.total : 0;
}

void Reservations::Take(const std::string& client, uint64_t n, int64_t expiry_ms) {
  if (n == 0) return;
  MutexLock lock(&mu_);
  Held& h = clients_[client];
  if (!h.by_expiry.empty() && h.by_expiry.back().first == expiry_ms) {
    h.by_expiry.back().second += n;
  } else {
    h.by_expiry.emplace_back(expiry_ms, n);
  }
  h.total += n;
}

void Reservations::Give(const std::string& client, uint64_t n, int64_t now_ms) {
  if (n == 0) return;
  MutexLock lock(&mu_);
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  Held& h = it->second;
  Expire(h, now_ms);
  while (n > 0 && !h.by_expiry.empty()) {
    const uint64_t take = std::min(n, h.by_expiry.front().second);
    h.by_expiry.front().second -= take;
    h.total -= take;
    n -= take;
    if (h.by_expiry.front().second == 0) h.by_expiry.pop_front();
  }
  if (h.total == 0) clients_.erase(it);
}

void Reservations::NoteRefused(uint64_t n) {
  MutexLock lock(&mu_);
  refused_ += n;
}

void Reservations::NoteShortfalls(uint64_t n) {
  MutexLock lock(&mu_);
  shortfalls_ += n;
}

Reservations::Totals Reservations::totals(int64_t now_ms) {
  MutexLock lock(&mu_);
  Totals t;
  for (auto it = clients_.begin(); it != clients_.end();) {
    Expire(it->second, now_ms);
    if (it->second.total == 0) {
      clients_.erase(it++);
      continue;
    }
    t.held += it->second.total;
    ++t.clients;
    ++it;
  }
  t.refused = refused_;
  t.shortfalls = shortfalls_;
  return t;
}

}  // namespace tierkv::master
