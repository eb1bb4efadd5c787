"""Mooncake Store's Python API (mooncake.store) over tierkv.

Engines written against `MooncakeDistributedStore` (SGLang HiCache, LMCache,
vLLM connectors) run unchanged:

    from tierkv.mooncake_compat import MooncakeDistributedStore, ReplicateConfig
    store = MooncakeDistributedStore()
    store.setup("10.0.0.2", "P2PHANDSHAKE", 0, 0, "tcp", "", "10.0.0.1:50051")

Conventions are Mooncake's: calls return 0 or a negative Mooncake error code
(ERROR_CODES) and never raise on a store or network error; reads return
bytes read (batch_get_into) or b"" (get) on a miss; a put of a key that
exists returns 0 (first writer wins, values are immutable). Lists of unequal
lengths give one INVALID_PARAMS per key. Only wrong use of the API raises
(an unknown setup() keyword: TypeError naming that keyword).

Mapping to tierkv: global_segment_size is memory this process lends (0: a
pure client that lends nothing); local_buffer_size is accepted and unused
(tierkv reads and writes the caller's buffers in place); metadata_server
"P2PHANDSHAKE" (or any non-http value) asks the master for its metadata URL;
protocol "tcp" moves data over shm to same-host stores and tcp otherwise,
"rdma" over rdma, falling back to tcp with a warning where no NIC is usable.
ReplicateConfig.group_ids become tierkv groups; with_soft_pin objects are
evicted only after every unpinned one, with_hard_pin objects never (only a
remove takes them out). The _multi_buffers forms and put_parts gather and
scatter in place: no part is copied on the way.

Timeouts come from TIERKV_RPC_TIMEOUT and TIERKV_TRANSFER_TIMEOUT (seconds;
defaults 5 and 30), as tierkv's flags read TIERKV_<FLAG>; TIERKV_REPLY_SPIN
(seconds, default 50e-6; 0: never) is how long a call busy-polls for its
reply before sleeping. TIERKV_REPLICA_CACHE (keys, 0: off) sizes the cache of
replicas a repeated get reads without asking the master. TIERKV_TOKEN_FILE names the file holding the token
for a master running --auth token.
"""

import json
import logging
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request

from . import DEFAULT_REPLICA_CACHE, Client, Error, value_size

log = logging.getLogger("tierkv.mooncake_compat")

# Mooncake's ErrorCode values (mooncake-store/include/types.h).
ERROR_CODES = {
    "OK": 0,
    "INTERNAL_ERROR": -1,
    "BUFFER_OVERFLOW": -10,
    "SEGMENT_NOT_FOUND": -101,
    "NO_AVAILABLE_HANDLE": -200,
    "INVALID_KEY": -400,
    "WRITE_FAIL": -500,
    "INVALID_PARAMS": -600,
    "INVALID_WRITE": -700,
    "INVALID_READ": -701,
    "REPLICA_IS_NOT_READY": -703,
    "OBJECT_NOT_FOUND": -704,
    "OBJECT_ALREADY_EXISTS": -705,
    "OBJECT_HAS_LEASE": -706,
    "LEASE_EXPIRED": -707,
    "TRANSFER_FAIL": -800,
    "RPC_FAIL": -900,
    "UNAVAILABLE_IN_CURRENT_STATUS": -1010,
}
globals().update(ERROR_CODES)

# absl status code -> Mooncake code.
_FROM_ABSL = {
    0: OK,
    3: INVALID_PARAMS,         # INVALID_ARGUMENT (also: buffer too small)
    4: TRANSFER_FAIL,          # DEADLINE_EXCEEDED
    5: OBJECT_NOT_FOUND,
    6: OBJECT_ALREADY_EXISTS,
    8: NO_AVAILABLE_HANDLE,    # RESOURCE_EXHAUSTED: no room in the cluster
    9: OBJECT_HAS_LEASE,       # FAILED_PRECONDITION: leased (being read)
    11: TRANSFER_FAIL,         # OUT_OF_RANGE
    14: RPC_FAIL,              # UNAVAILABLE
    15: TRANSFER_FAIL,         # DATA_LOSS: checksum mismatch, not data
}


def _code(status):
    """A Mooncake code from an absl code, an Error, or None (OK)."""
    if status is None:
        return OK
    if isinstance(status, Error):
        status = status.code
    return _FROM_ABSL.get(int(status), INTERNAL_ERROR)


class ReplicateConfig:
    """Mooncake's replication options for a put."""

    def __init__(self):
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments = []
        self.prefer_alloc_in_same_node = False
        self.group_ids = []

    def __repr__(self):
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_soft_pin={self.with_soft_pin}, "
                f"with_hard_pin={self.with_hard_pin}, preferred_segment={self.preferred_segment!r}, "
                f"preferred_segments={self.preferred_segments!r}, group_ids={self.group_ids!r})")


_SETUP_PARAMS = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
                 "rdma_devices", "master_server_addr", "engine")
_SETUP_DEFAULTS = {"global_segment_size": 16 << 20, "local_buffer_size": 16 << 20, "protocol": "tcp",
                   "rdma_devices": "", "master_server_addr": "127.0.0.1:50051", "engine": None}


def _bind_setup(args, kwargs):
    """Binds setup()'s arguments as Python would, with Python's messages:
    an unknown keyword's TypeError names only that keyword."""
    if len(args) > len(_SETUP_PARAMS):
        raise TypeError(f"setup() takes from 3 to {len(_SETUP_PARAMS) + 1} positional arguments "
                        f"but {len(args) + 1} were given")
    bound = dict(zip(_SETUP_PARAMS, args))
    for name, value in kwargs.items():
        if name not in _SETUP_PARAMS:
            raise TypeError(f"setup() got an unexpected keyword argument '{name}'")
        if name in bound:
            raise TypeError(f"setup() got multiple values for argument '{name}'")
        bound[name] = value
    for name in ("local_hostname", "metadata_server"):
        if name not in bound:
            raise TypeError(f"setup() missing 1 required positional argument: '{name}'")
    for name, value in _SETUP_DEFAULTS.items():
        bound.setdefault(name, value)
    return bound


def _env_seconds(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s", name, os.environ[name], default)
        return default


def _env_count(name, default):
    try:
        n = int(os.environ.get(name, default))
        if n >= 0:
            return n
    except ValueError:
        pass
    log.warning("%s=%r is not a count of 0 or more; using %s", name, os.environ[name], default)
    return default


def _listen_address(hostname):
    """The address the lent segment serves on: local_hostname's host part."""
    host = hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname
    if host in ("", "localhost"):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def _rdma_nic_present():
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


class MooncakeDistributedStore:
    """Mooncake's store client. Thread-safe, like the tierkv Client under it."""

    _instances = 0
    _instances_lock = threading.Lock()

    def __init__(self):
        self._client = None
        self._hostname = ""
        self._registered = []  # (start, end) of buffers given to register_buffer
        self._lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------
    def setup(self, *args, **kwargs):
        """setup(local_hostname, metadata_server, global_segment_size=16MiB,
        local_buffer_size=16MiB, protocol="tcp", rdma_devices="",
        master_server_addr="127.0.0.1:50051", engine=None) -> int"""
        a = _bind_setup(args, kwargs)
        if self._client is not None:
            return OK  # already set up, as Mooncake answers a second setup
        if a["engine"] is not None:
            log.info("setup(engine=...) ignored: tierkv has its own transfer engine")
        master = str(a["master_server_addr"])
        metadata = str(a["metadata_server"] or "")
        if metadata.startswith(("http://", "https://")):
            metadata = metadata.rstrip("/")
            if metadata.endswith("/metadata"):
                metadata = metadata[: -len("/metadata")]
        else:
            if metadata != "P2PHANDSHAKE":
                log.warning("metadata_server %r is not an http URL; asking the master %s", metadata, master)
            metadata = None
        try:
            lend = int(a["global_segment_size"] or 0)
            int(a["local_buffer_size"] or 0)
        except (TypeError, ValueError):
            return INVALID_PARAMS
        protocol = str(a["protocol"] or "tcp").lower()
        devices = [d for d in str(a["rdma_devices"] or "").split(",") if d]
        if protocol == "tcp":
            transports = ["shm", "tcp"]
        elif protocol == "rdma":
            transports = ["rdma", "tcp"]
            if not _rdma_nic_present():
                log.warning("protocol rdma: no RDMA NIC on this host; falling back to tcp")
                transports, devices = ["shm", "tcp"], []
        else:
            log.error("protocol %r is not tcp or rdma", protocol)
            return INVALID_PARAMS
        hostname = str(a["local_hostname"] or socket.gethostname())
        with MooncakeDistributedStore._instances_lock:
            MooncakeDistributedStore._instances += 1
            n = MooncakeDistributedStore._instances
        # Several ranks of one host each set up a store: the name must be unique.
        name = f"{hostname}:{os.getpid()}-{n}" if ":" not in hostname else f"{hostname}-{os.getpid()}-{n}"
        options = dict(transports=transports, rdma_devices=devices, lend_size=lend, lend_name=name,
                       host=hostname.rsplit(":", 1)[0], listen=_listen_address(hostname),
                       rpc_timeout=_env_seconds("TIERKV_RPC_TIMEOUT", 5.0),
                       transfer_timeout=_env_seconds("TIERKV_TRANSFER_TIMEOUT", 30.0),
                       reply_spin=_env_seconds("TIERKV_REPLY_SPIN", 50e-6),
                       replica_cache=_env_count("TIERKV_REPLICA_CACHE", DEFAULT_REPLICA_CACHE))
        try:
            try:
                client = Client(master, metadata, **options)
            except Error as e:
                if protocol != "rdma" or transports[0] != "rdma":
                    raise
                log.warning("protocol rdma unusable (%s); falling back to tcp", e)
                options.update(transports=["shm", "tcp"], rdma_devices=[])
                client = Client(master, metadata, **options)
        except Error as e:
            log.error("setup against master %s failed: %s", master, e)
            return _code(e)
        self._client = client
        self._hostname = client.local_segment or hostname
        return OK

    def init_all(self, protocol, device_name, mount_segment_size=16 << 20):
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, 0, protocol, device_name)

    def close(self):
        """Stops the client and unlends its memory. Returns 0."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            c.close()
        return OK

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def get_hostname(self):
        """This store's name in the cluster (its lent segment), else local_hostname."""
        return self._hostname

    def health_check(self):
        """0 when the master answers, else a negative code."""
        c = self._client
        if c is None:
            return UNAVAILABLE_IN_CURRENT_STATUS
        try:
            c.stats()
            return OK
        except Error as e:
            return _code(e)

    # --- memory ---------------------------------------------------------
    def register_buffer(self, buffer_ptr, size):
        """Registers [ptr, ptr+size) for zero-copy transfers: bookkeeping
        only (and an rdma registration where rdma is in use), so a host pool
        of hundreds of GB registers at once. A range inside one already
        registered is accepted as is."""
        c = self._client
        if c is None:
            return UNAVAILABLE_IN_CURRENT_STATUS
        start, end = int(buffer_ptr), int(buffer_ptr) + int(size)
        with self._lock:
            if any(s <= start and end <= e for s, e in self._registered):
                return OK
            try:
                c.register_memory(start, end - start)
            except Error as e:
                return _code(e)
            self._registered.append((start, end))
        return OK

    def unregister_buffer(self, buffer_ptr):
        c = self._client
        if c is None:
            return UNAVAILABLE_IN_CURRENT_STATUS
        start = int(buffer_ptr)
        with self._lock:
            match = [r for r in self._registered if r[0] == start]
            if not match:
                return INVALID_PARAMS
            try:
                c.unregister_memory(start)
            except Error as e:
                return _code(e)
            self._registered.remove(match[0])
        return OK

    # --- helpers --------------------------------------------------------
    @staticmethod
    def _put_options(config, n):
        if config is None:
            return {}, None
        preferred = config.preferred_segment or (config.preferred_segments[0] if config.preferred_segments else "")
        opts = dict(replicas=max(1, int(config.replica_num)), preferred_segment=preferred,
                    soft_pin=bool(config.with_soft_pin), hard_pin=bool(config.with_hard_pin))
        groups = list(config.group_ids or [])
        if len(groups) == 1 and n > 1:
            groups = groups * n
        return opts, ([str(g) for g in groups] if groups else None)

    @staticmethod
    def _put_code(status):
        # First writer wins: a key that exists holds the (immutable) value.
        if status is None or getattr(status, "code", None) == 6:
            return OK
        return _code(status)

    def _batch_put(self, keys, put, config):
        c = self._client
        if c is None:
            return [UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        opts, groups = self._put_options(config, len(keys))
        try:
            res = put(c, groups=groups, **opts)
        except Error as e:  # refused as a whole (e.g. lengths differ)
            return [_code(e)] * len(keys)
        return [self._put_code(r) for r in res]

    @staticmethod
    def _size_code(r):
        if r is None:
            return OBJECT_NOT_FOUND
        if isinstance(r, Error):
            return _code(r)
        return int(r)

    # --- puts -----------------------------------------------------------
    def put(self, key, value, config=None):
        return self._batch_put([key], lambda c, **o: c.batch_put([key], [value], **o), config)[0]

    def put_batch(self, keys, values, config=None):
        keys = list(keys)
        if len(keys) != len(values):
            return INVALID_PARAMS
        res = self._batch_put(keys, lambda c, **o: c.batch_put(keys, list(values), **o), config)
        return next((r for r in res if r != OK), OK)

    def put_from(self, key, buffer_ptr, size, config=None):
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        keys = list(keys)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_put(keys, lambda c, **o: c.batch_put_ptrs(keys, buffer_ptrs, sizes, **o), config)

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        """Each key's value is the concatenation of its buffers."""
        keys = list(keys)
        if len(keys) != len(all_buffer_ptrs) or len(keys) != len(all_sizes) or any(
                len(p) != len(s) for p, s in zip(all_buffer_ptrs, all_sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_put(keys, lambda c, **o: c.batch_put_ptr_parts(keys, all_buffer_ptrs, all_sizes, **o),
                               config)

    def put_parts(self, key, *parts, config=None):
        c = self._client
        if c is None:
            return UNAVAILABLE_IN_CURRENT_STATUS
        opts, _ = self._put_options(config, 1)
        try:
            c.put_parts(key, *parts, **opts)
        except Error as e:
            return self._put_code(e)
        return OK

    # --- gets -----------------------------------------------------------
    def get(self, key):
        """The value, or b"" on a miss or an error (Mooncake's convention)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys):
        c = self._client
        if c is None:
            return [b""] * len(keys)
        try:
            return [v if isinstance(v, bytes) else b"" for v in c.batch_get(list(keys))]
        except Error:
            return [b""] * len(keys)

    def get_into(self, key, buffer_ptr, size):
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        """Bytes read per key, or a negative code: OBJECT_NOT_FOUND for a miss,
        INVALID_PARAMS for a buffer smaller than the value."""
        keys = list(keys)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        c = self._client
        if c is None:
            return [UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        try:
            res = c.batch_get_into_ptrs(keys, buffer_ptrs, sizes)
        except Error as e:
            return [_code(e)] * len(keys)
        return [self._size_code(r) for r in res]

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, prefer_same_node=True):
        """Each key's value is scattered over its buffers, in order; bytes read
        per key. INVALID_PARAMS where the buffers add up to less than the value,
        TRANSFER_FAIL where to more (Mooncake's answers; the value's bytes are
        in the buffers' first bytes even then)."""
        keys = list(keys)
        if len(keys) != len(all_buffer_ptrs) or len(keys) != len(all_sizes) or any(
                len(p) != len(s) for p, s in zip(all_buffer_ptrs, all_sizes)):
            return [INVALID_PARAMS] * len(keys)
        c = self._client
        if c is None:
            return [UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        try:
            res = c.batch_get_into_ptr_parts(keys, all_buffer_ptrs, all_sizes)
        except Error as e:
            return [_code(e)] * len(keys)
        out = []
        for r, sizes in zip(res, all_sizes):
            code = self._size_code(r)
            if code >= 0 and code != sum(int(x) for x in sizes):
                code = TRANSFER_FAIL
            out.append(code)
        return out

    # --- lookups and removal --------------------------------------------
    def is_exist(self, key):
        """1 present, 0 absent, negative on an error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys):
        c = self._client
        if c is None:
            return [UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        try:
            return [1 if p else 0 for p in c.batch_exists(list(keys))]
        except Error as e:
            return [_code(e)] * len(keys)

    def get_size(self, key):
        """The value's size in bytes, or a negative code (OBJECT_NOT_FOUND)."""
        c = self._client
        if c is None:
            return UNAVAILABLE_IN_CURRENT_STATUS
        k = key.decode("latin-1") if isinstance(key, bytes) else str(key)
        try:
            info = json.loads(c.http_get(f"/v1/objects/{urllib.parse.quote(k, safe='')}",
                                         timeout=_env_seconds("TIERKV_RPC_TIMEOUT", 5.0)))
        except urllib.error.HTTPError as e:
            return OBJECT_NOT_FOUND if e.code == 404 else INTERNAL_ERROR
        except (OSError, ValueError):
            return RPC_FAIL
        if info.get("state") != "complete" or not info.get("visible", True):
            return OBJECT_NOT_FOUND
        return value_size(int(info["size"]), int(info.get("put_id", 0)))

    def remove(self, key, force=False):
        c = self._client
        if c is None:
            return UNAVAILABLE_IN_CURRENT_STATUS
        try:
            c.remove(key, force=force)
            return OK
        except Error as e:
            return _code(e)

    def batch_remove(self, keys, force=False):
        return [self.remove(k, force) for k in keys]

    def remove_all(self, force=False):
        """How many objects were removed, or -1 on an error."""
        c = self._client
        if c is None:
            return INTERNAL_ERROR
        try:
            return int(c.remove_all(force=force))
        except Error:
            return INTERNAL_ERROR


__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "ERROR_CODES"] + list(ERROR_CODES)
