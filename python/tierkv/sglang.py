"""tierkv as an SGLang HiCache storage backend (L3 under the host pool).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"tierkv",
          "module_path":"tierkv.sglang","class_name":"TierkvStore","interface_v1":1,
          "master_server_address":"10.0.0.1:50051"}'

Keys are those of SGLang's Mooncake backend (mooncake_store.py), so a
TierkvStore and a Mooncake-API client share a cluster's pages. A page hash
`h` becomes `P_h`, where P joins with `_` the extra_config
"extra_backend_tag" (when not None, even "") and storage_config.model_name
with each `/` turned into `-` (when not empty); with neither, the bare `h`.
An MHA page is two objects, `P_h_<tp>_k` and `P_h_<tp>_v`
(`P_h_<tp>_<pp>_k`/`_v` when pp_size > 1); an MLA page is one,
`P_h__k` (`P_h_<pp>_k` when pp_size > 1). Every call maps keys this one way,
v1 and the older interface alike. Beyond that backend: K and V of a page form
one group (visible and evicted together), each page names the previous page
as its parent (prefix-aware eviction), and batch_exists is ONE server-side
PrefixMatch. SGLang's split-heads mode (tp_lcm_size with the page_head
layout), several objects per rank, is refused at construction.

batch_get_v1/batch_set_v1 move pages between the registered host pool and
the store with no copy: the pool's page addresses (get_page_buffer_meta)
are read and written in place. They return one bool per key, never None,
and never raise on a store or network error (a failed page is False).
The older interface (batch_set/batch_get, what SGLang calls without
interface_v1) moves one buffer per page, as the host pool's get_data_page
gives it: for MHA its first half is the page's K object and its second half
its V object, which is the page_first layout's flat page, so pages written
either way read back either way.

extra_config keys (all optional but the master): master_server_address (or
TIERKV_MASTER), metadata_server ("P2PHANDSHAKE": ask the master),
global_segment_size (bytes this process lends, default 0), protocol
("tcp"/"rdma"), rdma_devices, replicas, transfer_timeout, rpc_timeout,
extra_backend_tag (a key prefix, as above), reply_spin (seconds a call
busy-polls for its reply; 0: never), replica_cache
(keys whose replicas a repeated get reads without the master; 0: off), token_file
(the token for a master running --auth token; default $TIERKV_TOKEN_FILE).
"""

import logging
import os
import threading

from . import DEFAULT_REPLICA_CACHE, Client, Error

log = logging.getLogger("tierkv.sglang")

try:  # subclass SGLang's base where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # SGLang is absent: the documented interface, stand-alone
    class _Base:
        """Stand-in for sglang.srt.mem_cache.hicache_storage.HiCacheStorage."""

        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host


def _cfg(storage_config, name, default=None):
    if storage_config is None:
        return default
    if isinstance(storage_config, dict):
        return storage_config.get(name, default)
    return getattr(storage_config, name, default)


def _address(x):
    """(address, nbytes) of a torch tensor, numpy array or buffer."""
    if hasattr(x, "data_ptr"):
        # A strided view's bytes are not the range data_ptr() starts.
        if not x.is_contiguous():
            raise ValueError("a non-contiguous tensor is not one address range")
        return x.data_ptr(), x.numel() * x.element_size()
    from . import buffer_address
    return buffer_address(x, True)


def key_prefix(extra_backend_tag, model_name):
    """What SGLang's Mooncake backend puts, with a `_`, before every page hash:
    the tag (when not None) and the model name with `/` as `-` (when not
    empty), joined by `_`; None where neither is set."""
    parts = [] if extra_backend_tag is None else [str(extra_backend_tag)]
    if model_name:
        parts.append(str(model_name).replace("/", "-"))
    return "_".join(parts) if parts else None


class TierkvStore(_Base):
    """HiCacheStorage over tierkv. Thread-safe (SGLang calls it from its
    prefetch and backup threads at once)."""

    def __init__(self, storage_config=None, kwargs=None):
        extra = dict(_cfg(storage_config, "extra_config", None) or {})
        extra.update(kwargs or {})
        self.tp_rank = int(_cfg(storage_config, "tp_rank", 0) or 0)
        self.tp_size = int(_cfg(storage_config, "tp_size", 1) or 1)
        self.pp_rank = int(_cfg(storage_config, "pp_rank", 0) or 0)
        self.pp_size = int(_cfg(storage_config, "pp_size", 1) or 1)
        self.is_mla = bool(_cfg(storage_config, "is_mla_model", False))
        if _cfg(storage_config, "should_split_heads", False):
            raise ValueError("tierkv.sglang does not support split heads (tp_lcm_size with the page_head layout)")
        prefix = key_prefix(extra.get("extra_backend_tag"), _cfg(storage_config, "model_name", None))
        self._key_head = "" if prefix is None else prefix + "_"
        pp = self.pp_size > 1
        if self.is_mla:
            # Every TP rank holds the same MLA page, so its rank field names
            # only the pipeline stage, and is empty without one (`h__k`).
            self._key_tails = [f"_{self.pp_rank if pp else ''}_k"]
        else:
            rank = f"{self.tp_rank}_{self.pp_rank}" if pp else f"{self.tp_rank}"
            self._key_tails = [f"_{rank}_k", f"_{rank}_v"]
        master = extra.get("master_server_address") or os.environ.get("TIERKV_MASTER", "127.0.0.1:50051")
        metadata = extra.get("metadata_server") or None
        if metadata == "P2PHANDSHAKE":
            metadata = None
        elif metadata and metadata.endswith("/metadata"):
            metadata = metadata[: -len("/metadata")]
        protocol = str(extra.get("protocol", "tcp")).lower()
        transports = ["rdma", "tcp"] if protocol == "rdma" else ["shm", "tcp"]
        devices = [d for d in str(extra.get("rdma_devices", "") or "").split(",") if d]
        self.replicas = int(extra.get("replicas", 1))
        opts = dict(transports=transports, rdma_devices=devices,
                    lend_size=int(extra.get("global_segment_size", 0) or 0),
                    rpc_timeout=float(extra.get("rpc_timeout", 5.0)),
                    transfer_timeout=float(extra.get("transfer_timeout", 30.0)),
                    reply_spin=float(extra.get("reply_spin", 50e-6)),
                    replica_cache=int(extra.get("replica_cache", DEFAULT_REPLICA_CACHE)),
                    token_file=extra.get("token_file") or None)
        try:
            self.client = Client(master, metadata, **opts)
        except Error as e:
            if protocol != "rdma":
                raise
            log.warning("rdma unusable (%s); falling back to tcp", e)
            opts.update(transports=["shm", "tcp"], rdma_devices=[])
            self.client = Client(master, metadata, **opts)
        self.mem_pool_host = None
        self._registered = None
        self._stats_lock = threading.Lock()
        self._stats = {"exists_pages_asked": 0, "exists_pages_found": 0, "get_pages": 0, "get_pages_ok": 0,
                       "set_pages": 0, "set_pages_ok": 0}

    # --- keys -----------------------------------------------------------
    def object_keys(self, key):
        """The objects of page `key`, K first: the one key map of every call."""
        return [f"{self._key_head}{key}{tail}" for tail in self._key_tails]

    def _flat_keys(self, keys):
        return [k for key in keys for k in self.object_keys(key)]

    def _count(self, **kw):
        with self._stats_lock:
            for k, v in kw.items():
                self._stats[k] += v

    # --- pool -----------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host):
        """Registers the whole host pool once, so every page moves in place."""
        super().register_mem_pool_host(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        ptr, size = _address(mem_pool_host.kv_buffer)
        try:
            self.client.register_memory(ptr, size)
            self._registered = ptr
        except Error as e:  # still works over transports that need no registration
            log.warning("cannot register the host pool: %s", e)

    def _page_meta(self, keys, host_indices):
        page = self.mem_pool_host.page_size
        if len(host_indices) != len(keys) * page:
            raise ValueError(f"{len(keys)} keys need {len(keys) * page} host indices, got {len(host_indices)}")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    def _per_page(self, ok_flags):
        m = len(self._key_tails)
        return [all(ok_flags[i * m:(i + 1) * m]) for i in range(len(ok_flags) // m)]

    def _page_objects(self, buffers):
        """(ptrs, sizes) of the objects of one (address, size) buffer per page:
        for MHA the buffer's halves, K then V, as get_data_page lays them out."""
        ptrs, sizes = [], []
        for ptr, size in buffers:
            ptr, size = int(ptr), int(size)
            if len(self._key_tails) == 1:
                ptrs.append(ptr)
                sizes.append(size)
            elif size % 2:
                raise ValueError(f"an MHA page of {size} bytes has no equal K and V halves")
            else:
                ptrs += [ptr, ptr + size // 2]
                sizes += [size // 2, size // 2]
        return ptrs, sizes

    def _put_pages(self, keys, ptrs, sizes, prefix_keys=()):
        """Stores the objects of pages `keys` (one ptr and size per object, K
        then V); True per page stored or already present."""
        m = len(self._key_tails)
        parent = self.object_keys(prefix_keys[-1])[0] if prefix_keys else ""
        flat, groups, parents = [], [], []
        for key in keys:
            objs = self.object_keys(key)
            flat += objs
            groups += [objs[0]] * m if m > 1 else [""]
            parents += [parent] * m
            parent = objs[0]
        try:
            res = self.client.batch_put_ptrs(flat, ptrs, sizes, groups=groups, parent_keys=parents,
                                             replicas=self.replicas)
        except Error as e:
            log.warning("storing %d pages failed: %s", len(keys), e)
            res = [e] * len(flat)
        # A page that is already there is stored (first writer wins).
        ok = self._per_page([r is None or getattr(r, "code", None) == 6 for r in res])
        self._count(set_pages=len(keys), set_pages_ok=sum(ok))
        return ok

    def _get_pages(self, keys, ptrs, sizes):
        """Reads the objects of pages `keys` into ptrs/sizes; True per page
        whose every object filled its buffer exactly (a shorter object is
        another layout's, and would misplace V)."""
        try:
            got = self.client.batch_get_into_ptrs(self._flat_keys(keys), ptrs, sizes)
        except Error as e:
            log.warning("reading %d pages failed: %s", len(keys), e)
            got = [None] * len(ptrs)
        ok = self._per_page([isinstance(g, int) and not isinstance(g, bool) and g == s
                             for g, s in zip(got, sizes)])
        self._count(get_pages=len(keys), get_pages_ok=sum(ok))
        return ok

    # --- interface_v1 ---------------------------------------------------
    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Reads pages into the host pool at host_indices; True per page read."""
        if not keys:
            return []
        ptrs, sizes = self._page_meta(keys, host_indices)
        return self._get_pages(keys, ptrs, sizes)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Writes pages from the host pool; True per page stored (or present)."""
        if not keys:
            return []
        ptrs, sizes = self._page_meta(keys, host_indices)
        return self._put_pages(keys, ptrs, sizes, list(getattr(extra_info, "prefix_keys", None) or []))

    def batch_exists(self, keys, extra_info=None):
        """How many leading pages are present: one server-side PrefixMatch."""
        if not keys:
            return 0
        try:
            n = self.client.prefix_match(self._flat_keys(keys)) // len(self._key_tails)
        except Error as e:
            log.warning("batch_exists failed: %s", e)
            n = 0
        self._count(exists_pages_asked=len(keys), exists_pages_found=n)
        return n

    # --- the older interface --------------------------------------------
    def exists(self, key):
        return self.batch_exists([key]) == 1

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], [value] if value is not None else None,
                              [target_location] if target_location is not None else None,
                              [target_sizes] if target_sizes is not None else None)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        """Stores one buffer per page (tensors/buffers, or addresses with
        sizes) under the pages' object keys; True when every page is stored."""
        if not keys:
            return True
        try:
            buffers = ([_address(v) for v in values] if values is not None
                       else list(zip(target_locations, target_sizes)))
            if len(buffers) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
            ptrs, sizes = self._page_objects(buffers)
        except (Error, TypeError, ValueError) as e:
            log.warning("batch_set failed: %s", e)
            return False
        return all(self._put_pages(list(keys), ptrs, sizes))

    def get(self, key, target_location=None, target_sizes=None):
        out = self.batch_get([key], [target_location] if target_location is not None else None,
                             [target_sizes] if target_sizes is not None else None)
        return out[0] if out else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Into target_locations (one page buffer per key: tensors/buffers, or
        addresses with sizes): per key the target, or None where the page was
        not read whole. Without targets, each page's bytes (None on a miss)."""
        keys = list(keys)
        if not keys:
            return []
        if target_locations is None:
            m = len(self._key_tails)
            try:
                got = self.client.batch_get(self._flat_keys(keys))
            except Error:
                return [None] * len(keys)
            pages = [got[i * m:(i + 1) * m] for i in range(len(keys))]
            return [b"".join(p) if all(isinstance(v, bytes) for v in p) else None for p in pages]
        try:
            buffers = ([_address(t) for t in target_locations] if target_sizes is None
                       else list(zip(target_locations, target_sizes)))
            if len(buffers) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(buffers)} targets")
            ptrs, sizes = self._page_objects(buffers)
        except (Error, TypeError, ValueError) as e:
            log.warning("batch_get failed: %s", e)
            return [None] * len(keys)
        return [t if ok else None for ok, t in zip(self._get_pages(keys, ptrs, sizes), target_locations)]

    # --- housekeeping ---------------------------------------------------
    def clear(self):
        """Removes every object in the cluster (leased ones stay until read)."""
        try:
            self.client.remove_all()
        except Error as e:
            log.warning("clear failed: %s", e)

    def get_stats(self):
        """Pages asked and found by batch_exists, and read and written by every get and set."""
        with self._stats_lock:
            return dict(self._stats)

    def close(self):
        if self.client is not None:
            self.client.close()
            self.client = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

from .sglang_linker import TierkvLinker  # noqa: E402,F401
