// MetadataClient: where segment descriptors are published and looked up.
//
// Three implementations: the master's HTTP metadata endpoint
// (`http://host:port`, Mooncake-compatible GET/PUT/DELETE /metadata?key=),
// an in-process map for tests, and (later) etcd. Values are opaque bytes.
//
// Thread-safe. Calls block for at most the client's timeout (and Get for at
// most until its deadline).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/auth.h"

namespace tierkv::transport {

class MetadataClient {
 public:
  virtual ~MetadataClient() = default;
  // NOT_FOUND for a missing key; UNAVAILABLE when the store cannot be reached.
  absl::StatusOr<std::string> Get(const std::string& key) { return Get(key, absl::InfiniteFuture()); }
  // As Get(key), but also gives up by `deadline` (DEADLINE_EXCEEDED once
  // it has passed): a lookup made for a transfer must not outlive the
  // transfer. The HTTP client bounds each wait for the server by what is
  // left, so a server that stops answering costs no more than that.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline) = 0;
  virtual absl::Status Put(const std::string& key, const std::string& value) = 0;
  // NOT_FOUND for a missing key.
  virtual absl::Status Delete(const std::string& key) = 0;
};

// Shared by everything in one process that holds the pointer.
std::shared_ptr<MetadataClient> NewInMemoryMetadata();

// `url` is "http://host:port" or "https://host:port" (a master with
// --tls-cert; `tls.ca` verifies it, `tls.cert`/`key` answer a master that
// asks for a client certificate). INVALID_ARGUMENT for another scheme. A
// non-empty `token` goes with every request as "Authorization: Bearer";
// a master that refuses it answers UNAUTHENTICATED or PERMISSION_DENIED.
// `url` may list several ("http://h1:p,http://h2:p": the masters of a
// high-availability group): a call goes to the one that answered last, and
// to the next while one is unreachable or answers 503 (not the leader).
//
// `refresh`, when set, finds the URL list again (in the same form as
// `url`): when every URL known has failed a call with UNAVAILABLE, the
// client asks it (at most once a second, outside any lock) and, if the
// answer differs, tries the call once more over the new list. So callers
// of masters found in etcd follow a master that joined, or moved, after
// they started. A failing `refresh` adds its reason to the call's status.
using MetadataRefresh = std::function<absl::StatusOr<std::string>()>;
absl::StatusOr<std::unique_ptr<MetadataClient>> NewHttpMetadata(const std::string& url,
                                                                absl::Duration timeout = absl::Seconds(5),
                                                                const std::string& token = "",
                                                                const auth::TlsFiles& tls = {},
                                                                MetadataRefresh refresh = nullptr);

}  // namespace tierkv::transport
