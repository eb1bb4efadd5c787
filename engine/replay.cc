#include "engine/replay.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <unistd.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "config/units.h"

namespace tierkv::engine {
namespace {

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

nlohmann::json ShortJson(const std::array<uint64_t, kStopReasons>& by) {
  nlohmann::json out = nlohmann::json::object();
  for (int i = 0; i < kStopReasons; ++i) {
    if (by[i] > 0) out[StopReasonName(static_cast<StopReason>(i))] = by[i];
  }
  return out;
}

}  // namespace

ReplayReport Replay(const std::vector<TraceRequest>& trace, InferenceEngine& engine, const ReplayOptions& options) {
  ReplayReport rep;
  rep.mode = engine.synthetic() ? "synthetic" : "model";
  const int P = engine.cache().config().page_tokens;
  const int vocab = 512;
  SeenPages own;
  SeenPages& seen = options.seen != nullptr ? *options.seen : own;  // the infinite cache
  CacheStats before = engine.cache_stats();
  absl::Time start = absl::Now();
  const bool bar = options.progress && isatty(STDERR_FILENO);
  for (size_t i = 0; i < trace.size(); ++i) {
    if (options.before_request) options.before_request(i);
    std::vector<int32_t> prompt = PromptTokens(trace[i], vocab, options.max_prompt_tokens);
    if (prompt.empty()) continue;
    // The bound counts pages the same way the engine may use them: whole
    // pages, never the one holding the last token.
    std::vector<PageKey> keys = PageKeys(prompt, P, engine.key_space());
    size_t usable = (prompt.size() - 1) / P, bound = 0;
    while (bound < usable && seen.contains(keys[bound])) ++bound;
    for (const PageKey& k : keys) seen.insert(k);
    RequestResult r = options.serve ? options.serve(prompt) : engine.Serve(prompt);
    if (r.pd) {
      ++rep.pd.requests;
      rep.pd.transfer_s += r.pd_transfer_s;
      rep.pd.exposed_s += r.pd_exposed_s;
    }
    if (options.after_request) options.after_request(i, r);
    ++rep.requests;
    rep.tokens += r.tokens;
    rep.cached_tokens += r.cached_tokens;
    rep.l1_tokens += r.l1_tokens;
    rep.l2_tokens += r.l2_tokens;
    rep.l3_tokens += r.l3_tokens;
    rep.bound_tokens += bound * P;
    if (bound * P > r.cached_tokens) rep.short_tokens[static_cast<int>(r.stop)] += bound * P - r.cached_tokens;
    rep.store_errors += r.store_error;
    rep.corrupt_pages += r.corrupt_pages;
    if (!r.status.ok()) {
      if (rep.failed++ == 0) rep.first_failure = std::string(r.status.message());
    }
    rep.ttft.push_back(r.ttft_s);
    rep.ttft_nocache.push_back(r.ttft_nocache_s);
    rep.window.push_back({i, trace[i].timestamp_ms, engine.window_hit_rate()});
    if (bar && (i % 10 == 0 || i + 1 == trace.size())) {
      int width = 40, done = static_cast<int>(width * (i + 1) / trace.size());
      std::fprintf(stderr, "\r  [%s%s] %zu/%zu  hit rate %.1f%%  ", std::string(done, '#').c_str(),
                   std::string(width - done, '.').c_str(), i + 1, trace.size(), 100 * rep.hit_rate());
      std::fflush(stderr);
    }
  }
  if (bar) std::fprintf(stderr, "\n");
  rep.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  const CacheStats& after = engine.cache_stats();
  rep.fetched_bytes = after.l3_fetch_bytes - before.l3_fetch_bytes;
  rep.put_bytes = after.l3_put_bytes - before.l3_put_bytes;
  rep.put_failures = after.l3_put_failures - before.l3_put_failures;
  rep.reput_pages = after.l3_reput_pages - before.l3_reput_pages;
  rep.reput_bytes = after.l3_reput_bytes - before.l3_reput_bytes;
  rep.tokens_per_s = engine.tokens_per_s();
  return rep;
}

namespace {

double PdGBps(const ReplayReport& r) { return r.pd.transfer_s > 0 ? r.pd.bytes / r.pd.transfer_s / 1e9 : 0; }

double PdShare(const ReplayReport& r) {
  double ttft_sum = 0;
  for (double t : r.ttft) ttft_sum += t;
  return ttft_sum > 0 ? r.pd.exposed_s / ttft_sum : 0;
}

nlohmann::json PdJson(const ReplayReport& r) {
  return {{"shape", r.pd.shape},
          {"requests", r.pd.requests},
          {"recomputed_here", r.pd.fallbacks},
          {"bytes_moved", r.pd.bytes},
          {"transfer_s", r.pd.transfer_s},
          {"exposed_transfer_s", r.pd.exposed_s},
          {"exposed_share_of_ttft", PdShare(r)},
          {"GBps", PdGBps(r)},
          {"raw_engine_GBps", r.pd.raw_GBps},
          {"ratio_to_raw", r.pd.raw_GBps > 0 ? PdGBps(r) / r.pd.raw_GBps : 0}};
}

}  // namespace

nlohmann::json ReplayReport::ToJson() const {
  return {{"mode", mode},
          {"requests", requests},
          {"tokens", tokens},
          {"hit_rate", hit_rate()},
          {"hit_rate_l1", tokens ? double(l1_tokens) / tokens : 0},
          {"hit_rate_l2", tokens ? double(l2_tokens) / tokens : 0},
          {"hit_rate_l3", tokens ? double(l3_tokens) / tokens : 0},
          {"infinite_cache_bound", bound_rate()},
          {"ratio_to_bound", bound_tokens ? double(cached_tokens) / bound_tokens : 1.0},
          {"ttft_mean_s", Mean(ttft)},
          {"ttft_p50_s", Percentile(ttft, 0.5)},
          {"ttft_p99_s", Percentile(ttft, 0.99)},
          {"ttft_nocache_mean_s", Mean(ttft_nocache)},
          {"ttft_nocache_p50_s", Percentile(ttft_nocache, 0.5)},
          {"ttft_nocache_p99_s", Percentile(ttft_nocache, 0.99)},
          {"store_fetched_bytes", fetched_bytes},
          {"store_put_bytes", put_bytes},
          {"store_put_failures", put_failures},
          {"store_reput_pages", reput_pages},
          {"store_reput_bytes", reput_bytes},
          {"store_evicted_pages", store_evicted_pages},
          {"store_offloaded_pages", store_offloaded_pages},
          {"store_ssd_reads", store_ssd_reads},
          {"store_offload_failed", store_offload_failed},
          {"store_ssd_dropped", store_ssd_dropped},
          {"store_stage_no_room", store_stage_no_room},
          {"evicted_needed_again", store_evicted_pages ? double(reput_pages) / store_evicted_pages : 0.0},
          {"short_of_bound_tokens", ShortJson(short_tokens)},
          {"store_errors", store_errors},
          {"corrupt_pages", corrupt_pages},
          {"failed_requests", failed},
          {"tokens_per_s_cost_model", tokens_per_s},
          {"wall_s", wall_s},
          {"pd", pd.shape.empty() ? nlohmann::json(nullptr) : PdJson(*this)}};
}

std::string ReplayReport::Table() const {
  std::string out;
  auto row = [&](const std::string& k, const std::string& v) { absl::StrAppendFormat(&out, "  %-32s %s\n", k, v); };
  auto pct = [](double x) { return absl::StrFormat("%.1f%%", 100 * x); };
  row("mode", mode);
  row("requests", absl::StrCat(requests));
  row("prompt tokens", absl::StrCat(tokens));
  row("hit rate (all tiers)", pct(hit_rate()));
  row("  L1 (device pool)", pct(tokens ? double(l1_tokens) / tokens : 0));
  row("  L2 (host pool)", pct(tokens ? double(l2_tokens) / tokens : 0));
  row("  L3 (tierkv)", pct(tokens ? double(l3_tokens) / tokens : 0));
  row("infinite-cache bound", pct(bound_rate()));
  row("ratio to the bound", absl::StrFormat("%.3f", bound_tokens ? double(cached_tokens) / bound_tokens : 1.0));
  std::string why;
  for (int i = 0; i < kStopReasons; ++i) {
    if (short_tokens[i] == 0) continue;
    absl::StrAppend(&why, why.empty() ? "" : ", ", StopReasonName(static_cast<StopReason>(i)), " ",
                    absl::StrFormat("%.2f%%", bound_tokens ? 100.0 * short_tokens[i] / bound_tokens : 0.0));
  }
  if (!why.empty()) row("short of the bound, by why", why);
  row("TTFT mean / p50 / p99", absl::StrFormat("%.1f / %.1f / %.1f ms", 1e3 * Mean(ttft), 1e3 * Percentile(ttft, 0.5),
                                               1e3 * Percentile(ttft, 0.99)));
  row("TTFT without cache (estimated)", absl::StrFormat("%.1f / %.1f / %.1f ms", 1e3 * Mean(ttft_nocache),
                                            1e3 * Percentile(ttft_nocache, 0.5), 1e3 * Percentile(ttft_nocache, 0.99)));
  row("store traffic (fetched / put)", absl::StrCat(FormatSize(fetched_bytes), " / ", FormatSize(put_bytes)));
  row("re-put after eviction", absl::StrCat(FormatSize(reput_bytes), " (", reput_pages, " pages)"));
  if (store_evicted_pages > 0) {
    row("evicted pages needed again", absl::StrFormat("%.1f%% of %d", 100.0 * reput_pages / store_evicted_pages,
                                                      store_evicted_pages));
  }
  if (store_offloaded_pages > 0) {
    row("moved to SSD / staged back", absl::StrCat(store_offloaded_pages, " / ", store_ssd_reads, " pages"));
    row("SSD moves failed / records lost", absl::StrCat(store_offload_failed, " / ", store_ssd_dropped, " pages"));
    row("SSD hits missed (no DRAM to stage)", absl::StrCat(store_stage_no_room, " pages"));
  }
  if (!pd.shape.empty()) {
    row("P/D", absl::StrCat(pd.shape, ": ", pd.requests, " requests by prefill peers, ", pd.fallbacks,
                            " recomputed here"));
    row("P/D moved / TTFT share exposed", absl::StrCat(FormatSize(pd.bytes), " / ", pct(PdShare(*this))));
    row("P/D GB/s computing (raw, ratio)", absl::StrFormat("%.2f (%.2f, %.2f)", PdGBps(*this), pd.raw_GBps,
                                                         pd.raw_GBps > 0 ? PdGBps(*this) / pd.raw_GBps : 0.0));
  }
  row("puts failed (not stored)", absl::StrCat(put_failures));
  row("store errors (recomputed)", absl::StrCat(store_errors));
  if (corrupt_pages > 0) row("corrupt pages (recomputed)", absl::StrCat(corrupt_pages));
  if (failed > 0) row("failed requests (device)", absl::StrCat(failed, ", first: ", first_failure));
  row("compute model", absl::StrFormat("%.0f tokens/s", tokens_per_s));
  row("wall time", absl::StrFormat("%.1f s", wall_s));
  return out;
}

absl::Status WriteWindowCsv(const ReplayReport& report, const std::string& path) {
  std::ofstream out(path);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  out << "request,timestamp_ms,window_hit_rate\n";
  for (const WindowPoint& p : report.window) out << p.request << ',' << p.timestamp_ms << ',' << p.hit_rate << '\n';
  return out ? absl::OkStatus() : absl::UnavailableError(absl::StrCat("writing ", path));
}

absl::Status WriteWindowSvg(const ReplayReport& report, const std::string& path) {
  std::ofstream out(path);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  const double W = 720, H = 300, L = 50, B = 40, T = 20, R = 20;
  size_t n = std::max<size_t>(report.window.size(), 2);
  auto x = [&](size_t i) { return L + (W - L - R) * i / (n - 1); };
  auto y = [&](double v) { return T + (H - T - B) * (1 - v); };
  out << absl::StrFormat("<svg xmlns='http://www.w3.org/2000/svg' width='%.0f' height='%.0f' font-family='sans-serif' font-size='11'>\n", W, H);
  out << "<rect width='100%' height='100%' fill='white'/>\n";
  for (int g = 0; g <= 4; ++g) {
    double v = g / 4.0;
    out << absl::StrFormat("<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='#ddd'/>", L, W - R, y(v), y(v));
    out << absl::StrFormat("<text x='%.1f' y='%.1f' text-anchor='end'>%d%%</text>\n", L - 6, y(v) + 4, g * 25);
  }
  out << absl::StrFormat("<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='#999' stroke-dasharray='4 3'/>", L,
                         W - R, y(report.bound_rate()), y(report.bound_rate()));
  out << absl::StrFormat("<text x='%.1f' y='%.1f' text-anchor='end' fill='#777'>infinite-cache bound</text>\n", W - R,
                         y(report.bound_rate()) - 4);
  out << "<polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='";
  for (size_t i = 0; i < report.window.size(); ++i) out << absl::StrFormat("%.1f,%.1f ", x(i), y(report.window[i].hit_rate));
  out << "'/>\n";
  out << absl::StrFormat("<text x='%.1f' y='%.1f' text-anchor='middle'>request</text>\n", (L + W - R) / 2, H - 8);
  out << absl::StrFormat("<text x='%.1f' y='14'>windowed prefix-cache hit rate (%s mode)</text>\n", L, report.mode);
  out << "</svg>\n";
  return out ? absl::OkStatus() : absl::UnavailableError(absl::StrCat("writing ", path));
}

absl::Status WriteCapacitySvg(const std::vector<CapacitySeries>& series, double bound, const std::string& title,
                              const std::string& path) {
  std::ofstream out(path);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  const double W = 720, H = 340, L = 50, B = 40, T = 24, R = 120;
  double top = std::max(bound, 0.05);
  double right = 0;
  for (const CapacitySeries& s : series) {
    for (const auto& [c, h] : s.points) {
      right = std::max(right, c);
      top = std::max(top, h);
    }
  }
  top = std::min(1.0, std::ceil(top * 10) / 10);
  right = right > 0 ? right : 1;
  auto x = [&](double c) { return L + (W - L - R) * c / right; };
  auto y = [&](double v) { return T + (H - T - B) * (1 - v / top); };
  static const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                                  "#7f7f7f"};
  out << absl::StrFormat("<svg xmlns='http://www.w3.org/2000/svg' width='%.0f' height='%.0f' font-family='sans-serif' font-size='11'>\n", W, H);
  out << "<rect width='100%' height='100%' fill='white'/>\n";
  for (int g = 0; g <= 4; ++g) {
    double v = top * g / 4;
    out << absl::StrFormat("<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='#ddd'/>", L, W - R, y(v), y(v));
    out << absl::StrFormat("<text x='%.1f' y='%.1f' text-anchor='end'>%.0f%%</text>\n", L - 6, y(v) + 4, 100 * v);
  }
  for (int g = 0; g <= 4; ++g) {
    double c = right * g / 4;
    out << absl::StrFormat("<text x='%.1f' y='%.1f' text-anchor='middle'>%g%%</text>\n", x(c), H - B + 14, 100 * c);
  }
  if (bound > 0) {
    out << absl::StrFormat("<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='#999' stroke-dasharray='4 3'/>", L,
                           W - R, y(bound), y(bound));
    out << absl::StrFormat("<text x='%.1f' y='%.1f' fill='#777'>infinite cache</text>\n", W - R + 6, y(bound) + 4);
  }
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    out << absl::StrFormat("<polyline fill='none' stroke='%s' stroke-width='1.5' points='", color);
    for (const auto& [c, h] : series[i].points) out << absl::StrFormat("%.1f,%.1f ", x(c), y(h));
    out << "'/>\n";
    out << absl::StrFormat("<text x='%.1f' y='%.1f' fill='%s'>%s</text>\n", W - R + 6, T + 14 * (i + 2), color,
                           series[i].name);
  }
  out << absl::StrFormat("<text x='%.1f' y='%.1f' text-anchor='middle'>capacity (share of the bytes the trace writes)</text>\n",
                         (L + W - R) / 2, H - 8);
  out << absl::StrFormat("<text x='%.1f' y='16'>%s</text>\n", L, title);
  out << "</svg>\n";
  return out ? absl::OkStatus() : absl::UnavailableError(absl::StrCat("writing ", path));
}

}  // namespace tierkv::engine
