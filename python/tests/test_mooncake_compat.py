"""tierkv.mooncake_compat: Mooncake's Python store API and its return conventions."""

import ctypes
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from conftest import Cluster, unique
from waiting import wait_for
from tierkv.mooncake_compat import (INVALID_PARAMS, OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, MooncakeDistributedStore,
                                    ReplicateConfig)

MIB = 1 << 20


def addr(a):
    return a.ctypes.data


def test_setup_forms(cluster):
    m = cluster.master_address
    md = cluster.metadata_url + "/metadata"
    s7 = MooncakeDistributedStore()
    assert s7.setup("localhost", md, 32 * MIB, 16 * MIB, "tcp", "", m) == 0
    s8 = MooncakeDistributedStore()
    assert s8.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", m, None) == 0
    kw = MooncakeDistributedStore()
    assert kw.setup(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", global_segment_size=0,
                    local_buffer_size=0, protocol="tcp", rdma_devices="", master_server_addr=m) == 0
    k = unique("setup") + "k"
    assert s7.put(k, b"lent") == 0
    assert s8.get(k) == b"lent" and kw.get(k) == b"lent"
    # A pure client (global_segment_size 0) lends nothing; the lender does.
    names = [seg["name"] for seg in cluster.segments()]
    assert s7.get_hostname() in names
    assert s8.get_hostname() not in names and kw.get_hostname() not in names
    for s in (s7, s8, kw):
        assert s.close() == 0


def test_unknown_setup_keyword_is_a_type_error_naming_only_it(cluster):
    s = MooncakeDistributedStore()
    with pytest.raises(TypeError) as e:
        s.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.master_address, enable_gpu_magic=True)
    assert str(e.value) == "setup() got an unexpected keyword argument 'enable_gpu_magic'"
    # SGLang's retry: parse the name out of the message and drop that keyword only.
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.master_address) == 0
    s.close()


def test_rdma_without_a_nic_falls_back_or_fails_fast(cluster):
    s = MooncakeDistributedStore()
    t0 = time.monotonic()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "rdma", "", cluster.master_address)
    assert time.monotonic() - t0 < 15
    assert rc == 0 or rc < 0
    if rc == 0:
        k = unique("rdma") + "k"
        assert s.put(k, b"over whatever works") == 0 and s.get(k) == b"over whatever works"
    s.close()


def test_unreachable_master_gives_a_negative_code():
    s = MooncakeDistributedStore()
    os.environ["TIERKV_RPC_TIMEOUT"] = "0.5"
    try:
        assert s.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:1") < 0
    finally:
        del os.environ["TIERKV_RPC_TIMEOUT"]
    assert s.put("k", b"v") < 0 and s.get("k") == b"" and s.is_exist("k") < 0


def test_round_trips_through_every_api(store):
    p = unique("mc")
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    assert store.put(p + "put", raw) == 0
    assert store.get(p + "put") == raw
    assert store.get_size(p + "put") == len(raw)
    assert store.put_parts(p + "parts", raw[:10], raw[10:]) == 0
    assert store.get(p + "parts") == raw
    assert store.put_batch([p + "b1", p + "b2"], [b"one", b"two"]) == 0
    assert store.get_batch([p + "b1", p + "b2", p + "none"]) == [b"one", b"two", b""]

    pool = np.zeros(16 * MIB, dtype=np.uint8)
    assert store.register_buffer(addr(pool), pool.nbytes) == 0
    src = rng.integers(0, 256, 4 * MIB, dtype=np.uint8)
    pool[:4 * MIB] = src
    assert store.put_from(p + "from", addr(pool), MIB) == 0
    assert store.get_into(p + "from", addr(pool) + 8 * MIB, MIB) == MIB
    assert np.array_equal(pool[8 * MIB:9 * MIB], src[:MIB])

    keys = [p + f"z{i}" for i in range(4)]
    ptrs = [addr(pool) + i * MIB for i in range(4)]
    assert store.batch_put_from(keys, ptrs, [MIB] * 4) == [0] * 4
    pool[8 * MIB:] = 0
    dst = [addr(pool) + (8 + i) * MIB for i in range(4)]
    assert store.batch_get_into(keys, dst, [MIB] * 4) == [MIB] * 4
    assert np.array_equal(pool[8 * MIB:12 * MIB], src)

    # Multi-buffer forms: one object from several buffers, scattered back.
    mk = [p + "m0", p + "m1"]
    parts = [[addr(pool), addr(pool) + 2 * MIB], [addr(pool) + MIB, addr(pool) + 3 * MIB]]
    sizes = [[1000, 2000], [3000, 4000]]
    assert store.batch_put_from_multi_buffers(mk, parts, sizes) == [0, 0]
    pool[8 * MIB:] = 0
    back = [[addr(pool) + 8 * MIB, addr(pool) + 9 * MIB], [addr(pool) + 10 * MIB, addr(pool) + 11 * MIB]]
    assert store.batch_get_into_multi_buffers(mk, back, sizes) == [3000, 7000]
    assert np.array_equal(pool[8 * MIB:8 * MIB + 1000], src[:1000])
    assert np.array_equal(pool[9 * MIB:9 * MIB + 2000], src[2 * MIB:2 * MIB + 2000])
    assert np.array_equal(pool[11 * MIB:11 * MIB + 4000], src[3 * MIB:3 * MIB + 4000])
    assert store.get(p + "m0") == src[:1000].tobytes() + src[2 * MIB:2 * MIB + 2000].tobytes()
    assert store.unregister_buffer(addr(pool)) == 0


def test_conventions_for_misses_existing_keys_and_bad_lists(store):
    p = unique("conv")
    buf = np.zeros(MIB, dtype=np.uint8)
    store.register_buffer(addr(buf), buf.nbytes)
    assert store.put(p + "k", b"first") == 0
    assert store.put(p + "k", b"second") == 0  # first writer wins
    assert store.get(p + "k") == b"first"
    assert store.batch_put_from([p + "k"], [addr(buf)], [10]) == [0]
    assert store.get(p + "k") == b"first"
    assert store.is_exist(p + "k") == 1 and store.is_exist(p + "none") == 0
    assert store.batch_is_exist([p + "k", p + "none"]) == [1, 0]
    assert store.get(p + "none") == b""
    assert store.get_size(p + "none") == OBJECT_NOT_FOUND
    assert store.get_into(p + "none", addr(buf), MIB) == OBJECT_NOT_FOUND
    assert store.batch_get_into([p + "k", p + "none"], [addr(buf), addr(buf) + 100], [100, 100]) == [
        5, OBJECT_NOT_FOUND]
    assert bytes(buf[:5]) == b"first"
    assert store.batch_get_into([p + "k"], [addr(buf)], [2]) == [INVALID_PARAMS]  # too small
    # Unequal lengths: one negative code per key.
    assert store.batch_get_into([p + "k", p + "a", p + "b"], [addr(buf)], [10, 10]) == [INVALID_PARAMS] * 3
    assert store.batch_put_from([p + "x", p + "y"], [addr(buf)], [1, 1]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers([p + "x"], [[addr(buf)]], [[1, 2]]) == [INVALID_PARAMS]
    assert store.remove(p + "none") == OBJECT_NOT_FOUND
    assert store.remove(p + "k") == OBJECT_HAS_LEASE  # just read: leased
    assert store.remove(p + "k", force=True) == 0 and store.is_exist(p + "k") == 0
    assert store.health_check() == 0
    store.unregister_buffer(addr(buf))


def test_replicate_config_and_groups(store, cluster):
    p = unique("cfg")
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    cfg.with_soft_pin = True
    assert store.put(p + "two", b"replicated", cfg) == 0
    import json
    import urllib.request
    with urllib.request.urlopen(f"{cluster.metadata_url}/v1/objects/{p}two") as r:
        info = json.loads(r.read())
    assert len(info["replicas"]) == 2 and info["soft_pin"]
    g = ReplicateConfig()
    g.group_ids = ["grp-" + p]
    assert store.put_batch([p + "k", p + "v"], [b"K", b"V"], g) == 0
    with urllib.request.urlopen(f"{cluster.metadata_url}/v1/objects/{p}k") as r:
        assert json.loads(r.read())["group"] == "grp-" + p


def test_register_buffer_is_cheap_for_a_huge_pool(store):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 256 << 30  # 256 GiB of address space (PROT_NONE, never committed)
    prot_none, map_private, map_anon, map_noreserve = 0, 0x02, 0x20, 0x4000
    base = libc.mmap(None, size, prot_none, map_private | map_anon | map_noreserve, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        t0 = time.monotonic()
        assert store.register_buffer(base, size) == 0
        assert store.register_buffer(base + 4096, 4096) == 0  # inside: accepted
        assert time.monotonic() - t0 < 1.0
        assert store.unregister_buffer(base) == 0
    finally:
        libc.munmap(base, size)


def test_remove_all_leaves_nothing(store):
    p = unique("all")
    keys = [p + str(i) for i in range(40)]
    assert store.put_batch(keys, [b"x"] * 40) == 0
    assert store.remove_all() >= 40
    assert store.batch_is_exist(keys) == [0] * 40


def test_dropped_without_close_cleans_up(cluster):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MIB, 0, "tcp", "", cluster.master_address) == 0
    name = s.get_hostname()
    assert name in [seg["name"] for seg in cluster.segments()]
    del s
    import gc
    gc.collect()
    wait_for(f"{name}'s segment to leave the master", lambda: name not in [seg["name"] for seg in cluster.segments()],
             timeout=10, detail=lambda: f"segments: {cluster.segments()!r}")


def test_mooncake_store_import_resolves_to_tierkv_only_when_opted_in():
    compat = os.environ.get("TIERKV_COMPAT_DIR", os.path.join(os.path.dirname(__file__), "..", "compat"))
    env = dict(os.environ)
    code = "import mooncake.store as m; print(m.MooncakeDistributedStore.__module__)"
    env["PYTHONPATH"] = compat + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tierkv.mooncake_compat"
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0  # no shadowing by default


def test_hard_pins_outlast_eviction_where_soft_pins_go():
    c = Cluster(daemons=1, segment_size="16mib")
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", c.master_address) == 0
        p = unique("pin")
        hard, soft = ReplicateConfig(), ReplicateConfig()
        hard.with_hard_pin = True
        soft.with_soft_pin = True
        blob = bytes(range(256)) * 4096  # 1 MiB
        assert s.put(p + "hard", blob, hard) == 0
        # Only soft-pinned objects follow, four times what fits: they must go,
        # oldest first, and the hard pin must not. The index orders accesses
        # to 1/64 s (ties go round-robin across its shards), so the first one
        # is put well over a tick before the rest to be surely the oldest:
        # the master stamps it from its clock (this host's) before the put returns.
        assert s.put(p + "0", blob, soft) == 0
        first = time.monotonic()
        wait_for("the index's access clock to move well over a tick (1/64 s) past the first put",
                 lambda: time.monotonic() - first > 4 / 64, timeout=5)
        for i in range(1, 64):
            assert s.put(p + str(i), blob, soft) == 0, i
        assert s.is_exist(p + "hard") == 1 and s.get(p + "hard") == blob
        assert s.is_exist(p + "0") == 0 and s.is_exist(p + "63") == 1
        with urllib.request.urlopen(f"{c.metadata_url}/v1/objects/{p}hard", timeout=5) as r:
            assert json.loads(r.read())["hard_pin"] is True
        assert s.remove(p + "hard", force=True) == 0 and s.is_exist(p + "hard") == 0
    finally:
        s.close()
        c.stop()
