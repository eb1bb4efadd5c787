// The C API over client::Client (see tierkv.h).
#include <cstdlib>
#include <cstring>

#include "client/client.h"
#include "client/tierkv.h"

struct tierkv_client {
  std::unique_ptr<tierkv::client::Client> impl;
};

namespace {

int Report(const absl::Status& s, char** error) {
  if (!s.ok() && error != nullptr) *error = strdup(std::string(s.message()).c_str());
  return static_cast<int>(s.code());
}

}  // namespace

extern "C" {

tierkv_client* tierkv_client_create(const char* master, const char* metadata_url, size_t lend_size,
                                    char** error) {
  if (master == nullptr || metadata_url == nullptr) {
    Report(absl::InvalidArgumentError("master and metadata_url are required"), error);
    return nullptr;
  }
  tierkv::client::ClientOptions o;
  o.master = master;
  o.metadata = metadata_url;
  o.lend_size = lend_size;
  auto c = tierkv::client::Client::Create(o);
  if (!c.ok()) {
    Report(c.status(), error);
    return nullptr;
  }
  return new tierkv_client{std::move(*c)};
}

void tierkv_client_destroy(tierkv_client* client) { delete client; }
void tierkv_free_string(char* s) { std::free(s); }

int tierkv_put(tierkv_client* client, const char* key, const void* data, size_t size, int replicas,
               char** error) {
  if (client == nullptr || key == nullptr || (data == nullptr && size > 0)) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  tierkv::client::PutOptions o;
  o.replicas = replicas;
  return Report(client->impl->Put(key, {static_cast<const char*>(data), size}, o), error);
}

int tierkv_get(tierkv_client* client, const char* key, void* buf, size_t cap, size_t* size,
               char** error) {
  if (client == nullptr || key == nullptr || (buf == nullptr && cap > 0)) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  absl::StatusOr<size_t> got = client->impl->Get(key, {static_cast<char*>(buf), cap});
  if (got.ok() && size != nullptr) *size = *got;
  return Report(got.status(), error);
}

int tierkv_batch_get(tierkv_client* client, const char* const* keys, size_t n, void* const* bufs,
                     const size_t* caps, size_t* sizes, int* codes, char** error) {
  if (client == nullptr || (n > 0 && (keys == nullptr || bufs == nullptr || caps == nullptr ||
                                      sizes == nullptr || codes == nullptr))) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  std::vector<std::string> k;
  std::vector<absl::Span<char>> outs;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] == nullptr) return Report(absl::InvalidArgumentError("null key"), error);
    k.emplace_back(keys[i]);
    outs.emplace_back(static_cast<char*>(bufs[i]), caps[i]);
  }
  auto got = client->impl->BatchGet(k, outs);
  for (size_t i = 0; i < n; ++i) {
    codes[i] = static_cast<int>(got[i].status().code());
    sizes[i] = got[i].ok() ? *got[i] : 0;
  }
  return TIERKV_OK;
}

int tierkv_exists(tierkv_client* client, const char* key, int* present, char** error) {
  if (client == nullptr || key == nullptr || present == nullptr) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  absl::StatusOr<bool> e = client->impl->Exists(key);
  if (e.ok()) *present = *e ? 1 : 0;
  return Report(e.status(), error);
}

int tierkv_prefix_match(tierkv_client* client, const char* const* keys, size_t n, size_t* matched,
                        char** error) {
  if (client == nullptr || matched == nullptr || (n > 0 && keys == nullptr)) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  std::vector<std::string> k;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] == nullptr) return Report(absl::InvalidArgumentError("null key"), error);
    k.emplace_back(keys[i]);
  }
  absl::StatusOr<size_t> m = client->impl->PrefixMatch(k);
  if (m.ok()) *matched = *m;
  return Report(m.status(), error);
}

int tierkv_remove(tierkv_client* client, const char* key, int force, char** error) {
  if (client == nullptr || key == nullptr) return Report(absl::InvalidArgumentError("null argument"), error);
  return Report(client->impl->Remove(key, force != 0), error);
}

}  // extern "C"
