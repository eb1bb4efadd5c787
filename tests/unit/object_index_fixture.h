// The fixture the object index's tests share (object_index_*_test.cc): an
// ObjectIndex over a MemStore and a SegmentRegistry, on a manual clock, and
// the few calls every test makes (mount a segment, put a key whole, start
// the background evictor).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "base/clock.h"
#include "master/internal/index_impl.h"
#include "master/object_index.h"
#include "tests/support/status_matchers.h"

// Not in an anonymous namespace: the suites that derive from it, and
// gtest's check that one suite has one fixture, span several files.
namespace tierkv::master {

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(IndexOptions()); }

  void Build(IndexOptions options) {
    index_.reset();
    registry_ = std::make_unique<SegmentRegistry>();
    store_ = NewMemStore();
    options_ = options;
    index_ = std::make_unique<ObjectIndex>(options, registry_.get(), store_.get(), &clock_);
  }

  uint32_t Mount(const std::string& name, uint64_t capacity, const std::string& host = "") {
    bool restored;
    std::optional<uint32_t> replaced;
    auto id = registry_->Mount({name, host.empty() ? name : host, capacity, "inc", ""},
                               clock_.Now(), &restored, &replaced);
    EXPECT_TRUE(id.ok());
    return *id;
  }

  absl::Status Put(const std::string& key, uint64_t size, PutItem extra = {}) {
    extra.key = key;
    extra.size = size;
    auto started = index_->PutStart({extra});
    if (!started[0].status.ok()) return started[0].status;
    return index_->PutEnd({key})[0];
  }

  bool Present(const std::string& key) { return index_->Exists({key})[0]; }

  // The background evictor on a thread of the test's, returned once it
  // runs (or after 10 s without: the caller checks EvictorRunning).
  std::thread StartEvictor() {
    std::thread t([this] { index_->RunEvictor(); });
    const absl::Time up = absl::Now() + absl::Seconds(10);
    while (!index_->EvictorRunning() && absl::Now() < up) std::this_thread::yield();
    return t;
  }

  ManualClock clock_;
  IndexOptions options_;
  std::unique_ptr<SegmentRegistry> registry_;
  std::unique_ptr<IndexStore> store_;
  std::unique_ptr<ObjectIndex> index_;
};

}  // namespace tierkv::master
