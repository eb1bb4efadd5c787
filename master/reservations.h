// Reservations: the counted read leases clients take for read sessions
// (KeysRequest.counted), per client, so one client cannot pin the
// cluster's memory with them, and the reads that found less than a
// reservation promised, as clients report them.
//
// A reservation ends when its reader gives it back or when its lease
// expires. Give-backs name no reservation, only a client and a count (a
// client's counted reads under memory pressure give back through the same
// path), so the count per client is a bound on a runaway reader, not an
// exact quota: it errs low, and concurrent requests of one client may
// overshoot the cap by a batch. Clients are named by TenantKey(tenant, id)
// and a tenant's clients together are held to a cap of their own, since
// an id is the client's to choose: rotating ids escapes only the
// per-client cap.
//
//   Reservations r(65536);
//   uint64_t room = r.Room(client, now_ms);      // before a counted lookup
//   r.Take(client, granted, expiry_ms);          // the leases it granted
//   r.Give(client, released, now_ms);            // leases given back
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "base/mutex.h"

namespace tierkv::master {

class Reservations {
 public:
  // At most `cap` held per client and `tenant_cap` per tenant; 0: no cap.
  explicit Reservations(uint64_t cap, uint64_t tenant_cap = 0) : cap_(cap), tenant_cap_(tenant_cap) {}

  // How many more `client` (a TenantKey) may take now: the least of its
  // cap and its tenant's, less what each holds (unbounded without caps).
  uint64_t Room(const std::string& client, int64_t now_ms);
  // `client` took `n` reservations whose leases end at `expiry_ms`.
  void Take(const std::string& client, uint64_t n, int64_t expiry_ms);
  // `client` gave `n` back (the oldest go first).
  void Give(const std::string& client, uint64_t n, int64_t now_ms);
  // Lookups refused for the cap, and reads short of their reservation.
  void NoteRefused(uint64_t n);
  void NoteShortfalls(uint64_t n);

  struct Totals {
    uint64_t held = 0;        // over every client, leases not yet expired
    uint64_t clients = 0;     // clients holding any
    uint64_t refused = 0;     // since start
    uint64_t shortfalls = 0;  // since start
  };
  Totals totals(int64_t now_ms);
  uint64_t cap() const { return cap_; }
  uint64_t tenant_cap() const { return tenant_cap_; }

 private:
  struct Held {
    std::deque<std::pair<int64_t, uint64_t>> by_expiry;  // (expiry ms, count), in order taken
    uint64_t total = 0;
  };
  static void Expire(Held& h, int64_t now_ms);
  // What `cap` leaves beside `of`'s entry in `held` (erased once empty).
  static uint64_t RoomIn(absl::flat_hash_map<std::string, Held>& held, const std::string& of, uint64_t cap,
                         int64_t now_ms);
  static void TakeIn(Held& h, uint64_t n, int64_t expiry_ms);
  static void GiveIn(absl::flat_hash_map<std::string, Held>& held, const std::string& of, uint64_t n, int64_t now_ms);

  const uint64_t cap_, tenant_cap_;
  Mutex mu_;
  absl::flat_hash_map<std::string, Held> clients_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Held> tenants_ ABSL_GUARDED_BY(mu_);
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t shortfalls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tierkv::master
