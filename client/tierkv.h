/* The tierkv client's C API, for inference workers in other languages.
 *
 *   char* err = NULL;
 *   tierkv_client* c = tierkv_client_create("10.0.0.1:50051", "http://10.0.0.1:8080", 0, &err);
 *   if (c == NULL) { fprintf(stderr, "%s\n", err); tierkv_free_string(err); }
 *   int code = tierkv_put(c, "page-1", data, size, 1, &err);
 *
 * Every call returns a status code (0 = OK; otherwise an absl::StatusCode
 * value: 5 NOT_FOUND, 6 ALREADY_EXISTS, 8 RESOURCE_EXHAUSTED, 14
 * UNAVAILABLE, 15 DATA_LOSS, ...). When `error` is not NULL and the call
 * fails, *error receives a message the caller frees with
 * tierkv_free_string. Handles are opaque and thread-safe; buffers are the
 * caller's and are not kept after a call returns. No call lets a C++
 * exception reach the caller: one raised inside is answered as a status
 * (8 RESOURCE_EXHAUSTED for memory that could not be had, 13 INTERNAL
 * otherwise). */
#ifndef TIERKV_CLIENT_TIERKV_H_
#define TIERKV_CLIENT_TIERKV_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TIERKV_OK = 0,
  TIERKV_INVALID_ARGUMENT = 3,
  TIERKV_NOT_FOUND = 5,
  TIERKV_ALREADY_EXISTS = 6,
  TIERKV_RESOURCE_EXHAUSTED = 8,
  TIERKV_FAILED_PRECONDITION = 9,
  TIERKV_UNAVAILABLE = 14,
  TIERKV_DATA_LOSS = 15,
};

typedef struct tierkv_client tierkv_client;

/* lend_size > 0 also lends that many bytes of this process's memory. */
tierkv_client* tierkv_client_create(const char* master, const char* metadata_url, size_t lend_size,
                                    char** error);
void tierkv_client_destroy(tierkv_client* client);
void tierkv_free_string(char* s);

int tierkv_put(tierkv_client* client, const char* key, const void* data, size_t size, int replicas,
               char** error);
/* Reads into buf (capacity cap); *size gets the value's size. */
int tierkv_get(tierkv_client* client, const char* key, void* buf, size_t cap, size_t* size,
               char** error);
/* One call for n keys; codes[i] and sizes[i] per key. Returns 0 unless the
 * arguments are unusable. */
int tierkv_batch_get(tierkv_client* client, const char* const* keys, size_t n, void* const* bufs,
                     const size_t* caps, size_t* sizes, int* codes, char** error);
int tierkv_exists(tierkv_client* client, const char* key, int* present, char** error);
int tierkv_prefix_match(tierkv_client* client, const char* const* keys, size_t n, size_t* matched,
                        char** error);
int tierkv_remove(tierkv_client* client, const char* key, int force, char** error);

#ifdef __cplusplus
}
#endif

#endif /* TIERKV_CLIENT_TIERKV_H_ */
