"""The deployment files under deploy/, checked against the real binaries.

systemd units go through `systemd-analyze verify`; the decode-node launcher
starts real daemons against a real master on loopback; the Kubernetes and
Slurm examples and the env files name only flags the binaries have, with
values they accept; every metric the Grafana dashboard queries is in a live
master's or daemon's /metrics.
"""

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import BIN_DIR, ROOT, Process
from waiting import wait_for

DEPLOY = os.path.join(ROOT, "deploy")
LAUNCH = os.path.join(DEPLOY, "tierkv-node-launch")
MASTER_BIN = os.path.join(BIN_DIR, "tierkv-master")
STORE_BIN = os.path.join(BIN_DIR, "tierkv-store")


def binary_flags(binary):
    """Flag name -> env name, from the binary's --help."""
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20, check=True).stdout
    names = re.findall(r"^  --([a-z0-9-]+) ", out, re.M)
    envs = re.findall(r"env (TIERKV_[A-Z0-9_]+)", out)
    return dict(zip(names, envs))


def print_config(binary, env):
    """The binary's resolved configuration under `env` (only TIERKV_* set)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    r = subprocess.run([binary, "--print-config"], capture_output=True, text=True, timeout=20, env={**base, **env})
    assert r.returncode == 0, f"{os.path.basename(binary)} refused {env}: {r.stderr}"
    return dict(line.split(" = ", 1) for line in r.stdout.splitlines() if " = " in line)


def read_env_file(path):
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                k, v = line.split("=", 1)
                env[k] = v
    return env


def http_get(port, path, timeout=5):
    """(status, body); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def free_port_run(n):
    """A base port with n consecutive free ports above it (bound and released)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


def alive(pid):
    """Running and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().split("\0")


@pytest.fixture
def master():
    m = Process("tierkv-master", ["--rpc-port=0", "--http-port=0", "--segment-ttl=2s", "--check-interval=100ms"])
    yield m
    m.kill(signal.SIGTERM)


def live_segments(master):
    status, body = http_get(master.http_port, "/v1/segments")
    assert status == 200, body
    return sorted(s["name"] for s in json.loads(body) if s.get("state") == "live")


# --- systemd ---------------------------------------------------------------

def test_systemd_units_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    units = {}
    for path in glob.glob(os.path.join(DEPLOY, "systemd", "*.service")):
        with open(path) as f:
            text = f.read()
        assert "Type=notify" in text, path
        # Installed paths in the files; the build's binaries for verify,
        # which checks that ExecStart is executable.
        assert re.search(r"^ExecStart=/usr/local/bin/tierkv-(master|store)\b", text, re.M), path
        text = re.sub(r"/usr/local/bin/(tierkv-[a-z]+)", lambda m: os.path.join(BIN_DIR, m.group(1)), text)
        (tmp_path / os.path.basename(path)).write_text(text)
        units[os.path.basename(path)] = text
    assert set(units) == {"tierkv-master.service", "tierkv-store@.service"}
    store = units["tierkv-store@.service"]
    for want in ("LimitMEMLOCK=infinity", "Restart=on-failure", "EnvironmentFile=/etc/tierkv/store-%i.env",
                 "--port=%i", "NoNewPrivileges=yes"):
        assert want in store, want
    assert "EnvironmentFile=/etc/tierkv/master.env" in units["tierkv-master.service"]
    r = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "tierkv-master.service"),
                        str(tmp_path / "tierkv-store@8800.service")],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    # verify exits 0 on unknown keys too, only warning: any output fails.
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_env_files_name_real_flags_with_accepted_values():
    d = os.path.join(DEPLOY, "systemd")
    master_envs = set(binary_flags(MASTER_BIN).values())
    store_envs = set(binary_flags(STORE_BIN).values())
    menv = read_env_file(os.path.join(d, "master.env"))
    assert set(menv) <= master_envs, set(menv) - master_envs
    cfg = print_config(MASTER_BIN, menv)
    assert cfg["rpc-port"] == "50051" and cfg["http-port"] == "8080"
    senv = {**read_env_file(os.path.join(d, "store.env")), **read_env_file(os.path.join(d, "store-8800.env"))}
    assert set(senv) <= store_envs, set(senv) - store_envs
    cfg = print_config(STORE_BIN, senv)
    assert cfg["mlock"] == "true" and cfg["rdma-devices"] == "mlx5_0" and cfg["numa-node"] == "0"
    # The daemons' master and metadata are the master's ports.
    assert senv["TIERKV_MASTER"].endswith(":" + menv["TIERKV_RPC_PORT"])
    assert senv["TIERKV_METADATA"].endswith(":" + menv["TIERKV_HTTP_PORT"])


# --- the decode-node launcher -----------------------------------------------

def launcher_pids(output):
    return [int(p) for p in re.findall(r"started daemon \d+ .*? pid (\d+):", output)]


def test_launcher_starts_daemons_waits_for_ready_and_forwards_sigterm(master, tmp_path):
    base = free_port_run(2)
    cmd = [LAUNCH, "--count=2", f"--base-port={base}", "--http-base-port=0", "--rdma-devices=mlx5_0,mlx5_1",
           "--numa-nodes=0,0", f"--master=127.0.0.1:{master.port}", f"--metadata=http://127.0.0.1:{master.http_port}",
           "--segment-size=32mib", "--listen=127.0.0.1", "--ready-timeout=60", f"--log-dir={tmp_path}",
           f"--ready-file={tmp_path}/ready", f"--store-bin={STORE_BIN}", "--", "--heartbeat-interval=100ms"]
    out_path = tmp_path / "launch.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for("the ready file", lambda: os.path.exists(tmp_path / "ready") or proc.poll() is not None, timeout=60)
        text = out_path.read_text()
        assert proc.poll() is None, text
        assert "ready: 2 daemons" in text, text
        pids = launcher_pids(text)
        assert len(pids) == 2, text
        # Each daemon has its port, NIC and NUMA node.
        for i, pid in enumerate(pids):
            args = cmdline(pid)
            assert f"--port={base + i}" in args and f"--rdma-devices=mlx5_{i}" in args and "--numa-node=0" in args
        # Both /ready, both segments live at the master.
        http_ports = [int(re.search(r"http=(\d+)", (tmp_path / f"store-{base + i}.out").read_text()).group(1))
                      for i in range(2)]
        for hp in http_ports:
            assert http_get(hp, "/ready") == (200, "ready\n")
        assert live_segments(master) == sorted(f"127.0.0.1:{base + i}" for i in range(2))
        # SIGTERM is forwarded: both daemons unmount and exit, then the launcher.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0, out_path.read_text()
        assert not any(alive(p) for p in pids)
        assert live_segments(master) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launcher_fails_naming_the_daemon_that_cannot_start_and_leaves_nothing(master, tmp_path):
    base = free_port_run(2)
    # Daemon 1 asks for a NUMA node this host does not have: it exits 2.
    cmd = [LAUNCH, "--count=2", f"--base-port={base}", "--http-base-port=0", "--numa-nodes=0,999",
           f"--master=127.0.0.1:{master.port}", f"--metadata=http://127.0.0.1:{master.http_port}",
           "--segment-size=32mib", "--listen=127.0.0.1", "--ready-timeout=60", f"--log-dir={tmp_path}",
           f"--store-bin={STORE_BIN}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAILED: daemon 1 (port {base + 1}, numa 999) exited with status 2 before it was ready" in r.stderr, r.stderr
    assert "--numa-node 999" in r.stderr  # the daemon's own reason, from its log
    pids = launcher_pids(r.stdout)
    assert len(pids) == 2, r.stdout
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
    wait_for("daemon 0 to unmount", lambda: live_segments(master) == [], timeout=10)


def test_launcher_times_out_naming_the_daemon_that_is_not_ready(tmp_path):
    base = free_port_run(1)
    closed = free_port_run(2)  # nothing listens there: the daemon never mounts
    cmd = [LAUNCH, "--count=1", f"--base-port={base}", "--http-base-port=0", f"--master=127.0.0.1:{closed}",
           f"--metadata=http://127.0.0.1:{closed + 1}", "--segment-size=32mib", "--listen=127.0.0.1",
           "--ready-timeout=2", "--stop-timeout=10", f"--log-dir={tmp_path}", f"--store-bin={STORE_BIN}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAILED: daemon 0 (port {base}) not ready after 2s" in r.stderr, r.stderr
    pids = launcher_pids(r.stdout)
    assert len(pids) == 1 and not alive(pids[0])


def test_launcher_refuses_mismatched_lists():
    r = subprocess.run([LAUNCH, "--count=2", "--rdma-devices=mlx5_0", f"--store-bin={STORE_BIN}"],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 2 and "--rdma-devices names 1 NICs for 2 daemons" in r.stderr, r.stderr


# --- Kubernetes and Slurm ---------------------------------------------------

def k8s_docs():
    yaml = pytest.importorskip("yaml")
    docs = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, "k8s", "*.yaml"))):
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def test_k8s_manifests_parse_and_match_the_binaries():
    docs = k8s_docs()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for want in [("Deployment", "tierkv-master"), ("Service", "tierkv-master"), ("DaemonSet", "tierkv-store"),
                 ("Service", "tierkv-store"), ("ServiceMonitor", "tierkv")]:
        assert want in kinds, want
    flags = {"tierkv-master": binary_flags(MASTER_BIN), "tierkv-store": binary_flags(STORE_BIN)}
    binaries = {"tierkv-master": MASTER_BIN, "tierkv-store": STORE_BIN}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    container_ports = {}  # workload name -> {port name: number}
    store_containers = 0
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        ports = container_ports.setdefault(w["metadata"]["name"], {})
        for c in spec["containers"]:
            binary = os.path.basename(c["command"][0])
            assert binary in flags, c["command"]
            env = {e["name"]: e.get("value", "127.0.0.1") for e in c["env"]}  # valueFrom: an address
            assert set(env) <= set(flags[binary].values()), set(env) - set(flags[binary].values())
            cfg = print_config(binaries[binary], env)
            http = int(cfg["http-port"])
            named = {p["name"]: p["containerPort"] for p in c["ports"]}
            ports.update(named)
            if binary == "tierkv-master":
                assert sorted(named.values()) == sorted([int(cfg["rpc-port"]), http])
            else:
                store_containers += 1
                assert sorted(named.values()) == sorted([int(cfg["port"]), http])
                # Memory: hugepages equal to the segment, and a memory limit.
                res = c["resources"]
                assert res["limits"]["hugepages-2Mi"] == res["requests"]["hugepages-2Mi"]
                assert cfg["hugepages"] == "true"
                gib = int(res["limits"]["hugepages-2Mi"].rstrip("Gi"))
                assert cfg["segment-size"] in (f"{gib}gib", str(gib << 30)), cfg["segment-size"]
                assert "memory" in res["limits"]
                assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
                assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
                # The master it dials is the master Service's ports.
                svc = {p["name"]: p["port"] for p in services["tierkv-master"]["spec"]["ports"]}
                assert cfg["master"] == f"tierkv-master:{svc['rpc']}"
                assert cfg["metadata"] == f"http://tierkv-master:{svc['http']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert get["path"] in ("/ready", "/health")
                port = named.get(get["port"], get["port"])
                assert port == http, (c["name"], probe, get)
        assert store_containers or w["kind"] == "Deployment"
    assert store_containers >= 2
    # Services point at ports the pods have; the ServiceMonitor at Services' ports.
    by_selector = {"tierkv-master": "tierkv-master", "tierkv-store": "tierkv-store"}
    svc_port_names = set()
    for name, svc in services.items():
        pod_ports = container_ports[by_selector[svc["spec"]["selector"]["app.kubernetes.io/name"]]]
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert (target in pod_ports) or (target in pod_ports.values()), (name, p)
            svc_port_names.add(p["name"])
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    for ep in monitor["spec"]["endpoints"]:
        assert ep["path"] == "/metrics" and ep["port"] in svc_port_names, ep


def test_slurm_example_uses_real_flags():
    path = os.path.join(DEPLOY, "slurm", "tierkv-decode.sbatch")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    text = open(path).read()
    master_flags = set(binary_flags(MASTER_BIN))
    store_flags = set(binary_flags(STORE_BIN))
    launch_help = subprocess.run([LAUNCH, "--help"], capture_output=True, text=True, timeout=20).stdout
    launch_flags = set(re.findall(r"^  --([a-z-]+)", launch_help, re.M))
    master_cmd = re.search(r'tierkv-master" (.*?)&$', text, re.S | re.M).group(1)
    for f in re.findall(r"--([a-z-]+)=", master_cmd):
        assert f in master_flags, f
    launch_cmd = re.search(r'"\$LAUNCH" (.*?)&$', text, re.S | re.M).group(1)
    launch_part, store_part = launch_cmd.split(" -- ", 1)
    for f in re.findall(r"--([a-z-]+)=", launch_part):
        assert f in launch_flags, f
    for f in re.findall(r"--([a-z-]+)", store_part.split(">")[0]):
        assert f in store_flags, f
    # Gated: the workers start only after the live-segment wait.
    assert text.index('"state":"live"') < text.index('bash -c "$WORKER_CMD"')


# --- Grafana ----------------------------------------------------------------

def exposed_names(body):
    names = set()
    for line in body.splitlines():
        if line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


def test_grafana_dashboard_queries_only_live_metric_names(tmp_path):
    with open(os.path.join(DEPLOY, "grafana", "tierkv.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    queried = set()
    for e in exprs:
        queried |= set(re.findall(r"\btierkv_[a-z0-9_]+", e))
    for want in ("tierkv_master_query_pages_asked_total", "tierkv_master_query_pages_found_total",
                 "tierkv_segment_capacity_bytes", "tierkv_segment_used_bytes", "tierkv_master_evictions_total",
                 "tierkv_store_client_bytes_total", "tierkv_master_rpc_errors_total"):
        assert want in queried, want
    m = Process("tierkv-master", ["--rpc-port=0", "--http-port=0", "--check-interval=100ms"])
    d = Process("tierkv-store", [f"--master=127.0.0.1:{m.port}", f"--metadata=http://127.0.0.1:{m.http_port}",
                                 "--segment-size=32mib", "--port=0", "--http-port=0", "--heartbeat-interval=100ms"])
    try:
        wait_for("the daemon to mount", lambda: http_get(d.http_port, "/ready")[0] == 200, timeout=20)
        # A put and a get, so the per-client query counters have series.
        src = tmp_path / "value"
        src.write_bytes(os.urandom(4096))
        ctl = [os.path.join(BIN_DIR, "tierkvctl"), f"--master=127.0.0.1:{m.port}",
               f"--http=127.0.0.1:{m.http_port}"]
        for args in (["put", "dash-key", str(src)], ["get", "dash-key", str(tmp_path / "back")]):
            r = subprocess.run(ctl + args, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
        live = exposed_names(http_get(m.http_port, "/metrics")[1]) | exposed_names(http_get(d.http_port, "/metrics")[1])
        missing = sorted(n for n in queried if n not in live)
        assert not missing, f"queried but not exposed: {missing}\nexposed: {sorted(live)}"
    finally:
        d.kill(signal.SIGTERM)
        m.kill(signal.SIGTERM)
