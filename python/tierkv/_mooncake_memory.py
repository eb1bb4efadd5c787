"""Host memory for tierkv.mooncake_compat's registered buffers: Mooncake's
allocator calls (get_alloc_func_addr, get_free_func_addr,
MooncakeHostMemAllocator), bind_to_numa_node, and BufferPool, which lends
regions registered with a store (BufferLease; also under Mooncake's names
RegisteredBufferPool and RegisteredBufferLease)."""

import ctypes
import logging
import os
import threading
import time

from ._mooncake_codes import OK

log = logging.getLogger("tierkv.mooncake_compat")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


def _aligned_alloc(size, alignment):
    p = ctypes.c_void_p()
    rc = _libc.posix_memalign(ctypes.byref(p), alignment, max(1, size))
    if rc != 0:
        raise MemoryError(f"posix_memalign({size}, {alignment}): {os.strerror(rc)}")
    return p.value


def get_alloc_func_addr():
    """Address of a C function void*(size_t) allocating host memory for
    registered buffers (libc malloc here; Mooncake's allocates hugepages)."""
    return ctypes.cast(_libc.malloc, ctypes.c_void_p).value


def get_free_func_addr():
    """Address of the matching void(void*) (libc free)."""
    return ctypes.cast(_libc.free, ctypes.c_void_p).value


class MooncakeHostMemAllocator:
    """Host memory for buffers given to register_buffer: alloc(size) -> an
    address (0 on failure), free(ptr) -> 0. Page-aligned private memory
    (Mooncake's is shared memory for its client daemon, which tierkv lacks)."""

    def alloc(self, size):
        try:
            return _aligned_alloc(int(size), 4096)
        except MemoryError as e:
            log.error("MooncakeHostMemAllocator.alloc: %s", e)
            return 0

    def free(self, ptr):
        if ptr:
            _libc.free(ctypes.c_void_p(int(ptr)))
        return OK


def bind_to_numa_node(node):
    """Runs the calling thread on NUMA node `node`'s CPUs and, where libnuma
    is installed, prefers that node for its allocations. Warns (and binds
    nothing) where NUMA is absent or the node does not exist; never raises."""
    try:
        with open(f"/sys/devices/system/node/node{int(node)}/cpulist") as f:
            text = f.read().strip()
    except (OSError, ValueError):
        log.warning("bind_to_numa_node(%s): no such NUMA node here; binding skipped", node)
        return
    cpus = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        log.warning("bind_to_numa_node(%s): sched_setaffinity failed: %s", node, e)
    try:
        numa = ctypes.CDLL("libnuma.so.1")
        if numa.numa_available() >= 0:
            numa.numa_set_bind_policy(0)
            numa.numa_set_preferred(int(node))
    except OSError:
        log.info("bind_to_numa_node(%s): libnuma absent; CPUs bound, memory policy unchanged", node)


# --- BufferPool ---------------------------------------------------------------
class BufferLease:
    """A registered buffer lent by a BufferPool: .ptr, .size, .buffer (a
    writable memoryview of .size bytes), release(); a context manager that
    releases on exit. The memory stays valid while the pool is open (a
    released region is kept for reuse), so a view outliving release() sees
    the next lease's bytes."""

    def __init__(self, pool, region, size):
        self._pool, self._region, self._size = pool, region, size

    @property
    def ptr(self):
        if self._region is None:
            raise RuntimeError("registered buffer lease is closed")
        return self._region[0]

    @property
    def size(self):
        return self._size

    @property
    def buffer(self):
        return memoryview((ctypes.c_ubyte * self._size).from_address(self.ptr)).cast("B")

    def release(self):
        if self._region is not None:
            region, self._region = self._region, None
            self._pool._release(region)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class BufferPool:
    """Mooncake's pool of registered host buffers (BufferPool, also
    RegisteredBufferPool). acquire(size) lends a region of at least size
    bytes, registered with store.register_buffer; a released region returns
    to a free list of its size class (sizes up to min_size_class share one
    class, larger ones round up to powers of two below alignment, then to
    multiples of alignment). With the store's local_buffer_size > 0 the pool
    holds at most that many bytes and regions are exact-sized and freed on
    release; with 0 it holds at most max_bytes (which must then be > 0).
    Exhaustion blocks (block_on_exhaustion, or block=) up to timeout seconds,
    then raises RuntimeError, as do closed pools and oversized requests.
    Thread-safe."""

    def __init__(self, store, max_bytes=0, min_size_class=64 * 1024, max_size_class=None, alignment=8 << 20,
                 block_on_exhaustion=True, default_timeout=None, max_regions=None, prewarm_size=None,
                 prewarm_count=0):
        if store is None or getattr(store, "_client", None) is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class <= 0 or alignment <= 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        self._store = store
        self._shared = store._local_buffer_size > 0
        if self._shared:
            max_bytes = store._local_buffer_size
        elif max_bytes <= 0:
            raise RuntimeError("max_bytes must be positive")
        self._max_bytes = int(max_bytes)
        self._max_class = min(int(max_size_class) if max_size_class is not None else self._max_bytes,
                              self._max_bytes)
        self._min_class, self._alignment = int(min_size_class), int(alignment)
        self._block, self._timeout, self._max_regions = block_on_exhaustion, default_timeout, max_regions
        self._cond = threading.Condition()
        self._free = {}      # size class -> [(ptr, size)]
        self._regions = {}   # ptr -> size, every region held (free or lent)
        self._lent = set()
        self._total = 0
        self._closed = False
        if prewarm_size is not None and prewarm_count > 0:
            self.prewarm(prewarm_size, prewarm_count)

    def _class_of(self, size):
        size = max(int(size), 1)
        if self._shared:
            return size, size > self._max_class
        if size > self._max_class:
            return -(-size // self._alignment) * self._alignment, True
        if size <= self._min_class:
            return self._min_class, False
        if size <= self._alignment:
            return 1 << (size - 1).bit_length(), False
        return -(-size // self._alignment) * self._alignment, False

    def _room_for(self, size):
        if self._max_regions is not None and len(self._regions) >= self._max_regions:
            return False
        return self._total + size <= self._max_bytes

    def _new_region(self, size):
        ptr = _aligned_alloc(size, self._alignment)
        if self._store.register_buffer(ptr, size) != 0:
            _libc.free(ctypes.c_void_p(ptr))
            raise RuntimeError("register_buffer failed")
        self._regions[ptr] = size
        self._total += size
        return ptr, size

    def _drop_region(self, region):
        ptr, size = region
        self._store.unregister_buffer(ptr)
        _libc.free(ctypes.c_void_p(ptr))
        del self._regions[ptr]
        self._total -= size

    def acquire(self, size, block=None, timeout=None):
        size_class, oversize = self._class_of(size)
        if size_class > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        block = self._block if block is None else bool(block)
        timeout = self._timeout if timeout is None else timeout
        if timeout is not None and timeout < 0:
            raise RuntimeError("timeout must be non-negative")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("registered buffer pool is closed")
                free = self._free.get(size_class) if not oversize else None
                if free:
                    region = free.pop()
                    break
                if self._room_for(size_class):
                    region = self._new_region(size_class)
                    break
                if not block:
                    raise RuntimeError("registered buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for registered buffer")
                self._cond.wait(left)
            self._lent.add(region[0])
        return BufferLease(self, region, int(size))

    buffer = acquire

    def _release(self, region):
        with self._cond:
            self._lent.discard(region[0])
            if self._shared or self._closed or region[1] > self._max_class:
                self._drop_region(region)
            else:
                self._free.setdefault(region[1], []).append(region)
            self._cond.notify_all()

    def prewarm(self, size, count):
        """Registers count regions of size's class ahead of use (a no-op when
        the pool carves the store's local buffer)."""
        if self._shared:
            return
        size_class, oversize = self._class_of(size)
        if oversize:
            raise RuntimeError("cannot prewarm oversize buffers")
        with self._cond:
            for _ in range(int(count)):
                if self._closed:
                    raise RuntimeError("registered buffer pool is closed")
                if not self._room_for(size_class):
                    raise RuntimeError("registered buffer pool capacity exceeded")
                self._free.setdefault(size_class, []).append(self._new_region(size_class))
            self._cond.notify_all()

    def close(self):
        """Unregisters and frees every region; RuntimeError while any is lent."""
        with self._cond:
            if self._closed:
                return
            if self._lent:
                raise RuntimeError("cannot close registered buffer pool with active leases")
            for regions in self._free.values():
                for region in regions:
                    self._drop_region(region)
            self._free.clear()
            self._closed = True


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
