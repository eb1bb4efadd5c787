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

Beyond puts and gets: setup(config) takes one dict with readable sizes
("4GB"); upserts remove then put (not atomic; see the note above _upsert);
get_into_ranges reads whole values and copies ranges out; tensors use
Mooncake's 40-byte tensor header, so they read back on either client (torch
is imported on the first tensor call only); BufferPool lends registered host
buffers; calls needing what tierkv lacks (a client daemon, copy tasks, key
listings, NVMe-oF) answer UNAVAILABLE_IN_CURRENT_MODE with a log line.
docs/mooncake-api.md marks every call of Mooncake's binding.

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
import re
import socket
import threading
import urllib.parse

from . import DEFAULT_REPLICA_CACHE, Client, Error, value_size

log = logging.getLogger("tierkv.mooncake_compat")

from ._mooncake_codes import *  # noqa: F401,F403  (ERROR_CODES, each code, _code)
from ._mooncake_codes import (ERROR_CODES, INTERNAL_ERROR, INVALID_PARAMS, OBJECT_NOT_FOUND, OK,
                              TRANSFER_FAIL, UNAVAILABLE_IN_CURRENT_MODE, UNAVAILABLE_IN_CURRENT_STATUS, _Refused,
                              _code)
# This module holds the store's setup, lifecycle, memory registration, puts,
# gets and lookups; the rest of the binding lives beside it, one concern per
# module (_mooncake_config, _memory, _objects, _sessions, _tensors), the
# store's other calls as mixins it inherits.
from ._mooncake_config import (ObjectDataType, ReplicateConfig, SoftPinAction, _bind_config, _bind_setup, _env_count,
                               _env_seconds, _listen_address, _rdma_nic_present, parse_size)
from ._mooncake_memory import (BufferLease, BufferPool, MooncakeHostMemAllocator, bind_to_numa_node,
                               get_alloc_func_addr, get_free_func_addr)
from ._mooncake_memory import RegisteredBufferLease, RegisteredBufferPool  # Mooncake's names for them
from ._mooncake_objects import (BufferHandle, Descriptor, DiskDescriptor, MemoryDescriptor, ObjectCalls,
                                QueryTaskResponse, ReplicaDescriptor, ReplicaStatus, TaskStatus, TaskType)
from ._mooncake_sessions import SessionCalls
from ._mooncake_tensors import TensorCalls


class MooncakeDistributedStore(SessionCalls, ObjectCalls, TensorCalls):
    """Mooncake's store client. Thread-safe, like the tierkv Client under it."""

    _instances = 0
    _instances_lock = threading.Lock()

    def __init__(self):
        self._client = None
        self._hostname = ""
        self._registered = []  # (start, end) of buffers given to register_buffer
        self._lock = threading.Lock()
        self._local_buffer_size = 0
        self._segment_by_host = {}  # "host:port" (a get_hostname) -> segment name

    # --- lifecycle ------------------------------------------------------
    def setup(self, *args, **kwargs):
        """setup(local_hostname, metadata_server, global_segment_size=16MiB,
        local_buffer_size=16MiB, protocol="tcp", rdma_devices="",
        master_server_addr="127.0.0.1:50051", engine=None) -> int

        or setup(config): one dict with those names as keys (device_name and
        master_server_address are accepted for rdma_devices and
        master_server_addr, as in Mooncake's JSON configs); sizes may be ints
        or strings such as "4GB" or "512MB". A missing or unknown key, or an
        unreadable size, gives INVALID_PARAMS."""
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            a = _bind_config(args[0])
            if isinstance(a, int):
                return a
        else:
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
            lend = parse_size(a["global_segment_size"] or 0)
            local_buffer = parse_size(a["local_buffer_size"] or 0)
        except (TypeError, ValueError) as e:
            log.error("setup: %s", e)
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
        self._local_buffer_size = local_buffer
        self._hostname = self._served_hostname(client) or hostname
        return OK

    def _served_hostname(self, client):
        """host:port where this store's lent segment serves (Mooncake's
        get_hostname form), or "" when it lends nothing."""
        name = client.local_segment
        if not name:
            return ""
        try:
            seg = json.loads(client.http_get(f"/v1/segments/{urllib.parse.quote(name, safe='')}",
                                             timeout=_env_seconds("TIERKV_RPC_TIMEOUT", 5.0)))
        except (OSError, ValueError) as e:
            log.warning("segment %s not described by the master (%s); get_hostname gives its name", name, e)
            return name
        m = re.search(r"(\d+)\s*$", str(seg.get("endpoint", "")))
        if not m:
            return name
        self._segment_by_host[f"{seg.get('host', '')}:{m.group(1)}"] = name
        return f"{seg.get('host', '')}:{m.group(1)}"

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Mooncake's dummy client borrows memory and transfers from a
        separate per-host client daemon reached at server_address. tierkv has
        no such daemon (its store daemons lend memory to the cluster, and
        every process talks to the master itself), so this cannot be done:
        UNAVAILABLE_IN_CURRENT_MODE, with a log line. Use setup() against the
        master, with global_segment_size=0 for a process that lends nothing."""
        log.error("setup_dummy(%s): tierkv has no per-host client daemon to attach to; "
                  "call setup(..., global_segment_size=0, ..., master_server_addr=<tierkv master>) instead",
                  server_address)
        return UNAVAILABLE_IN_CURRENT_MODE

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
        """host:port where this store's lent segment serves, as Mooncake
        answers; it names the segment in ReplicateConfig.preferred_segment.
        A store lending nothing serves nothing: its local_hostname as given."""
        return self._hostname

    def health_check(self):
        """0 when the master answers, else a negative code
        (UNAVAILABLE_IN_CURRENT_STATUS before setup or after close).
        Mooncake answers 1 and 2 for those cases; tierkv keeps one rule, a
        negative answer is a failure, as its other calls do."""
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
    def _put_options(self, config, n):
        """tierkv put options from a ReplicateConfig; raises _Refused(code)
        for a config that cannot be honoured."""
        if config is None:
            return {}, None
        action = SoftPinAction(int(getattr(config, "soft_pin_action", SoftPinAction.PRESERVE)))
        ttl = getattr(config, "soft_pin_ttl_ms", None)
        if ttl is not None and action != SoftPinAction.ENABLE:
            log.error("soft_pin_ttl_ms needs soft_pin_action ENABLE")
            raise _Refused(INVALID_PARAMS)
        replicas = int(config.replica_num)
        nof = int(getattr(config, "nof_replica_num", 0) or 0)
        if nof > 0:
            if replicas <= 0:
                log.error("nof_replica_num=%d: tierkv has no NVMe-oF tier and no memory replica was asked for", nof)
                raise _Refused(UNAVAILABLE_IN_CURRENT_MODE)
            log.warning("nof_replica_num=%d ignored: tierkv has no NVMe-oF tier", nof)
        soft = action == SoftPinAction.ENABLE or (action == SoftPinAction.PRESERVE and bool(config.with_soft_pin))
        preferred = config.preferred_segment or (config.preferred_segments[0] if config.preferred_segments else "")
        opts = dict(replicas=max(1, replicas), preferred_segment=self._segment_name(preferred),
                    soft_pin=soft, hard_pin=bool(config.with_hard_pin))
        groups = list(config.group_ids or [])
        if len(groups) == 1 and n > 1:
            groups = groups * n
        return opts, ([str(g) for g in groups] if groups else None)

    def _segment_name(self, preferred):
        """A segment name from a preferred segment given as a name or as a
        store's get_hostname() (host:port)."""
        if not preferred or preferred in self._segment_by_host.values():
            return preferred
        if preferred in self._segment_by_host:
            return self._segment_by_host[preferred]
        c = self._client
        try:
            segments = json.loads(c.http_get("/v1/segments", timeout=_env_seconds("TIERKV_RPC_TIMEOUT", 5.0)))
        except (OSError, ValueError, AttributeError):
            return preferred
        for seg in segments:
            m = re.search(r"(\d+)\s*$", str(seg.get("endpoint", "")))
            if seg.get("name") == preferred:
                return preferred
            if m and f"{seg.get('host', '')}:{m.group(1)}" == preferred:
                self._segment_by_host[preferred] = seg["name"]
                return seg["name"]
        return preferred

    @staticmethod
    def _put_code(status):
        # First writer wins: a key that exists holds the (immutable) value.
        if status is None or getattr(status, "code", None) == 6:
            return OK
        return _code(status)

    def _put_setup(self, n, config):
        """(client, put options, groups) for a put of n keys; raises
        _Refused(code) before setup or for a config that cannot be honoured."""
        c = self._client
        if c is None:
            raise _Refused(UNAVAILABLE_IN_CURRENT_STATUS)
        opts, groups = self._put_options(config, n)
        return c, opts, groups

    def _batch_put(self, keys, put, config):
        try:
            c, opts, groups = self._put_setup(len(keys), config)
        except _Refused as r:
            return [r.code] * len(keys)
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
        try:
            opts, _ = self._put_options(config, 1)
            c.put_parts(key, *parts, **opts)
        except _Refused as r:
            return r.code
        except Error as e:
            return self._put_code(e)
        return OK

    # --- gets -----------------------------------------------------------
    def get(self, key):
        """The value, or b"" on a miss or an error (Mooncake's convention)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys):
        return [v if v is not None else b"" for v in self._values(keys)]

    def _values(self, keys):
        """Each key's value as bytes, or None where it could not be read."""
        c = self._client
        if c is None:
            return [None] * len(keys)
        try:
            return [v if isinstance(v, bytes) else None for v in c.batch_get(list(keys))]
        except Error:
            return [None] * len(keys)

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
        info = self._object_info(key)
        if not isinstance(info, dict):
            return info
        return value_size(int(info["size"]), int(info.get("put_id", 0)))

    # The older binding's camelCase names, which tools still call
    # (Mooncake's store_kv_bench.py calls isExist).
    def isExist(self, key):  # noqa: N802
        return self.is_exist(key)

    def getSize(self, key):  # noqa: N802
        return self.get_size(key)

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


__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "ReplicaStatus", "ObjectDataType",
           "TaskType", "TaskStatus", "QueryTaskResponse", "MemoryDescriptor", "DiskDescriptor", "Descriptor",
           "ReplicaDescriptor", "BufferHandle", "BufferPool", "BufferLease", "RegisteredBufferPool",
           "RegisteredBufferLease", "MooncakeHostMemAllocator", "bind_to_numa_node", "get_alloc_func_addr",
           "get_free_func_addr", "parse_size", "ERROR_CODES"]
__all__ += list(ERROR_CODES)

# The public names defined in the _mooncake_* modules report this module,
# where callers import them from, so pickles, reprs and help() name the
# public path and do not depend on how the code is split into files.
for _public in (ReplicateConfig, SoftPinAction, ObjectDataType, parse_size, ReplicaStatus, TaskType, TaskStatus,
                QueryTaskResponse, MemoryDescriptor, DiskDescriptor, Descriptor, ReplicaDescriptor, BufferHandle,
                BufferPool, BufferLease, MooncakeHostMemAllocator, bind_to_numa_node, get_alloc_func_addr,
                get_free_func_addr):
    _public.__module__ = __name__
del _public
