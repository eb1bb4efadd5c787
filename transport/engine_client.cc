// The transfer engine's client side: submitting, routing and running
// transfers, and looking peers up (internal/engine_impl.h).
#include <algorithm>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/internal/engine_impl.h"

namespace tierkv::transport::internal {

std::shared_ptr<Batch> Engine::Submit(std::vector<Request> requests, absl::Duration timeout) {
  return Start(std::move(requests), timeout, /*here=*/false);
}

std::shared_ptr<Batch> Engine::SubmitHere(std::vector<Request> requests, absl::Duration timeout) {
  return Start(std::move(requests), timeout, /*here=*/true);
}

std::vector<absl::Status> Engine::Transfer(std::vector<Request> requests, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) timeout = options_.default_timeout;
  std::shared_ptr<Batch> b = SubmitHere(std::move(requests), timeout);
  // Every task ends by the deadline; the margin covers the last wake-up.
  // A Wait that runs out seals the batch, so what did not finish reads
  // DEADLINE_EXCEEDED.
  (void)b->Wait(absl::Now() + timeout + absl::Seconds(5));
  return b->statuses();
}

std::shared_ptr<Batch> Engine::Start(std::vector<Request> requests, absl::Duration timeout, bool here) {
  if (timeout <= absl::ZeroDuration()) timeout = options_.default_timeout;
  absl::Time deadline = absl::Now() + timeout;
  auto batch = std::make_shared<BatchImpl>(requests.size(), deadline);
  requests_.fetch_add(requests.size(), std::memory_order_relaxed);

  // Group by segment, keeping request order within each. Runs of
  // requests to one segment (the common case) skip the map lookup.
  std::map<std::string, std::vector<size_t>> by_segment;
  std::vector<size_t>* group = nullptr;
  const std::string* group_segment = nullptr;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    if (r.length == 0) continue;  // nothing to move: OK
    if (r.local == nullptr) {
      batch->SetStatus(i, absl::InvalidArgumentError("request has no local buffer"));
      continue;
    }
    if (group == nullptr || r.segment != *group_segment) {
      group = &by_segment[r.segment];
      group_segment = &r.segment;
    }
    group->push_back(i);
  }
  struct Plan {
    Backend* backend;
    std::shared_ptr<PeerChannel> channel;
    std::string segment;
    size_t first_slice, end_slice;
  };
  std::vector<Plan> plans;
  for (auto& [segment, idx] : by_segment) {
    absl::StatusOr<Prepared> peer = GetPeer(segment, deadline);
    std::vector<const BufferDescriptor*> located;  // per request of idx; null: in no buffer
    if (peer.ok() && !LocateAll(peer->desc, requests, idx, &located) && options_.peer_mode) {
      // A peer registers memory whenever it likes: an address outside
      // every buffer known means its table is looked up again, once.
      Invalidate(segment);
      peer = GetPeer(segment, deadline);
      if (peer.ok()) LocateAll(peer->desc, requests, idx, &located);
    }
    if (!peer.ok()) {
      for (size_t i : idx) batch->SetStatus(i, peer.status());
      continue;
    }
    // Each request goes to the chosen transport unless that one refuses
    // its memory; then to the next transport that reaches the peer. A
    // request that continues the previous one on its route joins its run
    // (EngineOptions::coalesce).
    struct Route {
      std::shared_ptr<PeerChannel> channel;
      std::vector<size_t> leads;   // the first request of each run
      std::vector<uint64_t> runs;  // the run's length
      const BufferDescriptor* where = nullptr;  // the last run's buffer at the peer
    };
    std::map<Backend*, Route> routes;
    auto add = [&](Backend* backend, const std::shared_ptr<PeerChannel>& channel, size_t i,
                   const BufferDescriptor* where) {
      Route& route = routes[backend];
      route.channel = channel;
      const Request& r = requests[i];
      if (!route.leads.empty() &&
          Continues(requests[route.leads.back()], route.runs.back(), r, route.where, where, backend)) {
        route.runs.back() += r.length;
        batch->Follow(i, route.leads.back());
        coalesced_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      route.leads.push_back(i);
      route.runs.push_back(r.length);
      route.where = where;
    };
    LocalHint local_hint;  // most requests come from where the previous one did
    for (size_t k = 0; k < idx.size(); ++k) {
      const size_t i = idx[k];
      const Request& r = requests[i];
      const BufferDescriptor* where = located[k];
      if (where == nullptr) {
        batch->SetStatus(i, peer->desc.Locate(r.offset, r.length).status());  // its message
        continue;
      }
      const bool gpu = LocalIsGpu(r.local, r.length, &local_hint) || where->location.rfind("cuda:", 0) == 0;
      std::string refusal = Refusal(peer->backend, r, gpu, where);
      if (refusal.empty()) {
        add(peer->backend, peer->channel, i, where);
        continue;
      }
      absl::StatusOr<std::pair<Backend*, std::shared_ptr<PeerChannel>>> alt =
          Fallback(segment, *peer, r, gpu, where, refusal, deadline);
      if (!alt.ok()) {
        batch->SetStatus(i, alt.status());
        continue;
      }
      add(alt->first, alt->second, i, where);
    }
    for (auto& [backend, route] : routes) {
      size_t first = batch->slices.size();
      for (size_t k = 0; k < route.leads.size(); ++k) {
        const size_t i = route.leads[k];
        const Request& r = requests[i];
        const uint64_t length = route.runs[k];
        for (uint64_t done = 0; done < length; done += options_.slice_size) {
          Slice s;
          s.op = r.op;
          s.local = static_cast<char*>(r.local) + done;
          s.remote_offset = r.offset + done;
          s.length = std::min(options_.slice_size, length - done);
          if (length <= options_.slice_size) s.crc = r.crc;
          s.epoch = r.epoch;
          s.set_grant(r.grant);
          batch->slices.push_back(s);
          batch->slice_request.push_back(i);
        }
      }
      plans.push_back({backend, route.channel, segment, first, batch->slices.size()});
    }
  }
  batch->Start();
  // Spread each channel's slices over the workers by bytes, at most 64
  // slices per task, and no task for less than kMinTaskBytes where the
  // rest can take it: a hop to a worker and back costs a few tens of
  // microseconds, more than moving a small value, so a single get's value
  // and trailer move together. With `here`, the last task is this
  // thread's, run once the others are queued so they move in parallel
  // with it, unless its backend may overstay the deadline (the caller
  // must not be held past it).
  constexpr uint64_t kMinTaskBytes = 256 << 10;
  std::optional<Task> mine;
  bool mine_bounded = false;
  for (const Plan& p : plans) {
    uint64_t left = 0;
    for (size_t k = p.first_slice; k < p.end_slice; ++k) left += batch->slices[k].length;
    const uint64_t workers = static_cast<uint64_t>(std::max(1, options_.workers));
    const uint64_t per_task = std::max<uint64_t>((left + workers - 1) / workers, kMinTaskBytes);
    for (size_t k = p.first_slice; k < p.end_slice;) {
      Task t{batch, p.channel, p.segment, {}, deadline};
      uint64_t bytes = 0;
      // At most 64 slices a task, except small ones: a task of many tiny
      // slices (one-token entries) still moves only a few hundred KiB, and
      // a transport may pack them into a few frames.
      while (k < p.end_slice && (t.slices.size() < 64 || (bytes < kMinTaskBytes && t.slices.size() < 4096))) {
        Slice* s = &batch->slices[k++];
        t.slices.push_back(s);
        bytes += s->length;
        left -= s->length;
        if (bytes >= per_task && left >= kMinTaskBytes) break;
      }
      if (mine) queue_->Push(std::move(*mine));
      mine = std::move(t);
      mine_bounded = p.backend->capabilities().bounded_post;
    }
  }
  if (mine) {
    if (here && mine_bounded) {
      Run(*mine);
    } else {
      queue_->Push(std::move(*mine));
    }
  }
  return batch;
}

PeerInfo Engine::Describe(const std::string& segment) {
  PeerInfo info;
  info.segment = segment;
  absl::StatusOr<Prepared> p = GetPeer(segment, absl::Now() + absl::Seconds(5));
  std::shared_ptr<PeerEntry> e = Entry(segment);
  MutexLock lock(&e->mu);
  if (e->desc) info.host = e->desc->host;
  info.fallbacks = e->fallbacks;
  if (p.ok()) {
    info.transport = p->transport;
  } else {
    info.fallbacks.push_back(std::string(p.status().message()));
  }
  return info;
}

bool Engine::ChecksumsCopies(const std::string& segment, uint64_t length) {
  if (length > options_.slice_size) return false;
  std::shared_ptr<PeerEntry> e = Entry(segment);
  MutexLock lock(&e->mu);
  return e->channel != nullptr && e->backend != nullptr && e->backend->capabilities().checksums_copies;
}

void Engine::ForgetPeers() {
  MutexLock lock(&peers_mu_);
  peers_.clear();
}

EngineStats Engine::Stats() const {
  return {requests_.load(), failed_.load(), bytes_read_.load(), bytes_written_.load(), coalesced_.load()};
}

std::string Engine::Refusal(Backend* backend, const Request& r, bool gpu, const BufferDescriptor* where) {
  const Capabilities caps = backend->capabilities();
  if (gpu && !caps.cuda_memory) return absl::StrCat("transport ", backend->name(), " cannot move GPU memory");
  if (caps.keyed_buffers && !where->keys.contains(backend->name())) {
    return absl::StrCat("transport ", backend->name(), " cannot reach the peer's buffer at ", where->offset);
  }
  if (!caps.needs_registered_local) return "";
  std::shared_lock lock(served_mu_);
  const LocalBuffer* b = LocalBufferOf(r.local, r.length);
  if (b == nullptr) return absl::StrCat("transport ", backend->name(), " needs the local buffer registered");
  if (!refused_.contains({b->id, backend})) return "";
  return absl::StrCat("transport ", backend->name(), " could not register the local buffer");
}

absl::StatusOr<std::pair<Backend*, std::shared_ptr<PeerChannel>>> Engine::Fallback(
    const std::string& segment, const Prepared& peer, const Request& r, bool gpu, const BufferDescriptor* where,
    const std::string& refusal, absl::Time deadline) {
  std::vector<std::string> reasons{refusal};
  std::vector<Backend*> candidates;
  for (Backend* b : order_) {
    if (b == peer.backend || !peer.desc.transports.contains(b->name())) continue;
    std::string no = Refusal(b, r, gpu, where);
    if (no.empty()) {
      candidates.push_back(b);
    } else {
      reasons.push_back(no);
    }
  }
  std::shared_ptr<PeerEntry> e = Entry(segment);
  PrepareContext ctx = internal::PeerContext(options_, segment, peer.desc, deadline);
  for (Backend* b : candidates) {
    std::shared_ptr<PeerChannel> ch;
    uint64_t generation;
    {
      MutexLock lock(&e->mu);
      generation = e->generation;
      auto it = e->alternates.find(b->name());
      if (it != e->alternates.end() && it->second && it->second->healthy()) ch = it->second;
    }
    if (!ch) {
      // A handshake: over the network, so not under the entry's lock.
      absl::StatusOr<std::unique_ptr<PeerChannel>> made = b->Prepare(peer.desc, ctx);
      if (!made.ok()) {
        reasons.push_back(absl::StrCat(b->name(), ": ", made.status().message()));
        continue;
      }
      ch = std::move(*made);
    }
    MutexLock lock(&e->mu);
    if (e->generation == generation) {
      // Cache it, unless another thread cached a healthy one meanwhile.
      std::shared_ptr<PeerChannel>& cached = e->alternates[b->name()];
      if (cached && cached != ch && cached->healthy()) {
        ch = cached;
      } else {
        cached = ch;
      }
    }
    // A refusal is normal for unregistered buffers: say so once per peer.
    if (e->logged.insert(absl::StrCat(b->name(), ": ", refusal)).second) {
      TKV_LOG(INFO) << refusal << " for segment " << segment << "; such requests go over " << b->name();
    }
    return std::make_pair(b, ch);
  }
  return absl::FailedPreconditionError(absl::StrCat("no transport to segment ", segment,
                                                    " can move this request: ", absl::StrJoin(reasons, "; ")));
}

bool Engine::LocalIsGpu(void* addr, uint64_t length, LocalHint* hint) {
  char* a = static_cast<char*>(addr);
  if (hint->start != nullptr && a >= hint->start && RangeWithin(a - hint->start, length, hint->length)) {
    return hint->gpu;
  }
  std::shared_lock lock(served_mu_);
  const LocalBuffer* b = LocalBufferOf(addr, length);
  if (b == nullptr) return false;
  *hint = {b->addr, b->length, b->location.kind == Location::kCuda};
  return hint->gpu;
}

std::shared_ptr<PeerEntry> Engine::Entry(const std::string& segment) {
  MutexLock lock(&peers_mu_);
  auto& e = peers_[segment];
  if (!e) e = std::make_shared<PeerEntry>();
  return e;
}

absl::StatusOr<Engine::Prepared> Engine::GetPeer(const std::string& segment, absl::Time deadline) {
  std::shared_ptr<PeerEntry> e = Entry(segment);
  {
    MutexLock lock(&e->mu);
    while (true) {
      if (e->channel && e->channel->healthy() && e->desc) {
        return Prepared{*e->desc, e->channel, e->backend, e->transport};
      }
      if (!e->looking_up) break;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat("segment ", segment,
                                                        " is still being looked up (its descriptor or its "
                                                        "daemon is slow to answer)"));
      }
      e->looked_up.WaitFor(&e->mu, absl::ToChronoMicroseconds(std::min(left, absl::Seconds(1))));
    }
    e->looking_up = true;
  }
  absl::StatusOr<Prepared> p = LookUp(segment, deadline, *e);
  MutexLock lock(&e->mu);
  e->looking_up = false;
  e->looked_up.SignalAll();
  return p;
}

absl::StatusOr<Engine::Prepared> Engine::LookUp(const std::string& segment, absl::Time deadline, PeerEntry& e) {
  absl::StatusOr<std::string> json = options_.peer_mode ? FetchPeerDescriptor(segment, deadline)
                                                       : options_.metadata->Get(DescriptorKey(segment), deadline);
  if (!json.ok()) {
    if (absl::IsNotFound(json.status())) {
      return absl::NotFoundError(absl::StrCat("segment ", segment, " is not published"));
    }
    return Annotate(json.status(), absl::StrCat("looking up segment ", segment));
  }
  ASSIGN_OR_RETURN(SegmentDescriptor desc, SegmentDescriptor::FromJson(*json));
  PrepareContext ctx = internal::PeerContext(options_, segment, desc, deadline);
  std::vector<std::string> reasons;
  std::shared_ptr<PeerChannel> channel;
  Backend* chosen = nullptr;
  for (Backend* b : order_) {
    if (!desc.transports.contains(b->name())) {
      reasons.push_back(absl::StrCat(b->name(), ": not offered by the peer"));
      continue;
    }
    absl::StatusOr<std::unique_ptr<PeerChannel>> ch = b->Prepare(desc, ctx);
    if (ch.ok()) {
      channel = std::move(*ch);
      chosen = b;
      break;
    }
    TKV_LOG(WARNING) << "transport " << b->name() << " cannot reach segment " << segment
                     << " on host " << desc.host << " (" << desc.host_id.substr(0, 8) << ") from "
                     << options_.host << " (" << options_.host_id.substr(0, 8) << "): "
                     << ch.status().message() << "; trying the next transport";
    reasons.push_back(absl::StrCat(b->name(), ": ", ch.status().message()));
  }
  MutexLock lock(&e.mu);
  e.desc = desc;
  ++e.generation;
  e.channel = channel;
  e.alternates.clear();
  e.fallbacks = reasons;
  if (chosen == nullptr) {
    return absl::UnavailableError(absl::StrCat("no transport reaches segment ", segment, ": ",
                                               absl::StrJoin(reasons, "; ")));
  }
  e.backend = chosen;
  e.transport = chosen->name();
  return Prepared{desc, channel, chosen, e.transport};
}

void Engine::Run(Task& t) {
  if (absl::Now() >= t.deadline || t.batch->sealed()) {
    // The caller stopped waiting: its buffers must not be touched now.
    for (Slice* s : t.slices) s->status = absl::DeadlineExceededError("transfer queued past its deadline");
  } else {
    t.channel->Post(t.slices, t.deadline);
  }
  uint64_t read = 0, written = 0, failed = 0;
  for (Slice* s : t.slices) {
    if (!s->status.ok()) {
      ++failed;
    } else if (s->op == Op::kRead) {
      read += s->length;
    } else {
      written += s->length;
    }
  }
  bytes_read_.fetch_add(read, std::memory_order_relaxed);
  bytes_written_.fetch_add(written, std::memory_order_relaxed);
  failed_.fetch_add(failed, std::memory_order_relaxed);
  if (!t.channel->healthy()) {
    std::shared_ptr<PeerEntry> e = Entry(t.segment);
    MutexLock lock(&e->mu);
    if (e->channel == t.channel) e->channel.reset();  // re-prepare on next use
    for (auto& [name, ch] : e->alternates) {
      if (ch == t.channel) ch.reset();
    }
  }
  t.batch->Complete(t.slices);
}
bool Engine::LocateAll(const SegmentDescriptor& desc, const std::vector<Request>& requests,
                       const std::vector<size_t>& idx, std::vector<const BufferDescriptor*>* where) {
  where->assign(idx.size(), nullptr);
  const BufferDescriptor* last = nullptr;  // most requests land where the previous one did
  bool all = true;
  for (size_t k = 0; k < idx.size(); ++k) {
    const Request& r = requests[idx[k]];
    if (last == nullptr || r.offset < last->offset || !RangeWithin(r.offset - last->offset, r.length, last->length)) {
      absl::StatusOr<const BufferDescriptor*> found = desc.Locate(r.offset, r.length);
      if (!found.ok()) {
        all = false;
        continue;
      }
      last = *found;
    }
    (*where)[k] = last;
  }
  return all;
}

}  // namespace tierkv::transport::internal
