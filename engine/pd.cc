#include "engine/pd.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "nlohmann/json.hpp"

namespace tierkv::engine {
namespace {

using transport::Op;
using transport::Request;

// The request a decode writes into its mailbox (host byte order; both ends
// run on one architecture): a fixed header, the layout's name, the prompt,
// and where each page from `have` on must land.
constexpr uint32_t kMagic = 0x44504b54;  // "TKPD"
struct Header {
  uint32_t magic;
  uint32_t page_tokens;
  uint64_t id;
  uint64_t page_bytes;
  uint64_t tokens;
  uint64_t have;       // pages the decode holds already
  uint64_t pages;      // destinations that follow (pages of the prompt from `have` on)
  int64_t deadline_ms;  // Unix time in ms
  uint32_t space_bytes;
  uint32_t reserved;
};
constexpr uint64_t kMaxRequestBytes = 64 << 20;

std::string SpaceName(const InferenceEngine& e) {
  const KeySpace s = e.key_space();
  return absl::StrCat(s.model_id, "|", s.dtype, "|", s.layout);
}

struct ParsedRequest {
  Header h;
  std::string space;
  std::vector<int32_t> tokens;
  std::vector<uint64_t> dst;
};

absl::StatusOr<ParsedRequest> Parse(const std::string& bytes) {
  ParsedRequest r;
  if (bytes.size() < sizeof(Header)) return absl::InvalidArgumentError("request shorter than its header");
  std::memcpy(&r.h, bytes.data(), sizeof(Header));
  if (r.h.magic != kMagic) return absl::InvalidArgumentError("request has a bad magic");
  const uint64_t want = sizeof(Header) + r.h.space_bytes + r.h.tokens * 4 + r.h.pages * 8;
  if (r.h.tokens > kMaxRequestBytes || r.h.pages > kMaxRequestBytes || r.h.page_tokens == 0 || want != bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("request of ", bytes.size(), " bytes does not match its header"));
  }
  const char* p = bytes.data() + sizeof(Header);
  r.space.assign(p, r.h.space_bytes);
  p += r.h.space_bytes;
  r.tokens.resize(r.h.tokens);
  std::memcpy(r.tokens.data(), p, r.h.tokens * 4);
  p += r.h.tokens * 4;
  r.dst.resize(r.h.pages);
  std::memcpy(r.dst.data(), p, r.h.pages * 8);
  const uint64_t pages = (r.h.tokens + r.h.page_tokens - 1) / r.h.page_tokens;
  if (r.h.have > pages || r.h.have + r.h.pages != pages) {
    return absl::InvalidArgumentError("request's pages do not cover its prompt");
  }
  return r;
}

absl::Status RegisterPool(transport::TransferEngine* transfer, InferenceEngine* engine) {
  KvPool& l1 = engine->cache().l1_pool();
  const std::string location = engine->device().host_addressable() ? "cpu:0" : engine->device().name();
  return Annotate(transfer->RegisterMemory(l1.base(), l1.bytes(), location, l1.memfd()), "registering the L1 pool");
}

}  // namespace

// --- prefill

absl::StatusOr<std::unique_ptr<PdPrefill>> PdPrefill::Create(InferenceEngine* engine,
                                                             transport::TransferEngine* transfer) {
  if (transfer->session_id().empty()) return absl::InvalidArgumentError("P/D needs a transfer engine in peer mode");
  RETURN_IF_ERROR(RegisterPool(transfer, engine));
  std::unique_ptr<PdPrefill> p(new PdPrefill(engine, transfer));
  p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
  return p;
}

PdPrefill::~PdPrefill() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  (void)transfer_->UnregisterMemory(engine_->cache().l1_pool().base());
}

void PdPrefill::Loop() {
  // Requests arrive as notifications; the wait for one is cut short now
  // and then so that a stop is seen.
  while (!stop_) {
    for (const transport::Notification& n : transfer_->TakeNotifications(absl::Now() + absl::Milliseconds(100))) {
      if (n.name == "pd.req") Handle(n);
    }
  }
}

void PdPrefill::Handle(const transport::Notification& n) {
  nlohmann::json q = nlohmann::json::parse(n.message, nullptr, false);
  if (q.is_discarded() || !q.is_object() || !q.contains("id") || !q["id"].is_number_unsigned() ||
      !q.contains("addr") || !q["addr"].is_number_unsigned() || !q.contains("len") || !q["len"].is_number_unsigned()) {
    TKV_LOG(WARNING) << "P/D request from " << n.from << " is malformed; ignored";
    refused_.fetch_add(1);
    return;
  }
  const uint64_t id = q["id"].get<uint64_t>();
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  // Times the decode's TTFT is made of: compute (modelled in synthetic
  // mode), the pushes (first page sent to last landed), the part of them
  // left after the last page was computed, and the whole serve.
  double compute_s = 0, push_s = 0, tail_s = 0;
  const absl::Time began = absl::Now();
  auto answer = [&](const absl::Status& st, const std::vector<float>& logits, size_t pages) {
    nlohmann::json a{{"id", id},
                     {"ok", st.ok()},
                     {"pages", pages},
                     {"compute_s", compute_s},
                     {"push_s", push_s},
                     {"tail_s", tail_s},
                     {"serve_s", absl::ToDoubleSeconds(absl::Now() - began)}};
    if (!st.ok()) a["error"] = std::string(st.message()).substr(0, 1024);
    if (st.ok() && logits.size() * sizeof(float) <= (16 << 10)) {
      a["logits"] = absl::Base64Escape(
          absl::string_view(reinterpret_cast<const char*>(logits.data()), logits.size() * sizeof(float)));
    }
    absl::Status sent = transfer_->Notify(n.from, "pd.done", a.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                                          std::max(deadline, absl::Now() + absl::Seconds(1)));
    if (!sent.ok()) TKV_LOG(WARNING) << "P/D answer to " << n.from << " not delivered: " << sent.message();
    (st.ok() ? served_ : refused_).fetch_add(1);
  };
  const uint64_t len = q["len"].get<uint64_t>();
  if (len > kMaxRequestBytes) return answer(absl::InvalidArgumentError("request too large"), {}, 0);
  std::string bytes(len, '\0');
  absl::Status read = transfer_->Transfer({{Op::kRead, bytes.data(), n.from, q["addr"].get<uint64_t>(), len}},
                                          absl::Seconds(5))[0];
  if (!read.ok()) return answer(Annotate(read, "reading the request"), {}, 0);
  absl::StatusOr<ParsedRequest> req = Parse(bytes);
  if (!req.ok()) return answer(req.status(), {}, 0);
  deadline = absl::FromUnixMillis(req->h.deadline_ms);
  // The layout is checked before any byte moves: pages of another model,
  // dtype, page size or split would be garbage in the decode's pool.
  const size_t page_bytes = engine_->cache().config().page_bytes;
  if (req->space != SpaceName(*engine_) || req->h.page_bytes != page_bytes ||
      static_cast<int>(req->h.page_tokens) != engine_->cache().config().page_tokens) {
    return answer(absl::FailedPreconditionError(absl::StrCat(
                      "layout mismatch: decode has ", req->space, " with ", req->h.page_tokens, "-token pages of ",
                      req->h.page_bytes, " bytes; prefill has ", SpaceName(*engine_), " with ",
                      engine_->cache().config().page_tokens, "-token pages of ", page_bytes, " bytes")),
                  {}, 0);
  }
  const uint64_t have = req->h.have;
  // Synthetic pages exist only for whole pages; the model fills the last,
  // partial one too.
  const uint64_t tokens = req->tokens.size(), P = req->h.page_tokens;
  const uint64_t expected = (engine_->synthetic() ? tokens / P : (tokens + P - 1) / P) - std::min(have, tokens / P);
  std::vector<std::shared_ptr<transport::Batch>> sent;
  std::vector<Request> pending;  // pages not submitted yet
  uint64_t pending_bytes = 0, pages_sent = 0;
  absl::Time first_sent;
  absl::Status pushed;
  auto flush = [&] {
    if (pending.empty()) return;
    sent.push_back(transfer_->Submit(std::move(pending), std::max(deadline - absl::Now(), absl::Milliseconds(1))));
    pending.clear();
    pending_bytes = 0;
  };
  // Waits for every push; the hook does it once the last page is sent, so
  // the times end where the transfer did, before the engine writes the
  // pages to the store.
  auto land = [&] {
    for (auto& b : sent) {
      (void)b->Wait(deadline);
      for (const absl::Status& s : b->statuses()) {
        if (pushed.ok() && !s.ok()) pushed = Annotate(s, "pushing a page");
      }
    }
  };
  // A page goes as soon as its chunk is computed (model mode: a chunk's
  // compute dwarfs a submit); synthetic pages, made in a moment each, go
  // in batches of about a megabyte, as many small pages would otherwise
  // cost a worker hop apiece.
  PageHook push = [&](size_t page, char* l1) {
    if (page < have || page - have >= req->dst.size()) return;
    const absl::Time now = absl::Now();
    if (pages_sent == 0) first_sent = now;
    pending.push_back({Op::kWrite, l1, n.from, req->dst[page - have], page_bytes});
    pending_bytes += page_bytes;
    ++pages_sent;
    if (!engine_->synthetic() || pending_bytes >= (1 << 20) || pages_sent == expected) flush();
    if (pages_sent == expected) {
      land();
      push_s = absl::ToDoubleSeconds(absl::Now() - first_sent);
      tail_s = absl::ToDoubleSeconds(absl::Now() - now);
    }
  };
  RequestResult r = engine_->Serve(req->tokens, push);
  compute_s = r.compute_s;
  if (pages_sent != expected) {
    flush();
    land();
  }
  absl::Status st = r.status.ok() ? pushed : r.status;
  if (st.ok() && pages_sent < expected) {
    st = absl::InternalError(absl::StrCat("prefill pushed ", pages_sent, " of ", expected,
                                          " pages (its L1 could not hold the prompt)"));
  }
  answer(st, r.logits, pages_sent);
}

// --- decode

absl::StatusOr<std::unique_ptr<PdDecode>> PdDecode::Create(InferenceEngine* engine,
                                                           transport::TransferEngine* transfer,
                                                           std::vector<std::string> prefills, PdOptions options) {
  if (transfer->session_id().empty()) return absl::InvalidArgumentError("P/D needs a transfer engine in peer mode");
  if (prefills.empty()) return absl::InvalidArgumentError("P/D decode needs at least one prefill peer");
  RETURN_IF_ERROR(RegisterPool(transfer, engine));
  std::unique_ptr<PdDecode> d(new PdDecode(engine, transfer, std::move(prefills), options));
  ASSIGN_OR_RETURN(d->mailbox_, transport::SharedRegion::Create(std::max<size_t>(options.mailbox_bytes, 4096), {}));
  RETURN_IF_ERROR(Annotate(transfer->RegisterMemory(d->mailbox_->data(), d->mailbox_->size(), "cpu:0",
                                                    d->mailbox_->fd()),
                           "registering the P/D mailbox"));
  return d;
}

PdDecode::~PdDecode() {
  ReleaseQuarantined(/*all=*/true);
  (void)transfer_->UnregisterMemory(mailbox_->data());
  (void)transfer_->UnregisterMemory(engine_->cache().l1_pool().base());
}

std::string PdDecode::PickPeer() {
  const absl::Time now = absl::Now();
  for (size_t tried = 0; tried < prefills_.size(); ++tried) {
    const std::string& peer = prefills_[next_peer_++ % prefills_.size()];
    auto it = avoided_.find(peer);
    if (it == avoided_.end()) return peer;
    if (now < it->second) continue;
    // Its time out is over: used again only once it answers.
    if (transfer_->Probe(peer, now + absl::Seconds(1)).ok()) {
      avoided_.erase(it);
      return peer;
    }
    it->second = now + options_.avoid_for;
  }
  return "";
}

void PdDecode::Quarantine(const std::vector<int>& slots, absl::Time until) {
  for (int s : slots) quarantined_.emplace_back(s, until);
}

void PdDecode::ReleaseQuarantined(bool all) {
  const absl::Time now = absl::Now();
  std::erase_if(quarantined_, [&](const std::pair<int, absl::Time>& q) {
    if (!all && now < q.second) return false;
    engine_->cache().FreeL1(q.first);
    return true;
  });
}

absl::StatusOr<PdDecode::Answer> PdDecode::Remote(const std::string& peer, absl::Span<const int32_t> prompt,
                                                  size_t have, const std::vector<int>& slots, absl::Time deadline) {
  const std::string space = SpaceName(*engine_);
  const CacheConfig& cc = engine_->cache().config();
  Header h{kMagic,
           static_cast<uint32_t>(cc.page_tokens),
           next_id_++,
           cc.page_bytes,
           prompt.size(),
           have,
           slots.size(),
           absl::ToUnixMillis(deadline),
           static_cast<uint32_t>(space.size()),
           0};
  const uint64_t len = sizeof(Header) + space.size() + prompt.size() * 4 + slots.size() * 8;
  if (len > mailbox_->size()) {
    return absl::ResourceExhaustedError(absl::StrCat("request of ", len, " bytes is larger than the mailbox (",
                                                     mailbox_->size(), ")"));
  }
  char* p = mailbox_->data();
  std::memcpy(p, &h, sizeof h);
  p += sizeof h;
  std::memcpy(p, space.data(), space.size());
  p += space.size();
  std::memcpy(p, prompt.data(), prompt.size() * 4);
  p += prompt.size() * 4;
  for (int s : slots) {
    const uint64_t addr = reinterpret_cast<uintptr_t>(engine_->cache().L1Page(s));
    std::memcpy(p, &addr, 8);
    p += 8;
  }
  nlohmann::json q{{"id", h.id}, {"addr", reinterpret_cast<uintptr_t>(mailbox_->data())}, {"len", len}};
  RETURN_IF_ERROR(Annotate(transfer_->Notify(peer, "pd.req", q.dump(), deadline), "asking the prefill"));
  while (absl::Now() < deadline) {
    for (const transport::Notification& n : transfer_->TakeNotifications(deadline)) {
      nlohmann::json a = nlohmann::json::parse(n.message, nullptr, false);
      // Answers to earlier requests that were given up are dropped.
      if (n.name != "pd.done" || a.is_discarded() || !a.is_object() || a.value("id", uint64_t{0}) != h.id) continue;
      if (!a.value("ok", false)) {
        return absl::UnavailableError(absl::StrCat("prefill ", peer, " failed the request: ", a.value("error", "")));
      }
      Answer out;
      std::string raw;
      if (a.contains("logits") && a["logits"].is_string() && absl::Base64Unescape(a["logits"].get<std::string>(), &raw)) {
        out.logits.resize(raw.size() / sizeof(float));
        std::memcpy(out.logits.data(), raw.data(), out.logits.size() * sizeof(float));
      }
      auto seconds = [&](const char* field) {
        return a.contains(field) && a[field].is_number() ? std::max(0.0, a[field].get<double>()) : 0.0;
      };
      out.compute_s = seconds("compute_s");
      out.push_s = seconds("push_s");
      out.tail_s = seconds("tail_s");
      out.serve_s = seconds("serve_s");
      return out;
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("prefill ", peer, " did not finish the request by its deadline"));
}

RequestResult PdDecode::Serve(absl::Span<const int32_t> prompt) {
  ReleaseQuarantined(/*all=*/false);
  const std::string peer = PickPeer();
  auto local = [&](const std::string& why) {
    ++stats_.fallbacks;
    stats_.last_error = why;
    RequestResult r = engine_->Serve(prompt);
    r.pd = false;
    return r;
  };
  if (peer.empty()) return local("every prefill peer is avoided after a failure and did not answer a probe");
  PrefixCache& cache = engine_->cache();
  const size_t P = cache.config().page_tokens;
  // As Serve: the page holding the last token is computed, never taken
  // from the cache.
  const uint64_t loads = cache.stats().l1_loads, stores = cache.stats().l1_stores;
  Lookup lookup = cache.Acquire(prompt, prompt.empty() ? 0 : (prompt.size() - 1) / P);
  const size_t have = lookup.pages.size();
  const size_t pages = (prompt.size() + P - 1) / P;
  std::vector<int> slots;
  for (size_t i = have; i < pages; ++i) {
    const int s = cache.AllocateL1();
    if (s < 0) break;
    slots.push_back(s);
  }
  if (have + slots.size() < pages || prompt.empty()) {
    for (int s : slots) cache.FreeL1(s);
    cache.Release(&lookup);
    return local("no L1 room for the prompt's pages");
  }
  const size_t computed = prompt.size() - have * P;
  const double rate = engine_->tokens_per_s() > 0 ? engine_->tokens_per_s() : 5000;
  const absl::Time deadline =
      absl::Now() + std::max(options_.min_timeout, absl::Seconds(4.0 * static_cast<double>(computed) / rate));
  const absl::Time asked = absl::Now();
  absl::StatusOr<Answer> answer = Remote(peer, prompt, have, slots, deadline);
  if (!answer.ok()) {
    // A late write may still land in these pages until the deadline.
    Quarantine(slots, deadline + absl::Seconds(1));
    cache.Release(&lookup);
    avoided_[peer] = absl::Now() + options_.avoid_for;
    TKV_LOG(WARNING) << "P/D: " << answer.status().message() << "; computing here, and avoiding " << peer
                     << " for " << absl::FormatDuration(options_.avoid_for);
    return local(std::string(answer.status().message()));
  }
  RequestResult r;
  r.pd = true;
  r.tokens = prompt.size();
  r.cached_tokens = have * P;
  r.l1_tokens = lookup.l1_pages * P;
  r.l2_tokens = lookup.l2_pages * P;
  r.l3_tokens = lookup.l3_pages * P;
  r.lookup_tokens = std::min(lookup.keys.size(), (prompt.size() - 1) / P) * P;
  r.stop = lookup.stop;
  r.fetch_s = absl::ToDoubleSeconds(lookup.fetch_time);
  r.fetch_bytes = lookup.fetch_bytes;
  r.store_error = lookup.l3_error;
  r.corrupt_pages = lookup.l3_corrupt;
  // TTFT: the prefix's fetch, the prefill's compute, the pushes left after
  // it, and the control path (the round trip less the prefill's own time).
  const double round = absl::ToDoubleSeconds(absl::Now() - asked);
  r.compute_s = answer->compute_s;
  r.pd_transfer_s = answer->push_s;
  r.pd_exposed_s = answer->tail_s;
  r.ttft_s = r.fetch_s + answer->compute_s + answer->tail_s + std::max(0.0, round - answer->serve_s);
  r.ttft_nocache_s = static_cast<double>(prompt.size()) / rate;
  r.logits = std::move(answer->logits);
  cache.Commit(prompt, &lookup, slots);
  engine_->Account(r, loads, stores);
  ++stats_.requests;
  stats_.pages_received += slots.size();
  stats_.bytes_received += slots.size() * cache.config().page_bytes;
  stats_.transfer_s += r.pd_transfer_s;
  return r;
}

}  // namespace tierkv::engine
