"""tierkv as an LMCache remote backend (vLLM -> LMCache -> tierkv).

    # lmcache.yaml
    remote_url: "tierkv://10.0.0.1:50051"     # the master's RPC address
    remote_serde: "naive"

TierkvConnector follows LMCache's RemoteConnector interface (async get, put,
exists, list, close, and the batched forms: batched_get, batched_put,
batched_async_contains); TierkvConnectorAdapter creates it for tierkv://
URLs. Each chunk is one object: a small header (shape, dtype, format, length)
then the chunk's bytes, written from the chunk's memory in place. Contains
is ONE server-side PrefixMatch: how many leading chunks are present.
Network and store errors never raise out of a call: a get is None, a
contains counts what was answered, a put is dropped with a warning.

The blocking client calls run in the default executor, releasing the GIL,
so LMCache's event loop keeps running.
"""

import asyncio
import json
import logging
import struct
import urllib.parse

from . import Client, Error

log = logging.getLogger("tierkv.lmcache")

_MAGIC = b"TKVL"


def _key(k):
    return k.to_string() if hasattr(k, "to_string") else str(k)


def _header(obj):
    md = getattr(obj, "metadata", None)
    meta = {
        "shape": list(getattr(md, "shape", []) or []),
        "dtype": str(getattr(md, "dtype", "")),
        "fmt": int(getattr(getattr(md, "fmt", 0), "value", getattr(md, "fmt", 0)) or 0),
    }
    body = json.dumps(meta).encode()
    return _MAGIC + struct.pack("<I", len(body)) + body


def _split(value):
    """(meta, payload memoryview) of a stored chunk; None if it is not one."""
    if len(value) < 8 or value[:4] != _MAGIC:
        return None
    (n,) = struct.unpack("<I", value[4:8])
    meta = json.loads(bytes(value[8:8 + n]))
    return meta, memoryview(value)[8 + n:]


def parse_url(url):
    """host:port of the master from tierkv://host:port."""
    u = urllib.parse.urlparse(url)
    if u.scheme != "tierkv" or not u.hostname or not u.port:
        raise ValueError(f"{url!r} is not tierkv://host:port")
    return f"{u.hostname}:{u.port}"


class TierkvConnector:
    """LMCache RemoteConnector over tierkv. `local_cpu_backend.allocate(shape,
    dtype, fmt)` gives the memory objects gets fill."""

    def __init__(self, url, loop=None, local_cpu_backend=None, *, client=None, **client_options):
        self.url = url
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.client = client or Client(parse_url(url), **client_options)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # --- contains -------------------------------------------------------
    def exists_sync(self, key):
        try:
            return self.client.exists(_key(key))
        except Error:
            return False

    async def exists(self, key):
        return await self._run(self.exists_sync, key)

    def support_batched_async_contains(self):
        return True

    def batched_contains(self, keys):
        try:
            return self.client.prefix_match([_key(k) for k in keys])
        except Error as e:
            log.warning("contains failed: %s", e)
            return 0

    async def batched_async_contains(self, lookup_id, keys, pin=False):
        return await self._run(self.batched_contains, keys)

    # --- put ------------------------------------------------------------
    def support_batched_put(self):
        return True

    def _put_many(self, keys, objs):
        ks, parts = [], []
        for k, o in zip(keys, objs):
            ks.append(_key(k))
            parts.append(_header(o) + bytes(o.byte_array))
        try:
            res = self.client.batch_put(ks, parts)
        except Error as e:
            log.warning("put of %d chunks failed: %s", len(ks), e)
            return
        for k, r in zip(ks, res):
            if r is not None and getattr(r, "code", None) != 6:  # present already is fine
                log.warning("put %s: %s", k, r)

    async def put(self, key, memory_obj):
        await self._run(self._put_many, [key], [memory_obj])

    async def batched_put(self, keys, memory_objs):
        await self._run(self._put_many, list(keys), list(memory_objs))

    # --- get ------------------------------------------------------------
    def support_batched_get(self):
        return True

    def _get_many(self, keys):
        try:
            values = self.client.batch_get([_key(k) for k in keys])
        except Error as e:
            log.warning("get of %d chunks failed: %s", len(keys), e)
            return [None] * len(keys)
        out = []
        for v in values:
            parsed = _split(v) if isinstance(v, bytes) else None
            if parsed is None:
                out.append(None)
                continue
            meta, payload = parsed
            obj = self._allocate(meta, len(payload))
            if obj is None:
                out.append(None)
                continue
            obj.byte_array[:len(payload)] = payload
            out.append(obj)
        return out

    def _allocate(self, meta, nbytes):
        if self.local_cpu_backend is None:
            return None
        try:
            import torch
            dtype = getattr(torch, meta["dtype"].replace("torch.", ""), None)
        except ImportError:
            dtype = meta["dtype"]
        try:
            return self.local_cpu_backend.allocate(tuple(meta["shape"]), dtype, meta["fmt"])
        except Exception as e:  # the local pool is full
            log.warning("cannot allocate a chunk of %d bytes: %s", nbytes, e)
            return None

    async def get(self, key):
        return (await self._run(self._get_many, [key]))[0]

    async def batched_get(self, keys):
        return await self._run(self._get_many, list(keys))

    # --- rest -----------------------------------------------------------
    async def list(self):
        return []  # tierkv does not enumerate keys

    def support_ping(self):
        return True

    async def ping(self):
        try:
            await self._run(self.client.stats)
            return 0
        except Error as e:
            return -int(e.code)

    async def close(self):
        self.client.close()


class TierkvConnectorAdapter:
    """LMCache's ConnectorAdapter for tierkv:// URLs."""

    schema = "tierkv://"

    def can_parse(self, url):
        return url.startswith(self.schema)

    def create_connector(self, context):
        return TierkvConnector(context.url, getattr(context, "loop", None),
                               getattr(context, "local_cpu_backend", None))


__all__ = ["TierkvConnector", "TierkvConnectorAdapter", "parse_url"]
