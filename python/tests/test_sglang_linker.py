"""tierkv.sglang.TierkvLinker (SGLang's unified-cache external linker) on a real cluster.

The "device" pools are CPU torch tensors laid out as SGLang's MHA pool is:
per layer a K and a V buffer of [slots, heads, dim]. Transfers are SGLang's
PoolTransfer (or the module's stand-in when SGLang is absent): page hashes
plus page-aligned slot indices. Every wait is bounded (waiting.wait_for).
"""

import pytest
import torch

from conftest import Cluster, unique
from waiting import wait_for
import tierkv
from tierkv.sglang import TierkvLinker, TierkvStore
from tierkv.sglang_linker import LinkerCancelOutcome, PoolTransfer

PAGE = 4  # tokens per page
LAYERS = 3
SLOTS = 64  # token slots per buffer
HEADS, DIM = 2, 8  # a row: 2 x 8 float16 = 32 bytes


def make_pools(fill):
    """{"kv": [K per layer, V per layer]}; fill=True: distinct values per byte."""
    def buf(obj, layer):
        if not fill:
            return torch.zeros(SLOTS, HEADS, DIM, dtype=torch.float16)
        base = (obj * LAYERS + layer) * SLOTS * HEADS * DIM
        return torch.arange(base, base + SLOTS * HEADS * DIM, dtype=torch.float32).remainder(2039) \
            .to(torch.float16).reshape(SLOTS, HEADS, DIM)
    return {"kv": [[buf(o, l) for l in range(LAYERS)] for o in range(2)]}


def kv(hashes, first_slot, policy="all_pages"):
    return PoolTransfer(name="kv", device_indices=torch.arange(first_slot, first_slot + len(hashes) * PAGE),
                        keys=list(hashes), hit_policy=policy)


def linker_for(cluster, pools, tag, **extra):
    config = {"master_server_address": cluster.master_address, "metadata_server": cluster.metadata_url,
              "extra_backend_tag": tag, "load_timeout": 10}
    config.update(extra)
    return TierkvLinker(None, None, extra_config=config, pools=pools, page_size=PAGE)


def wait_offloads(linker, n):
    wait_for(f"{n} offloads", lambda: linker.num_completed_offloads() >= n, timeout=20)
    return [linker.pop_completed_offload() for _ in range(n)]


def wait_load(linker):
    wait_for("a load batch", lambda: linker.num_completed_loads() >= 1, timeout=20)
    return linker.pop_completed_load()


def page_rows(pools, obj, layer, first_slot):
    return pools["kv"][obj][layer][first_slot:first_slot + PAGE]


@pytest.fixture
def src(cluster):
    """A linker over filled pools (the writer) with keys of its own."""
    tag = unique("lk")
    pools = make_pools(True)
    lk = linker_for(cluster, pools, tag)
    yield lk, pools, tag
    lk.close()


def test_keys_are_tierkv_stores(src, cluster):
    lk, _, tag = src
    store = TierkvStore({"extra_config": {"master_server_address": cluster.master_address,
                                          "metadata_server": cluster.metadata_url, "extra_backend_tag": tag}})
    try:
        assert lk.object_keys("kv", "h1") == store.object_keys("h1") == [f"{tag}_h1_0_k", f"{tag}_h1_0_v"]
    finally:
        store.close()


def test_offload_then_lookup_returns_every_restorable_length(src, client):
    lk, _, tag = src
    hashes = [f"p{i}" for i in range(6)]
    assert lk.offload([kv(hashes[:2], 0)])
    assert lk.offload([kv(hashes[2:4], 8)])
    assert wait_offloads(lk, 2) == [True, True]
    assert lk.lookup("r1", [kv(hashes, 32)]) == [1, 2, 3, 4]
    # Pages 4 and 5 were never written; asking past them changes nothing.
    assert lk.lookup("r1", [kv(hashes[:3], 32)]) == [1, 2, 3]
    assert lk.cancel_request("r1") == LinkerCancelOutcome.LOOKUP_RELEASED
    # A page is its K and V, grouped, with the previous page as parent.
    for h in hashes[:4]:
        assert client.exists(f"{tag}_{h}_0_k") and client.exists(f"{tag}_{h}_0_v")
    assert lk.lookup("r2", [kv(["nope"] + hashes, 32)]) == []
    assert not lk.has_pending_operations()  # a miss reserves nothing


def test_page_with_a_member_missing_is_never_counted(src, client):
    lk, _, tag = src
    hashes = [f"q{i}" for i in range(4)]
    assert lk.offload([kv(hashes[:2], 0)])
    assert wait_offloads(lk, 1) == [True]
    # Page 2: K alone, the size a whole page's K has.
    client.put(f"{tag}_{hashes[2]}_0_k", bytes(LAYERS * PAGE * HEADS * DIM * 2))
    assert lk.lookup("r", [kv(hashes, 16)]) == [1, 2]
    # A page whose objects have another layout's size is not whole either.
    client.put(f"{tag}_{hashes[3]}_0_k", b"x" * 7)
    client.put(f"{tag}_{hashes[3]}_0_v", b"x" * 7)
    assert lk.lookup("r", [kv(hashes, 16)]) == [1, 2]
    lk.cancel_request("r")


def test_trailing_window_pool_makes_the_set_sparse(cluster, client):
    """A side pool with trailing_pages: n counts only when its window ending
    at n is whole, so the answer is a set, not a run."""
    tag = unique("lk")
    pools = make_pools(True)
    pools["swa"] = [[torch.ones(SLOTS, 4, dtype=torch.float16) for _ in range(LAYERS)]]
    lk = linker_for(cluster, pools, tag)
    try:
        hashes = [f"s{i}" for i in range(4)]
        swa = lambda keys, first, policy="all_pages": PoolTransfer(
            name="swa", device_indices=torch.arange(first, first + len(keys) * PAGE), keys=keys, hit_policy=policy)
        assert lk.offload([kv(hashes[:2], 0), swa(hashes[1:2], 4)])  # node 1: SWA state at its end only
        assert lk.offload([kv(hashes[2:], 8), swa(hashes[3:], 12)])  # node 2 likewise
        assert wait_offloads(lk, 2) == [True, True]
        got = lk.lookup("r", [kv(hashes, 32), swa(hashes[-1:], 44, "trailing_pages")])
        assert got == [2, 4]
        assert lk.object_keys("swa", "s1") == [f"{tag}_s1_0_swa_0"]
        lk.cancel_request("r")
    finally:
        lk.close()


def test_layer_wise_load_lands_offloaded_bytes_layer_by_layer(src, cluster):
    lk, pools, tag = src
    hashes = [f"l{i}" for i in range(3)]
    assert lk.offload([kv(hashes, 8)])
    assert wait_offloads(lk, 1) == [True]

    dst_pools = make_pools(False)
    dst = linker_for(cluster, dst_pools, tag)
    try:
        assert dst.lookup("r", [kv(hashes, 20)]) == [1, 2, 3]
        landed = []
        complete = dst.layer_done_counter.complete
        dst.layer_done_counter.complete = lambda i, layer: (landed.append((i, layer)), complete(i, layer))
        assert dst.load("r", [kv(hashes, 20)])
        index = dst.start_layer_wise_loading()
        assert index >= 0
        dst.layer_done_counter.set_consumer(index)
        for layer in range(LAYERS):  # what the forward pass does before each layer
            dst.layer_done_counter.wait_until(layer)
            for obj in range(2):
                for p in range(3):
                    want = page_rows(pools, obj, layer, 8 + p * PAGE)
                    assert torch.equal(page_rows(dst_pools, obj, layer, 20 + p * PAGE), want), (layer, obj, p)
        assert wait_load(dst) == ["r"]
        assert landed == [(index, layer) for layer in range(LAYERS)]
        assert dst.take_failed_loads() == {}
        # Slots outside the load stay untouched.
        assert not dst_pools["kv"][0][0][:20].any() and not dst_pools["kv"][1][2][32:].any()
        assert not dst.has_pending_operations()
        assert dst.start_layer_wise_loading() == -1
    finally:
        dst.close()


def test_reserved_lookup_pins_pages_and_cancel_releases_them(src, client):
    lk, _, tag = src
    hashes = [f"c{i}" for i in range(2)]
    assert lk.offload([kv(hashes, 0)])
    assert wait_offloads(lk, 1) == [True]
    key = f"{tag}_{hashes[0]}_0_k"
    assert lk.lookup("r", [kv(hashes, 16)]) == [1, 2]
    with pytest.raises(tierkv.FailedPrecondition):  # leased by the lookup's session
        client.remove(key)
    # Cancel before load: nothing in flight, no completion, leases given back.
    assert lk.load("r", [kv(hashes, 16)])
    assert lk.cancel_queued_load("r") is True
    assert not lk.has_pending_operations()
    assert lk.start_layer_wise_loading() == -1
    assert lk.num_completed_loads() == 0
    assert lk.cancel_request("r") == LinkerCancelOutcome.NOT_FOUND
    client.remove(key)
    assert lk.lookup("r", [kv(hashes, 16)]) == []


@pytest.fixture(scope="module")
def small_cluster():
    c = Cluster(daemons=1, segment_size="16mib")
    yield c
    c.stop()


def storm(client, prefix, total=48 << 20, size=1 << 20):
    """Puts `total` bytes of other values (3x the small cluster); full puts are fine."""
    value = bytes(size)
    for i in range(total // size):
        try:
            client.put(f"{prefix}{i}", value)
        except (tierkv.ResourceExhausted, tierkv.Unavailable):
            pass


def test_reserved_lookup_survives_an_eviction_storm(small_cluster):
    cluster = small_cluster
    client = tierkv.Client(cluster.master_address, cluster.metadata_url, transfer_timeout=10)
    tag = unique("ev")
    pools, dst_pools = make_pools(True), make_pools(False)
    src, dst = linker_for(cluster, pools, tag), linker_for(cluster, dst_pools, tag)
    try:
        hashes = [f"e{i}" for i in range(4)]
        other = [f"o{i}" for i in range(4)]
        assert src.offload([kv(hashes, 0)]) and src.offload([kv(other, 16)])
        assert wait_offloads(src, 2) == [True, True]
        assert dst.lookup("keep", [kv(hashes, 32)]) == [1, 2, 3, 4]
        assert dst.lookup("drop", [kv(other, 48)]) == [1, 2, 3, 4]
        assert dst.cancel_request("drop") == LinkerCancelOutcome.LOOKUP_RELEASED
        storm(client, unique("storm"))
        # The released pages went; the reserved ones are still there to load.
        assert not any(client.batch_exists([k for h in other for k in dst.object_keys("kv", h)]))
        assert dst.load("keep", [kv(hashes, 32)])
        dst.start_layer_wise_loading()
        assert wait_load(dst) == ["keep"]
        assert dst.take_failed_loads() == {}
        for obj in range(2):
            for layer in range(LAYERS):
                assert torch.equal(dst_pools["kv"][obj][layer][32:48], pools["kv"][obj][layer][0:16])
        # Loaded, the reservation is over: the next storm takes them too.
        storm(client, unique("storm"))
        assert not any(client.batch_exists([k for h in hashes for k in dst.object_keys("kv", h)]))
        assert dst.lookup("keep", [kv(hashes, 32)]) == []
    finally:
        src.close()
        dst.close()
        client.close()


def test_failed_load_completes_and_releases_layers(src, client):
    """A store error is a failed completion, never an exception or a hang."""
    lk, _, tag = src
    hashes = ["f0"]
    assert lk.offload([kv(hashes, 0)])
    assert wait_offloads(lk, 1) == [True]
    # No lookup for this rid, and the page is removed before the load runs.
    client.remove(f"{tag}_f0_0_v")
    assert lk.load("r", [kv(hashes, 16)])
    index = lk.start_layer_wise_loading()
    lk.layer_done_counter.set_consumer(index)
    lk.layer_done_counter.wait_until(LAYERS - 1)
    assert wait_load(lk) == ["r"]
    assert list(lk.take_failed_loads()) == ["r"]
    assert lk.stats.loads_failed == 1


def test_offload_of_a_node_is_whole_or_not_at_all(src, client):
    lk, _, tag = src
    hashes = [f"w{i}" for i in range(3)]
    # The node's middle page is already present (another writer): still stored.
    client.put(f"{tag}_w1_0_k", bytes(LAYERS * PAGE * HEADS * DIM * 2))
    client.put(f"{tag}_w1_0_v", bytes(LAYERS * PAGE * HEADS * DIM * 2))
    assert lk.offload([kv(hashes, 0)])
    assert wait_offloads(lk, 1) == [True]
    assert lk.lookup("r", [kv(hashes, 16)]) == [1, 2, 3]
    lk.cancel_request("r")


def test_a_node_the_store_cannot_take_leaves_no_page(small_cluster):
    """Two pages of 16 MiB objects in a 16 MiB cluster: the node is not
    stored, and none of its pages is left behind."""
    rows = 1 << 19  # a row: 1 MiB
    pools = {"kv": [[torch.ones(2 * PAGE, rows, dtype=torch.float16) for _ in range(2)] for _ in range(2)]}
    lk = TierkvLinker(None, None, pools=pools, page_size=PAGE, extra_config={
        "master_server_address": small_cluster.master_address, "metadata_server": small_cluster.metadata_url,
        "extra_backend_tag": unique("big")})
    try:
        big = ["b0", "b1"]
        assert lk.offload([kv(big, 0)])
        assert wait_offloads(lk, 1) == [False]
        assert not any(lk.client.batch_exists([k for h in big for k in lk.object_keys("kv", h)]))
        assert lk.stats.offloads_failed == 1
    finally:
        lk.close()


def test_close_is_clean(cluster):
    lk = linker_for(cluster, make_pools(True), unique("cl"))
    assert lk.offload([kv(["z0"], 0)])
    assert lk.lookup("r", [kv(["z0"], 16)]) in ([], [1])
    lk.close()
    assert not any(t.is_alive() for t in lk._threads)
    assert not lk.has_pending_operations()
    assert lk.num_completed_loads() == lk.num_completed_offloads() == 0
    lk.close()  # idempotent
    # After close nothing raises: no hit, nothing queued.
    assert lk.lookup("r", [kv(["z0"], 16)]) == []
    assert lk.offload([kv(["z0"], 0)]) is False
    assert lk.load("r", [kv(["z0"], 16)]) is False
