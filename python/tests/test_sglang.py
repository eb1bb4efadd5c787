"""tierkv.sglang.TierkvStore with a stand-in for SGLang's host pool.

FakeHostPool follows MHATokenToKVPoolHost's documented surface: kv_buffer,
page_size, get_page_buffer_meta(indices) -> (ptrs, sizes) with K then V of
each page (layout page_first: a page's K of every layer is contiguous), and
get_data_page(index) -> the page as one flat buffer, K then V (what the
generic, non-v1 path stores). With mla=True a page is one part, as in
MLATokenToKVPoolHost. The pool is a torch bfloat16 tensor, as SGLang's is,
or a numpy array.

Object names in these tests are written out by hand from SGLang's Mooncake
backend (mooncake_store.py), never computed by the module under test.
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
    def __init__(self, pages, kind="torch", mla=False):
        self.page_size = PAGE
        self.pages = pages
        self.kind = kind
        self.parts = 1 if mla else 2  # objects per page: K and V, or MLA's one
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
            ptrs += [self._base + (part * self.pages + page) * PAGE_BYTES for part in range(self.parts)]
            sizes += [PAGE_BYTES] * self.parts
        return ptrs, sizes

    def get_data_page(self, index):
        """The page holding token `index`, flat: K then V (a copy, as SGLang's
        page_first pool flattens a strided slice)."""
        page = int(index) // self.page_size
        return self.kv_buffer[:self.parts, page].reshape(-1).copy() if self.kind == "numpy" else \
            self.kv_buffer[:self.parts, page].flatten().clone()

    def get_dummy_flat_data_page(self):
        if self.kind == "numpy":
            return np.zeros(self.parts * PAGE_BYTES, dtype=np.uint8)
        return torch.zeros(self.parts * PAGE_BYTES // 2, dtype=torch.bfloat16)

    def object_bytes(self, page):
        """The bytes each object of `page` must hold: [K, V], or [MLA's one]."""
        return [self._bytes[part, page].tobytes() for part in range(self.parts)]

    def fill(self, page, seed):
        rng = np.random.default_rng(seed)
        self._bytes[:, page, :] = rng.integers(0, 256, (2, PAGE_BYTES), dtype=np.uint8)

    def page_bytes(self, pages):
        """A copy of the K and V bytes of `pages` (a slice)."""
        return self._bytes[:self.parts, pages, :].copy()

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
    should_split_heads: bool = False
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
    # Mooncake's key layout (model name first); K and V of a page in one group.
    k5, v5 = obj(f"test-model_{keys[5]}_0_k"), obj(f"test-model_{keys[5]}_0_v")
    assert k5["group"] == v5["group"] == f"test-model_{keys[5]}_0_k"
    assert b.batch_exists(keys) == 8
    # The first page of the second batch names the last page of the first as parent.
    assert obj(f"test-model_{keys[3]}_0_k")["cached_children"] >= 1


def test_batch_exists_is_the_leading_run(backend):
    b, pool = backend
    p = unique("sgx")
    keys = [p + str(i) for i in range(6)]
    assert b.batch_set_v1([keys[i] for i in (0, 1, 3, 4)], indices([0, 1, 3, 4])) == [True] * 4
    assert b.batch_exists(keys) == 2
    assert b.exists(keys[0]) and not b.exists(keys[2])
    assert b.batch_get_v1(keys, indices(range(10, 16))) == [True, True, False, True, True, False]
    # Only the V half of a page present: the page is absent.
    b.client.put(f"test-model_{keys[2]}_0_v", b"v" * 10)
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
    assert b.exists(p + "one") and b.batch_exists([p + "0", p + "1", p + "nope"]) == 2
    assert b.set(p + "unread", np.arange(4, dtype=np.int64))
    b.clear()
    assert not b.exists(p + "unread")
    # A page read above stays under its read lease (the master's --lease-ttl)
    # until the lease ends; clear takes it then.

    def cleared():
        b.clear()
        return not b.exists(p + "one") and b.batch_exists([p + "0"]) == 0

    wait_for("clear to take the pages read above once their read leases end", cleared, timeout=20)


@pytest.fixture
def make_backend(cluster):
    """TierkvStore factory over the module's cluster: make(extra_config additions, **StorageConfig fields)."""
    made = []

    def make(extra=None, **fields):
        cfg = {"master_server_address": cluster.master_address, "metadata_server": "P2PHANDSHAKE",
               "transfer_timeout": 5, "rpc_timeout": 1}
        cfg.update(extra or {})
        made.append(TierkvStore(StorageConfig(extra_config=cfg, **fields), None))
        return made[-1]

    yield make
    for b in made:
        b.close()


def as_bytes(x):
    """The bytes of a torch tensor or numpy array."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


TAG, MODEL = "tenantA", "org/Llama-3-8B"  # SGLang writes the model as org-Llama-3-8B

# The objects SGLang's Mooncake backend writes for page hash {h}, tag
# tenantA and model org/Llama-3-8B, per storage config.
LAYOUTS = {
    "mha": (dict(tp_rank=1, tp_size=2),
            ["tenantA_org-Llama-3-8B_{h}_1_k", "tenantA_org-Llama-3-8B_{h}_1_v"]),
    "mha-pp": (dict(tp_rank=2, tp_size=4, pp_rank=1, pp_size=2),
               ["tenantA_org-Llama-3-8B_{h}_2_1_k", "tenantA_org-Llama-3-8B_{h}_2_1_v"]),
    "mla": (dict(tp_rank=3, tp_size=4, is_mla_model=True), ["tenantA_org-Llama-3-8B_{h}__k"]),
    "mla-pp": (dict(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, is_mla_model=True),
               ["tenantA_org-Llama-3-8B_{h}_1_k"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pages_are_the_objects_sglang_mooncake_writes(make_backend, store, layout):
    fields, names = LAYOUTS[layout]
    b = make_backend({"extra_backend_tag": TAG}, model_name=MODEL, **fields)
    pool = FakeHostPool(8, mla=fields.get("is_mla_model", False))
    b.register_mem_pool_host(pool)
    p = unique("sgl")
    keys = [p + str(i) for i in range(3)]
    for i in range(3):
        pool.fill(i, 70 + i)
    assert b.batch_set_v1(keys, indices(range(3))) == [True] * 3
    # A Mooncake-API client finds every page by SGLang's names, byte for byte.
    for i, k in enumerate(keys):
        assert [store.get(n.format(h=k)) for n in names] == pool.object_bytes(i), f"page {i}"
    # And a page a Mooncake-API client wrote under those names is a hit here.
    q = p + "mc"
    rng = np.random.default_rng(7)
    written = [rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes() for _ in names]
    for n, v in zip(names, written):
        assert store.put(n.format(h=q), v) == 0
    assert b.batch_exists(keys + [q]) == 4
    assert b.batch_get_v1([q], indices([5])) == [True]
    assert pool.object_bytes(5) == written


# (extra_backend_tag, model_name) -> the object keys of MHA page "h" on TP rank 0.
PREFIXES = [
    ("absent", None, ["h_0_k", "h_0_v"]),
    (None, "", ["h_0_k", "h_0_v"]),
    ("t1", None, ["t1_h_0_k", "t1_h_0_v"]),
    ("", "m", ["_m_h_0_k", "_m_h_0_v"]),  # an empty tag still takes its place
    ("", None, ["_h_0_k", "_h_0_v"]),
    (None, "a/b/c", ["a-b-c_h_0_k", "a-b-c_h_0_v"]),
    (7, "m", ["7_m_h_0_k", "7_m_h_0_v"]),
]


@pytest.mark.parametrize("tag,model,want", PREFIXES)
def test_key_prefix_follows_sglang_for_unset_and_empty_parts(make_backend, tag, model, want):
    extra = {} if tag == "absent" else {"extra_backend_tag": tag}
    assert make_backend(extra, model_name=model).object_keys("h") == want


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_generic_interface_uses_the_same_objects(make_backend, store, kind, mla):
    b = make_backend({"extra_backend_tag": "g"}, model_name="org/M", is_mla_model=mla)
    pool = FakeHostPool(16, kind, mla=mla)
    b.register_mem_pool_host(pool)
    p = unique("sgg")
    keys = [p + str(i) for i in range(4)]
    for i in range(4):
        pool.fill(i, 90 + i)
    # What SGLang's controller does without interface_v1: one flat page per hash.
    assert b.batch_set(keys, [pool.get_data_page(t) for t in indices(range(4))[::PAGE]])
    assert b.batch_exists(keys) == 4
    assert b.exists(keys[2]) and not b.exists(p + "absent")
    targets = [pool.get_dummy_flat_data_page() for _ in range(5)]
    got = b.batch_get(keys + [p + "absent"], targets)
    assert [g is t for g, t in zip(got, targets)] == [True] * 4 + [False] and got[4] is None
    assert [as_bytes(t) for t in targets[:4]] == [b"".join(pool.object_bytes(i)) for i in range(4)]
    # The pages are the objects SGLang's Mooncake layout names, so v1 and a
    # Mooncake-API client read them too.
    tails = ["__k"] if mla else ["_0_k", "_0_v"]
    assert [store.get(f"g_org-M_{keys[1]}{t}") for t in tails] == pool.object_bytes(1)
    assert b.batch_get_v1(keys, indices(range(8, 12))) == [True] * 4
    assert np.array_equal(pool.page_bytes(slice(8, 12)), pool.page_bytes(slice(0, 4)))
    # And a page written by v1 reads back whole through the generic calls.
    pool.fill(5, 99)
    assert b.batch_set_v1([p + "v1"], indices([5])) == [True]
    one = pool.get_dummy_flat_data_page()
    assert b.get(p + "v1", one) is one and as_bytes(one) == b"".join(pool.object_bytes(5))
    assert b.batch_get([p + "v1"]) == [b"".join(pool.object_bytes(5))]


def test_split_heads_is_refused(make_backend):
    with pytest.raises(ValueError, match="split heads"):
        make_backend(should_split_heads=True)


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
