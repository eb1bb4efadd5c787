"""Fixtures: a real tierkv-master and tierkv-store daemons on loopback.

Binaries come from TIERKV_BIN_DIR (ctest sets it to build/tools). Every
process binds port 0 and prints `listening ...` as its first stdout line,
which is how the fixture learns its ports. Every wait is a bounded poll of
its condition through waiting.wait_for (STYLE.md practice 17).
"""

import json
import os
import re
import signal
import ssl
import subprocess
import tempfile
import threading
import urllib.request

import pytest

from waiting import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN_DIR = os.environ.get("TIERKV_BIN_DIR", os.path.join(ROOT, "build", "tools"))


class Process:
    """A child binary; stderr goes to a file shown when a test fails."""

    def __init__(self, name, args):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"tierkv-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([os.path.join(BIN_DIR, name)] + args, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        line = self._first_line(timeout=20)
        m = re.match(r"listening (\w+)=(\d+) http=(\d+)", line or "")
        if not m:
            self.kill()
            raise RuntimeError(f"{name} did not start: {line!r}\n{self.logs()}")
        self.port = int(m.group(2))
        self.http_port = int(m.group(3))
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def _first_line(self, timeout):
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return out[0].strip() if out else None

    def alive(self):
        return self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        if self.alive():
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def logs(self):
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]


class Cluster:
    """A master and `daemons` store daemons on 127.0.0.1."""

    daemon_args = ()  # extra daemon flags
    token = ""  # the bearer token the fixture's own HTTP reads present
    ca = None  # a CA: the master serves TLS (--tls-cert) under a certificate it signs

    def __init__(self, daemons=2, segment_size="256mib", master_args=(), daemon_args=(), token="", tls_ca=None):
        self.segment_size = segment_size
        self.daemon_args = list(daemon_args)
        self.token = token
        self.ca = tls_ca
        self.master = Process("tierkv-master", ["--rpc-port=0", "--http-port=0", "--segment-ttl=1s",
                                                "--check-interval=100ms"] + list(master_args))
        self.daemons = []
        for i in range(daemons):
            self.add_daemon(i)
        self.wait_live(daemons)

    @property
    def master_address(self):
        return f"127.0.0.1:{self.master.port}"

    @property
    def metadata_url(self):
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.master.http_port}"

    def add_daemon(self, i):
        d = Process("tierkv-store", [f"--master={self.master_address}", f"--metadata={self.metadata_url}",
                                     f"--segment-size={self.segment_size}", "--port=0", "--http-port=0",
                                     "--heartbeat-interval=200ms", f"--name=daemon-{i}"] + list(self.daemon_args))
        self.daemons.append(d)
        return d

    def segments(self):
        req = urllib.request.Request(self.metadata_url + "/v1/segments")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        context = ssl.create_default_context(cafile=self.ca) if self.ca else None
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
            return json.loads(r.read())

    def wait_live(self, n, timeout=20):
        """Until exactly n segments are live at the master."""
        live = []

        def n_live():
            live.append(sum(s.get("state") == "live" for s in self.segments()))
            return live[-1] == n

        wait_for(f"{n} segments live", n_live, timeout=timeout, ignore=(OSError,),
                 detail=lambda: f"last seen: {live[-1] if live else 'no answer'} live\n{self.logs()}")

    def wait_gone(self, i, timeout=20):
        """Until daemon i's segment has left the master's live set."""
        wait_for(f"daemon-{i} to leave the live set",
                 lambda: not any(s.get("name") == f"daemon-{i}" and s.get("state") == "live"
                                 for s in self.segments()),
                 timeout=timeout, detail=self.logs)

    def logs(self):
        out = "--- master\n" + self.master.logs()
        for i, d in enumerate(self.daemons):
            out += f"\n--- daemon {i}\n" + d.logs()
        return out

    def stop(self):
        for d in self.daemons:
            d.kill(signal.SIGTERM)
        self.master.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


@pytest.fixture
def fresh_cluster():
    """A cluster of its own, for tests that kill processes."""
    c = Cluster()
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    import tierkv
    c = tierkv.Client(cluster.master_address, cluster.metadata_url, transfer_timeout=10)
    c.remove_all(force=True)
    yield c
    c.close()


@pytest.fixture
def store(cluster):
    """A MooncakeDistributedStore over the module's cluster, emptied first."""
    from tierkv.mooncake_compat import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master_address) == 0
    s.remove_all(force=True)
    yield s
    s.close()


def unique(prefix):
    """A key prefix no other test uses."""
    unique.n += 1
    return f"{prefix}-{os.getpid()}-{unique.n}-"


unique.n = 0


def pytest_sessionfinish(session, exitstatus):
    # No tests collected (pytest's exit status 5) is a failure here, never a pass.
    if session.testscollected == 0:
        session.exitstatus = 1
