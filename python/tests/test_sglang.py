"""tierkv.sglang.TierkvStore with a stand-in for SGLang's host pool.

FakeHostPool follows MHATokenToKVPoolHost's documented surface: kv_buffer,
page_size, get_page_buffer_meta(indices) -> (ptrs, sizes) with K then V of
each page (layout page_first: a page's K of every layer is contiguous). The
pool is a torch bfloat16 tensor, as SGLang's is, or a numpy array; every
test runs over both.
"""

import json
import signal
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from conftest import unique
from waiting import wait_for
from tierkv.sglang import TierkvStore

PAGE = 4          # tokens per page
PAGE_BYTES = 64 * 1024  # one page's K (or V) over all layers


class FakeHostPool:
    def __init__(self, pages, kind="torch"):
        self.page_size = PAGE
        self.pages = pages
        if kind == "torch":  # [K|V][page][elements]
            self.kv_buffer = torch.zeros((2, pages, PAGE_BYTES // 2), dtype=torch.bfloat16)
            self._base = self.kv_buffer.data_ptr()
            self._bytes = self.kv_buffer.view(torch.uint8).numpy()  # the same memory, as bytes
        else:
            self.kv_buffer = np.zeros((2, pages, PAGE_BYTES), dtype=np.uint8)
            self._base = self.kv_buffer.ctypes.data
            self._bytes = self.kv_buffer

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for t in list(indices)[::self.page_size]:
            page = int(t) // self.page_size
            ptrs += [self._base + page * PAGE_BYTES, self._base + (self.pages + page) * PAGE_BYTES]
            sizes += [PAGE_BYTES, PAGE_BYTES]
        return ptrs, sizes

    def fill(self, page, seed):
        rng = np.random.default_rng(seed)
        self._bytes[:, page, :] = rng.integers(0, 256, (2, PAGE_BYTES), dtype=np.uint8)

    def page_bytes(self, pages):
        """A copy of the K and V bytes of `pages` (a slice)."""
        return self._bytes[:, pages, :].copy()

    def zero(self):
        self._bytes[:] = 0


@dataclass
class StorageConfig:  # SGLang's HiCacheStorageConfig, the fields the backend reads
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    is_page_first_layout: bool = True
    model_name: str = "test-model"
    extra_config: dict = field(default_factory=dict)


@dataclass
class ExtraInfo:
    prefix_keys: list = None


def indices(pages):
    return np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.fixture(params=["torch", "numpy"])
def backend(cluster, request):
    b = TierkvStore(StorageConfig(extra_config={"master_server_address": cluster.master_address,
                                                "metadata_server": "P2PHANDSHAKE",
                                                "transfer_timeout": 5, "rpc_timeout": 1}), None)
    b.clear()
    pool = FakeHostPool(32, request.param)
    b.register_mem_pool_host(pool)
    yield b, pool
    b.close()


def test_pages_round_trip_zero_copy_with_groups_and_parents(backend, cluster):
    b, pool = backend
    p = unique("sg")
    keys = [p + str(i) for i in range(8)]
    for i in range(8):
        pool.fill(i, 50 + i)
    src = pool.page_bytes(slice(0, 8))
    assert b.batch_set_v1(keys[:4], indices(range(4))) == [True] * 4
    assert b.batch_set_v1(keys[4:], indices(range(4, 8)), ExtraInfo(prefix_keys=keys[:4])) == [True] * 4
    assert b.batch_set_v1(keys[:2], indices(range(2))) == [True] * 2  # already there: stored
    pool.zero()
    assert b.batch_get_v1(keys, indices(range(16, 24))) == [True] * 8
    assert np.array_equal(pool.page_bytes(slice(16, 24)), src)

    def obj(k):
        with urllib.request.urlopen(f"{cluster.metadata_url}/v1/objects/{k}") as r:
            return json.loads(r.read())
    # Mooncake's key layout; K and V of a page in one group.
    k5, v5 = obj(keys[5] + "_0_k"), obj(keys[5] + "_0_v")
    assert k5["group"] == v5["group"] == keys[5] + "_0_k"
    assert b.batch_exists(keys) == 8
    # The first page of the second batch names the last page of the first as parent.
    assert obj(keys[3] + "_0_k")["cached_children"] >= 1


def test_batch_exists_is_the_leading_run(backend):
    b, pool = backend
    p = unique("sgx")
    keys = [p + str(i) for i in range(6)]
    assert b.batch_set_v1([keys[i] for i in (0, 1, 3, 4)], indices([0, 1, 3, 4])) == [True] * 4
    assert b.batch_exists(keys) == 2
    assert b.exists(keys[0]) and not b.exists(keys[2])
    assert b.batch_get_v1(keys, indices(range(10, 16))) == [True, True, False, True, True, False]
    # Only the V half of a page present: the page is absent.
    b.client.put(keys[2] + "_0_v", b"v" * 10)
    assert b.batch_exists(keys) == 2
    s = b.get_stats()
    assert s["exists_pages_asked"] >= 6 + 6 and s["exists_pages_found"] >= 4


def test_old_interface_and_clear(backend):
    b, _ = backend
    p = unique("sgo")
    vals = [np.full(1000, i, dtype=np.float32) for i in range(3)]
    assert b.batch_set([p + str(i) for i in range(3)], vals)
    assert b.set(p + "one", np.arange(10, dtype=np.int64))
    out = np.zeros(10, dtype=np.int64)
    assert b.get(p + "one", out) is out and np.array_equal(out, np.arange(10))
    outs = [np.zeros(1000, dtype=np.float32) for _ in range(4)]
    got = b.batch_get([p + "0", p + "1", p + "2", p + "nope"], outs)
    assert got[:3] == outs[:3] and got[3] is None
    assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
    b.clear()
    assert not b.exists(p + "one") and b.batch_exists([p + "0"]) == 0


def test_killed_daemon_gives_false_never_none(fresh_cluster):
    b = TierkvStore(StorageConfig(extra_config={"master_server_address": fresh_cluster.master_address,
                                                "transfer_timeout": 3, "rpc_timeout": 1}), None)
    pool = FakeHostPool(64)
    b.register_mem_pool_host(pool)
    p = unique("sgk")
    keys = [p + str(i) for i in range(16)]
    assert b.batch_set_v1(keys, indices(range(16))) == [True] * 16
    fresh_cluster.daemons[1].kill(signal.SIGKILL)

    def read_misses():
        """A read of every page (and an exists): the pages read back, unless some did not."""
        t0 = time.monotonic()
        got = b.batch_get_v1(keys, indices(range(32, 48)))
        n = b.batch_exists(keys)
        assert time.monotonic() - t0 < 20
        assert len(got) == 16 and all(g is True or g is False for g in got)
        assert isinstance(n, int) and 0 <= n <= 16
        return None if all(got) else got

    got = wait_for("a read to miss the killed daemon's pages", read_misses, timeout=30, detail=fresh_cluster.logs)
    assert not all(got), "the killed daemon's pages still read"
    # K and V of a page share a daemon, so the survivor's pages read whole.
    assert any(got), "a page survives only if both its halves do"
    # New pages go to the surviving daemon.
    fresh_cluster.wait_gone(1)
    fresh = [p + "after" + str(i) for i in range(4)]
    assert b.batch_set_v1(fresh, indices(range(16, 20))) == [True] * 4
    assert b.batch_get_v1(fresh, indices(range(32, 36))) == [True] * 4
    assert np.array_equal(pool.page_bytes(slice(32, 36)), pool.page_bytes(slice(16, 20)))
    fresh_cluster.master.kill(signal.SIGKILL)
    killed = time.monotonic()
    # Pages read within the last replica_cache_fresh (0.1 s) of the master's
    # last answer may still come from the replica cache; past it, none do:
    # a read begun 0.15 s after the kill (later still after the last answer)
    # must find none.

    def none_read():
        late = time.monotonic() - killed > 0.15
        got = b.batch_get_v1(keys, indices(range(32, 48)))
        assert not late or got == [False] * 16, f"read from the replica cache past its freshness: {got}"
        return got == [False] * 16

    wait_for("every page read to fail once the master is dead", none_read, timeout=5)
    assert b.batch_set_v1([p + "new"], indices([50])) == [False]
    assert b.batch_exists(keys) == 0
    assert time.monotonic() - killed < 20
    b.close()
