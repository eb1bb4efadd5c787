"""KV events from a real tierkv-master, read the way a KV-aware router reads
vLLM's: a zmq SUB socket for [topic, seq, payload] messages and a DEALER for
replay, decoded with python3-msgpack (docs/kv-events.md). Objects go in
through tierkv.Client against a real tierkv-store daemon.

Every wait has a deadline (BOUND); the subscriber first waits until its
subscription is live by putting probe keys until one is announced, since a
zmq SUB misses what was published before it joined (that is what replay is
for, and test_replay_from_a_sequence covers it).
"""

import itertools
import re
import signal
import time
import urllib.request

import msgpack
import pytest
import zmq

from conftest import Cluster, Process, unique
import tierkv
import waiting

BOUND = 20  # seconds; no wait in this file takes longer
TOPIC = b"kv-events"
FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def master_args(fmt):
    return ["--rpc-port=0", "--http-port=0", "--segment-ttl=1s", "--check-interval=100ms",
            "--kv-events-endpoint=tcp://127.0.0.1:*", "--kv-events-replay-endpoint=tcp://127.0.0.1:*",
            f"--kv-events-format={fmt}", "--kv-events-batch-interval=5ms"]


def bound_endpoints(master):
    """The PUB and ROUTER endpoints the master logged (wildcard ports resolved)."""
    m = waiting.wait_for("the master to log its kv events endpoints",
                         lambda: re.search(r"kv events: publishing on (\S+) .*replay on (\S+)", master.logs()),
                         timeout=BOUND, detail=master.logs)
    return m.group(1), m.group(2)


class EventsCluster(Cluster):
    """conftest's Cluster with a master that publishes KV events."""

    def __init__(self, fmt="array", daemons=1, segment_size="256mib"):
        self.fmt = fmt
        self.segment_size = segment_size
        self.master = Process("tierkv-master", master_args(fmt))
        self.daemons = []
        try:
            self.pub, self.replay = bound_endpoints(self.master)
            for i in range(daemons):
                self.add_daemon(i)
            self.wait_live(daemons)
        except Exception:
            self.stop()
            raise

    def client(self):
        return tierkv.Client(self.master_address, self.metadata_url, transfer_timeout=10)

    def metrics(self):
        with urllib.request.urlopen(self.metadata_url + "/metrics", timeout=5) as r:
            return r.read().decode()


def normalise(event, fmt):
    """An event as a dict with "type", checking the layout of `fmt` on the way."""
    if fmt == "array":
        assert isinstance(event, list), event
        tag = event[0]
        assert len(event) == 1 + len(FIELDS[tag]), event
        d = dict(zip(FIELDS[tag], event[1:]))
        d["type"] = tag
        return d
    assert isinstance(event, dict), event
    assert list(event) == ["type"] + FIELDS[event["type"]], event  # names in vLLM's field order
    return dict(event)


def decode(seq_bytes, payload, fmt):
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 4, batch
    ts, events, dp_rank, epoch = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 600
    assert dp_rank is None
    assert isinstance(epoch, int) and epoch > 0
    return {"seq": int.from_bytes(seq_bytes, "big"), "epoch": epoch, "events": [normalise(e, fmt) for e in events]}


class Subscriber:
    def __init__(self, cluster):
        self.fmt = cluster.fmt
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(cluster.pub)
        self.batches = []

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()

    def receive(self, timeout):
        if not self.sock.poll(int(timeout * 1000)):
            return False
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC
        self.batches.append(decode(seq, payload, self.fmt))
        return True

    def events(self):
        return [e for b in self.batches for e in b["events"]]

    def stored(self):
        return [e for e in self.events() if e["type"] == "BlockStored"]

    def removed_keys(self):
        return {h for e in self.events() if e["type"] == "BlockRemoved" for h in e["block_hashes"]}

    def drain(self):
        """Takes in every message already received, without waiting."""
        while self.receive(0):
            pass

    def wait_for(self, cond, what):
        """Until cond() holds of what has been received, taking messages in as they come."""
        def received():
            self.drain()
            return cond()

        waiting.wait_for(what, received, timeout=BOUND, detail=lambda: f"got {self.events()!r}")

    def join(self, client):
        """Until the subscription is live: probe keys until one is announced."""
        probe = unique("probe")
        probes = itertools.count()

        def announced():
            if not self.batches:  # nothing seen yet: another probe (one sent too early is lost)
                client.put(probe + str(next(probes)), b"p")
            self.drain()
            return any(e["type"] == "BlockStored" for e in self.events())

        waiting.wait_for("the subscription to see a probe put announced", announced, timeout=BOUND,
                         detail=lambda: f"got {self.events()!r}")


def replay(endpoint, start, fmt, request=None):
    """Asks for every batch from `start`; returns them up to the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        if request is not None:
            sock.send_multipart(request)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        deadline = time.monotonic() + BOUND
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and sock.poll(int(left * 1000)), "replay sent no end marker"
            frames = sock.recv_multipart()
            assert len(frames) == 3 and frames[0] == b"", frames
            if frames[1] == END_SEQ:
                assert frames[2] == b""
                return out
            out.append(decode(frames[1], frames[2], fmt))
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture
def events_cluster(request, monkeypatch):
    monkeypatch.setenv("TIERKV_LOG_LEVEL", "info")  # the bound endpoints are read from the log
    c = EventsCluster(**getattr(request, "param", {}))
    yield c
    c.stop()


@pytest.mark.parametrize("events_cluster", [{"fmt": "array"}, {"fmt": "map"}], indirect=True,
                         ids=["array", "map"])
def test_stored_and_removed_in_order(events_cluster):
    c = events_cluster.client()
    sub = Subscriber(events_cluster)
    try:
        sub.join(c)
        p = unique("put")
        keys = [p + str(i) for i in range(5)]
        # A prefix chain: each page names the previous one as its parent.
        assert c.batch_put(keys, [bytes([i]) * 4096 for i in range(5)],
                           parent_keys=[""] + keys[:-1]) == [None] * 5
        want = {k.encode() for k in keys}
        sub.wait_for(lambda: want <= {h for e in sub.stored() for h in e["block_hashes"]}, "BlockStored per key")
        c.remove(keys[4])
        sub.wait_for(lambda: keys[4].encode() in sub.removed_keys(), "BlockRemoved")

        seqs = [b["seq"] for b in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # one apart, no gap
        assert len({b["epoch"] for b in sub.batches}) == 1
        by_key = {e["block_hashes"][0]: e for e in sub.stored() if len(e["block_hashes"]) == 1}
        for i, k in enumerate(keys):
            e = by_key[k.encode()]
            assert e["parent_block_hash"] == (keys[i - 1].encode() if i else None)
            assert e["token_ids"] == [] and e["block_size"] == 0 and e["lora_id"] is None
            assert e["medium"] == "cpu"
        assert sub.removed_keys() & want == {keys[4].encode()}
        assert [e for e in sub.events() if e["type"] == "BlockRemoved"][0]["medium"] == "cpu"

        text = events_cluster.metrics()
        assert "tierkv_master_kv_events_dropped_total 0" in text
        published = re.search(r"^tierkv_master_kv_events_published_total (\S+)", text, re.M)
        assert published and float(published.group(1)) >= 6, text
        assert re.search(r"^tierkv_master_kv_events_batches_total [1-9]", text, re.M), text
    finally:
        sub.close()
        c.close()


@pytest.mark.parametrize("events_cluster", [{"segment_size": "4mib"}], indirect=True)
def test_eviction_reports_evicted_keys(events_cluster):
    c = events_cluster.client()
    sub = Subscriber(events_cluster)
    try:
        sub.join(c)
        p = unique("evict")
        keys = [p + str(i) for i in range(24)]  # 6 MiB into a 4 MiB segment
        for k in keys:
            c.put(k, b"e" * (256 << 10))
        present = dict(zip(keys, c.batch_exists(keys)))
        evicted = {k.encode() for k, there in present.items() if not there}
        assert evicted, "nothing was evicted"
        sub.wait_for(lambda: evicted <= sub.removed_keys(), "BlockRemoved for every evicted key")
        kept = {k.encode() for k, there in present.items() if there}
        assert not (sub.removed_keys() & kept)
    finally:
        sub.close()
        c.close()


def test_lost_segment_reports_its_objects(events_cluster):
    c = events_cluster.client()
    sub = Subscriber(events_cluster)
    try:
        sub.join(c)
        p = unique("lost")
        keys = [p + str(i) for i in range(8)]
        assert c.batch_put(keys, [b"l" * 4096] * 8) == [None] * 8
        want = {k.encode() for k in keys}
        sub.wait_for(lambda: want <= {h for e in sub.stored() for h in e["block_hashes"]}, "BlockStored")
        events_cluster.daemons[0].kill(signal.SIGKILL)
        events_cluster.wait_gone(0)
        sub.wait_for(lambda: want <= sub.removed_keys(), "BlockRemoved for the lost segment's objects")
    finally:
        sub.close()
        c.close()


def test_replay_from_a_sequence(events_cluster):
    c = events_cluster.client()
    sub = Subscriber(events_cluster)
    try:
        sub.join(c)
        p = unique("replay")
        for i in range(6):  # one put per batch, most likely; at least several batches
            c.put(p + str(i), b"r" * 1024)
        last = (p + "5").encode()
        sub.wait_for(lambda: any(last in e["block_hashes"] for e in sub.stored()), "the last put")
        live = {b["seq"]: b for b in sub.batches}
        n = sorted(live)[len(live) // 2]
        # A malformed request first (a 3-byte "seq"): ignored, the next one answered.
        got = replay(events_cluster.replay, n, events_cluster.fmt, request=[b"", b"bad"])
        assert [b["seq"] for b in got] == list(range(n, n + len(got)))
        assert got and got[-1]["seq"] >= max(live)
        for b in got:
            if b["seq"] in live:
                assert b == live[b["seq"]]
        # From 0: the whole epoch, opening with AllBlocksCleared (nothing was recovered).
        everything = replay(events_cluster.replay, 0, events_cluster.fmt)
        assert everything[0]["seq"] == 0
        assert everything[0]["events"][0]["type"] == "AllBlocksCleared"
    finally:
        sub.close()
        c.close()


def test_restarted_master_has_a_new_epoch(events_cluster):
    first = replay(events_cluster.replay, 0, events_cluster.fmt)
    assert first and first[0]["events"][0] == {"type": "AllBlocksCleared"}
    old_epoch = first[0]["epoch"]
    events_cluster.master.kill(signal.SIGTERM)
    events_cluster.master = Process("tierkv-master", master_args(events_cluster.fmt))
    events_cluster.pub, events_cluster.replay = bound_endpoints(events_cluster.master)
    again = replay(events_cluster.replay, 0, events_cluster.fmt)
    assert again, events_cluster.master.logs()
    assert again[0]["seq"] == 0  # sequence numbers start over with the epoch
    assert again[0]["events"][0] == {"type": "AllBlocksCleared"}
    assert again[0]["epoch"] != old_epoch and again[0]["epoch"] > old_epoch
