// Client: the library inference workers link to put and get KV blocks.
//
//   ClientOptions options;
//   options.master = "10.0.0.1:50051";
//   options.metadata = "http://10.0.0.1:8080";
//   ASSIGN_OR_RETURN(auto client, Client::Create(options));
//   RETURN_IF_ERROR(client->Put("page-1f3a...", bytes));
//   ASSIGN_OR_RETURN(std::string value, client->Get("page-1f3a..."));
//
// Put: PutStart at the master (which picks replicas and extents), writes
// the bytes to every replica through the transfer engine, then PutEnd; on
// any failure PutRevoke, so no reader ever sees a partial value. Get:
// GetReplicas (which grants a read lease), reads one replica, and tries the
// next replica when a transport fails. Every value is stored with a
// trailer that names its put and holds a CRC32C over key and value, which
// Get checks: bytes of another put (another key's, an older one's) at the
// extent read as a miss (NOT_FOUND), a checksum mismatch is DATA_LOSS;
// never data.
//
// Zero copy: Put reads from the caller's bytes and Get(key, span) writes
// into it directly; nothing is copied in between. Transports that need
// registered memory (rdma) move buffers given to RegisterMemory; any other
// buffer still works, over the next transport that reaches the store (tcp),
// so register the buffers of the fast path. Trailers always sit in memory
// the client registered itself.
//
// Deadlines: a transfer that did not finish by its deadline fails the put
// (DEADLINE_EXCEEDED, revoked, never committed). A read must finish inside
// the read lease GetReplicas granted (less a margin): one that would not is
// given up as a miss (NOT_FOUND), since after the lease the store may hand
// the extent to another put.
//
// Replica cache (ClientOptions::replica_cache; on by default, 0 turns it
// off): a Get remembers where the value sits for as long as the read lease
// GetReplicas granted with it runs (less the margin above), and a Get of
// the same key inside that time reads it there without asking the master,
// as long as the master answered this client within
// `replica_cache_fresh` (100 ms): past that, the next Get asks, which
// renews it. The lease keeps those extents from being freed or reused, so the
// bytes read are the value that was current when the lease was granted,
// and they are checksummed as always. This client's own Remove and
// RemoveAll are never answered from the cache; a key removed by another
// client (which a lease lets it do only with `force`, or once the lease
// has ended) can still be read here until the lease ends, as a read begun
// before the removal would have been. A remembered location that fails
// (its daemon died, the lease ran out mid-read, a checksum mismatch) is
// forgotten and the key asked of the master again, once. Every answer
// names the master's epoch and membership (which changes whenever
// segments leave); one naming a new one forgets every entry. So under
// faults a cached get behaves as an uncached one would have up to
// `replica_cache_fresh` earlier: gets may still succeed for that long
// after the master's last answer to this client when the master goes
// away, and a store the master has dropped (a dead or cut-off daemon) is
// not read through the cache once the client has heard of the drop, at
// most `replica_cache_fresh` after it.
//
// Batch calls are the fast path: one RPC per phase for the whole batch and
// one transfer batch; they return one status per key.
//
// Thread-safe; a Client is meant to be shared by a worker's threads.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/master_client.h"
#include "transport/engine.h"

namespace tierkv::client {

namespace internal {
class GrantCache;
class ReplicaCache;
class TrailerArena;
}

struct ClientOptions {
  std::string master = "127.0.0.1:50051";
  // http://host:port of the metadata server (the master's HTTP port), or a
  // list of them (one per master); empty: MetadataUrl's choice.
  std::string metadata;
  // Overrides `metadata` (tests, embedded clusters).
  std::shared_ptr<transport::MetadataClient> metadata_client;
  // The bearer token for a master running --auth token, sent with every
  // RPC and metadata request (base/auth.h); or the file holding it
  // (read once by Create; `token` wins). Both empty: no token.
  std::string token;
  std::string token_file;
  // TLS to the master's gRPC port (MasterClientOptions::tls); empty: plain.
  auth::TlsFiles tls;
  std::vector<std::string> transports;  // preference; empty = auto
  std::vector<std::string> rdma_devices;  // NICs for rdma ("mlx5_0"); empty = every active port
  int connections = 4;
  int workers = 4;
  std::string listen = "127.0.0.1";
  absl::Duration rpc_timeout = absl::Seconds(5);
  absl::Duration transfer_timeout = absl::Seconds(30);
  // How long a call busy-polls for its reply (the master's direct lane, a
  // tcp transfer) before sleeping in the kernel. A reply due within it
  // costs no wake-up, which is tens of microseconds on virtual machines;
  // the caller's core is busy meanwhile. 0 never spins; at most 1 ms.
  absl::Duration reply_spin = absl::Microseconds(50);
  bool verify_checksums = true;
  // Keys whose replicas are remembered while their read lease runs, so a
  // repeated Get of a key skips the master (see "Replica cache" above);
  // 0 turns this off. An entry costs about a hundred bytes and its key.
  size_t replica_cache = 16384;
  // Entries serve only within this of the master's last answer to a
  // GetReplicas of this client; the bound on how stale a cached get may be
  // under faults.
  absl::Duration replica_cache_fresh = absl::Milliseconds(100);
  // While DRAM is evicted the master counts readers, and a read's lease is
  // given back as soon as the read is over, so the object may go at once.
  // The replica cache keeps such a read (and its lease) this long at most;
  // 0 gives it back at once and never caches it.
  absl::Duration replica_cache_hold = absl::Milliseconds(100);
  // Lend this much of the client's own memory as a segment (0: none).
  // With a token or a certificate (a master that authenticates; the
  // credential then needs the daemon role to mount), the segment admits
  // only connections with a data grant, as a daemon running --auth does.
  uint64_t lend_size = 0;
  std::string lend_name;  // default: "client-<id>"
  std::string host;       // host identity for replica spreading; default: the machine's
  std::string client_id;  // default: random
};

struct PutOptions {
  int replicas = 1;
  std::string preferred_segment;  // e.g. local_segment() to keep KV local
  bool soft_pin = false;  // evicted only after every unpinned object
  bool hard_pin = false;  // never evicted; leaves only by Remove
};

// One value of a batch put. `group`: items of one BatchPut with the same
// non-empty group become visible together and leave together.
// `parent_key`: the previous page of the same prefix (prefix-aware eviction).
// `parts`: when not empty, the value is their concatenation (and `value` is
// ignored), each part read in place: a value gathered from several buffers
// is never joined in a copy.
struct PutItem {
  std::string key;
  absl::string_view value;  // binary-safe; the caller's bytes, read in place
  std::string group;
  std::string parent_key;
  std::vector<absl::string_view> parts;
};

// What StartReadSession leased: one entry per key asked, in order.
class ReadSession {
 public:
  ReadSession(const ReadSession&) = delete;
  ReadSession& operator=(const ReadSession&) = delete;
  ~ReadSession();
  size_t size() const;
  const std::string& key(size_t i) const;
  // Key i's value size, or why it cannot be read (NOT_FOUND: a miss).
  absl::StatusOr<uint64_t> value_size(size_t i) const;
  // When key i's lease ends on this process's clock, less the margin.
  absl::Time lease_end(size_t i) const;

 private:
  friend class Client;
  ReadSession();
  struct State;
  std::unique_ptr<State> state_;
};

// One range of a session's value: out.size() bytes from `offset`.
struct RangeRead {
  size_t key = 0;  // the key's index in the session
  uint64_t offset = 0;
  absl::Span<char> out;
};

// What StartWriteSession granted: one entry per item, in order.
class WriteSession {
 public:
  WriteSession(const WriteSession&) = delete;
  WriteSession& operator=(const WriteSession&) = delete;
  ~WriteSession();
  size_t size() const;
  const std::string& key(size_t i) const;
  // OK while key i can be written (or once committed); else why not.
  absl::Status status(size_t i) const;

 private:
  friend class Client;
  WriteSession();
  struct State;
  std::unique_ptr<State> state_;
};

// One value of a write session: its key and size, and as in PutItem.
struct WriteItem {
  std::string key;
  uint64_t size = 0;
  std::string group;
  std::string parent_key;
};

// One range of a session's value: `data` written at `offset`.
struct RangeWrite {
  size_t key = 0;  // the key's index in the session
  uint64_t offset = 0;
  absl::string_view data;
};

class Client {
 public:
  // INVALID_ARGUMENT for bad options; errors from starting the transfer
  // engine or lending memory (the first mount must succeed).
  static absl::StatusOr<std::unique_ptr<Client>> Create(ClientOptions options);
  ~Client();

  // ALREADY_EXISTS if the key is present or being put; RESOURCE_EXHAUSTED
  // when the cluster has no room; UNAVAILABLE when the master or a store
  // cannot be reached. A put whose grant came from a master that was
  // replaced before the put committed (a failover: the new leader never
  // knew of the grant, and daemons refuse writes at the old epoch) is put
  // again once, from the start, at the new leader; items of a group are
  // not (the group fails whole, as it would). One refused because every
  // segment awaits its daemon's re-mount (a master just elected or
  // restarted) is tried again until rpc_timeout has passed.
  absl::Status Put(const std::string& key, absl::string_view value, const PutOptions& options = {});
  std::vector<absl::Status> BatchPut(const std::vector<PutItem>& items, const PutOptions& options = {});

  // NOT_FOUND for a miss; DATA_LOSS on a checksum mismatch.
  absl::StatusOr<std::string> Get(const std::string& key);
  // Into `out`; the value's size. INVALID_ARGUMENT if `out` is too small.
  absl::StatusOr<size_t> Get(const std::string& key, absl::Span<char> out);
  // `timeout` bounds the data transfer (zero: the client's default); a
  // prefetch that must not stall a request passes a short one.
  std::vector<absl::StatusOr<size_t>> BatchGet(const std::vector<std::string>& keys,
                                               const std::vector<absl::Span<char>>& outs,
                                               absl::Duration timeout = absl::ZeroDuration());
  std::vector<absl::StatusOr<std::string>> BatchGet(const std::vector<std::string>& keys);
  // Scatters each value over its buffers, in order, filling each before
  // the next; buffers past the value's end are left untouched. The value's
  // size; INVALID_ARGUMENT when the buffers together are too small.
  std::vector<absl::StatusOr<size_t>> BatchGetScatter(const std::vector<std::string>& keys,
                                                      const std::vector<std::vector<absl::Span<char>>>& outs,
                                                      absl::Duration timeout = absl::ZeroDuration());

  // Read sessions (Mooncake's get sessions): StartReadSession asks the
  // master once for every key and keeps one located value per key under
  // the read lease the master granted (staging SSD hits first), so the
  // value cannot be evicted, removed or overwritten while it runs.
  // ReadRanges then reads byte ranges of those values with no master call,
  // as often as the caller likes, until the lease ends (the master's
  // --lease-ttl, less the client's margin); EndReadSession gives back the
  // leases the master counts. Per range: OK; the key's own status from the
  // start (NOT_FOUND for a miss); OUT_OF_RANGE for a range past the
  // value's end; ABORTED once the key's lease has ended or the session was
  // ended, or when the read could not finish inside the lease (nothing read
  // then is data); a transport
  // error when every replica failed. Ranges are not checksummed (the
  // checksum covers the whole value), but each read checks the trailer's
  // put id, so bytes of any other put read as NOT_FOUND, never as data.
  // A session must not outlive its client; it may be read from by several
  // threads at once. End it once its reads are over (idempotent).
  std::unique_ptr<ReadSession> StartReadSession(const std::vector<std::string>& keys);
  std::vector<absl::Status> ReadRanges(const ReadSession& session, const std::vector<RangeRead>& reads,
                                       absl::Duration timeout = absl::ZeroDuration());
  void EndReadSession(ReadSession& session);

  // Write sessions (Mooncake's put sessions): StartWriteSession asks the
  // master for room for every item (one PutStart, as a put does);
  // WriteRanges writes byte ranges of the values to every replica with no
  // master call, in any order, from any thread; CommitWriteSession writes
  // each key's trailer and commits (one PutEnd) the keys whose ranges
  // covered their value exactly, revoking the others and every member of a
  // group with a failed member; RevokeWriteSession revokes every key not
  // committed. Nothing is visible to readers before the commit, and a key
  // with a failed write is never committed. Per range: OK; the key's own
  // status (its start or an earlier write failed); INVALID_ARGUMENT for a
  // bad key index or a range overlapping one already written; OUT_OF_RANGE
  // past the value's size; FAILED_PRECONDITION once the key was committed
  // or revoked; a transport error (the key then fails). Per key
  // from the commit: OK, or why it was not committed (FAILED_PRECONDITION
  // naming the first byte never written). The master revokes keys left
  // uncommitted past its --put-timeout itself. Must not outlive its client.
  std::unique_ptr<WriteSession> StartWriteSession(const std::vector<WriteItem>& items,
                                                  const PutOptions& options = {});
  std::vector<absl::Status> WriteRanges(WriteSession& session, const std::vector<RangeWrite>& writes,
                                        absl::Duration timeout = absl::ZeroDuration());
  // Commit and revoke take the keys at the indices in `which` (empty: all);
  // the commit answers one status per key it names. A key is committed or
  // revoked once: FAILED_PRECONDITION after that.
  std::vector<absl::Status> CommitWriteSession(WriteSession& session, absl::Span<const size_t> which = {});
  void RevokeWriteSession(WriteSession& session, absl::Span<const size_t> which = {});

  absl::StatusOr<bool> Exists(const std::string& key);
  absl::StatusOr<std::vector<bool>> BatchExists(const std::vector<std::string>& keys);
  // How many leading keys are present (a prefix cache's question).
  absl::StatusOr<size_t> PrefixMatch(const std::vector<std::string>& keys);
  // NOT_FOUND; FAILED_PRECONDITION while leased unless `force`.
  absl::Status Remove(const std::string& key, bool force = false);
  // Removes every complete object; leased ones (being read) stay unless
  // `force`. How many were removed; UNAVAILABLE when the master is away.
  absl::StatusOr<uint64_t> RemoveAll(bool force = false);

  // For transports that need registered local memory.
  absl::Status RegisterMemory(void* addr, size_t length);
  absl::Status UnregisterMemory(void* addr);

  // The lent segment's name ("" when not lending) and whether it is mounted.
  // The metadata URL(s) this client found or was given at start.
  const std::string& metadata_url() const { return options_.metadata; }
  std::string local_segment() const;
  bool local_segment_mounted() const;

  transport::TransferEngine& engine() { return *engine_; }
  MasterClient& master() { return *master_; }

 private:
  Client() = default;
  struct Impl;
  // One try of BatchPut; `epoch`: the epoch of the master that granted it;
  // `unanswered`: PutStart itself failed UNAVAILABLE (no master answered
  // it; one may have died holding it).
  std::vector<absl::Status> PutOnce(const std::vector<PutItem>& items, const PutOptions& options, uint64_t* epoch,
                                    bool* unanswered);
  // Where one value goes: buffers that together hold exactly its bytes.
  using Pieces = absl::InlinedVector<absl::Span<char>, 1>;
  // GetReplicas, then reads each present key into place(i, value_size)
  // (false: the caller has no room, INVALID_ARGUMENT), inside its lease.
  std::vector<absl::StatusOr<size_t>> Fetch(const std::vector<std::string>& keys, absl::Duration timeout,
                                            const std::function<bool(size_t, uint64_t, Pieces*)>& place);
  ClientOptions options_;
  std::unique_ptr<MasterClient> master_;
  std::unique_ptr<transport::TransferEngine> engine_;
  std::unique_ptr<internal::TrailerArena> trailers_;  // registered with engine_
  std::unique_ptr<internal::ReplicaCache> replicas_;
  std::shared_ptr<internal::GrantCache> grants_;  // data grants, shared with engine_
  std::unique_ptr<class SegmentLender> lender_;
};

// http://host:port of the metadata server of the master at `master`
// (host:port): the host from `master`, the port the master reports. For
// clients told only where the master is (Mooncake's "P2PHANDSHAKE").
// With several masters ("h1:p1,h2:p2", docs/ha.md) the answer lists one URL
// per master host, each with the port the leader reports (every master of
// a group is taken to serve HTTP on the same port), so metadata calls
// follow the leader as RPCs do; the same for "etcd://h:p/<cluster>", with
// the masters etcd names.
// UNAVAILABLE when the master cannot be reached; NOT_FOUND from a master
// that does not report its HTTP port. `token`, `tls`: as in ClientOptions.
absl::StatusOr<std::string> DiscoverMetadata(const std::string& master,
                                             absl::Duration timeout = absl::Seconds(5),
                                             const std::string& token = "", const auth::TlsFiles& tls = {});

// The metadata URL(s) for a client or daemon of `master`, given `metadata`
// as configured: `metadata` when set; otherwise, for one host:port master,
// http://<its host>:8080 (the master's default HTTP port), and for a list
// of masters or an etcd:// address, DiscoverMetadata (so the masters must
// answer).
absl::StatusOr<std::string> MetadataUrl(const std::string& metadata, const std::string& master,
                                        absl::Duration timeout = absl::Seconds(5), const std::string& token = "",
                                        const auth::TlsFiles& tls = {});

// How a metadata client given MetadataUrl's answer finds the URLs again
// (transport::NewHttpMetadata's `refresh`): where they were discovered
// (no `metadata` given; a list of masters or etcd://), DiscoverMetadata
// once more, so a client or daemon follows a master that joined or moved
// after it started. nullptr where the URL was given or guessed.
transport::MetadataRefresh MetadataRefresher(const std::string& metadata, const std::string& master,
                                             absl::Duration timeout = absl::Seconds(5), const std::string& token = "",
                                             const auth::TlsFiles& tls = {});

// Bytes a value of `size` occupies in the store (value + checksum trailer).
uint64_t StoredSize(uint64_t value_size);
// A value's bytes from its object's stored size and put id (as
// /v1/objects/{key} gives them): objects put before put ids have a
// shorter trailer.
uint64_t ValueSizeOf(uint64_t stored_size, uint64_t put_id);

}  // namespace tierkv::client
