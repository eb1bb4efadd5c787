"""tierkv as an LMCache remote backend (vLLM -> LMCache -> tierkv).

    # lmcache.yaml
    remote_url: "tierkv://10.0.0.1:50051"     # the master's RPC address
    remote_serde: "naive"

TierkvConnector follows LMCache's RemoteConnector interface (async get, put,
exists, list, close, and the batched forms: batched_get, batched_put,
batched_async_contains); TierkvConnectorAdapter creates it for tierkv://
URLs. Each chunk is one object: a fixed-size header (shape, dtype, format)
then the chunk's bytes. Puts gather header and chunk from where they lie;
gets scatter straight into a memory object allocated with the shape of the
last full chunk seen (a chunk of another shape, e.g. a prompt's last,
shorter one, costs one copy). Contains is ONE server-side PrefixMatch: how
many leading chunks are present.
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
# Fixed, so a get can place the chunk's bytes before it has read the header.
_HEADER = 256


def _key(k):
    return k.to_string() if hasattr(k, "to_string") else str(k)


def _meta(obj):
    md = getattr(obj, "metadata", None)
    return {
        "shape": list(getattr(md, "shape", []) or []),
        "dtype": str(getattr(md, "dtype", "")),
        "fmt": int(getattr(getattr(md, "fmt", 0), "value", getattr(md, "fmt", 0)) or 0),
    }


def _header(meta):
    body = json.dumps(meta).encode()
    if 8 + len(body) > _HEADER:
        raise ValueError(f"chunk metadata of {len(body)} bytes does not fit the {_HEADER}-byte header")
    return _MAGIC + struct.pack("<I", len(body)) + body + bytes(_HEADER - 8 - len(body))


def _parse_header(hdr):
    """The meta dict of a stored chunk's header; None if it is not one."""
    if len(hdr) < _HEADER or bytes(hdr[:4]) != _MAGIC:
        return None
    (n,) = struct.unpack("<I", bytes(hdr[4:8]))
    if 8 + n > _HEADER:
        return None
    try:
        return json.loads(bytes(hdr[8:8 + n]))
    except ValueError:
        return None


def _release(obj):
    """Gives a memory object back to LMCache's allocator (a no-op elsewhere)."""
    down = getattr(obj, "ref_count_down", None)
    if down is not None:
        down()


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
        # Meta of the largest chunk put or read: gets allocate this shape
        # before they know a chunk's own.
        self._full = None
        self._full_bytes = 0

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

    def _learn(self, meta, nbytes):
        if nbytes > self._full_bytes:
            self._full, self._full_bytes = meta, nbytes

    def _put_many(self, keys, objs):
        ks, parts = [], []
        for k, o in zip(keys, objs):
            meta = _meta(o)
            try:
                hdr = _header(meta)
            except ValueError as e:
                log.warning("put %s: %s", _key(k), e)
                continue
            data = o.byte_array
            self._learn(meta, len(memoryview(data).cast("B")))
            ks.append(_key(k))
            parts.append([hdr, data])
        try:
            res = self.client.batch_put_parts(ks, parts)
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
        ks = [_key(k) for k in keys]
        if self._full is None or self.local_cpu_backend is None:
            return self._get_copied(ks)
        # Zero-copy: each chunk lands in a memory object of the full shape.
        objs = [self._allocate(self._full, self._full_bytes) for _ in ks]
        if any(o is None for o in objs):
            for o in objs:
                if o is not None:
                    _release(o)
            return self._get_copied(ks)
        hdrs = [bytearray(_HEADER) for _ in ks]
        try:
            got = self.client.batch_get_into_parts(ks, [[h, o.byte_array] for h, o in zip(hdrs, objs)])
        except Error as e:
            log.warning("get of %d chunks failed: %s", len(ks), e)
            got = [e] * len(ks)
        out, again = [None] * len(ks), []
        for i, (r, hdr, obj) in enumerate(zip(got, hdrs, objs)):
            if isinstance(r, int):
                out[i] = self._settle(ks[i], r - _HEADER, hdr, obj)
            else:
                _release(obj)
                if r is not None and getattr(r, "code", None) == 3:  # INVALID_ARGUMENT: a larger chunk
                    again.append(i)
                elif r is not None:
                    log.warning("get %s: %s", ks[i], r)
        if again:
            for i, v in zip(again, self._get_copied([ks[i] for i in again])):
                out[i] = v
        return out

    def _settle(self, key, nbytes, hdr, obj):
        """The chunk read into `obj`: obj itself when it has the chunk's shape,
        else a right-sized object it is copied into."""
        meta = _parse_header(hdr)
        if meta is None or nbytes < 0:
            log.warning("get %s: not a tierkv LMCache chunk", key)
            _release(obj)
            return None
        if meta == self._full and nbytes == self._full_bytes:
            return obj
        chunk = self._allocate(meta, nbytes)
        if chunk is not None:
            chunk.byte_array[:nbytes] = obj.byte_array[:nbytes]
        _release(obj)
        return chunk

    def _get_copied(self, ks):
        """Reads whole values, then copies each chunk into its own memory object."""
        try:
            values = self.client.batch_get(ks)
        except Error as e:
            log.warning("get of %d chunks failed: %s", len(ks), e)
            return [None] * len(ks)
        out = []
        for k, v in zip(ks, values):
            meta = _parse_header(v) if isinstance(v, bytes) else None
            if meta is None:
                if v is not None and not isinstance(v, Error):
                    log.warning("get %s: not a tierkv LMCache chunk", k)
                out.append(None)
                continue
            payload = memoryview(v)[_HEADER:]
            self._learn(meta, len(payload))
            obj = self._allocate(meta, len(payload))
            if obj is not None:
                obj.byte_array[:len(payload)] = payload
            out.append(obj)
        return out

    def _allocate(self, meta, nbytes):
        if self.local_cpu_backend is None:
            return None
        # The dtype comes back as what it was put as: a torch dtype from its
        # name ("torch.bfloat16"), any other kind as its string.
        dtype = meta["dtype"]
        if dtype.startswith("torch."):
            try:
                import torch
                dtype = getattr(torch, dtype[len("torch."):])
            except (ImportError, AttributeError):
                pass
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
