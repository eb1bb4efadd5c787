"""A peer process for test_mooncake_engine.py: a Mooncake-compatible
TransferEngine (through python/compat's mooncake.engine, as SGLang imports
it) with registered memory, driven by JSON lines on stdin.

argv: [local_hostname] [size]. Prints {"session", "addr", "size"} once
ready, then answers each command with one JSON line:
  {"op": "crc", "addr", "n"}         crc32 of n bytes at addr
  {"op": "fill", "addr", "n", "v"}   sets them to v
  {"op": "register", "n"}            registers a new buffer; {"addr"}
  {"op": "notifies"}                 {"notifies": [[name, msg], ...]}
"""

import json
import os
import sys
import zlib

import ctypes

import numpy as np

sys.path.insert(0, os.environ["TIERKV_COMPAT_DIR"])
from mooncake.engine import TransferEngine  # noqa: E402


def main():
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 64 << 20
    te = TransferEngine()
    if te.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 1
    buffers = []

    def new_buffer(n):
        a = np.zeros(n, dtype=np.uint8)
        if te.register_memory(a.ctypes.data, n) != 0:
            raise RuntimeError("register_memory failed")
        buffers.append(a)
        return a

    main_buf = new_buffer(size)
    print(json.dumps({"session": f"{host.split(':')[0]}:{te.get_rpc_port()}", "addr": main_buf.ctypes.data,
                      "size": size}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "crc":
            out = {"crc": zlib.crc32(ctypes.string_at(cmd["addr"], cmd["n"]))}
        elif op == "fill":
            ctypes.memset(cmd["addr"], cmd["v"], cmd["n"])
            out = {}
        elif op == "register":
            out = {"addr": new_buffer(cmd["n"]).ctypes.data}
        elif op == "notifies":
            out = {"notifies": [[n.name, n.msg] for n in te.get_notifies()]}
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
