#!/usr/bin/env python3
"""Python's batch_put_from / batch_get_into against the C++ client, same run.

Starts a master and one store daemon (build/tools) on loopback, then moves
--pages pages of --page bytes from a registered numpy pool through
tierkv.mooncake_compat (what SGLang and LMCache call) and through the C++
client with no Python between calls (Client.cxx_reference), alternating,
--rounds times each. Prints GB/s of both and their ratio (target >= 0.95).
The _multi_buffers forms move the same pages as two halves each (K and V
of a page from two places), against the same C++ figures.

    PYTHONPATH=build/python /usr/bin/python3 python/bench/bench_batch.py
"""

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from conftest import Cluster  # noqa: E402
from tierkv.mooncake_compat import MooncakeDistributedStore  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--segment-size", default="4gib")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    cluster = Cluster(daemons=1, segment_size=a.segment_size)
    try:
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.master_address) == 0
        cxx = store._client._c  # the same C++ client, called in a C++ loop
        n, size = a.pages, a.page
        pool = np.random.default_rng(1).integers(0, 256, 2 * n * size, dtype=np.uint8)
        base = pool.ctypes.data
        assert store.register_buffer(base, pool.nbytes) == 0
        src = [base + i * size for i in range(n)]
        dst = [base + (n + i) * size for i in range(n)]
        sizes = [size] * n
        # Keys the gets read, for both sides.
        assert store.batch_put_from([f"get-{i}" for i in range(n)], src, sizes) == [0] * n
        for i in range(2):  # warm both paths
            store.batch_get_into([f"get-{i}" for i in range(n)], dst, sizes)
            cxx.cxx_reference("get", "get-", dst, sizes, 1)

        half = size // 2
        src_kv = [[p, p + half] for p in src]
        dst_kv = [[p, p + half] for p in dst]
        kv_sizes = [[half, size - half]] * n
        t = {"py_put": [], "cxx_put": [], "py_get": [], "cxx_get": [], "py_put_mb": [], "py_get_mb": []}
        keys = [f"get-{i}" for i in range(n)]
        def timed(name, call, want):
            t0 = time.perf_counter()
            res = call()
            t[name].append(time.perf_counter() - t0)
            assert res == want, res

        def py_put(r):
            timed("py_put", lambda: store.batch_put_from([f"py-{r}-{i}" for i in range(n)], src, sizes), [0] * n)

        def cxx_put(r):
            t["cxx_put"].append(cxx.cxx_reference("put", f"cxx-{r}-", src, sizes, 1))

        def py_get():
            timed("py_get", lambda: store.batch_get_into(keys, dst, sizes), sizes)

        def py_put_mb(r):
            pk = [f"mb-{r}-{i}" for i in range(n)]
            timed("py_put_mb", lambda: store.batch_put_from_multi_buffers(pk, src_kv, kv_sizes), [0] * n)

        def py_get_mb():
            timed("py_get_mb", lambda: store.batch_get_into_multi_buffers(keys, dst_kv, kv_sizes), sizes)

        def cxx_get():
            t["cxx_get"].append(cxx.cxx_reference("get", "get-", dst, sizes, 1))

        # Rounds alternate which side goes first, so neither always meets a
        # store that has just been emptied (first-touch faults, eviction).
        for r in range(-1, a.rounds):
            steps = [lambda: py_put(r), lambda: cxx_put(r), py_get, cxx_get, lambda: py_put_mb(r), py_get_mb]
            if r % 2:
                steps = [steps[1], steps[0], steps[3], steps[2], steps[5], steps[4]]
            for step in steps:
                step()
            if r < 0:  # the warm-up round is not counted
                for v in t.values():
                    v.clear()
            store.remove_all()
            assert store.batch_put_from(keys, src, sizes) == [0] * n
        gbps = {k: n * size / min(v) / 1e9 for k, v in t.items()}
        out = {"pages": n, "page_bytes": size, "rounds": a.rounds,
               "put_py_GBps": gbps["py_put"], "put_cxx_GBps": gbps["cxx_put"],
               "get_py_GBps": gbps["py_get"], "get_cxx_GBps": gbps["cxx_get"],
               "put_ratio": gbps["py_put"] / gbps["cxx_put"], "get_ratio": gbps["py_get"] / gbps["cxx_get"],
               "multi_put_GBps": gbps["py_put_mb"], "multi_get_GBps": gbps["py_get_mb"],
               "multi_put_ratio": gbps["py_put_mb"] / gbps["cxx_put"],
               "multi_get_ratio": gbps["py_get_mb"] / gbps["cxx_get"]}
        out["target_met"] = min(out["put_ratio"], out["get_ratio"]) >= 0.95
        if a.json:
            print(json.dumps(out))
        else:
            print(f"{n} x {size} bytes, best of {a.rounds}: "
                  f"batch_put_from {out['put_py_GBps']:.2f} GB/s vs C++ {out['put_cxx_GBps']:.2f} "
                  f"({out['put_ratio']:.2f}x); batch_get_into {out['get_py_GBps']:.2f} GB/s vs C++ "
                  f"{out['get_cxx_GBps']:.2f} ({out['get_ratio']:.2f}x); target >= 0.95: "
                  f"{'met' if out['target_met'] else 'MISSED'}; _multi_buffers (two halves a page): put "
                  f"{out['multi_put_GBps']:.2f} GB/s ({out['multi_put_ratio']:.2f}x), get "
                  f"{out['multi_get_GBps']:.2f} GB/s ({out['multi_get_ratio']:.2f}x)")
        store.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
