"""Python callers of a high-availability group: two masters elected through a
real etcd on loopback, daemons and clients given only etcd://. The leader
is killed under Mooncake-API puts; every acknowledged put reads back through
the new leader, and Client.http_get finds it."""

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

from conftest import BIN_DIR, Process, unique
from waiting import wait_for
from tierkv import Client
from tierkv.mooncake_compat import MooncakeDistributedStore

ETCD = "/usr/bin/etcd"
pytestmark = pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason=f"{ETCD} is not installed (Debian etcd-server)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port, path, timeout=1.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


class Group:
    """etcd and two masters (127.0.0.1, ports of their own), cluster id `test`."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tierkv-py-ha-")
        self.logs = []
        self.daemons = []
        client, peer = free_port(), free_port()
        self.etcd = self._spawn("etcd", [ETCD, "--name", "m0", "--data-dir", f"{self.dir}/etcd",
                                         "--listen-client-urls", f"http://127.0.0.1:{client}",
                                         "--advertise-client-urls", f"http://127.0.0.1:{client}",
                                         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                         "--initial-cluster", f"m0=http://127.0.0.1:{peer}",
                                         "--heartbeat-interval", "50", "--election-timeout", "500",
                                         "--log-level", "warn"])
        wait_for("etcd to be healthy", lambda: get_json(client, "/health").get("health") == "true", timeout=20,
                 ignore=(OSError,), detail=self.describe)
        self.endpoint = f"127.0.0.1:{client}"
        self.master = f"etcd://{self.endpoint}/test"
        self.rpc = [free_port(), free_port()]
        self.http = [free_port(), free_port()]
        self.masters = [self._start_master(i) for i in range(2)]

    def _spawn(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        self.logs.append(log.name)
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)

    def _start_master(self, i):
        return self._spawn(f"master{i}", [os.path.join(BIN_DIR, "tierkv-master"), f"--etcd={self.endpoint}",
                                          "--cluster-id=test", "--listen=127.0.0.1",
                                          f"--advertise=127.0.0.1:{self.rpc[i]}", f"--rpc-port={self.rpc[i]}",
                                          f"--http-port={self.http[i]}", f"--data-dir={self.dir}/master{i}",
                                          "--ha-lease-ttl=2s", "--segment-ttl=10s", "--check-interval=100ms"])

    def role(self, i):
        return get_json(self.http[i], "/v1/ha").get("role")

    def leader(self, timeout=20, besides=None):
        """The index of the master that serves as leader (not `besides`)."""
        found = []

        def elected():
            for i in range(2):
                if i != besides and self.masters[i].poll() is None and self.role(i) == "leader":
                    found.append(i)
                    return True
            return False

        wait_for("a leader", elected, timeout=timeout, ignore=(OSError,), detail=self.describe)
        return found[0]

    def synced(self, i):
        """Whether master i leads semi-synchronously with a standby caught up."""
        h = get_json(self.http[i], "/v1/ha")
        return h.get("sync") == "semi-sync" and any(
            not s.get("snapshotting", True) and s.get("lag_batches", 1) == 0 and s.get("last_seen_seconds_ago", 99) < 1
            for s in h.get("standbys", []))

    def add_daemon(self, n):
        # No --metadata: the daemon asks the masters for it, and again when they move.
        d = Process("tierkv-store", [f"--master={self.master}", "--segment-size=64mib", "--port=0",
                                     "--http-port=0", "--heartbeat-interval=200ms", f"--name=daemon-{n}"])
        self.daemons.append(d)
        return d

    def live_segments(self, i):
        return sum(s.get("state") == "live" for s in get_json(self.http[i], "/v1/segments"))

    def describe(self):
        out = []
        for path in self.logs:
            with open(path, errors="replace") as f:
                out.append(f"--- {os.path.basename(path)}\n{f.read()[-3000:]}")
        for i, d in enumerate(self.daemons):
            out.append(f"--- daemon {i}\n{d.logs()}")
        return "\n".join(out)

    def stop(self):
        for d in self.daemons:
            d.kill(signal.SIGTERM)
        for p in self.masters + [self.etcd]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def group():
    g = Group()
    yield g
    g.stop()


def test_mooncake_api_given_etcd_follows_a_killed_leader(group):
    leader = group.leader()
    group.add_daemon(0)
    wait_for("the daemon to mount", lambda: group.live_segments(leader) == 1, timeout=20, ignore=(OSError,),
             detail=group.describe)
    wait_for("the standby to catch up", lambda: group.synced(leader), timeout=20, ignore=(OSError,),
             detail=group.describe)

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", group.master) == 0
    client = Client(group.master)
    try:
        assert json.loads(client.http_get("/v1/ha"))["role"] == "leader"
        prefix = unique("ha")
        acked = {}
        for i in range(40):
            k, v = f"{prefix}-{i}", os.urandom(4096 + i)
            assert store.put(k, v) == 0, group.describe()
            acked[k] = v
        assert group.synced(leader), "the leader wrote without its standby\n" + group.describe()

        group.masters[leader].kill()
        group.masters[leader].wait()
        killed = time.monotonic()
        new = group.leader(besides=leader)
        assert new != leader
        # Puts go on: each either fails (during the failover) or is acknowledged.
        numbers = itertools.count(len(acked))
        first_ack = None

        def put_until_refused():
            """Puts until one is refused (False: poll again) or 60 are acknowledged."""
            nonlocal first_ack
            while len(acked) < 60:
                i = next(numbers)
                k, v = f"{prefix}-{i}", os.urandom(4096 + i)
                if store.put(k, v) != 0:
                    return False
                acked[k] = v
                first_ack = first_ack or time.monotonic() - killed
            return True

        wait_for("60 puts acknowledged, the last 20 after the leader was killed", put_until_refused, timeout=30,
                 detail=lambda: f"{len(acked)} acknowledged\n{group.describe()}")
        assert first_ack is not None, "no put acknowledged after the leader was killed\n" + group.describe()
        print(f"first put acknowledged {first_ack * 1000:.0f} ms after the leader was killed")

        # Everything acknowledged, before and after, reads back byte-identical.
        for k, v in acked.items():
            assert store.get(k) == v, k
        # The client's HTTP reads follow too: the new leader answers.
        ha = json.loads(client.http_get("/v1/ha"))
        assert ha["role"] == "leader" and ha["leader"] == f"127.0.0.1:{group.rpc[new]}"
        assert client.metadata == f"http://127.0.0.1:{group.http[new]}"
    finally:
        client.close()
        store.close()
