"""tierkv as SGLang's unified-cache external linker: device pools <-> tierkv, no host tier.

    python -m sglang.launch_server ... --enable-unified-cache-external-linker \\
      --unified-cache-external-linker-config '{"linker":"TierkvLinker",
          "linker_module_path":"tierkv.sglang",
          "linker_extra_config":{"master_server_address":"10.0.0.1:50051"}}'

SGLang builds the class as `TierkvLinker(server_args, params, components=...,
extra_config=...)`; linker_extra_config takes TierkvStore's keys (tierkv.sglang:
master_server_address, protocol, extra_backend_tag, replicas, ...) plus
model_name, tp_rank, pp_rank, pp_size (when SGLang's own are not to be used)
and load_timeout (seconds a forward pass waits for one layer, default 30).

Layout. Page keys are TierkvStore.object_keys(page hash): the KV pool's K and
V objects (MLA: one) are named as SGLang's Mooncake HiCache backend names
them. A side pool P (swa, mamba, ...) stores object j of page h as
`<K key less its "_k">_<P>_<j>`. Every object holds the page's rows of each
of its layers in turn (layer 0 first), as SGLang's direct Mooncake linker
lays them out, so one layer is one byte range of every object.

Guarantees.
- lookup(rid, transfers) returns EVERY restorable prefix length, in pages: n
  is in the set when every pool meets its hit policy at n (all_pages: pages
  [0, n) whole; trailing_pages with a window of w pages: [n-w, n) whole). A
  page is whole when each of its objects is present with its layout's size.
  The answer comes from ONE read session over the candidate objects, kept as
  the rid's ticket: the master's counted read leases stop those pages being
  evicted, removed or overwritten until the load ends, the rid is cancelled
  or the lease runs out (the master's --lease-ttl). A lookup with no hit, a
  repeated lookup and cancel end the previous session at once.
- load + start_layer_wise_loading read each page layer by layer with range
  reads from the ticket's session (no master call per layer; when a lease has
  lapsed, one fresh session per layer at most) straight into the registered
  pool buffers, and mark each layer in layer_done_counter as it lands, in
  order.
- offload writes one node (the pages of its transfers) through one write
  session: a page's objects form one tierkv group (visible and evicted only
  whole), each page names the previous page of the node as its parent, and the
  node is committed whole or not at all (pages already present count as
  stored).
- Nothing here raises into the scheduler on a store or network error: lookup
  answers [], a load's rids complete anyway (and are listed by
  take_failed_loads(), logged), an offload completes False. A failed load still
  releases its layers so the forward pass never blocks.
- Two worker threads (one loads, one offloads, so completions keep FIFO order);
  each buffer is registered with the client once; reset() quiesces (bounded),
  close() also stops the threads, unregisters and closes the client.
"""

import enum
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

from . import Error

log = logging.getLogger("tierkv.sglang_linker")

_NOT_FOUND, _ALREADY_EXISTS, _ABORTED = 5, 6, 10

try:  # subclass SGLang's base where SGLang is installed
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker as _Base
except ImportError:
    class _Base:
        """Stand-in for sglang.srt.mem_cache.unified_cache.unified_cache_linker.
        UnifiedCacheLinker: lookup(rid, transfers) -> list[int] (pages),
        load(rid, transfers) -> bool, start_layer_wise_loading() -> int (-1:
        nothing queued), cancel_queued_load(rid) -> bool, num_completed_loads(),
        pop_completed_load() -> list[str], offload(transfers) -> bool,
        num_completed_offloads(), pop_completed_offload() -> bool, reset(),
        close(), and a layer_done_counter attribute."""

try:
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LinkerCancelOutcome
except ImportError:
    class LinkerCancelOutcome(str, enum.Enum):
        LOOKUP_RELEASED = "lookup_released"
        QUEUED_LOAD_CANCELLED = "queued_load_cancelled"
        SUBMITTED_LOAD_RETAINED = "submitted_load_retained"
        NOT_FOUND = "not_found"

try:
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer
except ImportError:
    @dataclass
    class PoolTransfer:
        """Stand-in for SGLang's PoolTransfer (the fields this linker reads)."""
        name: Any
        host_indices: Any = None
        device_indices: Any = None
        keys: Optional[List[str]] = None
        hit_policy: Any = "all_pages"
        nodes_to_load: Any = None
        indices_from_pool: Any = None


def _name(x):
    return str(getattr(x, "value", x))


def _ints(indices):
    return [int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]


class LayerWiseLoadCounter:
    """What SGLang's KV pools wait on (register_layer_transfer_counter): a
    batch opened by update_producer() lands layer by layer (complete), the
    forward pass calls set_consumer(index) and wait_until(layer) before it
    reads a layer. fail(index) releases every layer of a batch. wait_until
    is bounded by `timeout`; past it, it logs and returns. Thread-safe."""

    def __init__(self, num_layers, timeout=30.0):
        self.num_layers = num_layers
        self.timeout = timeout
        self._cv = threading.Condition()
        self._landed = {}  # index -> layers landed, in order
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self):
        with self._cv:
            self.producer_index += 1
            self._landed[self.producer_index] = 0
            for old in [i for i in self._landed if i < self.producer_index - 64]:
                del self._landed[old]  # batches nobody waited for
            return self.producer_index

    def set_consumer(self, index):
        self.consumer_index = index

    def complete(self, index, layer):
        self._set(index, layer + 1)

    def fail(self, index, error=None):
        """Releases every layer of batch `index` (its loads are reported failed)."""
        self._set(index, self.num_layers)

    def _set(self, index, landed):
        with self._cv:
            if index in self._landed:
                self._landed[index] = max(self._landed[index], landed)
                self._cv.notify_all()

    def landed(self, index):
        with self._cv:
            return self._landed.get(index, self.num_layers)

    def wait_until(self, threshold):
        index = self.consumer_index
        with self._cv:
            if index not in self._landed:
                return
            if not self._cv.wait_for(lambda: self._landed[index] > threshold, self.timeout):
                log.error("layer %d of load batch %d did not land within %.1fs", threshold, index, self.timeout)
            if threshold >= self.num_layers - 1:
                self._landed.pop(index, None)

    def reset(self):
        with self._cv:
            self._landed.clear()
            self.producer_index = self.consumer_index = -1
            self._cv.notify_all()


class _Pool:
    """One device pool: per object of a page, its per-layer buffers (None
    where the pool has no such layer), each [slots, ...] and contiguous."""

    def __init__(self, name, objects, page_size):
        from .sglang import _address
        self.name = name
        self.layers = []  # per object: per layer (ptr, row_bytes, object offset) or None
        self.sizes = []  # per object: its stored size
        self.buffers = []  # (ptr, nbytes, buffer): the memory to register
        for per_layer in objects:
            rows, offset = [], 0
            for buf in per_layer:
                if buf is None:
                    rows.append(None)
                    continue
                ptr, nbytes = _address(buf)
                row = nbytes // int(buf.shape[0])
                rows.append((ptr, row, offset))
                offset += row * page_size
                if hasattr(buf, "untyped_storage"):  # register the whole allocation once
                    whole = buf.untyped_storage()
                    self.buffers.append((whole.data_ptr(), whole.nbytes(), buf))
                else:
                    self.buffers.append((ptr, nbytes, buf))
            self.layers.append(rows)
            self.sizes.append(offset)
        self.on_cuda = any(getattr(b, "is_cuda", False) for _, _, b in self.buffers)


@dataclass
class _Ticket:  # a lookup's reservation: one read session over its objects
    session: Any
    index: dict  # object key -> index in the session


@dataclass
class _Load:
    rid: str
    ticket: Optional[_Ticket]
    reads: list  # (object key, pool, object number, first slot)


@dataclass
class _Stats:
    lookups: int = 0
    lookup_hits: int = 0
    loads: int = 0
    loads_failed: int = 0
    offloads: int = 0
    offloads_failed: int = 0


class TierkvLinker(_Base):
    """UnifiedCacheLinker over tierkv. Called from SGLang's scheduler thread;
    its two workers touch only the completion queues, the counter, the
    sessions they were handed and (each its own) fields of `stats`."""

    def __init__(self, server_args=None, params=None, *, components=None, extra_config=None, pools=None,
                 page_size=None):
        from .sglang import TierkvStore
        extra = dict(extra_config or {})
        self.page_size = int(page_size or getattr(params, "page_size", 0) or extra.pop("page_size", 0))
        if self.page_size <= 0:
            raise ValueError("TierkvLinker needs a page size (params.page_size)")
        if pools is None:
            pools = _pools_from_params(params)
        is_mla = len(pools["kv"]) == 1
        tp_rank, tp_size = _tp(params)
        config = {"tp_rank": extra.pop("tp_rank", tp_rank), "tp_size": tp_size,
                  "pp_rank": extra.pop("pp_rank", getattr(params, "pp_rank", 0)),
                  "pp_size": extra.pop("pp_size", getattr(params, "pp_size", 1)), "is_mla_model": is_mla,
                  "model_name": extra.pop("model_name", getattr(server_args, "model_path", None))}
        timeout = float(extra.pop("load_timeout", 30.0))
        self._store = TierkvStore(dict(config, extra_config=extra))
        self.client = self._store.client
        self._pools = {_name(n): _Pool(_name(n), objs, self.page_size) for n, objs in pools.items()}
        if len(self._store.object_keys("h")) != len(self._pools["kv"].layers):
            raise ValueError("the kv pool needs K and V buffers (MHA) or one (MLA)")
        self.num_layers = max(len(rows) for p in self._pools.values() for rows in p.layers)
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers, timeout)
        self._registered = []
        for ptr, nbytes in {(p, n) for pool in self._pools.values() for p, n, _ in pool.buffers}:
            try:
                self.client.register_memory(ptr, nbytes)
                self._registered.append(ptr)
            except Error as e:  # transports that need no registration still work
                log.warning("cannot register a pool buffer: %s", e)
        self._on_cuda = any(p.on_cuda for p in self._pools.values())
        self._lock = threading.Lock()
        self._tickets, self._queued, self._inflight, self._failed = {}, {}, set(), {}
        self._jobs = 0  # queued or running worker jobs, under _idle
        self._idle = threading.Condition(self._lock)
        self._loaded, self._offloaded = queue.Queue(), queue.Queue()
        self._load_q, self._offload_q = queue.Queue(), queue.Queue()
        self.stats = _Stats()
        self._closed = False
        self._threads = [threading.Thread(target=self._worker, args=(q, fn), daemon=True, name=name)
                         for q, fn, name in ((self._load_q, self._load_batch, "tierkv-linker-load"),
                                             (self._offload_q, self._store_node, "tierkv-linker-offload"))]
        for t in self._threads:
            t.start()

    # --- keys -----------------------------------------------------------
    def object_keys(self, pool, page_hash):
        """The objects of one page of `pool` ("kv" or a side pool's name)."""
        kv = self._store.object_keys(page_hash)
        if pool == "kv":
            return kv
        return [f"{kv[0][:-2]}_{pool}_{j}" for j in range(len(self._pools[pool].layers))]

    # --- lookup ---------------------------------------------------------
    def lookup(self, rid, transfers):
        """Every restorable prefix length (pages), reserved for `rid`."""
        self._end(self._take_ticket(rid))
        self.stats.lookups += 1
        kv = next((t for t in transfers if _name(t.name) == "kv"), None)
        hashes = list(kv.keys or []) if kv is not None else []
        if not hashes or self._closed:
            return []
        checks, keys, index = [], [], {}
        for t in transfers:
            name = _name(t.name)
            if name not in self._pools:
                log.warning("lookup for rid %s names pool %r this linker was not given", rid, name)
                return []
            window = None if _name(t.hit_policy) != "trailing_pages" else max(1, len(t.keys or ()))
            members = []
            for h in hashes:
                page = []
                for j, k in enumerate(self.object_keys(name, h)):
                    if k not in index:
                        index[k] = len(keys)
                        keys.append(k)
                    page.append((index[k], self._pools[name].sizes[j]))
                members.append(page)
            checks.append((window, members))
        try:
            session = self.client.read_session(keys)
            sizes = session.sizes()
        except Error as e:
            log.warning("lookup for rid %s failed: %s", rid, e)
            return []
        lengths = set(range(1, len(hashes) + 1))
        for window, members in checks:
            whole = [all(sizes[i] == size for i, size in page) for page in members]
            lengths = {n for n in lengths if all(whole[max(0, n - window) if window else 0:n])}
        if not lengths:
            self._end(_Ticket(session, index))
            return []
        with self._lock:
            self._tickets[rid] = _Ticket(session, index)
        self.stats.lookup_hits += 1
        return sorted(lengths)

    # --- loads ----------------------------------------------------------
    def load(self, rid, transfers):
        """Queues a load of `transfers` into their device indices; the next
        start_layer_wise_loading starts it. Reads come from rid's lookup."""
        reads = []
        for t in transfers:
            name = _name(t.name)
            for h, first in zip(t.keys or [], self._page_starts(t)):
                reads += [(k, self._pools[name], j, first) for j, k in enumerate(self.object_keys(name, h))]
        if not reads or self._closed:
            return False
        with self._lock:
            if rid in self._queued or rid in self._inflight:
                raise RuntimeError(f"a tierkv load for rid {rid!r} is already queued")
            self._queued[rid] = _Load(rid, self._tickets.pop(rid, None), reads)
        return True

    def _page_starts(self, t):
        slots = _ints(t.device_indices if t.device_indices is not None else t.host_indices)
        p = self.page_size
        if len(slots) != len(t.keys or ()) * p:
            raise ValueError(f"{len(t.keys or ())} pages need {len(t.keys or ()) * p} indices, got {len(slots)}")
        starts = slots[::p]
        if any(s % p or slots[i * p + p - 1] != s + p - 1 for i, s in enumerate(starts)):
            raise ValueError("device indices are not whole, aligned pages")
        return starts

    def start_layer_wise_loading(self):
        """Starts every queued load; the counter index they land under, or -1."""
        with self._lock:
            if not self._queued:
                return -1
            batch = list(self._queued.values())
            self._queued.clear()
            self._inflight.update(load.rid for load in batch)
            index = self.layer_done_counter.update_producer()
        self.stats.loads += len(batch)
        self._submit(self._load_q, (index, batch, self._ready_event()))
        return index

    def _load_batch(self, index, batch, event):
        failed, started = {}, []
        try:
            if event is not None:
                event.synchronize()
            where = self._locate(batch, started)
            for layer in range(self.num_layers):
                self._read_layer(layer, batch, where, started, failed)
                self.layer_done_counter.complete(index, layer)
        except Exception as e:  # never into the scheduler
            log.exception("tierkv load batch %d failed", index)
            failed.update({load.rid: repr(e) for load in batch if load.rid not in failed})
        finally:
            self.layer_done_counter.fail(index)  # every layer released, landed or not
            for load in batch:
                self._end(load.ticket)
            for s in started:
                self._end(_Ticket(s, {}))
            for rid, why in failed.items():
                log.error("tierkv load for rid %s failed: %s", rid, why)
            with self._lock:
                self._failed.update(failed)
                self._inflight.difference_update(load.rid for load in batch)
            self.stats.loads_failed += len(failed)
            self._loaded.put([load.rid for load in batch])

    def _locate(self, batch, started, renew=False):
        """object key -> (session, index): the tickets' sessions, one new
        session for the keys without (or, with `renew`, for every key)."""
        where, missing = {}, []
        for load in batch:
            for key, *_ in load.reads:
                if not renew and load.ticket is not None and key in load.ticket.index:
                    where[key] = (load.ticket.session, load.ticket.index[key])
                elif key not in missing:
                    missing.append(key)
        if missing:
            session = self.client.read_session(missing)
            started.append(session)
            where.update((key, (session, i)) for i, key in enumerate(missing))
        return where

    def _read_layer(self, layer, batch, where, started, failed, retried=False):
        by_session = {}
        for load in batch:
            if load.rid in failed:
                continue
            for key, pool, j, first in load.reads:
                spot = pool.layers[j][layer] if layer < len(pool.layers[j]) else None
                if spot is None:
                    continue
                ptr, row, offset = spot
                session, i = where[key]
                n = row * self.page_size
                by_session.setdefault(id(session), (session, [], []))
                by_session[id(session)][1].append((i, ptr + first * row, n, offset))
                by_session[id(session)][2].append(load.rid)
        lapsed = False
        for session, ranges, rids in by_session.values():
            for err, rid in zip(session.read_ranges(ranges), rids):
                if err is None or rid in failed:
                    continue
                if getattr(err, "code", None) == _ABORTED and not retried:
                    lapsed = True
                else:
                    failed[rid] = f"layer {layer}: {err}"
        if lapsed:  # a lease ran out: one fresh session, then this layer again
            where.update(self._locate([b for b in batch if b.rid not in failed], started, renew=True))
            self._read_layer(layer, batch, where, started, failed, retried=True)

    def cancel_queued_load(self, rid):
        """Drops rid's lookup ticket and its load if not yet started (True then)."""
        with self._lock:
            ticket, load = self._tickets.pop(rid, None), self._queued.pop(rid, None)
        self._end(ticket)
        self._end(load.ticket if load else None)
        return load is not None

    def cancel_request(self, rid):
        """Releases what rid holds here; a started load runs to completion."""
        with self._lock:
            ticket, load = self._tickets.pop(rid, None), self._queued.pop(rid, None)
            running = rid in self._inflight
        self._end(ticket)
        self._end(load.ticket if load else None)
        if load is not None:
            return LinkerCancelOutcome.QUEUED_LOAD_CANCELLED
        if ticket is not None:
            return LinkerCancelOutcome.LOOKUP_RELEASED
        return LinkerCancelOutcome.SUBMITTED_LOAD_RETAINED if running else LinkerCancelOutcome.NOT_FOUND

    def num_completed_loads(self):
        return self._loaded.qsize()

    def pop_completed_load(self):
        """The rids of the oldest finished load batch (failed ones included)."""
        return self._loaded.get_nowait()

    def take_failed_loads(self):
        """{rid: why} of the loads that failed since the last call."""
        with self._lock:
            out, self._failed = self._failed, {}
        return out

    # --- offloads -------------------------------------------------------
    def offload(self, transfers):
        """Queues one node for atomic persistence; False when there is nothing to write."""
        pages = {}  # page hash -> [(key, pool, object number, first slot)], in node order
        for t in transfers:
            name = _name(t.name)
            for h, first in zip(t.keys or [], self._page_starts(t)):
                pages.setdefault(h, []).extend(
                    (k, self._pools[name], j, first) for j, k in enumerate(self.object_keys(name, h)))
        if not pages or self._closed:
            return False
        self.stats.offloads += 1
        self._submit(self._offload_q, (list(pages.values()), self._ready_event()))
        return True

    def _store_node(self, pages, event):
        ok = False
        try:
            if event is not None:
                event.synchronize()
            ok = self._write_pages(pages)
        except Exception:  # never into the scheduler
            log.exception("tierkv offload failed")
        finally:
            if not ok:
                self.stats.offloads_failed += 1
            self._offloaded.put(ok)

    def _write_pages(self, pages):
        keys, sizes, groups, parents, objs, parent = [], [], [], [], [], ""
        for page in pages:
            group = page[0][0] if len(page) > 1 else ""
            for key, pool, j, _ in page:
                keys.append(key)
                sizes.append(pool.sizes[j])
                groups.append(group)
                parents.append(parent)
            objs += page
            parent = page[0][0]
        session, todo = None, []
        try:
            session = self.client.write_session(keys, sizes, groups=groups, parent_keys=parents,
                                                replicas=self._store.replicas)
            for i, st in enumerate(session.statuses()):
                if st is None:
                    todo.append(i)
                elif getattr(st, "code", None) != _ALREADY_EXISTS:  # present: stored (first writer wins)
                    raise st
            ranges = [(i, ptr + objs[i][3] * row, row * self.page_size, offset) for i in todo
                      for ptr, row, offset in filter(None, objs[i][1].layers[objs[i][2]])]
            bad = [e for e in session.write_ranges(ranges) if e is not None] if ranges else []
            if bad:
                raise bad[0]
            results = session.commit(todo) if todo else []
        except Error as e:
            log.warning("offloading %d pages failed: %s", len(pages), e)
            if session is not None:
                session.revoke()  # what was not committed
            return False
        if all(r is None for r in results):
            return True
        log.warning("committing %d pages failed: %s", len(pages), next(r for r in results if r is not None))
        for i, r in zip(todo, results):  # the node is whole or absent: take back what did commit
            if r is None:
                try:
                    self.client.remove(keys[i])
                except Error as e:
                    log.warning("cannot take back %s: %s", keys[i], e)
        return False

    def num_completed_offloads(self):
        return self._offloaded.qsize()

    def pop_completed_offload(self):
        """The oldest finished offload: True when its node was stored whole."""
        return self._offloaded.get_nowait()

    # --- lifecycle ------------------------------------------------------
    def has_pending_operations(self):
        with self._lock:
            return bool(self._tickets or self._queued or self._inflight or self._jobs)

    def reset(self, timeout=60.0):
        """Waits (at most `timeout` s) for started transfers, then drops every
        ticket, queued load and completion."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._jobs == 0, timeout):
                log.error("tierkv linker reset: transfers still running after %.0fs", timeout)
            tickets = list(self._tickets.values()) + [l.ticket for l in self._queued.values()]
            self._tickets.clear()
            self._queued.clear()
            self._failed.clear()
        for t in tickets:
            self._end(t)
        for q in (self._loaded, self._offloaded):
            while not q.empty():
                q.get_nowait()
        self.layer_done_counter.reset()

    def close(self, timeout=60.0):
        """reset(), then stops the workers and closes the client. Idempotent."""
        if self._closed:
            return
        self.reset(timeout)
        self._closed = True
        for q in (self._load_q, self._offload_q):
            q.put(None)
        for t in self._threads:
            t.join(timeout)
        for ptr in self._registered:
            try:
                self.client.unregister_memory(ptr)
            except Error:
                pass
        self._store.close()

    # --- internals ------------------------------------------------------
    def _submit(self, q, job):
        with self._lock:
            self._jobs += 1
        q.put(job)

    def _worker(self, q, fn):
        while True:
            job = q.get()
            if job is None:
                return
            try:
                fn(*job)
            finally:
                with self._idle:
                    self._jobs -= 1
                    self._idle.notify_all()

    def _take_ticket(self, rid):
        with self._lock:
            return self._tickets.pop(rid, None)

    @staticmethod
    def _end(ticket):
        if ticket is not None:
            try:
                ticket.session.end()
            except Error as e:
                log.warning("ending a read session failed: %s", e)

    def _ready_event(self):
        """A CUDA event after the work queued so far, when the pools are on a GPU."""
        if not self._on_cuda:
            return None
        import torch
        event = torch.cuda.Event()
        event.record()
        return event


def _tp(params):
    try:
        import torch.distributed as dist
        group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
        if params is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(group=group), dist.get_world_size(group=group)
    except ImportError:
        pass
    return 0, 1


def _pools_from_params(params):
    """{"kv": per object, per layer buffers} of SGLang's device KV pool."""
    kv = params.token_to_kv_pool_allocator.get_kvcache()
    if hasattr(kv, "k_buffer") and hasattr(kv, "v_buffer"):
        return {"kv": [list(kv.k_buffer), list(kv.v_buffer)]}
    if hasattr(kv, "kv_buffer"):
        return {"kv": [list(kv.kv_buffer)]}
    raise ValueError(f"TierkvLinker cannot lay out {type(kv).__name__}; pass pools=")
