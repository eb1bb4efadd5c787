"""tierkv.mooncake_compat: Mooncake's Python store API and its return conventions."""

import ctypes
import json
import os
import struct
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


def served_names(cluster):
    """Each segment's host:port (its endpoint's port), as get_hostname answers."""
    out = {}
    for seg in cluster.segments():
        port = seg["endpoint"].split()[-1]
        out[f"{seg['host']}:{port}"] = seg["name"]
    return out


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
    served = served_names(cluster)
    assert s7.get_hostname() in served
    assert s8.get_hostname() == "localhost" and kw.get_hostname() == "127.0.0.1"
    assert s8.get_hostname() not in served and kw.get_hostname() not in served
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
    assert store.isExist(p + "k") == 1 and store.isExist(p + "none") == 0  # the older names
    assert store.getSize(p + "none") == OBJECT_NOT_FOUND
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
    name = served_names(cluster)[s.get_hostname()]
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


# --- the rest of Mooncake's store binding ------------------------------------
from tierkv.mooncake_compat import (UNAVAILABLE_IN_CURRENT_MODE, UNAVAILABLE_IN_CURRENT_STATUS, BufferHandle,  # noqa: E402
                                    BufferPool, MooncakeHostMemAllocator, ReplicaStatus, SoftPinAction,
                                    bind_to_numa_node, get_alloc_func_addr, get_free_func_addr, parse_size)


def object_info(cluster, key):
    with urllib.request.urlopen(f"{cluster.metadata_url}/v1/objects/{key}", timeout=5) as r:
        return json.loads(r.read())


def test_setup_from_a_config_dict_with_readable_sizes(cluster):
    assert parse_size("4GB") == 4 << 30 and parse_size("512MB") == 512 << 20 and parse_size("1.5k") == 1536
    assert parse_size(" 64 mib ") == 64 << 20 and parse_size(4096) == 4096 and parse_size("7") == 7
    for bad in ("4XB", "-1MB", "", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    s = MooncakeDistributedStore()
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "global_segment_size": "32MB",
           "local_buffer_size": "0", "protocol": "tcp", "device_name": "",
           "master_server_address": cluster.master_address}
    assert s.setup(cfg) == 0
    seg = served_names(cluster)[s.get_hostname()]
    assert [x["capacity"] for x in cluster.segments() if x["name"] == seg] == [32 << 20]
    k = unique("dict") + "k"
    assert s.put(k, b"from a dict config") == 0 and s.get(k) == b"from a dict config"
    assert s.close() == 0
    for broken in ({**cfg, "global_segment_size": "lots"}, {**cfg, "no_such_key": 1},
                   {k: v for k, v in cfg.items() if k != "master_server_address"}):
        assert MooncakeDistributedStore().setup(broken) == INVALID_PARAMS


def test_setup_dummy_get_hostname_and_health(cluster):
    s = MooncakeDistributedStore()
    assert s.health_check() == UNAVAILABLE_IN_CURRENT_STATUS  # not set up
    assert s.setup_dummy(64 * MIB, 16 * MIB, "127.0.0.1:50052") == UNAVAILABLE_IN_CURRENT_MODE
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 0, "tcp", "", cluster.master_address) == 0
    host, port = s.get_hostname().rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert s.health_check() == 0
    # preferred_segment = get_hostname() places the replica on this store's segment.
    cfg = ReplicateConfig()
    cfg.preferred_segment = s.get_hostname()
    k = unique("pref") + "k"
    assert s.put(k, b"x" * 1000, cfg) == 0
    seg = served_names(cluster)[s.get_hostname()]
    assert [r["segment"] for r in object_info(cluster, k)["replicas"]] == [seg]
    s.close()
    assert s.health_check() == UNAVAILABLE_IN_CURRENT_STATUS


def test_bind_to_numa_node_and_host_allocator():
    before = os.sched_getaffinity(0)
    try:
        assert bind_to_numa_node(0) is None
        if os.path.exists("/sys/devices/system/node/node0"):
            assert os.sched_getaffinity(0) <= before
        assert bind_to_numa_node(9999) is None  # warns, binds nothing
    finally:
        os.sched_setaffinity(0, before)
    a = MooncakeHostMemAllocator()
    p = a.alloc(MIB)
    assert p != 0 and p % 4096 == 0
    ctypes.memset(p, 7, MIB)
    assert ctypes.string_at(p + MIB - 1, 1) == b"\x07"
    assert a.free(p) == 0
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(get_free_func_addr())
    q = alloc(4096)
    assert q
    free(q)


def test_soft_pin_action_and_ttl(store, cluster):
    p = unique("spa")
    on = ReplicateConfig()
    on.soft_pin_action = SoftPinAction.ENABLE
    on.soft_pin_ttl_ms = 60_000
    assert store.put(p + "on", b"pinned", on) == 0
    assert object_info(cluster, p + "on")["soft_pin"] is True
    off = ReplicateConfig()
    off.with_soft_pin = True
    off.soft_pin_action = SoftPinAction.DISABLE
    assert store.put(p + "off", b"not pinned", off) == 0
    assert object_info(cluster, p + "off")["soft_pin"] is False
    keep = ReplicateConfig()
    keep.with_soft_pin = True  # PRESERVE follows with_soft_pin
    assert store.put(p + "keep", b"pinned", keep) == 0
    assert object_info(cluster, p + "keep")["soft_pin"] is True
    bad = ReplicateConfig()
    bad.soft_pin_ttl_ms = 1000  # a TTL without ENABLE
    assert store.put(p + "bad", b"x", bad) == INVALID_PARAMS and store.is_exist(p + "bad") == 0
    nof = ReplicateConfig()
    nof.replica_num, nof.nof_replica_num = 0, 1
    assert store.put(p + "nof", b"x", nof) == UNAVAILABLE_IN_CURRENT_MODE and store.is_exist(p + "nof") == 0


def test_get_buffer_and_batch_get_buffer(store):
    p = unique("buf")
    raw = np.random.default_rng(3).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    assert store.put(p + "a", raw) == 0 and store.put(p + "b", b"bee") == 0
    h = store.get_buffer(p + "a")
    assert isinstance(h, BufferHandle) and h.size() == len(raw) == len(h)
    assert bytes(h) == raw
    assert np.array_equal(np.array(h, copy=False), np.frombuffer(raw, dtype=np.uint8))
    assert ctypes.string_at(h.ptr(), 16) == raw[:16] and bytes(memoryview(h)[-5:]) == raw[-5:]
    assert store.get_buffer(p + "none") is None
    hs = store.batch_get_buffer([p + "b", p + "none", p + "a"])
    assert bytes(hs[0]) == b"bee" and hs[1] is None and bytes(hs[2]) == raw


def test_get_into_ranges(store):
    p = unique("rng")
    k1, k2 = p + "k1", p + "k2"
    v1, v2 = bytes(range(40)), bytes(range(100, 140))
    assert store.put(k1, v1) == 0 and store.put(k2, v2) == 0
    b0, b1 = np.full(32, 0xEE, dtype=np.uint8), np.full(32, 0xEE, dtype=np.uint8)
    assert store.register_buffer(addr(b0), 32) == 0 and store.register_buffer(addr(b1), 32) == 0
    res = store.get_into_ranges([addr(b0), addr(b1)], [[k1, k2], [k2, k1]],
                                [[[0, 20], [8]], [[4], [16]]], [[[1, 30], [2]], [[0], [10]]],
                                [[[4, 3], [5]], [[6], [4]]])
    assert res == [[[4, 3], [5]], [[6], [4]]]
    assert bytes(b0[0:4]) == v1[1:5] and bytes(b0[20:23]) == v1[30:33] and bytes(b0[8:13]) == v2[2:7]
    assert bytes(b1[4:10]) == v2[0:6] and bytes(b1[16:20]) == v1[10:14]
    assert b0[4] == 0xEE and b1[0] == 0xEE  # untouched between ranges
    # A miss, a source range past the object's end, a destination past the
    # registered buffer, a fragment-shape mismatch: each only its own entries.
    res = store.get_into_ranges([addr(b0)], [[k1, p + "none", k2, k1]], [[[0], [0], [0, 30], [0, 1]]],
                                [[[38], [0], [0, 0], [0]]], [[[2], [1], [1, 4], [1, 1]]])
    assert res == [[[2], [OBJECT_NOT_FOUND], [1, INVALID_PARAMS], [INVALID_PARAMS, INVALID_PARAMS]]]
    res = store.get_into_ranges([addr(b0)], [[k1]], [[[0]]], [[[39]]], [[[2]]])
    assert res == [[[INVALID_PARAMS]]]
    # Top-level lengths differ: every entry INVALID_PARAMS.
    assert store.get_into_ranges([addr(b0), addr(b1)], [[k1]], [[[0]]], [[[0]]], [[[1]]]) == [
        [[INVALID_PARAMS]], [[INVALID_PARAMS]]]
    # An unregistered buffer has no known bound: refused.
    loose = np.zeros(8, dtype=np.uint8)
    assert store.get_into_ranges([addr(loose)], [[k1]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]
    assert not loose.any()
    store.unregister_buffer(addr(b0))
    store.unregister_buffer(addr(b1))


def test_upserts_replace_values(store, cluster):
    p = unique("ups")
    assert store.upsert(p + "k", b"new") == 0 and store.get(p + "k") == b"new"
    assert store.get(p + "k") == b"new"  # leased by this read: upsert still replaces it
    assert store.upsert(p + "k", b"newer value") == 0 and store.get(p + "k") == b"newer value"
    assert store.upsert_parts(p + "k", b"pa", b"rts") == 0 and store.get(p + "k") == b"parts"
    assert store.upsert_batch([p + "k", p + "j"], [b"K2", b"J1"]) == 0
    assert store.get_batch([p + "k", p + "j"]) == [b"K2", b"J1"]
    assert store.upsert_batch([p + "k"], [b"a", b"b"]) == INVALID_PARAMS
    buf = np.frombuffer(b"0123456789abcdef", dtype=np.uint8).copy()
    assert store.register_buffer(addr(buf), buf.nbytes) == 0
    assert store.upsert_from(p + "k", addr(buf), 10) == 0 and store.get(p + "k") == b"0123456789"
    assert store.batch_upsert_from([p + "k", p + "j"], [addr(buf) + 10, addr(buf)], [6, 3]) == [0, 0]
    assert store.get_batch([p + "k", p + "j"]) == [b"abcdef", b"012"]
    assert store.batch_upsert_from([p + "k", p + "j"], [addr(buf)], [1, 1]) == [INVALID_PARAMS] * 2
    assert store.batch_upsert_from_multi_buffers([p + "m"], [[addr(buf), addr(buf) + 14]], [[2, 2]]) == [0]
    assert store.get(p + "m") == b"01ef"
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert store.upsert(p + "k", b"pinned now", cfg) == 0
    assert object_info(cluster, p + "k")["hard_pin"] is True and store.get(p + "k") == b"pinned now"
    store.unregister_buffer(addr(buf))


def test_put_from_with_metadata(store):
    p = unique("meta")
    data = np.arange(1000, dtype=np.float32)
    meta = np.array([42, 100], dtype=np.int32)
    assert store.put_from_with_metadata(p + "k", addr(data), addr(meta), data.nbytes, meta.nbytes) == 0
    assert store.get(p + "k") == meta.tobytes() + data.tobytes()
    assert store.put_from_with_metadata(p + "empty", addr(data), addr(meta), 0, meta.nbytes) == 0
    assert store.is_exist(p + "empty") == 0  # size 0 stores nothing, as Mooncake
    same_node = ReplicateConfig()
    same_node.prefer_alloc_in_same_node = True
    assert store.put_from_with_metadata(p + "x", addr(data), addr(meta), 4, 4, same_node) == -1


def test_replica_descriptors_and_clear(store, cluster):
    p = unique("desc")
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert store.put(p + "two", b"r" * 5000, cfg) == 0 and store.put(p + "one", b"o" * 10) == 0
    desc = store.get_replica_desc(p + "two")
    assert len(desc) == 2
    served = {v: k for k, v in served_names(cluster).items()}
    info = object_info(cluster, p + "two")
    for d, r in zip(desc, info["replicas"]):
        assert d.status == ReplicaStatus.COMPLETE and d.is_memory_replica() and not d.is_disk_replica()
        b = d.get_memory_descriptor().buffer_descriptor
        assert b.size == 5000 and b.buffer_address == r["offset"] and b.transport_endpoint == served[r["segment"]]
    with pytest.raises(RuntimeError):
        desc[0].get_disk_descriptor()
    assert store.get_replica_desc(p + "none") == []
    m = store.batch_get_replica_desc([p + "two", p + "one", p + "none"])
    assert sorted(m) == [p + "one", p + "two"] and len(m[p + "one"]) == 1
    # Clearing on one segment: "one" (all its replicas there) goes; "two"
    # (a replica elsewhere) stays.
    seg_one = object_info(cluster, p + "one")["replicas"][0]["segment"]
    cleared = store.batch_replica_clear([p + "two", p + "one", p + "none"], seg_one)
    assert cleared == [p + "one"]
    assert store.batch_is_exist([p + "two", p + "one"]) == [1, 0]
    assert store.batch_replica_clear([p + "two", p + "none"]) == [p + "two"]
    assert store.is_exist(p + "two") == 0


def test_remove_by_regex(store):
    p = unique("rx")
    assert store.put_batch([p + "a", p + "b"], [b"1", b"2"]) == 0
    assert store.remove_by_regex("(") == INVALID_PARAMS
    assert store.remove_by_regex("^" + p + ".*") == UNAVAILABLE_IN_CURRENT_MODE
    assert store.batch_is_exist([p + "a", p + "b"]) == [1, 1]
    assert store.remove_by_regex(".*", force=True) >= 2
    assert store.batch_is_exist([p + "a", p + "b"]) == [0, 0]


def test_unsupported_calls_answer_codes(store):
    assert store.create_copy_task("k", ["seg"]) == ((0, 0), UNAVAILABLE_IN_CURRENT_MODE)
    assert store.create_move_task("k", "a", "b") == ((0, 0), UNAVAILABLE_IN_CURRENT_MODE)
    assert store.query_task((1, 2)) == (None, UNAVAILABLE_IN_CURRENT_MODE)
    assert store.mount_segment("/dev/shm/x", MIB)["ret"] == UNAVAILABLE_IN_CURRENT_MODE
    assert store.alloc_from_mem_pool(4096) == 0


def test_buffer_pool_lends_registered_buffers(cluster):
    # local_buffer_size 0: the pool allocates and registers its own regions.
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.master_address) == 0
    with pytest.raises(RuntimeError):
        BufferPool(s)  # max_bytes must be positive then
    pool = BufferPool(s, max_bytes=4 * MIB, min_size_class=64 * 1024, alignment=MIB, prewarm_size=1000,
                      prewarm_count=2)
    k = unique("pool") + "k"
    with pool.acquire(100_000) as lease:
        assert lease.size == 100_000 and lease.ptr % MIB == 0
        view = lease.buffer
        assert len(view) == 100_000
        view[:] = bytes(range(256)) * 390 + bytes(160)
        assert s.put_from(k, lease.ptr, lease.size) == 0
        first = lease.ptr
    with pool.acquire(100_000) as again:
        assert again.ptr == first  # reused from its size class
        ctypes.memset(again.ptr, 0, again.size)
        assert s.get_into(k, again.ptr, again.size) == 100_000
        assert bytes(again.buffer[:512]) == bytes(range(256)) * 2
    held = [pool.acquire(MIB) for _ in range(3)]  # with the two prewarmed 64 KiB regions: 4 MiB is close
    with pytest.raises(RuntimeError):
        pool.acquire(MIB, block=False)
    with pytest.raises(RuntimeError):
        pool.acquire(MIB, timeout=0.05)
    with pytest.raises(RuntimeError):
        pool.acquire(64 * MIB)  # larger than the pool
    with pytest.raises(RuntimeError):
        pool.close()  # leases outstanding
    for lease in held:
        lease.release()
    pool.close()
    with pytest.raises(RuntimeError):
        pool.acquire(10)
    s.close()
    # local_buffer_size > 0: the pool's capacity is the local buffer.
    s2 = MooncakeDistributedStore()
    assert s2.setup("127.0.0.1", "P2PHANDSHAKE", 0, 2 * MIB, "tcp", "", cluster.master_address) == 0
    pool2 = BufferPool(s2)
    lease = pool2.acquire(MIB + 1)
    with pytest.raises(RuntimeError):
        pool2.acquire(MIB, block=False)
    lease.release()
    pool2.acquire(2 * MIB).release()
    pool2.close()
    s2.close()


# --- tensors -------------------------------------------------------------------
def _torch_or_skip():
    try:
        import torch
    except ImportError:
        print("torch is not importable here: tensor calls untested")
        pytest.skip("torch is not importable")
    return torch


def test_tensor_round_trips(store):
    torch = _torch_or_skip()
    p = unique("tensor")
    t = torch.randn(3, 5, 7)
    assert store.put_tensor(p + "f", t) == 0
    back = store.get_tensor(p + "f")
    assert back.dtype == torch.float32 and back.shape == t.shape and torch.equal(back, t)
    bf = torch.randn(4, 6).to(torch.bfloat16)
    ints = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4).transpose(0, 2)  # not contiguous
    assert store.batch_put_tensor([p + "bf", p + "i"], [bf, ints]) == [0, 0]
    got = store.batch_get_tensor([p + "bf", p + "i", p + "none"])
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], bf)
    assert got[1].shape == (4, 3, 2) and torch.equal(got[1], ints) and got[2] is None
    # The stored bytes are Mooncake's layout: header (dtype, ndim, shape[4]) then data.
    raw = store.get(p + "f")
    assert struct.unpack("<ii4q", raw[:40]) == (0, 3, 3, 5, 7, -1) and raw[40:] == t.numpy().tobytes()
    # A value put in that layout by any client reads as a tensor.
    hand = struct.pack("<ii4q", 6, 1, 3, -1, -1, -1) + np.array([7, 8, 9], dtype=np.int32).tobytes()
    assert store.put(p + "hand", hand) == 0
    assert store.get_tensor(p + "hand").tolist() == [7, 8, 9]
    # get_tensor_into: the tensor views the caller's buffer past the header.
    buf = np.zeros(4096, dtype=np.uint8)
    assert store.register_buffer(addr(buf), buf.nbytes) == 0
    view = store.get_tensor_into(p + "f", addr(buf), buf.nbytes)
    assert torch.equal(view, t) and view.data_ptr() == addr(buf) + 40
    assert store.get_tensor_into(p + "none", addr(buf), buf.nbytes) is None
    outs = store.batch_get_tensor_into([p + "bf", p + "none"], [addr(buf), addr(buf) + 2048], [2048, 2048])
    assert torch.equal(outs[0], bf) and outs[1] is None
    assert store.batch_get_tensor_into([p + "bf"], [addr(buf)], [1, 2]) == [INVALID_PARAMS]
    # Serialized buffers go back in with put_tensor_from.
    n = 40 + t.numel() * 4
    assert store.put_tensor_from(p + "copy", addr(buf) + 2048, 0) == INVALID_PARAMS
    store.get_into(p + "f", addr(buf), buf.nbytes)
    assert store.put_tensor_from(p + "copy", addr(buf), n) == 0 and torch.equal(store.get_tensor(p + "copy"), t)
    store.unregister_buffer(addr(buf))


def test_tensor_errors_and_upserts(store):
    torch = _torch_or_skip()
    p = unique("terr")
    assert store.put_tensor(p + "x", b"not a tensor") == INVALID_PARAMS
    assert store.put_tensor(p + "x", torch.zeros(1, 1, 1, 1, 1)) == INVALID_PARAMS  # over 4 dims
    assert store.put_tensor(p + "x", torch.zeros(0)) == INVALID_PARAMS
    assert store.batch_put_tensor([p + "a", p + "b"], [torch.ones(2)]) == [INVALID_PARAMS] * 2
    assert store.batch_put_tensor([p + "a", p + "b"], [torch.ones(2), "nope"]) == [0, INVALID_PARAMS]
    assert store.is_exist(p + "b") == 0
    assert store.put(p + "short", b"tiny") == 0 and store.get_tensor(p + "short") is None
    cfg = ReplicateConfig()
    cfg.replica_num, cfg.preferred_segments = 2, ["daemon-0"]
    assert store.pub_tensor(p + "c", torch.ones(3), cfg) == INVALID_PARAMS
    cfg.preferred_segments = ["daemon-0", "daemon-1"]
    assert store.pub_tensor(p + "c", torch.ones(3), cfg) == 0 and torch.equal(store.get_tensor(p + "c"), torch.ones(3))
    assert store.put_tensor(p + "a", torch.ones(2)) == 0  # exists: first writer wins
    assert torch.equal(store.get_tensor(p + "a"), torch.ones(2))
    assert store.upsert_tensor(p + "a", torch.full((5,), 2.0)) == 0
    assert torch.equal(store.get_tensor(p + "a"), torch.full((5,), 2.0))
    assert store.batch_upsert_tensor([p + "a", p + "n"], [torch.zeros(2), torch.ones(1, 2)]) == [0, 0]
    assert torch.equal(store.get_tensor(p + "n"), torch.ones(1, 2))


def test_tensor_parallel_forms(store):
    torch = _torch_or_skip()
    p = unique("tp")
    t = torch.arange(48, dtype=torch.float32).reshape(4, 12)
    assert store.put_tensor_with_tp(p + "w", t, tp_rank=1, tp_size=3, split_dim=1) == 0
    for r in range(3):
        assert torch.equal(store.get_tensor_with_tp(p + "w", tp_rank=r, tp_size=3, split_dim=1), t[:, 4 * r:4 * r + 4])
        assert torch.equal(store.get_tensor(f"{p}w_tp_{r}"), t[:, 4 * r:4 * r + 4])
    assert store.get_tensor_with_tp(p + "w") is None  # tp_size 1 reads the base key, never put
    assert store.put_tensor_with_tp(p + "bad", t, tp_size=3, split_dim=5) == INVALID_PARAMS
    assert store.put_tensor_with_tp(p + "bad", torch.ones(2), tp_size=3) == INVALID_PARAMS  # 2 chunks, not 3
    res = store.batch_put_tensor_with_tp([p + "a", p + "b"], [t, torch.ones(2)], tp_size=2)
    assert res == [0, 0]
    shards = store.batch_get_tensor_with_tp([p + "a", p + "b", p + "none"], tp_rank=1, tp_size=2)
    assert torch.equal(shards[0], t[2:]) and torch.equal(shards[1], torch.ones(1)) and shards[2] is None
    buf = np.zeros(1024, dtype=np.uint8)
    store.register_buffer(addr(buf), buf.nbytes)
    assert torch.equal(store.get_tensor_with_tp_into(p + "a", addr(buf), 1024, tp_rank=0, tp_size=2), t[:2])
    got = store.batch_get_tensor_with_tp_into([p + "a", p + "b"], [addr(buf), addr(buf) + 512], [512, 512],
                                              tp_rank=1, tp_size=2)
    assert torch.equal(got[0], t[2:]) and torch.equal(got[1], torch.ones(1))
    store.unregister_buffer(addr(buf))


def test_mooncake_store_shim_exports_the_new_names():
    compat = os.environ.get("TIERKV_COMPAT_DIR", os.path.join(os.path.dirname(__file__), "..", "compat"))
    env = dict(os.environ)
    env["PYTHONPATH"] = compat + os.pathsep + env.get("PYTHONPATH", "")
    code = ("from mooncake.store import BufferPool, SoftPinAction, bind_to_numa_node, ReplicaStatus, "
            "MooncakeHostMemAllocator, get_alloc_func_addr; import sys; "
            "print(SoftPinAction.ENABLE.value, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]  # importing never loads torch
