"""tierkv.lmcache.TierkvConnector with stand-ins for LMCache's key, memory
object and local CPU backend (their documented surface: key.to_string(),
obj.byte_array, obj.metadata.{shape,dtype,fmt}, backend.allocate)."""

import asyncio
from dataclasses import dataclass

import numpy as np

from conftest import unique
from tierkv.lmcache import TierkvConnector, TierkvConnectorAdapter, parse_url


@dataclass
class Key:
    chunk_hash: str

    def to_string(self):
        return f"vllm@test@1@0@{self.chunk_hash}"


@dataclass
class Metadata:
    shape: tuple
    dtype: str
    fmt: int = 1


class MemoryObj:
    def __init__(self, shape, dtype, fmt):
        self.array = np.zeros(shape, dtype=np.dtype(dtype))
        self.metadata = Metadata(tuple(shape), str(dtype), fmt)

    @property
    def byte_array(self):
        return memoryview(self.array).cast("B")


class CpuBackend:
    def allocate(self, shape, dtype, fmt):
        return MemoryObj(shape, dtype, fmt)


@dataclass
class Context:
    url: str
    loop: object = None
    local_cpu_backend: object = None


def test_batched_put_get_contains(cluster):
    adapter = TierkvConnectorAdapter()
    url = f"tierkv://{cluster.master_address}"
    assert adapter.can_parse(url) and parse_url(url) == cluster.master_address
    conn = adapter.create_connector(Context(url, None, CpuBackend()))
    p = unique("lm")
    keys = [Key(p + str(i)) for i in range(6)]
    objs = []
    for i in range(6):
        o = MemoryObj((2, 16, 64), "float32", 1)
        o.array[:] = np.random.default_rng(i).standard_normal((2, 16, 64))
        objs.append(o)

    async def run():
        await conn.batched_put(keys[:2] + keys[3:], objs[:2] + objs[3:])  # a hole at 2
        assert await conn.batched_async_contains("lookup-1", keys) == 2
        assert await conn.exists(keys[0]) and not await conn.exists(keys[2])
        got = await conn.batched_get(keys)
        assert got[2] is None
        for i in (0, 1, 3, 4, 5):
            assert got[i].metadata.shape == (2, 16, 64)
            assert np.array_equal(got[i].array, objs[i].array)
        await conn.put(keys[2], objs[2])
        assert await conn.batched_async_contains("lookup-2", keys) == 6
        assert np.array_equal((await conn.get(keys[2])).array, objs[2].array)
        assert await conn.ping() == 0
        await conn.close()

    asyncio.run(run())


def test_unreachable_master_never_raises():
    conn = TierkvConnector("tierkv://127.0.0.1:1", None, CpuBackend(), metadata="http://127.0.0.1:1",
                           rpc_timeout=0.5)

    async def run():
        assert await conn.batched_async_contains("x", [Key("a")]) == 0
        assert await conn.batched_get([Key("a")]) == [None]
        await conn.batched_put([Key("a")], [MemoryObj((4,), "float32", 1)])
        assert await conn.ping() < 0
        await conn.close()

    asyncio.run(run())
