"""Faults through the Mooncake-compatible API: a killed daemon and a stopped
master give negative codes or False within the timeouts, never an exception
or None."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from conftest import unique
from waiting import stays_false, wait_for
from tierkv.mooncake_compat import MooncakeDistributedStore

MIB = 1 << 20
RPC_TIMEOUT = 1.0
TRANSFER_TIMEOUT = 3.0
# A call may spend an RPC timeout per phase plus a transfer timeout, plus slack.
CALL_BOUND = 3 * RPC_TIMEOUT + TRANSFER_TIMEOUT + 5


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setenv("TIERKV_RPC_TIMEOUT", str(RPC_TIMEOUT))
    monkeypatch.setenv("TIERKV_TRANSFER_TIMEOUT", str(TRANSFER_TIMEOUT))


def open_store(cluster):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.master_address) == 0
    return s


def all_ints(values, n):
    return isinstance(values, list) and len(values) == n and all(type(v) is int for v in values)


def test_daemon_killed_mid_run(fresh_cluster, short_timeouts):
    s = open_store(fresh_cluster)
    p = unique("kill")
    n = 32
    keys = [p + str(i) for i in range(n)]
    src = np.random.default_rng(3).integers(0, 256, n * 256 * 1024, dtype=np.uint8)
    dst = np.zeros_like(src)
    s.register_buffer(src.ctypes.data, src.nbytes)
    s.register_buffer(dst.ctypes.data, dst.nbytes)
    ptrs = [src.ctypes.data + i * 256 * 1024 for i in range(n)]
    outs = [dst.ctypes.data + i * 256 * 1024 for i in range(n)]
    assert s.batch_put_from(keys, ptrs, [256 * 1024] * n) == [0] * n

    results, problems = [], []
    killed = threading.Event()
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                got = s.batch_get_into(keys, outs, [256 * 1024] * n)
                exist = s.batch_is_exist(keys)
            except Exception as e:  # must never happen
                problems.append(repr(e))
                return
            took = time.monotonic() - t0
            if not (all_ints(got, n) and all_ints(exist, n)):
                problems.append(f"not one int per key: {got!r} {exist!r}")
            if took > 2 * CALL_BOUND:
                problems.append(f"calls took {took:.1f}s")
            results.append((killed.is_set(), got, exist))

    def reader_says():  # for a failed wait: what the reader has seen so far
        return f"{len(results)} reads, the last {results[-1:]!r}; problems {problems!r}\n{fresh_cluster.logs()}"

    t = threading.Thread(target=reader)
    t.start()
    try:
        # (A reader that stopped on a problem ends either wait; the asserts below name it.)
        wait_for("three reads before the kill", lambda: len(results) >= 3 or not t.is_alive(), timeout=30,
                 detail=reader_says)
        # Set first: a read recorded as "before" must have ended before the kill.
        killed.set()
        fresh_cluster.daemons[0].kill(signal.SIGKILL)
        # Until the reader has seen the loss: some key negative and absent.
        wait_for("a read after the kill to find some key negative and absent",
                 lambda: not t.is_alive() or any(after and any(g < 0 for g in got) and any(e == 0 for e in exist)
                                                 for after, got, exist in results),
                 timeout=30, detail=reader_says)
    finally:
        stop.set()
        t.join(timeout=2 * CALL_BOUND)
    assert not t.is_alive()
    assert not problems, problems
    before = [r for r in results if not r[0]]
    assert before and all(got == [256 * 1024] * n for _, got, _ in before)
    lost = [(got, exist) for after, got, exist in results if after and any(g < 0 for g in got)]
    assert lost, "no read saw the daemon's loss"
    got, exist = lost[-1]
    # Keys on the surviving daemon still read back, byte for byte.
    for i, g in enumerate(got):
        if g > 0:
            assert np.array_equal(dst[i * 256 * 1024:(i + 1) * 256 * 1024], src[i * 256 * 1024:(i + 1) * 256 * 1024])
    assert any(g > 0 for g in got), "both daemons' keys lost"
    s.close()


def process_halted(proc):
    """True once the process is stopped (SIGSTOP) or gone (SIGKILL)."""
    if proc.poll() is not None:
        return True
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("T", "t", "Z")


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_master_stopped_gives_negative_codes(fresh_cluster, short_timeouts, how):
    s = open_store(fresh_cluster)
    p = unique("master")
    keys = [p + str(i) for i in range(8)]
    buf = np.zeros(8 * 4096, dtype=np.uint8)
    s.register_buffer(buf.ctypes.data, buf.nbytes)
    ptrs = [buf.ctypes.data + i * 4096 for i in range(8)]
    assert s.batch_put_from(keys, ptrs, [4096] * 8) == [0] * 8
    master = fresh_cluster.master
    master.proc.send_signal(getattr(signal, how))
    # The signal is delivered asynchronously: a call made before it lands
    # would still be answered.
    wait_for(f"the master to take {how}", lambda: process_halted(master.proc), timeout=5)
    try:
        checks = {
            "put": lambda: [s.put(p + "new", b"v")],
            "batch_put_from": lambda: s.batch_put_from([p + "n1", p + "n2"], ptrs[:2], [4096] * 2),
            "batch_get_into": lambda: s.batch_get_into(keys, ptrs, [4096] * 8),
            "batch_is_exist": lambda: s.batch_is_exist(keys),
            "is_exist": lambda: [s.is_exist(keys[0])],
            "remove": lambda: [s.remove(keys[0])],
            "health_check": lambda: [s.health_check()],
        }
        for name, call in checks.items():
            t0 = time.monotonic()
            got = call()
            took = time.monotonic() - t0
            assert all(type(v) is int and v < 0 for v in got), f"{name}: {got}"
            assert took < CALL_BOUND, f"{name} took {took:.1f}s"
        assert s.remove_all() == -1
        assert s.get(keys[0]) == b""
    finally:
        if how == "SIGSTOP":
            master.proc.send_signal(signal.SIGCONT)
    s.close()


def test_close_during_a_call_never_holds_other_python_threads(fresh_cluster, short_timeouts):
    """close() while another thread's call is in flight: the client's
    destructor (an unmount RPC to a stopped master, thread joins) runs
    without the GIL, so every other Python thread keeps running."""
    import tierkv
    c = tierkv.Client(fresh_cluster.master_address, fresh_cluster.metadata_url, lend_size=16 << 20,
                      rpc_timeout=RPC_TIMEOUT, transfer_timeout=TRANSFER_TIMEOUT)
    # A key the client has never seen, so the get must ask the master.
    absent = unique("close") + "absent"
    ticks, stop, call = [], threading.Event(), {}

    def ticker():
        # The measurement itself: a Python thread that needs the GIL every 10 ms.
        while not stop.is_set():
            ticks.append(time.monotonic())
            stop.wait(0.01)

    def caller():
        try:
            c.get(absent)
            call["result"] = "returned"
        except Exception as e:  # the stopped master: an RPC error
            call["result"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=ticker)
    t.start()
    master = fresh_cluster.master.proc
    master.send_signal(signal.SIGSTOP)
    try:
        a = threading.Thread(target=caller)
        a.start()
        stays_false("the caller's get returned", lambda: "result" in call, 0.3)  # it is in flight
        start = time.monotonic()
        c.close()
        # Whichever thread ends up destroying the client has done so once
        # the caller has returned.
        a.join(CALL_BOUND)
        assert not a.is_alive(), "the in-flight call never returned"
        stop.set()
        t.join()
        gaps = [y - x for x, y in zip(ticks, ticks[1:]) if x >= start - 0.05]
        assert gaps and max(gaps) < 0.5 * RPC_TIMEOUT, f"a Python thread was held for {max(gaps):.2f}s ({call})"
        with pytest.raises(Exception, match="closed"):
            c.get(absent)
    finally:
        stop.set()
        master.send_signal(signal.SIGCONT)
