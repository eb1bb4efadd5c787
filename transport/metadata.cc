#include "transport/metadata.h"

#include <map>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "config/base/auth.h"
#include "config/base/mutex.h"
#include "httplib.h"

namespace tierkv::transport {
namespace {

class InMemoryMetadata final : public MetadataClient {
 public:
  absl::StatusOr<std::string> Get(const std::string& key) override {
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

class HttpMetadata final : public MetadataClient {
 public:
  HttpMetadata(std::string url, absl::Duration timeout, std::string token, auth::TlsFiles tls)
      : url_(std::move(url)), timeout_(timeout), token_(std::move(token)), tls_(std::move(tls)) {}

  absl::StatusOr<std::string> Get(const std::string& key) override {
    auto cli = Client();
    auto res = cli->Get(Path(key));
    if (!res) return Unreachable("GET", res.error());
    if (res->status == 404) return absl::NotFoundError(absl::StrCat("no metadata for ", key));
    if (res->status != 200) return BadStatus("GET", res->status, res->body);
    return res->body;
  }
  absl::Status Put(const std::string& key, const std::string& value) override {
    auto cli = Client();
    auto res = cli->Put(Path(key), value, "application/octet-stream");
    if (!res) return Unreachable("PUT", res.error());
    if (res->status != 200) return BadStatus("PUT", res->status, res->body);
    return absl::OkStatus();
  }
  absl::Status Delete(const std::string& key) override {
    auto cli = Client();
    auto res = cli->Delete(Path(key));
    if (!res) return Unreachable("DELETE", res.error());
    if (res->status == 404) return absl::NotFoundError(absl::StrCat("no metadata for ", key));
    if (res->status != 200) return BadStatus("DELETE", res->status, res->body);
    return absl::OkStatus();
  }

 private:
  // A client per call keeps this object thread-safe without a lock;
  // descriptor traffic is rare (cached by the engine).
  std::unique_ptr<httplib::Client> Client() {
    auto cli = auth::NewHttpClient(url_, tls_, timeout_);
    if (!token_.empty()) cli->set_bearer_token_auth(token_.c_str());
    return cli;
  }
  std::string Path(const std::string& key) {
    return absl::StrCat("/metadata?key=", httplib::detail::encode_query_param(key));
  }
  absl::Status Unreachable(const char* method, httplib::Error e) {
    return absl::UnavailableError(absl::StrCat("metadata ", method, " to ", url_, " failed: ", httplib::to_string(e)));
  }
  absl::Status BadStatus(const char* method, int status, const std::string& body) {
    if (status == 401 || status == 403) {
      return absl::Status(status == 401 ? absl::StatusCode::kUnauthenticated : absl::StatusCode::kPermissionDenied,
                          absl::StrCat("metadata ", method, " to ", url_, " refused: ",
                                       body.substr(0, 200)));
    }
    return absl::InternalError(absl::StrCat("metadata ", method, " to ", url_, " answered ", status, ": ",
                                            body.substr(0, 200)));
  }

  std::string url_;  // scheme://host:port
  absl::Duration timeout_;
  std::string token_;
  auth::TlsFiles tls_;
};

}  // namespace

std::shared_ptr<MetadataClient> NewInMemoryMetadata() { return std::make_shared<InMemoryMetadata>(); }

absl::StatusOr<std::unique_ptr<MetadataClient>> NewHttpMetadata(const std::string& url,
                                                                absl::Duration timeout,
                                                                const std::string& token,
                                                                const auth::TlsFiles& tls) {
  absl::string_view rest = url;
  const bool https = absl::ConsumePrefix(&rest, "https://");
  if (!https && !absl::ConsumePrefix(&rest, "http://")) {
    return absl::InvalidArgumentError(absl::StrCat("metadata URL '", url, "' must start with http:// or https://"));
  }
  while (absl::ConsumeSuffix(&rest, "/")) {
  }
  size_t colon = rest.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(colon + 1), &port) ||
      port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metadata URL '", url, "' needs host:port"));
  }
  return std::unique_ptr<MetadataClient>(
      new HttpMetadata(absl::StrCat(https ? "https://" : "http://", rest), timeout, token, tls));
}

}  // namespace tierkv::transport
