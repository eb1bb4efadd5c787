// Prefill-to-decode disaggregation for the embedded engine, over the
// transfer engine in peer mode (transport/engine.h, docs/pd.md).
//
// A decode engine owns each request. PdDecode::Serve restores the longest
// prefix its cache holds (L1, L2, then the store), takes L1 pages for the
// rest, writes the request (its layout, tokens, and the address each
// missing page must land at) into a registered mailbox, and tells a
// prefill peer with a notification. The prefill (PdPrefill, a thread of
// its own) reads the request from that mailbox, checks the layout before
// it moves a byte, serves the prompt through its own engine (which writes
// new pages back to the store as usual), and pushes each page into the
// decode's L1 as the chunk computing it finishes; once every write landed
// it notifies the decode, with the first token's logits. Only then does
// the decode commit the pages to its cache.
//
// Failure never hangs and never loses the request: a prefill that refuses,
// fails a write, dies or stalls past the request's deadline makes the
// decode compute the request itself. That peer is avoided for
// PdOptions::avoid_for, then probed before it is used again. Pages a
// failed request had lent stay out of use until its deadline has passed
// (a late write may still land in them until then).
//
//   PdPrefill prefill(&prefill_engine, prefill_transfer);    // serves until destroyed
//   PdDecode decode(&decode_engine, decode_transfer, {prefill_transfer->session_id()});
//   RequestResult r = decode.Serve(prompt);                // r.pd: served by a prefill peer
//
// Both engines must be host-addressable L1 (cpu) or GPU L1 reachable by the
// cuda transport. Not thread-safe: one thread drives a PdDecode, as one
// drives its engine; a PdPrefill serves one request at a time.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "transport/engine.h"
#include "transport/memory.h"

namespace tierkv::engine {

struct PdOptions {
  // A request's deadline: at least this, or its tokens at the engine's
  // rate, times four (a prefill that is merely slow is not abandoned).
  absl::Duration min_timeout = absl::Seconds(2);
  // A peer that failed a request is not used for this long, then only
  // after a probe answered.
  absl::Duration avoid_for = absl::Seconds(5);
  size_t mailbox_bytes = 1 << 20;  // the largest request written (tokens and page addresses)
};

struct PdStats {
  uint64_t requests = 0;        // served by a prefill peer
  uint64_t fallbacks = 0;       // computed here instead (peer refused, failed, absent, avoided)
  uint64_t pages_received = 0;  // pages prefill pushed into L1
  uint64_t bytes_received = 0;
  double transfer_s = 0;        // request sent to completion notified, summed
  std::string last_error;       // why the last fallback happened
};

class PdPrefill {
 public:
  // Registers `engine`'s L1 pool with `transfer` (peer mode) and starts
  // serving. `transfer` must outlive this.
  static absl::StatusOr<std::unique_ptr<PdPrefill>> Create(InferenceEngine* engine, transport::TransferEngine* transfer);
  ~PdPrefill();  // stops serving; a request in progress finishes first
  PdPrefill(const PdPrefill&) = delete;
  PdPrefill& operator=(const PdPrefill&) = delete;

  uint64_t served() const { return served_.load(); }
  uint64_t refused() const { return refused_.load(); }

 private:
  PdPrefill(InferenceEngine* engine, transport::TransferEngine* transfer) : engine_(engine), transfer_(transfer) {}
  void Loop();
  // Serves one request named by a notification; answers the decode.
  void Handle(const transport::Notification& n);

  InferenceEngine* engine_;
  transport::TransferEngine* transfer_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> served_{0}, refused_{0};
  std::thread thread_;
};

class PdDecode {
 public:
  // Registers `engine`'s L1 pool and a mailbox with `transfer` (peer
  // mode). `prefills`: their session ids, used in turn.
  static absl::StatusOr<std::unique_ptr<PdDecode>> Create(InferenceEngine* engine, transport::TransferEngine* transfer,
                                                          std::vector<std::string> prefills, PdOptions options = {});
  ~PdDecode();

  // Serves `prompt`: the prefix from the cache, the rest from a prefill
  // peer, or all of it here when none can. RequestResult::pd says which;
  // the logits are the prefill's (model mode).
  RequestResult Serve(absl::Span<const int32_t> prompt);
  const PdStats& stats() const { return stats_; }

 private:
  PdDecode(InferenceEngine* engine, transport::TransferEngine* transfer, std::vector<std::string> prefills,
           PdOptions options)
      : engine_(engine), transfer_(transfer), prefills_(std::move(prefills)), options_(options) {}
  // The next prefill peer to ask: not avoided, or probed back; "" for none.
  std::string PickPeer();
  // What a prefill answered for a request it served.
  struct Answer {
    std::vector<float> logits;
    double compute_s = 0;  // its compute (the cost model's in synthetic mode)
    double push_s = 0;     // first page sent to last landed
    double tail_s = 0;     // of which after the last page was computed
    double serve_s = 0;    // the whole request at the prefill
  };
  // Asks `peer` to fill `slots` (pages have.. of `prompt`); OK once every
  // page landed.
  absl::StatusOr<Answer> Remote(const std::string& peer, absl::Span<const int32_t> prompt, size_t have,
                                const std::vector<int>& slots, absl::Time deadline);
  void Quarantine(const std::vector<int>& slots, absl::Time until);
  void ReleaseQuarantined(bool all);

  InferenceEngine* engine_;
  transport::TransferEngine* transfer_;
  std::vector<std::string> prefills_;
  PdOptions options_;
  size_t next_peer_ = 0;
  std::map<std::string, absl::Time> avoided_;  // peer -> until
  std::unique_ptr<transport::SharedRegion> mailbox_;  // shared memory, so a same-host prefill reads it by shm
  uint64_t next_id_ = 1;
  std::vector<std::pair<int, absl::Time>> quarantined_;  // L1 slots a failed request lent, until
  PdStats stats_;
};

}  // namespace tierkv::engine
