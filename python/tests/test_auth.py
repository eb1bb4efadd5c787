"""A master running --auth token, reached from Python as the engines reach
it: tierkv.Client with a token or a token file, Mooncake's store API with
TIERKV_TOKEN_FILE, and a caller without a token, refused with the reason."""

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request

import pytest

import tierkv
from conftest import Cluster
from waiting import wait_for

DAEMON = "daemon-token-0a1b2c3d4e5f"
CLIENT = "client-token-0a1b2c3d4e5f"
ADMIN = "admin-token-0a1b2c3d4e5f6"


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    (d / "tokens").write_text(f"{DAEMON} decode-0 daemon\n{CLIENT} sglang-0 client\n{ADMIN} ops admin\n")
    (d / "daemon.token").write_text(DAEMON + "\n")
    (d / "client.token").write_text("# the worker's token\n" + CLIENT + "\n")
    c = Cluster(daemons=1, segment_size="64mib", master_args=["--auth=token", f"--token-file={d / 'tokens'}"],
                daemon_args=["--auth=token", f"--token-file={d / 'daemon.token'}"], token=CLIENT)
    c.client_token_file = str(d / "client.token")
    yield c
    c.stop()


def test_a_token_opens_puts_and_gets(auth_cluster):
    # No metadata URL: discovered from the master, with the token.
    c = tierkv.Client(auth_cluster.master_address, token=CLIENT, transfer_timeout=10)
    try:
        assert c.metadata == auth_cluster.metadata_url
        c.put("py-auth-1", b"x" * 5000)
        assert bytes(c.get("py-auth-1")) == b"x" * 5000
    finally:
        c.close()
    c = tierkv.Client(auth_cluster.master_address, auth_cluster.metadata_url,
                      token_file=auth_cluster.client_token_file)
    try:
        assert bytes(c.get("py-auth-1")) == b"x" * 5000
        with pytest.raises(tierkv.PermissionDenied, match="needs admin"):
            c.remove_all(force=True)
    finally:
        c.close()


def test_no_token_or_a_wrong_one_is_refused_with_the_reason(auth_cluster):
    with pytest.raises(tierkv.Unauthenticated, match="no token"):
        tierkv.discover_metadata(auth_cluster.master_address)
    c = tierkv.Client(auth_cluster.master_address, auth_cluster.metadata_url)
    try:
        with pytest.raises(tierkv.Unauthenticated, match="no token"):
            c.put("py-auth-2", b"y" * 100)
    finally:
        c.close()
    c = tierkv.Client(auth_cluster.master_address, auth_cluster.metadata_url, token=DAEMON)
    try:
        with pytest.raises(tierkv.PermissionDenied, match="'decode-0' has role daemon"):
            c.put("py-auth-2", b"y" * 100)
    finally:
        c.close()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(auth_cluster.metadata_url + "/v1/stats", timeout=5)
    assert e.value.code == 401
    with pytest.raises(tierkv.InvalidArgument, match="cannot read token file"):
        tierkv.Client(auth_cluster.master_address, auth_cluster.metadata_url, token_file="/nonexistent/token")
    assert auth_cluster.master.alive()


def test_mooncake_store_api_reads_the_token_file_from_the_environment(auth_cluster, monkeypatch):
    from tierkv.mooncake_compat import MooncakeDistributedStore
    monkeypatch.setenv("TIERKV_TOKEN_FILE", auth_cluster.client_token_file)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", auth_cluster.master_address) == 0
    try:
        assert s.put("py-auth-mc", b"z" * 3000) == 0
        assert s.get("py-auth-mc") == b"z" * 3000
        assert s.is_exist("py-auth-mc") == 1
    finally:
        s.close()


def test_a_daemon_with_a_refused_token_exits_saying_why(auth_cluster, tmp_path):
    from conftest import BIN_DIR
    wrong = tmp_path / "wrong.token"
    wrong.write_text(CLIENT + "\n")  # a client's token: no daemon role
    r = subprocess.run([os.path.join(BIN_DIR, "tierkv-store"), f"--master={auth_cluster.master_address}",
                        f"--metadata={auth_cluster.metadata_url}", "--segment-size=16mib", "--port=0",
                        "--http-port=0", "--name=intruder", f"--token-file={wrong}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "refused" in r.stderr and "'sglang-0' has role client, needs daemon,admin" in r.stderr, r.stderr
    assert not any(s["name"] == "intruder" for s in auth_cluster.segments())
    assert auth_cluster.master.alive()


def ready(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_revoked_daemon_token_unreadies_it_with_the_reason_and_a_restored_one_remounts(tmp_path):
    tokens = tmp_path / "tokens"
    granted = f"{DAEMON} decode-0 daemon\n{CLIENT} sglang-0 client\n"
    tokens.write_text(granted)
    (tmp_path / "daemon.token").write_text(DAEMON + "\n")
    c = Cluster(daemons=1, segment_size="32mib", master_args=["--auth=token", f"--token-file={tokens}"],
                daemon_args=[f"--token-file={tmp_path / 'daemon.token'}"], token=CLIENT)
    try:
        port = c.daemons[0].http_port
        assert ready(port)[0] == 200
        tokens.write_text(f"{CLIENT} sglang-0 client\n")  # the daemon's token revoked
        c.master.proc.send_signal(signal.SIGHUP)
        wait_for("the daemon to lose its mount",
                 lambda: ready(port)[0] == 503 and "not mounted: UNAUTHENTICATED" in ready(port)[1], timeout=15)
        assert "the token is not accepted" in ready(port)[1], ready(port)[1]
        assert c.daemons[0].alive() and c.master.alive()
        tokens.write_text(granted)
        c.master.proc.send_signal(signal.SIGHUP)
        wait_for("the daemon to mount again", lambda: ready(port)[0] == 200, timeout=15)
        c.wait_live(1)
    finally:
        c.stop()


def _openssl(cwd, *args):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    """A master serving gRPC over TLS (certificates made here by openssl),
    with tokens, two of them in tenants."""
    d = tmp_path_factory.mktemp("tls")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl(d, "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=py-ca")
    _openssl(d, "req", *key, "-keyout", "master.key", "-out", "master.csr", "-subj", "/CN=master")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(d, "x509", "-req", "-in", "master.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-out", "master.pem", "-extfile", "san.ext")
    (d / "tokens").write_text(f"{DAEMON} decode-0 daemon\n{CLIENT} sglang-0 client tenant=team-a\n"
                              f"{ADMIN} ops admin tenant=team-b\n")
    (d / "daemon.token").write_text(DAEMON + "\n")
    c = Cluster(daemons=1, segment_size="64mib",
                master_args=["--auth=token", f"--token-file={d / 'tokens'}", f"--tls-cert={d / 'master.pem'}",
                             f"--tls-key={d / 'master.key'}"],
                daemon_args=[f"--token-file={d / 'daemon.token'}", f"--tls-ca={d / 'ca.pem'}"], token=CLIENT,
                tls_ca=str(d / "ca.pem"))
    yield c
    c.stop()


def test_tls_and_tenants_from_python(tls_cluster, monkeypatch):
    # The CA by argument, metadata discovered over TLS.
    a = tierkv.Client(tls_cluster.master_address, token=CLIENT, tls_ca=tls_cluster.ca, transfer_timeout=10)
    # The CA from the environment, as Mooncake's API and SGLang get it.
    monkeypatch.setenv("TIERKV_TLS_CA", tls_cluster.ca)
    b = tierkv.Client(tls_cluster.master_address, tls_cluster.metadata_url, token=ADMIN, transfer_timeout=10)
    try:
        a.put("py-tenant-key", b"from team-a")
        b.put("py-tenant-key", b"from team-b")
        assert bytes(a.get("py-tenant-key")) == b"from team-a"
        assert bytes(b.get("py-tenant-key")) == b"from team-b"
        assert b.batch_exists(["py-tenant-key", "only-a"]) == [True, False]
        a.put("only-a", b"1")
        assert b.batch_exists(["only-a"]) == [False]
        assert b.remove_all(force=True) == 1  # team-b's admin removes team-b's objects only
        assert bytes(a.get("py-tenant-key")) == b"from team-a"
        # The master's HTTP port is HTTPS too: the discovered URL says so, and
        # the client reads it with its CA.
        assert a.metadata.startswith("https://") and a.metadata == tls_cluster.metadata_url
        assert json.loads(a.http_get("/v1/objects/py-tenant-key"))["size"] > len(b"from team-a")
        with pytest.raises(OSError):
            urllib.request.urlopen(tls_cluster.metadata_url.replace("https", "http") + "/health", timeout=5)
    finally:
        a.close()
        b.close()
    # Without the CA the master cannot be reached, and the error says what to check.
    monkeypatch.delenv("TIERKV_TLS_CA")
    with pytest.raises(tierkv.DeadlineExceeded, match="give --tls-ca"):
        tierkv.Client(tls_cluster.master_address, tls_cluster.metadata_url, token=CLIENT, rpc_timeout=1.0).put(
            "x", b"y")
