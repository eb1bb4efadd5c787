"""mooncake.engine over tierkv (tierkv.mooncake_engine): Mooncake's Python
transfer engine between two real processes, as SGLang's and vLLM's
prefill-to-decode code drives it."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from waiting import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
COMPAT = os.environ.get("TIERKV_COMPAT_DIR", os.path.join(os.path.dirname(HERE), "compat"))
sys.path.insert(0, COMPAT)
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode  # noqa: E402

MIB = 1 << 20


class Peer:
    """pd_peer.py in its own process."""

    def __init__(self, host="127.0.0.1", size=64 * MIB, env=None):
        e = dict(os.environ, TIERKV_COMPAT_DIR=COMPAT, MC_TRANSFER_TIMEOUT="5")
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "pd_peer.py"), host, str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=e)
        hello = json.loads(self.proc.stdout.readline())
        assert "error" not in hello, hello
        self.session, self.addr, self.size = hello["session"], hello["addr"], hello["size"]

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def crc(self, addr, n):
        return self.ask(op="crc", addr=addr, n=n)["crc"]

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=20)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.kill(signal.SIGCONT)
    p.close()


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    te = TransferEngine()
    assert te.initialize("127.0.0.1:9", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(64 * MIB, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes) == 0
    te.buf = buf
    yield te
    te.unregister_memory(buf.ctypes.data)


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_the_surface_is_mooncakes():
    assert TransferOpcode.Read == 0 and TransferOpcode.Write == 1
    assert TransferEngine.TransferOpcode is TransferOpcode
    n = TransferNotify("room-7", "done")
    assert (n.name, n.msg) == ("room-7", "done")
    te = TransferEngine()
    # Before initialize nothing moves and nothing raises.
    assert te.batch_transfer_sync_write("127.0.0.1:1", [1], [2], [3]) == -1
    assert te.get_rpc_port() == -1
    assert te.initialize("127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "") == -1
    assert te.initialize("127.0.0.1:4242", "P2PHANDSHAKE", "tcp", "") == 0
    assert te.get_rpc_port() > 0 and te.get_rpc_port() != 4242  # the port given is ignored
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # once only
    assert json.loads(te.get_local_topology())
    assert te.get_engine() is te


def test_writes_and_reads_land_byte_identical(engine, peer):
    data = pattern(8 * MIB, 1)
    engine.buf[:data.nbytes] = data
    src = engine.buf.ctypes.data
    assert engine.transfer_sync_write(peer.session, src, peer.addr + 4096, data.nbytes) == 0
    assert peer.crc(peer.addr + 4096, data.nbytes) == zlib.crc32(data.tobytes())
    engine.buf[:data.nbytes] = 0
    assert engine.transfer_sync_read(peer.session, src, peer.addr + 4096, data.nbytes) == 0
    assert np.array_equal(engine.buf[:data.nbytes], data)
    # Per layer, as SGLang sends a chunk: one entry per layer's page.
    srcs = [src + i * 65536 for i in range(61)]
    dsts = [peer.addr + 32 * MIB + i * 131072 for i in range(61)]
    assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [65536] * 61) == 0
    for i in (0, 30, 60):
        assert peer.crc(dsts[i], 65536) == zlib.crc32(engine.buf[i * 65536:(i + 1) * 65536].tobytes())
    assert engine.batch_transfer_sync(peer.session, srcs, dsts, [65536] * 61, TransferOpcode.Read) == 0


def test_ranges_outside_the_peers_buffers_are_refused_with_nothing_written(engine, peer):
    engine.buf[:MIB] = 0xAB
    before = peer.crc(peer.addr, peer.size)
    src = engine.buf.ctypes.data
    end = peer.addr + peer.size
    assert engine.transfer_sync_write(peer.session, src, end - 4096, 8192) == -1
    assert engine.transfer_sync_write(peer.session, src, end + MIB, 4096) == -1
    assert engine.transfer_sync_write(peer.session, src, peer.addr - 1, 2) == -1
    # A batch with one bad entry fails as a whole (-1); its good entries may land.
    assert engine.batch_transfer_sync_write(peer.session, [src, src], [peer.addr, end], [16, 16]) == -1
    assert engine.batch_transfer_sync_write(peer.session, [src, src], [peer.addr], [16, 16]) == -1  # unequal
    assert peer.crc(peer.addr + 16, peer.size - 16) == zlib.crc32(bytes(peer.size - 16))
    assert before == zlib.crc32(bytes(peer.size))


def test_memory_the_peer_registers_later_is_reached(engine, peer):
    assert engine.transfer_sync_write(peer.session, engine.buf.ctypes.data, peer.addr, 64) == 0
    later = peer.ask(op="register", n=MIB)["addr"]
    engine.buf[:MIB] = pattern(MIB, 3)
    assert engine.transfer_sync_write(peer.session, engine.buf.ctypes.data, later, MIB) == 0
    assert peer.crc(later, MIB) == zlib.crc32(engine.buf[:MIB].tobytes())


def test_twelve_threads_at_once(engine, peer):
    data = pattern(12 * 2 * MIB, 4)
    engine.buf[:data.nbytes] = data
    results = [None] * 12

    def worker(t):
        rcs = []
        for rep in range(5):
            off = t * 2 * MIB
            srcs = [engine.buf.ctypes.data + off + i * 4096 for i in range(512)]
            dsts = [peer.addr + off + i * 4096 for i in range(512)]
            rcs.append(engine.batch_transfer_sync_write(peer.session, srcs, dsts, [4096] * 512))
        results[t] = rcs

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [[0] * 5] * 12
    assert peer.crc(peer.addr, data.nbytes) == zlib.crc32(data.tobytes())


def test_a_hundred_thousand_entries_in_one_call(engine, peer):
    # One entry per token, 64 bytes each: every other slot at the peer (no
    # two neighbours), then all adjacent (coalesced into one run).
    n, size = 100_000, 64
    data = pattern(n * size, 5)
    engine.buf[:data.nbytes] = data
    base = engine.buf.ctypes.data
    srcs = [base + i * size for i in range(n)]
    dsts = [peer.addr + 2 * i * size for i in range(n)]
    assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [size] * n) == 0
    got = peer.crc(peer.addr + 2 * 4242 * size, size)
    assert got == zlib.crc32(data[4242 * size:4243 * size].tobytes())
    before = engine.coalesced_entries()
    dsts = [peer.addr + i * size for i in range(n)]
    assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [size] * n) == 0
    assert engine.coalesced_entries() - before == n - 1
    assert peer.crc(peer.addr, n * size) == zlib.crc32(data.tobytes())


def test_async_batches_and_submitted_writes(engine, peer):
    engine.buf[:MIB] = pattern(MIB, 6)
    src = engine.buf.ctypes.data
    ids = [engine.batch_transfer_async_write(peer.session, [src + i * 4096], [peer.addr + i * 4096], [4096])
           for i in range(16)]
    assert all(i != 0 for i in ids)
    assert engine.get_batch_transfer_status(ids) == 0
    assert engine.get_batch_transfer_status(ids) == -1  # freed
    bid = engine.transfer_submit_write(peer.session, src, peer.addr + MIB, MIB)
    assert bid not in (0, 2**64 - 1)
    wait_for("the submitted write to finish", lambda: engine.transfer_check_status(bid) != 0, timeout=10)
    assert peer.crc(peer.addr + MIB, MIB) == zlib.crc32(engine.buf[:MIB].tobytes())
    bad = engine.batch_transfer_async_read(peer.session, [src], [peer.addr + peer.size], [16])
    assert engine.get_batch_transfer_status([bad]) == -1


def test_notifications_follow_the_data(engine, peer):
    engine.buf[:4096] = 7
    assert engine.batch_transfer_sync(peer.session, [engine.buf.ctypes.data], [peer.addr], [4096],
                                      TransferOpcode.Write, TransferNotify("room-1", "kv complete")) == 0
    assert engine.transfer_sync(peer.session, engine.buf.ctypes.data, peer.addr, 16, TransferOpcode.Write,
                                TransferNotify("room-2", "")) == 0
    assert peer.ask(op="notifies")["notifies"] == [["room-1", "kv complete"], ["room-2", ""]]
    assert peer.ask(op="notifies")["notifies"] == []
    assert engine.get_notifies() == []


def test_a_killed_peer_fails_within_the_deadline_and_a_restarted_one_is_probed_back(engine, monkeypatch):
    monkeypatch.setenv("MC_LEGACY_RPC_PORT_BINDING", "1")
    first = Peer()
    port = first.session.rsplit(":", 1)[1]
    src = engine.buf.ctypes.data
    assert engine.transfer_sync_write(first.session, src, first.addr, 4096) == 0
    assert engine.send_probe(first.session) == 0
    first.kill()
    start = time.monotonic()
    assert engine.transfer_sync_write(first.session, src, first.addr, MIB) == -1
    assert time.monotonic() - start < 5 + 2
    assert engine.send_probe(first.session) != 0
    second = Peer(host=f"127.0.0.1:{port}", env={"MC_LEGACY_RPC_PORT_BINDING": "1"})
    try:
        assert second.session == first.session
        wait_for("the restarted peer to answer a probe", lambda: engine.send_probe(second.session) == 0, timeout=10)
        assert engine.transfer_sync_write(second.session, src, second.addr, 4096) == 0
        assert engine.get_first_buffer_address(second.session) == second.addr
    finally:
        second.close()


def test_a_stopped_peer_holds_no_thread_past_the_deadline_nor_the_gil(engine, peer):
    assert engine.transfer_sync_write(peer.session, engine.buf.ctypes.data, peer.addr, 4096) == 0
    peer.kill(signal.SIGSTOP)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.01)

    t = threading.Thread(target=ticker)
    t.start()
    start = time.monotonic()
    rc = engine.transfer_sync_write(peer.session, engine.buf.ctypes.data, peer.addr, 8 * MIB)
    took = time.monotonic() - start
    stop.set()
    t.join()
    assert rc == -1
    assert took < 5 + 2, took
    assert len(ticks) > 50  # Python ran meanwhile: the GIL was released
    peer.kill(signal.SIGCONT)
    wait_for("the resumed peer to take writes again",
             lambda: engine.transfer_sync_write(peer.session, engine.buf.ctypes.data, peer.addr, 4096) == 0,
             timeout=15)


def test_managed_buffers_and_bytes(engine, peer):
    addr = engine.allocate_managed_buffer(MIB)
    assert addr != 0
    assert engine.write_bytes_to_buffer(addr, b"prefill", 7) == 0
    assert engine.read_bytes_from_buffer(addr, 7) == b"prefill"
    assert engine.transfer_sync_write(peer.session, addr, peer.addr, 7) == 0
    assert peer.crc(peer.addr, 7) == zlib.crc32(b"prefill")
    assert engine.free_managed_buffer(addr, MIB) == 0
    assert engine.free_managed_buffer(addr, MIB) == -1
