"""Mooncake's get and put sessions through tierkv.mooncake_compat, against a
real master and daemons: layer-wise range reads and writes with bytes
compared (torch tensors where torch is present), LEASE_EXPIRED (never an
exception) once a lease or session ended, a leased value surviving an
eviction storm and freed by the session's end, and nothing visible of a
put session before its end."""

import time

import numpy as np
import pytest

from conftest import Cluster, unique
from tierkv.mooncake_compat import (INVALID_PARAMS, INVALID_WRITE, LEASE_EXPIRED, OBJECT_ALREADY_EXISTS,
                                    OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, MooncakeDistributedStore, ReplicateConfig)

LAYERS, PAGE = 4, 8192


def layer_rows(base, keys, layer, stride):
    """Mooncake's layer-wise shape: per key one range, layer `layer` of its
    value, at base + key index * stride + layer * PAGE."""
    ptrs = [[base + i * stride + layer * PAGE] for i in range(len(keys))]
    sizes = [[PAGE] for _ in keys]
    offsets = [[layer * PAGE] for _ in keys]
    return ptrs, sizes, offsets


def test_put_and_get_sessions_move_values_layer_by_layer(store):
    keys = [unique("sess") + str(i) for i in range(3)]
    stride = LAYERS * PAGE
    src = np.random.default_rng(3).integers(0, 256, len(keys) * stride, dtype=np.uint8)
    assert store.batch_put_session_start(keys, [stride] * len(keys), ReplicateConfig()) == [0, 0, 0]
    # Layers written out of order; nothing is visible before the end.
    for layer in (2, 0, 3, 1):
        assert store.batch_put_from_multi_buffer_ranges(keys, *layer_rows(src.ctypes.data, keys, layer, stride)) \
            == [PAGE] * len(keys)
        assert store.batch_is_exist(keys) == [0, 0, 0]
    assert store.batch_put_session_end(keys) == [0, 0, 0]
    assert store.get(keys[1]) == src[stride:2 * stride].tobytes()  # checksummed whole

    dst = np.zeros_like(src)
    assert store.batch_get_session_start(keys + [unique("sess") + "absent"]) == [0, 0, 0, OBJECT_NOT_FOUND]
    for layer in range(LAYERS):
        assert store.batch_get_into_multi_buffer_ranges(keys, *layer_rows(dst.ctypes.data, keys, layer, stride)) \
            == [PAGE] * len(keys)
    assert np.array_equal(dst, src)
    # Several ranges of one key in one call, and a range past the value's end.
    two = np.zeros(2 * PAGE, dtype=np.uint8)
    got = store.batch_get_into_multi_buffer_ranges(
        [keys[0], keys[1]], [[two.ctypes.data, two.ctypes.data + PAGE], [two.ctypes.data]],
        [[PAGE, PAGE], [PAGE]], [[3 * PAGE, 0], [stride - PAGE + 1]])
    assert got == [2 * PAGE, INVALID_PARAMS]
    assert two[:PAGE].tobytes() == src[3 * PAGE:4 * PAGE].tobytes() and two[PAGE:].tobytes() == src[:PAGE].tobytes()
    # Leased: a remove without force is refused until the session ends.
    assert store.remove(keys[0]) == OBJECT_HAS_LEASE
    assert store.batch_get_session_end(keys) == 0
    # Ended: a range read is LEASE_EXPIRED, not an exception, and the lease went back at once.
    assert store.batch_get_into_multi_buffer_ranges(keys[:1], *layer_rows(dst.ctypes.data, keys[:1], 0, stride)) \
        == [LEASE_EXPIRED]
    assert store.remove(keys[0]) == 0


def test_put_session_errors_and_revoke(store):
    k, half, taken = unique("psess") + "k", unique("psess") + "half", unique("psess") + "taken"
    assert store.put(taken, b"x") == 0
    buf = np.arange(4 * PAGE, dtype=np.uint8)
    p = buf.ctypes.data
    assert store.batch_put_session_start([k, half, taken], [PAGE, PAGE], None) == [INVALID_PARAMS] * 3
    assert store.batch_put_session_start([k, half, taken], [PAGE, PAGE, 1]) == [0, 0, OBJECT_ALREADY_EXISTS]
    assert store.batch_put_from_multi_buffer_ranges(
        [k, half, taken], [[p], [p], [p]], [[PAGE], [PAGE // 2], [1]], [[0], [0], [0]]) == [PAGE, PAGE // 2,
                                                                                             INVALID_PARAMS]
    # Over a range already written, and past the value's size.
    assert store.batch_put_from_multi_buffer_ranges([k, half], [[p], [p]], [[10], [PAGE]], [[5], [PAGE // 2 + 1]]) \
        == [INVALID_PARAMS, INVALID_PARAMS]
    assert store.batch_put_session_end([k, half, unique("psess") + "never"]) == [0, INVALID_WRITE, OBJECT_NOT_FOUND]
    assert store.get(k) == buf[:PAGE].tobytes()
    assert store.is_exist(half) == 0
    # Revoked: nothing stays, and the key can be put again.
    r = unique("psess") + "r"
    assert store.batch_put_session_start([r], [PAGE]) == [0]
    assert store.batch_put_from_multi_buffer_ranges([r], [[p]], [[PAGE]], [[0]]) == [PAGE]
    assert store.batch_put_session_revoke([r]) == [0]
    assert store.batch_put_session_end([r]) == [OBJECT_NOT_FOUND]
    assert store.is_exist(r) == 0
    assert store.put(r, b"again") == 0 and store.get(r) == b"again"


def test_torch_tensors_move_through_sessions(store):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    keys = [unique("tsess") + str(i) for i in range(2)]
    src = torch.randn(len(keys), LAYERS, PAGE // 4)  # float32: one PAGE per layer
    stride = LAYERS * PAGE
    assert store.batch_put_session_start(keys, [stride] * len(keys)) == [0, 0]
    for layer in range(LAYERS):
        assert store.batch_put_from_multi_buffer_ranges(keys, *layer_rows(src.data_ptr(), keys, layer, stride)) \
            == [PAGE] * 2
    assert store.batch_put_session_end(keys) == [0, 0]
    dst = torch.zeros_like(src)
    assert store.batch_get_session_start(keys) == [0, 0]
    for layer in reversed(range(LAYERS)):
        assert store.batch_get_into_multi_buffer_ranges(keys, *layer_rows(dst.data_ptr(), keys, layer, stride)) \
            == [PAGE] * 2
    assert store.batch_get_session_end(keys) == 0
    assert torch.equal(dst, src)


def test_a_session_past_its_lease_answers_lease_expired_and_a_new_one_reads():
    c = Cluster(daemons=1, master_args=["--lease-ttl=1s"])
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", c.master_address) == 0
        k = unique("lease") + "k"
        v = np.random.default_rng(4).integers(0, 256, 2 * PAGE, dtype=np.uint8)
        assert s.put(k, v.tobytes()) == 0
        out = np.zeros_like(v)
        rows = ([[out.ctypes.data]], [[PAGE]], [[0]])
        assert s.batch_get_session_start([k]) == [0]
        assert s.batch_get_into_multi_buffer_ranges([k], *rows) == [PAGE]
        time.sleep(1.2)  # past the 1 s lease
        assert s.batch_get_into_multi_buffer_ranges([k], [[out.ctypes.data + PAGE]], [[PAGE]], [[PAGE]]) \
            == [LEASE_EXPIRED]
        assert s.batch_get_session_start([k]) == [0]
        assert s.batch_get_into_multi_buffer_ranges([k], [[out.ctypes.data + PAGE]], [[PAGE]], [[PAGE]]) == [PAGE]
        assert s.batch_get_session_end([k]) == 0
        assert np.array_equal(out, v)
    finally:
        s.close()
        c.stop()


def test_a_leased_value_survives_an_eviction_storm_until_its_session_ends():
    c = Cluster(daemons=1, segment_size="16mib")
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", c.master_address) == 0
        p = unique("storm")
        v = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
        assert s.put(p + "held", v.tobytes()) == 0
        assert s.batch_get_session_start([p + "held"]) == [0]
        blob = bytes(1 << 20)
        for i in range(48):  # three times what the segment holds
            assert s.put(p + str(i), blob) == 0, i
        assert s.is_exist(p + "0") == 0  # the storm did evict
        out = np.zeros_like(v)
        assert s.batch_get_into_multi_buffer_ranges([p + "held"], [[out.ctypes.data]], [[v.nbytes]], [[0]]) \
            == [v.nbytes]
        assert np.array_equal(out, v)
        assert s.batch_get_session_end([p + "held"]) == 0
        # Released: the next storm may take it like any other value.
        for i in range(48, 96):
            assert s.put(p + str(i), blob) == 0, i
        assert s.is_exist(p + "held") == 0
    finally:
        s.close()
        c.stop()
