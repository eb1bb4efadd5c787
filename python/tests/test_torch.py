"""The zero-copy paths with torch tensors (Debian's python3-torch), as the
engines use them: Mooncake's pointer API over a registered bfloat16 pool,
K and V of a page gathered from and scattered into separate tensors, the
tierkv client's part lists, and LMCache memory objects read in place."""

import ctypes

import pytest
import torch

from conftest import unique
from tierkv.lmcache import TierkvConnector

PAGES = 8
TOKENS, HEADS_DIM = 256, 128  # one page's K (or V): 256 tokens x 128 bf16 = 64 KiB


def nbytes(t):
    return t.numel() * t.element_size()


def as_bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def pool():
    """A host pool [page][K|V][token][dim] of random bf16 values, and an empty twin."""
    torch.manual_seed(3)
    src = torch.randn(PAGES, 2, TOKENS, HEADS_DIM, dtype=torch.bfloat16)
    return src, torch.zeros_like(src)


def test_mooncake_pages_and_split_kv_round_trip(store, pool):
    src, out = pool
    p = unique("tmc")
    for t in (src, out):
        assert store.register_buffer(t.data_ptr(), nbytes(t)) == 0
    page, half = nbytes(src[0]), nbytes(src[0, 0])
    keys = [p + str(i) for i in range(PAGES)]
    assert store.batch_put_from(keys, [src[i].data_ptr() for i in range(PAGES)], [page] * PAGES) == [0] * PAGES
    assert store.batch_get_into(keys, [out[i].data_ptr() for i in range(PAGES)], [page] * PAGES) == [page] * PAGES
    assert torch.equal(out, src)

    # One object per page from K and V where they lie, read back into a
    # pool of the other layout ([K|V][page]): the bytes move in place.
    kv = [p + "kv" + str(i) for i in range(PAGES)]
    ptrs = [[src[i, 0].data_ptr(), src[i, 1].data_ptr()] for i in range(PAGES)]
    assert store.batch_put_from_multi_buffers(kv, ptrs, [[half, half]] * PAGES) == [0] * PAGES
    other = torch.zeros(2, PAGES, TOKENS, HEADS_DIM, dtype=torch.bfloat16)
    assert store.register_buffer(other.data_ptr(), nbytes(other)) == 0
    back = [[other[0, i].data_ptr(), other[1, i].data_ptr()] for i in range(PAGES)]
    assert store.batch_get_into_multi_buffers(kv, back, [[half, half]] * PAGES) == [page] * PAGES
    assert torch.equal(other[0], src[:, 0]) and torch.equal(other[1], src[:, 1])
    # Gathered or whole, the object is the concatenation.
    assert store.get(kv[3]) == as_bytes(src[3]) == store.get(keys[3])
    # put_parts from tensors' buffers.
    assert store.put_parts(p + "parts", src[5, 1].view(torch.uint8).numpy(), src[5, 0].view(torch.uint8).numpy()) == 0
    assert store.get(p + "parts") == as_bytes(src[5, 1]) + as_bytes(src[5, 0])
    for t in (src, out, other):
        assert store.unregister_buffer(t.data_ptr()) == 0


def test_client_part_lists_over_tensors(client, pool):
    src, out = pool
    p = unique("tcl")
    half = nbytes(src[0, 0])
    keys = [p + str(i) for i in range(PAGES)]
    # V before K, from two places in the pool.
    res = client.batch_put_ptr_parts(keys, [[src[i, 1].data_ptr(), src[i, 0].data_ptr()] for i in range(PAGES)],
                                     [[half, half]] * PAGES)
    assert res == [None] * PAGES
    got = client.batch_get_into_ptr_parts(keys + [p + "missing"],
                                          [[out[i, 1].data_ptr(), out[i, 0].data_ptr()] for i in range(PAGES)] + [[]],
                                          [[half, half]] * PAGES + [[]])
    assert got == [2 * half] * PAGES + [None]
    assert torch.equal(out, src)
    # Buffers too small for the value: an error for that key alone.
    small = client.batch_get_into_ptr_parts(keys[:2], [[out[0, 0].data_ptr()], [out[1].data_ptr()]],
                                            [[half], [2 * half]])
    assert getattr(small[0], "code", None) == 3 and small[1] == 2 * half
    # Buffer objects work too (here numpy views of the tensors' memory).
    views = [[out[2, 0].view(torch.uint8).numpy(), out[2, 1].view(torch.uint8).numpy()]]
    out.zero_()
    assert client.batch_get_into_parts([keys[2]], views) == [2 * half]
    assert torch.equal(out[2, 0], src[2, 1]) and torch.equal(out[2, 1], src[2, 0])


class TensorMemoryObj:
    """LMCache's memory object: a tensor, its metadata, byte_array as a
    memoryview over the tensor's memory, and a reference count."""

    def __init__(self, backend, shape, dtype, fmt):
        self.tensor = torch.zeros(shape, dtype=dtype)
        self.metadata = type("Meta", (), {"shape": tuple(shape), "dtype": dtype, "fmt": fmt})()
        self.backend = backend

    @property
    def byte_array(self):
        n = nbytes(self.tensor)
        return memoryview((ctypes.c_ubyte * n).from_address(self.tensor.data_ptr())).cast("B")

    def ref_count_down(self):
        self.backend.released += 1


class TensorCpuBackend:
    def __init__(self):
        self.allocated = 0
        self.released = 0

    def allocate(self, shape, dtype, fmt):
        self.allocated += 1
        return TensorMemoryObj(self, shape, dtype, fmt)


def test_lmcache_chunks_are_read_into_memory_objects_in_place(cluster):
    import asyncio

    backend = TensorCpuBackend()
    conn = TierkvConnector(f"tierkv://{cluster.master_address}", None, backend)
    p = unique("tlm")
    torch.manual_seed(9)
    full = [TensorMemoryObj(backend, (2, 4, 256, 64), torch.bfloat16, 1) for _ in range(4)]
    for o in full:
        o.tensor.copy_(torch.randn(o.tensor.shape, dtype=torch.bfloat16))
    last = TensorMemoryObj(backend, (2, 4, 100, 64), torch.bfloat16, 1)  # a prompt's shorter last chunk
    last.tensor.copy_(torch.randn(last.tensor.shape, dtype=torch.bfloat16))
    keys = [p + str(i) for i in range(5)]

    def no_whole_values(*_):
        raise AssertionError("a chunk of the known shape was read as a whole value")

    async def run():
        await conn.batched_put(keys, full + [last])
        conn.client.batch_get = no_whole_values  # from here on, full chunks land in place
        backend.allocated = backend.released = 0
        got = await conn.batched_get(keys + [p + "missing"])
        assert got[5] is None
        for o, g in zip(full, got):
            assert g.metadata.shape == (2, 4, 256, 64) and torch.equal(g.tensor, o.tensor)
        assert got[4].metadata.shape == (2, 4, 100, 64) and torch.equal(got[4].tensor, last.tensor)
        # One object per key asked, plus the right-sized one for the short
        # chunk; the short chunk's and the miss's full-sized ones go back.
        assert backend.allocated == 6 + 1 and backend.released == 2
        await conn.close()

    asyncio.run(run())


def test_lmcache_chunk_larger_than_any_seen_is_still_read(cluster):
    import asyncio

    writer = TierkvConnector(f"tierkv://{cluster.master_address}", None, TensorCpuBackend())
    backend = TensorCpuBackend()
    reader = TierkvConnector(f"tierkv://{cluster.master_address}", None, backend)
    p = unique("tlb")
    small = TensorMemoryObj(backend, (2, 64), torch.float16, 1)
    big = TensorMemoryObj(backend, (2, 4096), torch.float16, 1)
    big.tensor.copy_(torch.randn(big.tensor.shape, dtype=torch.float16))

    async def run():
        await reader.batched_put([p + "s"], [small])  # the reader learns the small shape
        await writer.batched_put([p + "b"], [big])
        got = await reader.batched_get([p + "b", p + "s"])
        assert got[0].metadata.shape == (2, 4096) and torch.equal(got[0].tensor, big.tensor)
        assert got[1].metadata.shape == (2, 64)
        await reader.close()
        await writer.close()

    asyncio.run(run())
