#include "master/tenants.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierkv::master {

std::string TenantKey(absl::string_view tenant, absl::string_view key) {
  if (key.find(kTenantSeparator) != absl::string_view::npos) return std::string();
  if (tenant.empty()) return std::string(key);
  std::string out;
  out.reserve(tenant.size() + 1 + key.size());
  out.append(tenant.data(), tenant.size());
  out.push_back(kTenantSeparator);
  out.append(key.data(), key.size());
  return out;
}

std::string ClientKey(absl::string_view tenant, absl::string_view client_id) {
  std::string id(client_id);
  std::replace(id.begin(), id.end(), kTenantSeparator, '?');
  return TenantKey(tenant, id);
}

absl::string_view TenantOf(absl::string_view index_key) {
  const void* sep = std::memchr(index_key.data(), kTenantSeparator, index_key.size());
  if (sep == nullptr) return {};
  return index_key.substr(0, static_cast<const char*>(sep) - index_key.data());
}

absl::string_view UserKey(absl::string_view index_key) {
  const void* sep = std::memchr(index_key.data(), kTenantSeparator, index_key.size());
  if (sep == nullptr) return index_key;
  return index_key.substr(static_cast<const char*>(sep) - index_key.data() + 1);
}

TenantTable::Entry& TenantTable::Find(absl::string_view tenant) const {
  if (tenant.empty()) return *default_;
  MutexLock lock(&mu_);
  return tenants_[tenant];
}

absl::Status TenantTable::TryCharge(absl::string_view tenant, uint64_t bytes) {
  Entry& e = Find(tenant);
  uint64_t used = e.used.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t quota = e.quota.load(std::memory_order_relaxed);
    if (quota != 0 && used + bytes > quota) {
      return absl::ResourceExhaustedError(absl::StrCat("tenant ", TenantName(tenant), " is over its quota of ", quota,
                                                       " bytes: it holds ", used, " and this put needs ", bytes));
    }
    if (e.used.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed)) return absl::OkStatus();
  }
}

void TenantTable::Charge(absl::string_view tenant, uint64_t bytes) {
  if (bytes != 0) Find(tenant).used.fetch_add(bytes, std::memory_order_relaxed);
}

void TenantTable::Release(absl::string_view tenant, uint64_t bytes) {
  if (bytes == 0) return;
  std::atomic<uint64_t>& used = Find(tenant).used;
  uint64_t cur = used.load(std::memory_order_relaxed);
  while (!used.compare_exchange_weak(cur, cur - std::min(cur, bytes), std::memory_order_relaxed)) {
  }
}

uint64_t TenantTable::Excess(absl::string_view tenant, uint64_t bytes) const {
  const Entry& e = Find(tenant);
  const uint64_t quota = e.quota.load(std::memory_order_relaxed);
  const uint64_t want = e.used.load(std::memory_order_relaxed) + bytes;
  return quota != 0 && want > quota ? want - quota : 0;
}

bool TenantTable::Protected(absl::string_view tenant, uint64_t bytes) const {
  if (guarantees_.load(std::memory_order_relaxed) == 0) return false;
  const Entry& e = Find(tenant);
  const uint64_t guaranteed = e.guaranteed.load(std::memory_order_relaxed);
  const uint64_t used = e.used.load(std::memory_order_relaxed);
  return guaranteed != 0 && used - std::min(used, bytes) < guaranteed;
}

void TenantTable::NoteRejected(absl::string_view tenant) {
  Find(tenant).rejected.fetch_add(1, std::memory_order_relaxed);
}

void TenantTable::NoteEvictedForQuota(absl::string_view tenant, uint64_t bytes) {
  Find(tenant).evicted.fetch_add(bytes, std::memory_order_relaxed);
}

void TenantTable::SetLimits(absl::string_view tenant, TenantLimits limits) {
  Entry& e = Find(tenant);
  MutexLock lock(&mu_);  // serializes the guarantee count's update
  const int before = e.guaranteed.load() != 0 ? 1 : 0;
  const int after = limits.guaranteed_bytes != 0 ? 1 : 0;
  e.quota.store(limits.quota_bytes);
  e.guaranteed.store(limits.guaranteed_bytes);
  guarantees_.fetch_add(after - before, std::memory_order_relaxed);
}

TenantLimits TenantTable::Limits(absl::string_view tenant) const {
  const Entry& e = Find(tenant);
  return {e.quota.load(std::memory_order_relaxed), e.guaranteed.load(std::memory_order_relaxed)};
}

uint64_t TenantTable::UsedBy(absl::string_view tenant) const {
  return Find(tenant).used.load(std::memory_order_relaxed);
}

std::vector<TenantUsage> TenantTable::Snapshot() const {
  std::vector<TenantUsage> out;
  {
    MutexLock lock(&mu_);
    for (const auto& [name, e] : tenants_) {
      TenantUsage u{name,
                    {e.quota.load(), e.guaranteed.load()},
                    e.used.load(),
                    e.rejected.load(),
                    e.evicted.load()};
      if (u.used_bytes == 0 && u.limits.quota_bytes == 0 && u.limits.guaranteed_bytes == 0 && u.puts_rejected == 0 &&
          u.evicted_for_quota == 0) {
        continue;
      }
      out.push_back(std::move(u));
    }
  }
  std::sort(out.begin(), out.end(), [](const TenantUsage& a, const TenantUsage& b) { return a.tenant < b.tenant; });
  return out;
}

}  // namespace tierkv::master
