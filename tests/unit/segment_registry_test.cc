// SegmentRegistry's incremental placement order against a brute-force
// reference: the registry keeps its LIVE segments ordered by free space
// (overall and per host) as extents come and go, where it once sorted them
// all per placed object. A wrong update of that order shows here as a
// different segment or offset picked over random sequences of mounts,
// re-mounts, unmounts, dormancy, placements and frees. The counters (used,
// capacity, largest) and the lock-free LIVE snapshot are checked against
// the same model after every step.
#include <algorithm>
#include <atomic>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "master/segment_registry.h"

namespace tierkv::master {
namespace {

constexpr uint64_t kAlign = 64;

// What the registry is expected to hold, kept the simple way.
struct ModelSegment {
  uint32_t id;
  std::string name;
  std::string host;
  std::string incarnation;
  std::string ssd_id;
  uint64_t capacity;
  bool recovering = false;
  bool dormant = false;
  std::unique_ptr<ExtentAllocator> allocator;
};

class Model {
 public:
  std::map<uint32_t, ModelSegment> by_id;
  std::map<std::string, uint32_t> by_name;

  ModelSegment* Named(const std::string& name) {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : &by_id.at(it->second);
  }
  void Add(uint32_t id, const SegmentSpec& spec, bool recovering) {
    ModelSegment seg{id, spec.name, spec.host, spec.incarnation, spec.ssd_id, spec.capacity, recovering, false,
                     std::make_unique<ExtentAllocator>(spec.capacity, kAlign)};
    by_id.emplace(id, std::move(seg));
    by_name[spec.name] = id;
  }
  void Erase(uint32_t id) {
    by_name.erase(by_id.at(id).name);
    by_id.erase(id);
  }

  // The placement the registry documents, as it was first written: every
  // candidate sorted per call.
  absl::StatusOr<std::vector<Replica>> Allocate(uint64_t size, int count, const std::string& preferred,
                                                const std::vector<uint32_t>& with) {
    std::vector<std::pair<ModelSegment*, uint64_t>> candidates;
    size_t live = 0;
    for (auto& [id, seg] : by_id) {
      if (!seg.recovering) ++live;
      if (seg.recovering || seg.allocator->largest_free() < seg.allocator->Rounded(size)) continue;
      candidates.push_back({&seg, seg.allocator->capacity() - seg.allocator->used()});
    }
    if (live == 0) return absl::UnavailableError("none live");
    auto rank = [&](const ModelSegment* s) {
      return static_cast<size_t>(std::find(with.begin(), with.end(), s->id) - with.begin());
    };
    std::sort(candidates.begin(), candidates.end(), [&](const auto& a, const auto& b) {
      size_t ra = rank(a.first), rb = rank(b.first);
      if (ra != rb) return ra < rb;
      bool pa = a.first->name == preferred, pb = b.first->name == preferred;
      if (pa != pb) return pa;
      if (a.second != b.second) return a.second > b.second;
      return a.first->id < b.first->id;
    });
    std::vector<Replica> out;
    std::set<std::string> hosts;
    std::set<uint32_t> used;
    for (int pass = 0; pass < 2 && static_cast<int>(out.size()) < count; ++pass) {
      for (auto& [seg, free] : candidates) {
        if (static_cast<int>(out.size()) >= count) break;
        if (used.contains(seg->id) || (pass == 0 && hosts.contains(seg->host))) continue;
        std::optional<uint64_t> off = seg->allocator->Allocate(size);
        if (!off) continue;
        out.push_back({seg->id, false, false, *off});
        hosts.insert(seg->host);
        used.insert(seg->id);
      }
    }
    if (out.empty()) return absl::ResourceExhaustedError("no room");
    return out;
  }
};

void ExpectSameState(const SegmentRegistry& reg, const Model& model, uint32_t max_id) {
  uint64_t used = 0, capacity = 0, largest = 0;
  for (const auto& [id, seg] : model.by_id) {
    used += seg.allocator->used();
    if (!seg.dormant) capacity += seg.allocator->capacity();
    largest = std::max(largest, seg.allocator->capacity());
  }
  ASSERT_EQ(reg.used(), used);
  ASSERT_EQ(reg.capacity(), capacity);
  ASSERT_EQ(reg.largest_segment(), largest);
  const LiveSegments live = reg.LiveNames();
  for (uint32_t id = 0; id <= max_id + 1; ++id) {
    auto it = model.by_id.find(id);
    const bool expect_live = it != model.by_id.end() && !it->second.recovering;
    ASSERT_EQ(reg.IsLive(id), expect_live) << "id " << id;
    const std::string* name = live.Find(id);
    ASSERT_EQ(name != nullptr, expect_live) << "id " << id;
    if (expect_live) {
      ASSERT_EQ(*name, it->second.name);
    }
  }
}

class PlacementMatchesReference : public ::testing::TestWithParam<uint32_t> {};

TEST_P(PlacementMatchesReference, OverRandomSequences) {
  std::mt19937 rng(GetParam());
  auto pick = [&rng](size_t n) { return static_cast<size_t>(rng() % n); };
  SegmentRegistry reg(kAlign);
  Model model;
  std::vector<std::pair<Replica, uint64_t>> placed;  // extents to free later
  const std::vector<uint64_t> sizes = {1, 64, 100, 4096, 5000, 1 << 16, 1 << 18};
  const absl::Time now = absl::FromUnixSeconds(1000);
  uint32_t max_id = 0;
  int allocations = 0;
  for (int step = 0; step < 3000; ++step) {
    const size_t op = pick(100);
    if (op < 8 || model.by_id.empty()) {
      // Mount: a new name, or a known one re-mounted (same incarnation:
      // restored, maybe on another host; another: replaced).
      SegmentSpec spec;
      const bool known = !model.by_name.empty() && pick(2) == 0;
      spec.name = known ? std::next(model.by_name.begin(), pick(model.by_name.size()))->first
                        : absl::StrCat("seg", step);
      ModelSegment* old = model.Named(spec.name);
      spec.host = absl::StrCat("host", pick(5));
      spec.capacity = old != nullptr && pick(4) != 0 ? old->capacity : (1 + pick(8)) * (1 << 20) + pick(3) * 100;
      spec.incarnation = old != nullptr && pick(3) != 0 ? old->incarnation : absl::StrCat("inc", step);
      spec.ssd_id = pick(3) == 0 ? absl::StrCat("ssd", pick(3)) : "";
      bool restored = false;
      std::optional<uint32_t> replaced;
      absl::StatusOr<uint32_t> id = reg.Mount(spec, now, &restored, &replaced);
      ASSERT_TRUE(id.ok()) << id.status();
      if (old != nullptr && old->incarnation == spec.incarnation && old->capacity == spec.capacity && !old->dormant) {
        ASSERT_TRUE(restored);
        ASSERT_EQ(*id, old->id);
        old->recovering = false;
        old->host = spec.host;
        old->ssd_id = spec.ssd_id;
      } else {
        ASSERT_FALSE(restored);
        ASSERT_EQ(replaced.has_value(), old != nullptr);
        if (old != nullptr) model.Erase(old->id);
        model.Add(*id, spec, false);
      }
      max_id = std::max(max_id, *id);
    } else if (op < 10) {
      // A segment read back after a master restart.
      SegmentSpec spec{absl::StrCat("rec", step), absl::StrCat("host", pick(5)), (1 + pick(4)) * (1 << 20), "r"};
      uint32_t id = reg.Recover(spec, now);
      model.Add(id, spec, true);
      max_id = std::max(max_id, id);
    } else if (op < 13) {
      auto it = std::next(model.by_name.begin(), pick(model.by_name.size()));
      const std::string name = it->first;
      ASSERT_EQ(*reg.Unmount(name), it->second);
      model.Erase(it->second);
    } else if (op < 15) {
      auto it = std::next(model.by_name.begin(), pick(model.by_name.size()));
      ModelSegment& seg = model.by_id.at(it->second);
      const bool changed = reg.MakeDormant(seg.name, now);
      ASSERT_EQ(changed, !seg.ssd_id.empty());
      if (changed) {
        seg.recovering = seg.dormant = true;
        seg.allocator = std::make_unique<ExtentAllocator>(seg.capacity, kAlign);
      }
    } else if (op < 30 && !placed.empty()) {
      const size_t at = pick(placed.size());
      auto [r, size] = placed[at];
      placed.erase(placed.begin() + static_cast<ptrdiff_t>(at));
      reg.Free(r, size);
      if (auto it = model.by_id.find(r.segment_id); it != model.by_id.end()) {
        (void)it->second.allocator->Free(r.offset, size);
      }
    } else if (op < 33) {
      // A stage extent in one segment.
      const uint32_t id = 1 + static_cast<uint32_t>(pick(max_id + 1));
      const uint64_t size = sizes[pick(sizes.size())];
      std::optional<Replica> got = reg.AllocateIn(id, size);
      auto it = model.by_id.find(id);
      std::optional<uint64_t> want;
      if (it != model.by_id.end() && !it->second.recovering) want = it->second.allocator->Allocate(size);
      ASSERT_EQ(got.has_value(), want.has_value());
      if (got) {
        ASSERT_EQ(got->offset, *want);
        placed.push_back({*got, size});
      }
    } else {
      const uint64_t size = sizes[pick(sizes.size())];
      const int count = 1 + static_cast<int>(pick(3));
      std::string preferred;
      if (pick(3) == 0 && !model.by_name.empty()) {
        preferred = std::next(model.by_name.begin(), pick(model.by_name.size()))->first;
      } else if (pick(5) == 0) {
        preferred = "nobody";
      }
      std::vector<uint32_t> with;
      for (size_t n = pick(4); n > 0; --n) with.push_back(1 + static_cast<uint32_t>(pick(max_id + 1)));
      absl::StatusOr<std::vector<Replica>> got = reg.Allocate(size, count, preferred, with);
      absl::StatusOr<std::vector<Replica>> want = model.Allocate(size, count, preferred, with);
      ASSERT_EQ(got.status().code(), want.status().code()) << "step " << step << ": " << got.status();
      if (got.ok()) {
        ++allocations;
        ASSERT_EQ(got->size(), want->size()) << "step " << step;
        for (size_t i = 0; i < got->size(); ++i) {
          ASSERT_EQ((*got)[i].segment_id, (*want)[i].segment_id) << "step " << step << " replica " << i;
          ASSERT_EQ((*got)[i].offset, (*want)[i].offset) << "step " << step << " replica " << i;
          placed.push_back({(*got)[i], size});
        }
      }
    }
    ExpectSameState(reg, model, max_id);
  }
  EXPECT_GT(allocations, 500);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PlacementMatchesReference, ::testing::Values(1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u));

// Many segments on one host: the distinct-host pass must still end after a
// few steps and place the second replica on the next-emptiest segment.
TEST(SegmentRegistryTest, ManySegmentsOneHostPlacesOnTheEmptiest) {
  SegmentRegistry reg(kAlign);
  bool restored;
  std::optional<uint32_t> replaced;
  for (int i = 0; i < 2000; ++i) {
    ASSERT_TRUE(reg.Mount({absl::StrCat("s", i), "onehost", uint64_t{1} << 30, "x"}, absl::Now(), &restored, &replaced)
                    .ok());
  }
  ASSERT_TRUE(reg.Mount({"other", "otherhost", uint64_t{1} << 20, "x"}, absl::Now(), &restored, &replaced).ok());
  for (int i = 0; i < 2000; ++i) {
    absl::StatusOr<std::vector<Replica>> r = reg.Allocate(4096, 2, "");
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->size(), 2u);
    // The other host is used for the second replica while it has room.
    EXPECT_EQ(reg.Name((*r)[1].segment_id), "other") << i;
    EXPECT_NE((*r)[0].segment_id, (*r)[1].segment_id);
    if (::testing::Test::HasFailure()) return;
    if (i == 200) break;
  }
}

// A tenant lending its own memory holds what lands there: its segment takes
// only its tenant's objects, while an operator's (no tenant) takes anyone's.
// The owner's tenant comes with the mount, and an admin's re-mount keeps it.
TEST(SegmentRegistryTest, ATenantsOwnSegmentTakesOnlyItsTenantsObjects) {
  SegmentRegistry reg(kAlign);
  bool restored;
  std::optional<uint32_t> replaced;
  std::string owner, owner_tenant;
  ASSERT_TRUE(reg.Mount({"lender-a", "h1", uint64_t{1} << 30, "x"}, absl::Now(), &restored, &replaced,
                        absl::ZeroDuration(), nullptr, SegmentActor{"app-a", false, "a"}, &owner, &owner_tenant)
                  .ok());
  EXPECT_EQ(owner, "app-a");
  EXPECT_EQ(owner_tenant, "a");
  ASSERT_TRUE(reg.Mount({"operator", "h2", uint64_t{1} << 20, "x"}, absl::Now(), &restored, &replaced,
                        absl::ZeroDuration(), nullptr, SegmentActor{"decode-0", false, ""})
                  .ok());
  for (const std::string tenant : {"b", ""}) {
    for (int i = 0; i < 20; ++i) {
      // Even named as preferred, and with more room there.
      absl::StatusOr<std::vector<Replica>> r = reg.Allocate(4096, 2, "lender-a", {}, tenant);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->size(), 1u);
      EXPECT_EQ(reg.Name((*r)[0].segment_id), "operator");
    }
  }
  absl::StatusOr<std::vector<Replica>> r = reg.Allocate(4096, 2, "", {}, "a");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 2u);
  EXPECT_EQ(reg.Name((*r)[0].segment_id), "lender-a");  // the emptiest
  // Too large for the operator's segment: a's has room, but not for b.
  EXPECT_TRUE(absl::IsResourceExhausted(reg.Allocate(uint64_t{2} << 20, 1, "", {}, "b").status()));
  ASSERT_TRUE(reg.Mount({"lender-a", "h1", uint64_t{1} << 30, "x"}, absl::Now(), &restored, &replaced,
                        absl::ZeroDuration(), nullptr, SegmentActor{"ops", true, ""}, &owner, &owner_tenant)
                  .ok());
  EXPECT_EQ(owner, "app-a");
  EXPECT_EQ(owner_tenant, "a");
}

// Readers (lookups) and writers (placement, membership) at once: the
// snapshot a reader holds stays valid and self-consistent whatever
// changes after it was taken. Meant for TSan as much as for the asserts.
TEST(SegmentRegistryTest, SnapshotReadersRunBesideWriters) {
  SegmentRegistry reg(kAlign);
  bool restored;
  std::optional<uint32_t> replaced;
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(reg.Mount({absl::StrCat("s", i), absl::StrCat("h", i % 8), 1 << 24, "x"}, absl::Now(), &restored,
                          &replaced)
                    .ok());
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        const LiveSegments live = reg.LiveNames();
        for (uint32_t id = 1; id < 200; ++id) {
          if (const std::string* name = live.Find(id)) {
            ASSERT_FALSE(name->empty());
          }
          (void)reg.IsLive(id);
        }
        (void)reg.used();
        reads.fetch_add(1);
      }
    });
  }
  std::mt19937 rng(7);
  // At least 2,000 changes, and on until the readers have read beside them
  // a while (bounded: a loaded machine may start the readers late).
  for (int i = 0; i < 2000 || (reads.load() < 50 && i < 2'000'000); ++i) {
    const std::string name = absl::StrCat("s", rng() % 80);
    if (rng() % 4 == 0) {
      (void)reg.Unmount(name);
    } else if (rng() % 4 == 1) {
      (void)reg.Mount({name, absl::StrCat("h", rng() % 8), 1 << 24, absl::StrCat("i", rng() % 2)}, absl::Now(),
                      &restored, &replaced);
    } else if (absl::StatusOr<std::vector<Replica>> r = reg.Allocate(4096, 2, ""); r.ok()) {
      for (const Replica& rep : *r) reg.Free(rep, 4096);
    }
  }
  stop.store(true);
  for (std::thread& t : readers) t.join();
  EXPECT_GT(reads.load(), 0u);
  EXPECT_EQ(reg.used(), 0u);
}

}  // namespace
}  // namespace tierkv::master
