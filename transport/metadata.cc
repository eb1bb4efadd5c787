#include "transport/metadata.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "base/mutex.h"
#include "base/status.h"
#include "httplib.h"

namespace tierkv::transport {
namespace {

class InMemoryMetadata final : public MetadataClient {
 public:
  using MetadataClient::Get;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Time) override {
    MutexLock lock(&mu_);
    auto it = data_.find(key);
    if (it == data_.end()) return absl::NotFoundError(absl::StrCat("no metadata for ", key));
    return it->second;
  }
  absl::Status Put(const std::string& key, const std::string& value) override {
    MutexLock lock(&mu_);
    data_[key] = value;
    return absl::OkStatus();
  }
  absl::Status Delete(const std::string& key) override {
    MutexLock lock(&mu_);
    if (data_.erase(key) == 0) return absl::NotFoundError(absl::StrCat("no metadata for ", key));
    return absl::OkStatus();
  }

 private:
  Mutex mu_;
  std::map<std::string, std::string> data_ ABSL_GUARDED_BY(mu_);
};

// "http://h1:p,https://h2:p/" as scheme://host:port each.
absl::StatusOr<std::vector<std::string>> ParseMetadataUrls(const std::string& url) {
  std::vector<std::string> urls;
  for (absl::string_view one : absl::StrSplit(url, ',', absl::SkipWhitespace())) {
    absl::string_view rest = absl::StripAsciiWhitespace(one);
    if (!absl::StartsWith(rest, "https://") && !absl::StartsWith(rest, "http://")) {
      return absl::InvalidArgumentError(absl::StrCat("metadata URL '", one, "' must start with http:// or https://"));
    }
    absl::StatusOr<std::string> checked = auth::HttpEndpointUrl(rest);
    if (!checked.ok()) return absl::InvalidArgumentError(absl::StrCat("metadata URL: ", checked.status().message()));
    urls.push_back(*std::move(checked));
  }
  if (urls.empty()) return absl::InvalidArgumentError("metadata URL is empty");
  return urls;
}

class HttpMetadata final : public MetadataClient {
 public:
  HttpMetadata(std::vector<std::string> urls, absl::Duration timeout, std::string token, auth::TlsFiles tls,
               MetadataRefresh refresh)
      : urls_(std::make_shared<const std::vector<std::string>>(std::move(urls))),
        timeout_(timeout),
        token_(std::move(token)),
        tls_(std::move(tls)),
        refresh_(std::move(refresh)) {}

  using MetadataClient::Get;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline) override {
    std::string body;
    absl::Status s = Each(deadline, [&](httplib::Client& cli, const std::string& url) -> absl::Status {
      auto res = cli.Get(Path(key));
      if (!res) return Unreachable(url, "GET", res.error());
      if (res->status == 404) return absl::NotFoundError(absl::StrCat("no metadata for ", key));
      if (res->status != 200) return BadStatus(url, "GET", res->status, res->body);
      body = std::move(res->body);
      return absl::OkStatus();
    });
    if (!s.ok()) return s;
    return body;
  }
  absl::Status Put(const std::string& key, const std::string& value) override {
    return Each(absl::InfiniteFuture(), [&](httplib::Client& cli, const std::string& url) -> absl::Status {
      auto res = cli.Put(Path(key), value, "application/octet-stream");
      if (!res) return Unreachable(url, "PUT", res.error());
      if (res->status != 200) return BadStatus(url, "PUT", res->status, res->body);
      return absl::OkStatus();
    });
  }
  absl::Status Delete(const std::string& key) override {
    return Each(absl::InfiniteFuture(), [&](httplib::Client& cli, const std::string& url) -> absl::Status {
      auto res = cli.Delete(Path(key));
      if (!res) return Unreachable(url, "DELETE", res.error());
      if (res->status == 404) return absl::NotFoundError(absl::StrCat("no metadata for ", key));
      if (res->status != 200) return BadStatus(url, "DELETE", res->status, res->body);
      return absl::OkStatus();
    });
  }

 private:
  // Runs `op` on the server that answered last, then on each other one
  // while they are unreachable or not the leader (UNAVAILABLE); when all
  // are, finds the list again (Refresh) and tries the new one. A client
  // per call keeps the calls themselves outside the lock; descriptor
  // traffic is rare (cached by the engine). Nothing is tried once
  // `deadline` has passed, and each try waits no longer than what is left.
  template <class Op>
  absl::Status Each(absl::Time deadline, Op op) {
    std::shared_ptr<const std::vector<std::string>> urls = Urls();
    absl::Status st = EachOf(*urls, deadline, op);
    if (!absl::IsUnavailable(st) || !refresh_ || absl::Now() >= deadline) return st;
    absl::StatusOr<std::shared_ptr<const std::vector<std::string>>> fresh = Refresh(urls);
    if (!fresh.ok()) {
      return absl::UnavailableError(absl::StrCat(st.message(), "; finding the masters again: ", fresh.status().message()));
    }
    if (*fresh == nullptr) return st;  // too soon to ask again, or nothing new
    return EachOf(**fresh, deadline, op);
  }
  // UNAVAILABLE from the last server tried becomes DEADLINE_EXCEEDED when
  // it was the deadline that cut the try short.
  template <class Op>
  absl::Status EachOf(const std::vector<std::string>& urls, absl::Time deadline, Op op) {
    const size_t n = urls.size();
    const size_t first = current_.load(std::memory_order_relaxed) % n;
    absl::Status st;
    for (size_t i = 0; i < n; ++i) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(
            st.ok() ? std::string("metadata call past its deadline")
                    : absl::StrCat("metadata call past its deadline; last: ", st.message()));
      }
      const size_t at = (first + i) % n;
      absl::StatusOr<std::unique_ptr<httplib::Client>> cli =
          auth::NewHttpClient(urls[at], tls_, std::min(timeout_, left));
      if (!cli.ok()) return cli.status();  // ParseMetadataUrls let through what the client refuses
      if (!token_.empty()) (*cli)->set_bearer_token_auth(token_.c_str());
      st = op(**cli, urls[at]);
      if (!absl::IsUnavailable(st)) {
        current_.store(at, std::memory_order_relaxed);
        return st;
      }
      if (absl::Now() >= deadline) return absl::DeadlineExceededError(st.message());
    }
    return st;
  }
  std::shared_ptr<const std::vector<std::string>> Urls() {
    MutexLock lock(&mu_);
    return urls_;
  }
  // The new list, installed; nullptr when the last attempt was under a
  // second ago (a dead group is not asked on every call) or the list
  // found is the one `tried`.
  absl::StatusOr<std::shared_ptr<const std::vector<std::string>>> Refresh(
      const std::shared_ptr<const std::vector<std::string>>& tried) {
    const absl::Time now = absl::Now();
    {
      MutexLock lock(&mu_);
      if (urls_ != tried) return urls_;  // another call found a new list meanwhile
      if (now - last_refresh_ < absl::Seconds(1)) return nullptr;
      last_refresh_ = now;
    }
    ASSIGN_OR_RETURN(std::string found, refresh_());
    ASSIGN_OR_RETURN(std::vector<std::string> parsed, ParseMetadataUrls(found));
    if (parsed == *tried) return nullptr;
    auto next = std::make_shared<const std::vector<std::string>>(std::move(parsed));
    MutexLock lock(&mu_);
    urls_ = next;
    current_.store(0, std::memory_order_relaxed);
    return next;
  }
  std::string Path(const std::string& key) {
    return absl::StrCat("/metadata?key=", httplib::detail::encode_query_param(key));
  }
  static absl::Status Unreachable(const std::string& url, const char* method, httplib::Error e) {
    return absl::UnavailableError(absl::StrCat("metadata ", method, " to ", url, " failed: ", httplib::to_string(e)));
  }
  static absl::Status BadStatus(const std::string& url, const char* method, int status, const std::string& body) {
    if (status == 401 || status == 403) {
      return absl::Status(status == 401 ? absl::StatusCode::kUnauthenticated : absl::StatusCode::kPermissionDenied,
                          absl::StrCat("metadata ", method, " to ", url, " refused: ", body.substr(0, 200)));
    }
    // 503: a master that is not the leader (or not ready); another may be.
    return absl::Status(status == 503 ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal,
                        absl::StrCat("metadata ", method, " to ", url, " answered ", status, ": ", body.substr(0, 200)));
  }

  Mutex mu_;
  // scheme://host:port each; replaced whole by Refresh, so a call in flight
  // keeps the list it started with.
  std::shared_ptr<const std::vector<std::string>> urls_ ABSL_GUARDED_BY(mu_);
  absl::Time last_refresh_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::atomic<size_t> current_{0};  // an index into the list; taken modulo its size
  const absl::Duration timeout_;
  const std::string token_;
  const auth::TlsFiles tls_;
  const MetadataRefresh refresh_;
};

}  // namespace

std::shared_ptr<MetadataClient> NewInMemoryMetadata() { return std::make_shared<InMemoryMetadata>(); }

absl::StatusOr<std::unique_ptr<MetadataClient>> NewHttpMetadata(const std::string& url, absl::Duration timeout,
                                                                const std::string& token, const auth::TlsFiles& tls,
                                                                MetadataRefresh refresh) {
  ASSIGN_OR_RETURN(std::vector<std::string> urls, ParseMetadataUrls(url));
  return std::unique_ptr<MetadataClient>(new HttpMetadata(std::move(urls), timeout, token, tls, std::move(refresh)));
}

}  // namespace tierkv::transport
