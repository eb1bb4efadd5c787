"""tierkv: the Python client of the tierkv distributed KV-cache store.

    import tierkv
    c = tierkv.Client("10.0.0.1:50051")          # metadata URL from the master
    c.put("page-1", b"...")                        # or any buffer (numpy, torch, memoryview)
    value = c.get("page-1")                        # bytes, or None on a miss
    n = c.get_into("page-1", out_array)            # into a writable buffer, zero-copy

Every call releases the GIL while the C++ client works, so Python threads
run meanwhile. Single-key calls raise an Error subclass that names the status
(tierkv.Unavailable, tierkv.AlreadyExists, ...); a read miss is None. Batch
calls never raise for one key: they return one entry per key.

Faces: tierkv.Client (this module), tierkv.mooncake_compat (Mooncake's Python
store API), tierkv.sglang (HiCache storage backend), tierkv.lmcache.
"""

import os

from . import _errors
from ._errors import *  # noqa: F401,F403  (Error and one class per status)
from ._errors import Error, from_status
from ._tierkv import buffer_address, discover_metadata, read_token_file, stored_size, value_size
from ._tierkv import DEFAULT_REPLICA_CACHE, _Client

__all__ = ["Client", "ReadSession", "WriteSession", "DEFAULT_REPLICA_CACHE", "Error", "buffer_address", "discover_metadata", "read_token_file",
           "stored_size", "value_size"] + [n for n in _errors.__all__ if n not in ("from_status", "CODE_NAMES")]


def _key(k):
    return k if isinstance(k, (str, bytes)) else str(k)


def _results(pair, ok_value):
    """One entry per key from the module's (values, errors) batch answer:
    ok_value(v) where it succeeded, the Error where it did not."""
    values, errors = pair
    out = [ok_value(v) for v in values]
    for i, code, msg in errors:
        out[i] = from_status(code, msg)
    return out


class ReadSession:
    """Leased values whose byte ranges are read without asking the master.

        with client.read_session(["k1", "k2"]) as s:
            sizes = s.sizes()                        # int, or the Error (NotFound: a miss)
            errs = s.read_ranges([(0, ptr, n, off)])  # (key index, address, size, offset)

    read_ranges gives one entry per range: None when read, else the Error:
    NotFound (the key missed, or its bytes are another put's), OutOfRange
    (past the value's end), Aborted (the lease ended, or the session did:
    start a new one), a transport error. end() gives the leases back.
    Usable from several threads; end it once its reads are over.
    """

    def __init__(self, session, keys):
        self._s = session
        self.keys = keys

    def sizes(self):
        return [v if v >= 0 else from_status(-v, f"{k!r} cannot be read") for k, v in zip(self.keys, self._s.sizes())]

    def read_ranges(self, ranges, *, timeout=0.0):
        ranges = list(ranges)
        pair = self._s.read_ranges([int(r[0]) for r in ranges], [int(r[1]) for r in ranges],
                                   [int(r[2]) for r in ranges], [int(r[3]) for r in ranges], float(timeout))
        return _results(pair, lambda v: None)

    def end(self):
        self._s.end()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.end()


class WriteSession:
    """Values written range by range and committed together.

        s = client.write_session(["k"], [n])
        s.statuses()                           # per key None, or the Error (AlreadyExists, ...)
        s.write_ranges([(0, ptr, size, off)])  # (key index, address, size, offset)
        s.commit()                             # per key None, or why it was not committed

    Each byte of a value is written once, in any order and from any
    thread; commit() makes visible the keys whose ranges covered their
    value and revokes the rest; revoke() gives up every key.
    """

    def __init__(self, session, keys):
        self._s = session
        self.keys = keys

    def statuses(self):
        return _results(self._s.statuses(), lambda v: None)

    def write_ranges(self, ranges, *, timeout=0.0):
        ranges = list(ranges)
        pair = self._s.write_ranges([int(r[0]) for r in ranges], [int(r[1]) for r in ranges],
                                    [int(r[2]) for r in ranges], [int(r[3]) for r in ranges], float(timeout))
        return _results(pair, lambda v: None)

    def commit(self, indices=None):
        """Commits the keys at `indices` (None: all); per key named, None
        or why it was not committed. A key commits or revokes once."""
        return _results(self._s.commit([int(i) for i in indices or []]), lambda v: None)

    def revoke(self, indices=None):
        """Gives up the keys at `indices` (None: all) not yet committed."""
        self._s.revoke([int(i) for i in indices or []])


class Client:
    """The C++ client (client::Client). Thread-safe: share one per process.

    master: host:port of the master's RPC port (or "h1:p1,h2:p2", or
    "etcd://h:p/<cluster>": a high-availability group). metadata:
    http://host:port (https:// for a master with --tls-cert) of the metadata
    server, or one per master, comma-separated; None asks the master(s) for
    it, and a group again when its masters move. lend_size: bytes of this
    process's memory lent to the cluster as a segment (0: none).
    Timeouts are in seconds. reply_spin: seconds a call busy-polls for its
    reply before sleeping (0: never). replica_cache: keys whose replicas are
    remembered while their read lease runs and the master answered within
    100 ms, so a repeated get skips the master (0: off; client/client.h). token (or token_file, a file whose
    first word is the token; default $TIERKV_TOKEN_FILE): the bearer token
    for a master running --auth token. tls_ca (default $TIERKV_TLS_CA): the
    PEM certificates that sign the master's (and daemons'), to reach a master
    serving TLS; tls_cert and tls_key (default $TIERKV_TLS_CERT,
    $TIERKV_TLS_KEY): ours, for one that requires client certificates (with
    --auth mtls they are who we are).
    Raises Unavailable when the master
    cannot be reached, Unauthenticated or PermissionDenied when it refuses
    the token, InvalidArgument for bad options.
    """

    def __init__(self, master="127.0.0.1:50051", metadata=None, *, transports=None, rdma_devices=None,
                 lend_size=0, lend_name="", host="", client_id="", listen="127.0.0.1", rpc_timeout=5.0,
                 transfer_timeout=30.0, verify_checksums=True, connections=4, workers=4, reply_spin=50e-6,
                 replica_cache=DEFAULT_REPLICA_CACHE, token=None, token_file=None, tls_ca=None, tls_cert=None, tls_key=None):
        if not token:
            token_file = token_file or os.environ.get("TIERKV_TOKEN_FILE", "")
            token = read_token_file(token_file) if token_file else ""
        tls = (tls_ca or os.environ.get("TIERKV_TLS_CA", ""), tls_cert or os.environ.get("TIERKV_TLS_CERT", ""),
               tls_key or os.environ.get("TIERKV_TLS_KEY", ""))
        # With several masters or etcd://, the C++ client finds the URLs
        # itself, and again when the masters move; one master is asked for
        # its HTTP port.
        group = master.startswith("etcd://") or "," in master
        if not metadata and not group:
            metadata = discover_metadata(master, rpc_timeout, token, *tls)
        self._follow = group and not metadata
        self._c = _Client(master, metadata or "", list(transports or []), list(rdma_devices or []), int(lend_size),
                          lend_name, host, client_id, listen, float(rpc_timeout), float(transfer_timeout),
                          bool(verify_checksums), int(connections), int(workers), float(reply_spin), int(replica_cache), token,
                          *tls)
        self._token = token
        self._tls = tls
        self.master = master
        self.metadata = self._c.metadata_url

    def http_get(self, path, timeout=5.0):
        """GET `path` on the master's HTTP port (the metadata URL), with this
        client's token and, for an https:// URL, its TLS files; the body as
        bytes. With several masters, each in turn while one is unreachable or
        answers 503 (not the leader); with masters found in etcd or a list
        and none answering, they are found again once. Raises
        urllib.error.HTTPError for an error status, OSError when no master
        can be reached."""
        try:
            return self._http_get(self.metadata, path, timeout)
        except OSError as e:
            if not self._follow or (getattr(e, "code", 503) != 503):
                raise
            found = discover_metadata(self.master, timeout, self._token, *self._tls)
            if found == self.metadata:
                raise
            self.metadata = found
            return self._http_get(found, path, timeout)

    def _http_get(self, urls, path, timeout):
        import ssl
        import urllib.error
        import urllib.request

        last = None
        for url in urls.split(","):
            url = url.strip().rstrip("/")
            req = urllib.request.Request(url + path)
            if self._token:
                req.add_header("Authorization", f"Bearer {self._token}")
            context = None
            if url.startswith("https://"):
                ca, cert, key = self._tls
                context = ssl.create_default_context(cafile=ca or None)
                if cert:
                    context.load_cert_chain(cert, key or None)
            try:
                with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
                    return r.read()
            except urllib.error.HTTPError as e:
                if e.code != 503:
                    raise
                last = e
            except OSError as e:
                last = e
        raise last

    def close(self):
        """Stops the client (and unlends its segment). Later calls raise FailedPrecondition."""
        self._c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- writes ---------------------------------------------------------
    # Every put takes replicas, preferred_segment (a segment name to place the
    # first replica on), soft_pin (evicted only after unpinned objects) and
    # hard_pin (never evicted; only remove takes it out).
    def put(self, key, value, *, replicas=1, preferred_segment="", soft_pin=False, hard_pin=False, group="",
            parent_key=""):
        """Stores `value` (any C-contiguous buffer, read in place). AlreadyExists
        if the key is present (first writer wins); ResourceExhausted when full."""
        self._c.put(_key(key), value, replicas, preferred_segment, soft_pin, hard_pin, group, parent_key)

    def put_ptr(self, key, ptr, size, *, replicas=1, preferred_segment="", soft_pin=False, hard_pin=False,
                group="", parent_key=""):
        """Stores `size` bytes at address `ptr` (memory the caller keeps alive for the call)."""
        self._c.put_ptr(_key(key), int(ptr), int(size), replicas, preferred_segment, soft_pin, hard_pin, group,
                        parent_key)

    def put_parts(self, key, *parts, replicas=1, preferred_segment="", soft_pin=False, hard_pin=False):
        """Stores the concatenation of `parts` as one value; each part is read in
        place, never joined in a copy."""
        self._c.put_parts(_key(key), list(parts), replicas, preferred_segment, soft_pin, hard_pin)

    def batch_put(self, keys, values, *, groups=None, parent_keys=None, replicas=1, preferred_segment="",
                  soft_pin=False, hard_pin=False):
        """One entry per key: None where stored, the Error otherwise. Items with
        the same group become visible and leave together; parent_keys[i] is the
        previous page of the same prefix. InvalidArgument if lengths differ."""
        return _results(self._c.batch_put([_key(k) for k in keys], list(values), list(groups or []),
                                          list(parent_keys or []), replicas, preferred_segment, soft_pin,
                                          hard_pin),
                        lambda v: None)

    def batch_put_ptrs(self, keys, ptrs, sizes, *, groups=None, parent_keys=None, replicas=1,
                       preferred_segment="", soft_pin=False, hard_pin=False):
        """batch_put from (address, size) pairs."""
        return _results(self._c.batch_put_ptrs([_key(k) for k in keys], [int(p) for p in ptrs],
                                               [int(s) for s in sizes], list(groups or []),
                                               list(parent_keys or []), replicas, preferred_segment, soft_pin,
                                               hard_pin),
                        lambda v: None)

    def batch_put_parts(self, keys, parts, *, groups=None, parent_keys=None, replicas=1, preferred_segment="",
                        soft_pin=False, hard_pin=False):
        """batch_put where key i's value is the concatenation of the buffers
        parts[i], each read in place."""
        return _results(self._c.batch_put_parts([_key(k) for k in keys], [list(p) for p in parts],
                                                list(groups or []), list(parent_keys or []), replicas,
                                                preferred_segment, soft_pin, hard_pin),
                        lambda v: None)

    def batch_put_ptr_parts(self, keys, ptrs, sizes, *, groups=None, parent_keys=None, replicas=1,
                            preferred_segment="", soft_pin=False, hard_pin=False):
        """batch_put_parts from addresses: key i's value is the concatenation of
        sizes[i][j] bytes at ptrs[i][j]."""
        return _results(self._c.batch_put_ptr_parts([_key(k) for k in keys], [[int(p) for p in ps] for ps in ptrs],
                                                    [[int(s) for s in ss] for ss in sizes], list(groups or []),
                                                    list(parent_keys or []), replicas, preferred_segment, soft_pin,
                                                    hard_pin),
                        lambda v: None)

    # --- reads ----------------------------------------------------------
    def get(self, key):
        """The value as bytes, or None on a miss. DataLoss on a checksum mismatch."""
        return self._c.get(_key(key))

    def __getitem__(self, key):
        v = self.get(key)
        if v is None:
            raise KeyError(key)
        return v

    def __contains__(self, key):
        return self.exists(key)

    def get_into(self, key, out):
        """Reads into the writable buffer `out`; the value's size, or None on a
        miss. InvalidArgument if `out` is too small."""
        return self._c.get_into(_key(key), out)

    def get_into_ptr(self, key, ptr, size):
        """get_into for `size` bytes at address `ptr`."""
        return self._c.get_into_ptr(_key(key), int(ptr), int(size))

    def batch_get(self, keys):
        """One entry per key: bytes, None on a miss, or the Error."""
        out = []
        for v in self._c.batch_get([_key(k) for k in keys]):
            if isinstance(v, bytes):
                out.append(v)
            elif v[0] == 5:  # NOT_FOUND
                out.append(None)
            else:
                out.append(from_status(*v))
        return out

    def batch_get_into(self, keys, outs, *, timeout=0.0):
        """One entry per key: the size read into outs[i], None on a miss, or the
        Error. `timeout` (seconds, 0: the client's) bounds the transfer."""
        return self._sizes(self._c.batch_get_into([_key(k) for k in keys], list(outs), float(timeout)))

    def batch_get_into_ptrs(self, keys, ptrs, sizes, *, timeout=0.0):
        """batch_get_into for (address, size) pairs."""
        return self._sizes(self._c.batch_get_into_ptrs([_key(k) for k in keys], [int(p) for p in ptrs],
                                                       [int(s) for s in sizes], float(timeout)))

    def batch_get_into_parts(self, keys, outs, *, timeout=0.0):
        """Scatters key i's value over the writable buffers outs[i], in order,
        filling each before the next. One entry per key: the value's size,
        None on a miss, or the Error (InvalidArgument where outs[i] together
        are too small)."""
        return self._sizes(self._c.batch_get_into_parts([_key(k) for k in keys], [list(o) for o in outs],
                                                        float(timeout)))

    def batch_get_into_ptr_parts(self, keys, ptrs, sizes, *, timeout=0.0):
        """batch_get_into_parts over sizes[i][j] bytes at ptrs[i][j]."""
        return self._sizes(self._c.batch_get_into_ptr_parts([_key(k) for k in keys],
                                                            [[int(p) for p in ps] for ps in ptrs],
                                                            [[int(s) for s in ss] for ss in sizes],
                                                            float(timeout)))

    @staticmethod
    def _sizes(pair):
        values, errors = pair
        out = list(values)
        for i, code, msg in errors:
            out[i] = None if code == 5 else from_status(code, msg)
        return out

    def read_session(self, keys):
        """A ReadSession over keys: one master lookup leases a replica of
        each, whose ranges are then read with no master call until the lease
        ends (Client::StartReadSession, client/client.h)."""
        return ReadSession(self._c.start_read_session([_key(k) for k in keys]), list(keys))

    def write_session(self, keys, sizes, *, groups=None, parent_keys=None, replicas=1, preferred_segment="",
                      soft_pin=False, hard_pin=False):
        """A WriteSession: one master call grants room for each key's value
        of sizes[i] bytes; ranges are then written with no master call and
        the keys committed together (Client::StartWriteSession)."""
        return WriteSession(self._c.start_write_session([_key(k) for k in keys], [int(n) for n in sizes],
                                                        [str(g) for g in groups or []],
                                                        [_key(p) for p in parent_keys or []], int(replicas),
                                                        preferred_segment, bool(soft_pin), bool(hard_pin)),
                            list(keys))

    # --- lookups and removal --------------------------------------------
    def exists(self, key):
        return self._c.exists(_key(key))

    def batch_exists(self, keys):
        return self._c.batch_exists([_key(k) for k in keys])

    def prefix_match(self, keys):
        """How many leading keys are present (one server-side lookup)."""
        return self._c.prefix_match([_key(k) for k in keys])

    def remove(self, key, *, force=False):
        """NotFound (a KeyError) if absent; FailedPrecondition while being read unless force."""
        self._c.remove(_key(key), force)

    def remove_all(self, *, force=False):
        """Removes every object (leased ones stay unless force); how many were removed."""
        return self._c.remove_all(force)

    # --- memory and state -----------------------------------------------
    def register_memory(self, ptr, size):
        """Registers [ptr, ptr+size) for transports that need it (rdma)."""
        self._c.register_memory(int(ptr), int(size))

    def unregister_memory(self, ptr):
        self._c.unregister_memory(int(ptr))

    def register_buffer(self, buf):
        """Registers a Python buffer (kept alive by the caller); its address."""
        ptr, size = buffer_address(buf)
        self.register_memory(ptr, size)
        return ptr

    def stats(self):
        """The master's counters: objects, used_bytes, capacity_bytes, segments, ..."""
        return self._c.stats()

    @property
    def local_segment(self):
        """The lent segment's name ("" when not lending)."""
        return self._c.local_segment
