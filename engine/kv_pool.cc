#include "engine/kv_pool.h"

namespace tierkv::engine {

KvPool::KvPool(size_t slots, size_t page_bytes) : slots_(slots), page_bytes_(page_bytes) {
  auto region = transport::SharedRegion::Create(std::max<size_t>(1, slots * page_bytes), {});
  // A pool that cannot be reserved is a configuration error at start-up.
  if (!region.ok()) throw std::bad_alloc();
  region_ = std::move(*region);
  base_ = region_->data();
  for (size_t i = slots; i > 0; --i) free_.push_back(static_cast<int>(i - 1));
}

int KvPool::Allocate() {
  if (free_.empty()) return -1;
  int s = free_.back();
  free_.pop_back();
  return s;
}

void KvPool::Free(int slot) { free_.push_back(slot); }

}  // namespace tierkv::engine
