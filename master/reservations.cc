#include "master/reservations.h"

#include <algorithm>
#include <limits>

#include "master/tenants.h"

namespace tierkv::master {

void Reservations::Expire(Held& h, int64_t now_ms) {
  // Leases are taken with about the same length, so expiries come in
  // order; one out of order only ends a little late.
  while (!h.by_expiry.empty() && h.by_expiry.front().first <= now_ms) {
    h.total -= h.by_expiry.front().second;
    h.by_expiry.pop_front();
  }
}

uint64_t Reservations::RoomIn(absl::flat_hash_map<std::string, Held>& held, const std::string& of, uint64_t cap,
                              int64_t now_ms) {
  if (cap == 0) return std::numeric_limits<uint64_t>::max();
  auto it = held.find(of);
  if (it == held.end()) return cap;
  Expire(it->second, now_ms);
  if (it->second.total == 0) {
    held.erase(it);
    return cap;
  }
  return cap > it->second.total ? cap - it->second.total : 0;
}

void Reservations::TakeIn(Held& h, uint64_t n, int64_t expiry_ms) {
  if (!h.by_expiry.empty() && h.by_expiry.back().first == expiry_ms) {
    h.by_expiry.back().second += n;
  } else {
    h.by_expiry.emplace_back(expiry_ms, n);
  }
  h.total += n;
}

void Reservations::GiveIn(absl::flat_hash_map<std::string, Held>& held, const std::string& of, uint64_t n,
                          int64_t now_ms) {
  auto it = held.find(of);
  if (it == held.end()) return;
  Held& h = it->second;
  Expire(h, now_ms);
  while (n > 0 && !h.by_expiry.empty()) {
    const uint64_t take = std::min(n, h.by_expiry.front().second);
    h.by_expiry.front().second -= take;
    h.total -= take;
    n -= take;
    if (h.by_expiry.front().second == 0) h.by_expiry.pop_front();
  }
  if (h.total == 0) held.erase(it);
}

uint64_t Reservations::Room(const std::string& client, int64_t now_ms) {
  if (cap_ == 0 && tenant_cap_ == 0) return std::numeric_limits<uint64_t>::max();
  MutexLock lock(&mu_);
  return std::min(RoomIn(clients_, client, cap_, now_ms),
                  RoomIn(tenants_, std::string(TenantOf(client)), tenant_cap_, now_ms));
}

void Reservations::Take(const std::string& client, uint64_t n, int64_t expiry_ms) {
  if (n == 0) return;
  MutexLock lock(&mu_);
  TakeIn(clients_[client], n, expiry_ms);
  TakeIn(tenants_[std::string(TenantOf(client))], n, expiry_ms);
}

void Reservations::Give(const std::string& client, uint64_t n, int64_t now_ms) {
  if (n == 0) return;
  MutexLock lock(&mu_);
  // A tenant's count gives back only what its client held: a give-back
  // from a client that held nothing (an expired lease) frees nothing.
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  Expire(it->second, now_ms);
  const uint64_t held = it->second.total;
  GiveIn(clients_, client, n, now_ms);
  GiveIn(tenants_, std::string(TenantOf(client)), std::min(n, held), now_ms);
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
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    Expire(it->second, now_ms);
    if (it->second.total == 0) {
      tenants_.erase(it++);
    } else {
      ++it;
    }
  }
  t.refused = refused_;
  t.shortfalls = shortfalls_;
  return t;
}

}  // namespace tierkv::master
