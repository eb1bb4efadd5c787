// The C API over client::Client (see tierkv.h).
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>

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

// Runs `body`, answering an exception (an allocation that failed, a
// library that throws) as a status: one unwinding into C would end the
// caller's process.
template <class Body>
int Guarded(char** error, Body body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Report(absl::ResourceExhaustedError("out of memory"), error);
  } catch (const std::exception& e) {
    return Report(absl::InternalError(e.what()), error);
  } catch (...) {
    return Report(absl::InternalError("unknown exception"), error);
  }
}

}  // namespace

extern "C" {

tierkv_client* tierkv_client_create(const char* master, const char* metadata_url, size_t lend_size,
                                    char** error) {
  if (master == nullptr || metadata_url == nullptr) {
    Report(absl::InvalidArgumentError("master and metadata_url are required"), error);
    return nullptr;
  }
  tierkv_client* made = nullptr;
  Guarded(error, [&] {
    tierkv::client::ClientOptions o;
    o.master = master;
    o.metadata = metadata_url;
    o.lend_size = lend_size;
    auto c = tierkv::client::Client::Create(o);
    if (!c.ok()) return Report(c.status(), error);
    made = new tierkv_client{std::move(*c)};
    return static_cast<int>(TIERKV_OK);
  });
  return made;
}

void tierkv_client_destroy(tierkv_client* client) { delete client; }
void tierkv_free_string(char* s) { std::free(s); }

int tierkv_put(tierkv_client* client, const char* key, const void* data, size_t size, int replicas,
               char** error) {
  if (client == nullptr || key == nullptr || (data == nullptr && size > 0)) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  return Guarded(error, [&] {
    tierkv::client::PutOptions o;
    o.replicas = replicas;
    return Report(client->impl->Put(key, {static_cast<const char*>(data), size}, o), error);
  });
}

int tierkv_get(tierkv_client* client, const char* key, void* buf, size_t cap, size_t* size,
               char** error) {
  if (client == nullptr || key == nullptr || (buf == nullptr && cap > 0)) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  return Guarded(error, [&] {
    absl::StatusOr<size_t> got = client->impl->Get(key, {static_cast<char*>(buf), cap});
    if (got.ok() && size != nullptr) *size = *got;
    return Report(got.status(), error);
  });
}

int tierkv_batch_get(tierkv_client* client, const char* const* keys, size_t n, void* const* bufs,
                     const size_t* caps, size_t* sizes, int* codes, char** error) {
  if (client == nullptr || (n > 0 && (keys == nullptr || bufs == nullptr || caps == nullptr ||
                                      sizes == nullptr || codes == nullptr))) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  return Guarded(error, [&] {
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
    return static_cast<int>(TIERKV_OK);
  });
}

int tierkv_exists(tierkv_client* client, const char* key, int* present, char** error) {
  if (client == nullptr || key == nullptr || present == nullptr) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  return Guarded(error, [&] {
    absl::StatusOr<bool> e = client->impl->Exists(key);
    if (e.ok()) *present = *e ? 1 : 0;
    return Report(e.status(), error);
  });
}

int tierkv_prefix_match(tierkv_client* client, const char* const* keys, size_t n, size_t* matched,
                        char** error) {
  if (client == nullptr || matched == nullptr || (n > 0 && keys == nullptr)) {
    return Report(absl::InvalidArgumentError("null argument"), error);
  }
  return Guarded(error, [&] {
    std::vector<std::string> k;
    for (size_t i = 0; i < n; ++i) {
      if (keys[i] == nullptr) return Report(absl::InvalidArgumentError("null key"), error);
      k.emplace_back(keys[i]);
    }
    absl::StatusOr<size_t> m = client->impl->PrefixMatch(k);
    if (m.ok()) *matched = *m;
    return Report(m.status(), error);
  });
}

int tierkv_remove(tierkv_client* client, const char* key, int force, char** error) {
  if (client == nullptr || key == nullptr) return Report(absl::InvalidArgumentError("null argument"), error);
  return Guarded(error, [&] { return Report(client->impl->Remove(key, force != 0), error); });
}

}  // extern "C"
