"""Calls of tierkv.mooncake_compat's store beyond plain puts and gets, as
the mixin ObjectCalls: replica descriptions (from the master's HTTP API),
batch_replica_clear, remove_by_regex, upserts, put_from_with_metadata,
get_buffer, get_into_ranges, and the calls tierkv cannot serve; with the
records they answer (ReplicaDescriptor and its descriptors, BufferHandle,
QueryTaskResponse)."""

import ctypes
import enum
import json
import logging
import re
import urllib.error
import urllib.parse

from . import Error, value_size
from ._mooncake_codes import (INTERNAL_ERROR, INVALID_PARAMS, LEASE_EXPIRED, OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND,
                              OK, RPC_FAIL, UNAVAILABLE_IN_CURRENT_MODE, UNAVAILABLE_IN_CURRENT_STATUS, _code,
                              _Refused)
from ._mooncake_config import _env_seconds

log = logging.getLogger("tierkv.mooncake_compat")


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    SUCCESS = 2
    FAILED = 3


class MemoryDescriptor:
    """A replica in a segment's memory. buffer_descriptor.buffer_address is
    the replica's offset inside its segment (tierkv never hands out remote
    addresses); transport_endpoint is the segment's host:port."""

    def __init__(self, buffer_descriptor):
        self.buffer_descriptor = buffer_descriptor

    def __repr__(self):
        return f"MemoryDescriptor({self.buffer_descriptor!r})"


class DiskDescriptor:
    """A replica on a daemon's SSD tier. file_path names it as
    tierkv-ssd://<segment> (tierkv keeps SSD records in one store per
    daemon, not a file per object)."""

    def __init__(self, file_path, object_size):
        self.file_path = file_path
        self.object_size = object_size

    def __repr__(self):
        return f"DiskDescriptor(file_path={self.file_path!r}, object_size={self.object_size})"


class Descriptor:
    """Mooncake's AllocatedBuffer descriptor: size, buffer_address, transport_endpoint."""

    def __init__(self, size=0, buffer_address=0, transport_endpoint="", segment_name=""):
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint
        self.segment_name = segment_name  # tierkv's addition: the segment holding it

    def __repr__(self):
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class ReplicaDescriptor:
    """One replica of an object, as get_replica_desc answers."""

    def __init__(self, status, memory=None, disk=None):
        self.status = status
        self._memory = memory
        self._disk = disk

    def is_memory_replica(self):
        return self._memory is not None

    def is_disk_replica(self):
        return self._disk is not None

    def get_memory_descriptor(self):
        if self._memory is None:
            raise RuntimeError("not a memory replica")
        return self._memory

    def get_disk_descriptor(self):
        if self._disk is None:
            raise RuntimeError("not a disk replica")
        return self._disk

    def __repr__(self):
        return f"ReplicaDescriptor(status={self.status.name}, {self._memory or self._disk!r})"


class QueryTaskResponse:
    """Mooncake's task status record (tierkv runs no copy or move tasks)."""

    def __init__(self):
        self.id = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.FAILED
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client = ""
        self.message = ""


class BufferHandle(bytearray):
    """A value read by get_buffer: bytes this process owns, with Mooncake's
    ptr() and size() and the buffer protocol (np.array(h, copy=False) and
    memoryview(h) share its memory)."""

    def ptr(self):
        if not len(self):
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self):
        return len(self)


class ObjectCalls:
    """These calls of MooncakeDistributedStore (which provides self._client,
    a tierkv.Client or None, self._lock, self._registered, self._put_options,
    self._batch_put and self.remove_all)."""

    # --- object descriptions (the master's HTTP API) ----------------------
    def _object_info(self, key):
        """The master's /v1/objects record of a complete, visible key, or a
        negative code (OBJECT_NOT_FOUND for a miss)."""
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
        return info

    def _endpoint_of(self, segment, cache):
        if segment not in cache:
            cache[segment] = ""
            try:
                seg = json.loads(self._client.http_get(f"/v1/segments/{urllib.parse.quote(segment, safe='')}",
                                                       timeout=_env_seconds("TIERKV_RPC_TIMEOUT", 5.0)))
                m = re.search(r"(\d+)\s*$", str(seg.get("endpoint", "")))
                if m:
                    cache[segment] = f"{seg.get('host', '')}:{m.group(1)}"
            except (OSError, ValueError):
                pass
        return cache[segment]

    def get_replica_desc(self, key):
        """The key's replicas as ReplicaDescriptor objects (COMPLETE; memory
        replicas carry a MemoryDescriptor, SSD-tier ones a DiskDescriptor);
        [] for a miss or an error, as Mooncake answers."""
        return self._replica_desc(key, {})

    def batch_get_replica_desc(self, keys):
        """{key: [ReplicaDescriptor]} for the keys that exist."""
        cache = {}
        out = {}
        for k in keys:
            desc = self._replica_desc(k, cache)
            if desc:
                out[k] = desc
        return out

    def _replica_desc(self, key, endpoints):
        info = self._object_info(key)
        if isinstance(info, int):
            return []
        size = value_size(int(info["size"]), int(info.get("put_id", 0)))
        out = []
        for r in info.get("replicas", []):
            seg = str(r.get("segment", ""))
            if r.get("tier") == "ssd":
                out.append(ReplicaDescriptor(ReplicaStatus.COMPLETE, disk=DiskDescriptor(f"tierkv-ssd://{seg}", size)))
            else:
                d = Descriptor(size, int(r.get("offset", 0)), self._endpoint_of(seg, endpoints), seg)
                out.append(ReplicaDescriptor(ReplicaStatus.COMPLETE, memory=MemoryDescriptor(d)))
        return out

    def batch_replica_clear(self, keys, segment_name=""):
        """Drops replicas; the keys cleared. With segment_name "" every
        replica goes (the object is removed). With a segment, tierkv cannot
        drop one replica of several (an object's replicas live and leave
        together), so a key is cleared only when all its replicas are on that
        segment, and then the object is removed; other keys are left as they
        are and logged. A key being read (leased) is not cleared."""
        c = self._client
        if c is None:
            return []
        cleared = []
        for k in keys:
            if segment_name:
                info = self._object_info(k)
                if isinstance(info, int):
                    continue
                segs = {str(r.get("segment", "")) for r in info.get("replicas", [])}
                if segs != {segment_name}:
                    if segment_name in segs:
                        log.warning("batch_replica_clear: %s has replicas outside %s; tierkv drops an object's "
                                    "replicas together, so it is left as is", k, segment_name)
                    continue
            try:
                c.remove(k)
                cleared.append(k)
            except Error as e:
                if getattr(e, "code", None) != 5:
                    log.warning("batch_replica_clear: %s not cleared: %s", k, e)
        return cleared

    def remove_by_regex(self, regex_pattern, force=False):
        """How many objects were removed, or a negative code. The master
        keeps no listing of keys a client could match a pattern against, so
        only a pattern matching every key can be honoured (as remove_all);
        any other gives UNAVAILABLE_IN_CURRENT_MODE, with a log line. A
        pattern that does not compile gives INVALID_PARAMS."""
        try:
            re.compile(regex_pattern)
        except (re.error, TypeError):
            log.error("remove_by_regex: %r is not a regular expression", regex_pattern)
            return INVALID_PARAMS
        if regex_pattern.strip("^$") in ("", ".*", "(.*)", "[\\s\\S]*", "(?s).*"):
            return self.remove_all(force)
        log.error("remove_by_regex(%r): the tierkv master cannot list keys to match; "
                  "remove the keys by name (batch_remove) or use remove_all", regex_pattern)
        return UNAVAILABLE_IN_CURRENT_MODE

    # --- upserts --------------------------------------------------------
    # tierkv values are immutable, so an upsert removes the key (force: even
    # while it is being read) and then puts it. The two steps are not atomic:
    # between them a reader misses the key, a reader already transferring the
    # old value may fail its read (TRANSFER_FAIL), and a concurrent writer of
    # the same key can land its value first, after which the upsert retries
    # (three times) and then answers OBJECT_ALREADY_EXISTS.
    _UPSERT_TRIES = 3

    def _upsert(self, keys, put, config):
        """put(c, keys, **opts) -> [Error|None] for the keys given; one code per key."""
        try:
            c, opts, groups = self._put_setup(len(keys), config)
        except _Refused as r:
            return [r.code] * len(keys)
        codes = [None] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(self._UPSERT_TRIES):
            for i in todo:
                try:
                    c.remove(keys[i], force=True)
                except Error as e:
                    if getattr(e, "code", None) != 5:
                        codes[i] = _code(e)
            todo = [i for i in todo if codes[i] is None]
            if not todo:
                break
            try:
                res = put(c, todo, groups=[groups[i] for i in todo] if groups else None, **opts)
            except Error as e:
                for i in todo:
                    codes[i] = _code(e)
                break
            retry = []
            for i, r in zip(todo, res):
                if r is not None and getattr(r, "code", None) == 6:
                    retry.append(i)  # another writer landed between remove and put
                else:
                    codes[i] = _code(r)
            todo = retry
            if not todo:
                break
        for i in todo:
            codes[i] = OBJECT_ALREADY_EXISTS
        return codes

    def upsert(self, key, value, config=None):
        """Stores value under key whether or not it exists (see the note on upserts)."""
        return self._upsert([key], lambda c, idx, **o: c.batch_put([key], [value], **o), config)[0]

    def upsert_batch(self, keys, values, config=None):
        """upsert for each pair; 0 or the first failure's code."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            return INVALID_PARAMS
        res = self._upsert(keys, lambda c, idx, **o: c.batch_put([keys[i] for i in idx], [values[i] for i in idx],
                                                                 **o), config)
        return next((r for r in res if r != OK), OK)

    def upsert_parts(self, key, *parts, config=None):
        """upsert of the concatenation of parts (each read in place)."""
        return self._upsert([key], lambda c, idx, **o: c.batch_put_parts([key], [list(parts)], **o), config)[0]

    def upsert_from(self, key, buffer_ptr, size, config=None):
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        keys = list(keys)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._upsert(keys, lambda c, idx, **o: c.batch_put_ptrs(
            [keys[i] for i in idx], [buffer_ptrs[i] for i in idx], [sizes[i] for i in idx], **o), config)

    def batch_upsert_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        keys = list(keys)
        if len(keys) != len(all_buffer_ptrs) or len(keys) != len(all_sizes) or any(
                len(p) != len(s) for p, s in zip(all_buffer_ptrs, all_sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._upsert(keys, lambda c, idx, **o: c.batch_put_ptr_parts(
            [keys[i] for i in idx], [all_buffer_ptrs[i] for i in idx], [all_sizes[i] for i in idx], **o), config)

    # --- more puts and gets ---------------------------------------------
    def put_from_with_metadata(self, key, buffer_ptr, metadata_buffer_ptr, size, metadata_size, config=None):
        """Stores metadata_size bytes at metadata_buffer_ptr followed by size
        bytes at buffer_ptr as one value (both read in place). As in
        Mooncake: size 0 stores nothing and answers 0, and
        prefer_alloc_in_same_node answers -1."""
        if config is not None and config.prefer_alloc_in_same_node:
            log.error("put_from_with_metadata: prefer_alloc_in_same_node is not supported")
            return INTERNAL_ERROR
        if int(size) == 0:
            log.warning("put_from_with_metadata: empty data for %s; nothing stored", key)
            return OK
        return self._batch_put([key], lambda c, **o: c.batch_put_ptr_parts(
            [key], [[metadata_buffer_ptr, buffer_ptr]], [[metadata_size, size]], **o), config)[0]

    def get_buffer(self, key):
        """The value as a BufferHandle, or None on a miss or an error."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys):
        """One BufferHandle (or None) per key."""
        return [BufferHandle(v) if v is not None else None for v in self._values(keys)]

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
        """Reads byte ranges of objects into registered buffers:
        sizes[i][j][k] bytes of key all_keys[i][j] from offset
        all_src_offsets[i][j][k] land in buffer i at all_dst_offsets[i][j][k].
        Answers results[i][j][k]: bytes read, or a negative code
        (INVALID_PARAMS for a shape mismatch, a buffer not registered with
        register_buffer, a range past the buffer's registered end or past the
        object's end; OBJECT_NOT_FOUND for a miss).
        One read session for every distinct key (one master call), then
        only the ranges cross the network, straight into the buffers."""
        n = len(buffer_ptrs)
        top_ok = n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes)

        def rows(i, code):
            keys = all_keys[i] if i < len(all_keys) else [None]
            frags = all_dst_offsets[i] if i < len(all_dst_offsets) else []
            return [[code] * (len(frags[j]) if j < len(frags) else 1) for j in range(len(keys))]

        if not top_ok:
            log.error("get_into_ranges: the five lists differ in length")
            return [rows(i, INVALID_PARAMS) for i in range(n)]
        c = self._client
        if c is None:
            return [rows(i, UNAVAILABLE_IN_CURRENT_STATUS) for i in range(n)]
        wanted = sorted({k for keys in all_keys for k in keys})
        index = {k: j for j, k in enumerate(wanted)}
        try:
            session = c.read_session(wanted)
        except Error as e:
            return [rows(i, _code(e)) for i in range(n)]
        with self._lock:
            registered = list(self._registered)
        try:
            sizes_of = session.sizes()
            out, ranges, where = [], [], []  # where: (i, j, k) of each range read
            for i, base in enumerate(buffer_ptrs):
                base = int(base)
                end = next((e for s, e in registered if s <= base < e), None)
                keys, dsts, srcs, sizes = all_keys[i], all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
                if not (len(keys) == len(dsts) == len(srcs) == len(sizes)):
                    out.append(rows(i, INVALID_PARAMS))
                    continue
                key_rows = []
                for j, key in enumerate(keys):
                    d, src_row, z = dsts[j], srcs[j], sizes[j]
                    if not (len(d) == len(src_row) == len(z)):
                        key_rows.append([INVALID_PARAMS] * max(len(d), 1))
                        continue
                    total = sizes_of[index[key]]
                    frags = []
                    for k, (dst, src, size) in enumerate(zip(d, src_row, z)):
                        dst, src, size = int(dst), int(src), int(size)
                        if not isinstance(total, int):
                            frags.append(_code(total))
                        elif end is None or min(dst, src, size) < 0 or base + dst + size > end or src + size > total:
                            frags.append(INVALID_PARAMS)
                        else:
                            frags.append(size)
                            ranges.append((index[key], base + dst, size, src))
                            where.append((i, j, k))
                    key_rows.append(frags)
                out.append(key_rows)
            for (i, j, k), err in zip(where, session.read_ranges(ranges) if ranges else []):
                if err is not None:
                    out[i][j][k] = LEASE_EXPIRED if err.code == 10 else _code(err)
            return out
        finally:
            session.end()

    # --- calls tierkv cannot serve ----------------------------------------
    def alloc_from_mem_pool(self, size):
        """Mooncake serves this only for a dummy client (memory shared with
        its client daemon); tierkv has none: 0, with a log line."""
        log.error("alloc_from_mem_pool: no client-daemon memory pool in tierkv")
        return 0

    def create_copy_task(self, key, targets):
        """(task id, code): tierkv places replicas at put time and runs no
        copy tasks; ((0, 0), UNAVAILABLE_IN_CURRENT_MODE)."""
        log.error("create_copy_task: tierkv runs no replica copy tasks")
        return (0, 0), UNAVAILABLE_IN_CURRENT_MODE

    def create_move_task(self, key, source, target):
        log.error("create_move_task: tierkv runs no replica move tasks")
        return (0, 0), UNAVAILABLE_IN_CURRENT_MODE

    def query_task(self, task_id):
        log.error("query_task: tierkv runs no replica tasks")
        return None, UNAVAILABLE_IN_CURRENT_MODE

    def mount_segment(self, path, size, offset=0, protocol="tcp", location=""):
        log.error("mount_segment: tierkv lends memory only through setup(global_segment_size) or a store daemon")
        return {"ret": UNAVAILABLE_IN_CURRENT_MODE, "segment_ids": []}

    def unmount_segment(self, segment_ids):
        log.error("unmount_segment: tierkv mounts no segments after setup")
        return UNAVAILABLE_IN_CURRENT_MODE

    def allocate_and_mount_segment(self, size, protocol="tcp", location=""):
        log.error("allocate_and_mount_segment: tierkv lends memory only through setup(global_segment_size)")
        return {"ret": UNAVAILABLE_IN_CURRENT_MODE, "segment_ids": [], "allocated_size": 0}

    def unmount_and_free_segment(self, segment_ids):
        log.error("unmount_and_free_segment: tierkv mounts no segments after setup")
        return UNAVAILABLE_IN_CURRENT_MODE
