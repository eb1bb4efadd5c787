#include "engine/kv_pool.h"

#include "base/log.h"

namespace tierkv::engine {

KvPool::KvPool(size_t slots, size_t page_bytes, Device* device, Tier tier)
    : slots_(slots), page_bytes_(page_bytes), device_(device), tier_(tier) {
  const size_t bytes = std::max<size_t>(1, slots * page_bytes);
  if (tier_ == Tier::kDevice) {
    absl::StatusOr<char*> p = device_->Allocate(bytes);
    if (!p.ok()) {
      TKV_LOG(ERROR) << "L1 pool of " << bytes << " bytes on " << device_->name() << ": " << p.status().message();
      throw std::bad_alloc();
    }
    base_ = *p;
  } else {
    auto region = transport::SharedRegion::Create(bytes, {});
    if (!region.ok()) throw std::bad_alloc();
    region_ = std::move(*region);
    base_ = region_->data();
    if (!device_->host_addressable()) {
      absl::Status s = device_->RegisterHost(base_, bytes);
      registered_ = s.ok();
      // Unpinned, copies still work, through the driver's bounce buffers.
      if (!s.ok()) TKV_LOG(WARNING) << "L2 pool not pinned: " << s.message();
    }
  }
  for (size_t i = slots; i > 0; --i) free_.push_back(static_cast<int>(i - 1));
}

KvPool::~KvPool() {
  if (tier_ == Tier::kDevice) {
    device_->Free(base_, bytes());
  } else if (registered_) {
    device_->UnregisterHost(base_);
  }
}

int KvPool::Allocate() {
  if (free_.empty()) return -1;
  int s = free_.back();
  free_.pop_back();
  return s;
}

void KvPool::Free(int slot) { free_.push_back(slot); }

int KvPool::memfd() const {
  if (region_) return region_->fd();
  return tier_ == Tier::kDevice ? device_->MemoryFd(base_) : -1;
}

}  // namespace tierkv::engine
