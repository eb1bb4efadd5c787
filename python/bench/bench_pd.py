#!/usr/bin/env python3
"""Python's batch_transfer_sync_write (tierkv.mooncake_engine, what SGLang's
and vLLM's Mooncake P/D backends call) against the C++ engine moving the
same entries with no Python between calls, in the same run.

Two engines in peer mode in this process stand for prefill and decode, each
with a layer-major KV pool (numpy, registered): 61 layers, 1,152 bytes per
token per layer (MLA 576 x bf16), 64-token pages. One request of --tokens
tokens is one call with one entry per page per layer, its pages scattered at
decode, as SGLang sends a chunk. Python and C++ alternate, --rounds each.
Prints GB/s of both and their ratio (target >= 0.95).

    PYTHONPATH=build/python /usr/bin/python3 python/bench/bench_pd.py --tokens 4096
"""

import argparse
import json
import os
import time

import numpy as np

from tierkv.mooncake_engine import TransferEngine

LAYERS, TOKEN_BYTES, PAGE_TOKENS = 61, 576 * 2, 64
PAGE_BYTES = PAGE_TOKENS * TOKEN_BYTES


def engine(pool):
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert te.register_memory(pool.ctypes.data, pool.nbytes) == 0
    return te


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if "MC_FORCE_TCP" not in os.environ:
        os.environ["MC_FORCE_TCP"] = "1"  # numpy memory has no memfd: tcp, as between nodes
    pages = (a.tokens + PAGE_TOKENS - 1) // PAGE_TOKENS
    layer_bytes = pages * PAGE_BYTES
    prefill_pool = np.full(LAYERS * layer_bytes, 0x61, dtype=np.uint8)
    decode_pool = np.zeros(LAYERS * layer_bytes, dtype=np.uint8)
    prefill, decode = engine(prefill_pool), engine(decode_pool)
    session = f"127.0.0.1:{decode.get_rpc_port()}"
    srcs, dsts, lens = [], [], []
    for layer in range(LAYERS):
        for p in range(pages):
            srcs.append(prefill_pool.ctypes.data + layer * layer_bytes + p * PAGE_BYTES)
            dsts.append(decode_pool.ctypes.data + layer * layer_bytes + (pages - 1 - p) * PAGE_BYTES)
            lens.append(PAGE_BYTES)
    total = sum(lens)
    py_s = cxx_s = 0.0
    for _ in range(a.rounds):
        start = time.perf_counter()
        assert prefill.batch_transfer_sync_write(session, srcs, dsts, lens) == 0
        py_s += time.perf_counter() - start
        took = prefill._engine.cxx_reference(session, 1, srcs, dsts, lens, 1, 30.0)
        assert took >= 0
        cxx_s += took
    py = total * a.rounds / py_s / 1e9
    cxx = total * a.rounds / cxx_s / 1e9
    out = {"tokens": a.tokens, "entries": len(srcs), "bytes": total, "python_GBps": py, "cxx_GBps": cxx,
           "ratio": py / cxx, "target_ratio": 0.95}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{a.tokens} tokens, {len(srcs)} entries, {total / 1e6:.1f} MB per call: Python {py:.2f} GB/s, "
              f"C++ {cxx:.2f} GB/s, ratio {py / cxx:.2f} (target >= 0.95)")


if __name__ == "__main__":
    main()
