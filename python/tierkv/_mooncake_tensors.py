"""Tensor calls of tierkv.mooncake_compat's store, as the mixin
TensorCalls, and the helpers for Mooncake's tensor layout.

A tensor is stored as Mooncake's classic layout: a 40-byte header (int32
dtype code, int32 ndim, int64 shape[4] with -1 past ndim; little endian)
followed by the tensor's bytes, so a tensor put by either client reads back
on the other. torch is imported on first use only. The _with_tp forms store
chunk r of a tensor split for tensor parallelism under key_tp_r.
"""

import ctypes
import logging
import struct

from ._mooncake_codes import INVALID_PARAMS, OK, _Refused

log = logging.getLogger("tierkv.mooncake_compat")


# --- tensor layout helpers --------------------------------------------------
_TENSOR_HEADER = struct.Struct("<ii4q")  # dtype, ndim, shape[4]: Mooncake's TensorMetadata
# Mooncake's dtype codes, by torch dtype name.
_DTYPE_CODES = {"float32": 0, "float64": 1, "int8": 2, "uint8": 3, "int16": 4, "uint16": 5, "int32": 6,
                "uint32": 7, "int64": 8, "uint64": 9, "bool": 10, "float16": 11, "bfloat16": 12,
                "float8_e4m3fn": 13, "float8_e5m2": 14}
_DTYPE_NAMES = {v: k for k, v in _DTYPE_CODES.items()}


def _torch():
    import torch  # only tensor calls need it
    return torch


def _tp_key(key, rank):
    return f"{key}_tp_{rank}"


def _bad_preferred(config):
    if config is not None and config.preferred_segments and len(config.preferred_segments) != config.replica_num:
        log.error("preferred_segments names %d segments for replica_num %d", len(config.preferred_segments),
                  config.replica_num)
        return True
    return False


def _tp_chunks(tensor, tp_size, split_dim):
    try:
        chunks = tensor.chunk(tp_size, split_dim)
    except Exception as e:  # not a tensor, or a bad dimension
        log.error("cannot split for tensor parallelism: %s", e)
        return None
    if len(chunks) != tp_size:
        log.error("split gave %d chunks, not %d", len(chunks), tp_size)
        return None
    return [ch.contiguous() for ch in chunks]


def _tensor_parts(tensor):
    """[header, data] buffers for a torch tensor; data is the tensor's own
    memory (a contiguous host copy where it is not contiguous or not on the
    host). Raises _Refused(INVALID_PARAMS) for what Mooncake refuses: not a
    tensor, an unknown dtype, more than 4 dimensions, no elements."""
    if "Tensor" not in type(tensor).__name__:
        raise _Refused(INVALID_PARAMS)
    code = _DTYPE_CODES.get(str(tensor.dtype).replace("torch.", ""))
    if code is None or tensor.dim() > 4 or tensor.numel() == 0:
        raise _Refused(INVALID_PARAMS)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    shape = list(t.shape) + [-1] * (4 - t.dim())
    header = _TENSOR_HEADER.pack(code, t.dim(), *shape)
    data = (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    data._keep = t  # the tensor outlives the view of its memory
    return [header, data]


def _parse_header(raw):
    """(torch dtype, shape) from a header's bytes, or None."""
    code, ndim, *shape = _TENSOR_HEADER.unpack(raw)
    name = _DTYPE_NAMES.get(code)
    dtype = getattr(_torch(), name, None) if name else None
    if dtype is None or not 0 <= ndim <= 4 or any(d < 0 for d in shape[:ndim]):
        log.error("not a tensor value: dtype %d, ndim %d", code, ndim)
        return None
    return dtype, shape[:ndim]


def _shape_tensor(torch, buf, dtype, shape):
    t = torch.frombuffer(buf, dtype=dtype)
    return t.reshape(shape) if shape else t


def _tensor_from_bytes(value):
    if len(value) <= _TENSOR_HEADER.size:
        log.error("value too short for a tensor")
        return None
    parsed = _parse_header(value[:_TENSOR_HEADER.size])
    if parsed is None:
        return None
    try:
        return _shape_tensor(_torch(), bytearray(memoryview(value)[_TENSOR_HEADER.size:]), *parsed)
    except (RuntimeError, ValueError) as e:
        log.error("cannot make a tensor of the value: %s", e)
        return None


def _tensor_header_at(ptr, n):
    if n <= _TENSOR_HEADER.size:
        return None
    try:
        return _parse_header(ctypes.string_at(ptr, _TENSOR_HEADER.size))
    except ImportError:
        return None


def _tensor_at(ptr, n):
    """A tensor viewing n bytes at ptr (header + data), or None."""
    if n is None or n < 0:
        return None
    parsed = _tensor_header_at(ptr, n)
    if parsed is None:
        return None
    buf = (ctypes.c_ubyte * (n - _TENSOR_HEADER.size)).from_address(ptr + _TENSOR_HEADER.size)
    try:
        return _shape_tensor(_torch(), buf, *parsed)
    except (RuntimeError, ValueError) as e:
        log.error("cannot make a tensor of the value: %s", e)
        return None


class TensorCalls:
    """The tensor calls of MooncakeDistributedStore (which provides
    self._client, a tierkv.Client or None, self._batch_put, self._upsert,
    and the byte calls batch_put_from, batch_upsert_from, get_into and
    batch_get_into)."""

    def _put_tensor_entries(self, keys, tensors, config):
        """One code per key, storing each (key, tensor) as header + bytes."""
        entries, codes = [], [OK] * len(keys)
        for i, (k, t) in enumerate(zip(keys, tensors)):
            try:
                entries.append((i, _tensor_parts(t)))
            except _Refused as r:
                log.error("tensor for %s: not storable", k)
                codes[i] = r.code
        if entries:
            idx = [i for i, _ in entries]
            parts = [p for _, p in entries]
            res = self._batch_put([keys[i] for i in idx], lambda c, **o: c.batch_put_parts(
                [keys[i] for i in idx], parts, **o), config)
            for i, r in zip(idx, res):
                codes[i] = r
        return codes

    def put_tensor(self, key, tensor):
        """Stores a torch tensor (a CUDA one is copied to host first)."""
        return self._put_tensor_entries([key], [tensor], None)[0] if self._client else INVALID_PARAMS

    def pub_tensor(self, key, tensor, config=None):
        """put_tensor with a ReplicateConfig; preferred_segments, when given,
        must name replica_num segments (INVALID_PARAMS otherwise)."""
        if self._client is None or _bad_preferred(config):
            return INVALID_PARAMS
        return self._put_tensor_entries([key], [tensor], config)[0]

    def batch_put_tensor(self, keys, tensors_list):
        return self.batch_pub_tensor(keys, tensors_list, None)

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        keys = list(keys)
        if self._client is None or not keys or len(keys) != len(tensors_list) or _bad_preferred(config):
            return [INVALID_PARAMS] * len(keys)
        return self._put_tensor_entries(keys, list(tensors_list), config)

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """Splits the tensor into tp_size chunks along split_dim and stores
        chunk r under key_tp_r (all ranks, whatever tp_rank)."""
        return self.pub_tensor_with_tp(key, tensor, None, tp_rank, tp_size, split_dim)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        if self._client is None or _bad_preferred(config):
            return INVALID_PARAMS
        if tp_size <= 1:
            return self._put_tensor_entries([key], [tensor], config)[0]
        chunks = _tp_chunks(tensor, tp_size, split_dim)
        if chunks is None:
            return INVALID_PARAMS
        codes = self._put_tensor_entries([_tp_key(key, r) for r in range(tp_size)], chunks, config)
        return next((r for r in codes if r != OK), OK)

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0):
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0, tp_size=1, split_dim=0):
        base_keys = list(base_keys)
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        if self._client is None or not base_keys or len(base_keys) != len(tensors_list) or _bad_preferred(config):
            return [INVALID_PARAMS] * len(base_keys)
        codes = [OK] * len(base_keys)
        keys, chunks, owner = [], [], []
        for i, (k, t) in enumerate(zip(base_keys, tensors_list)):
            parts = _tp_chunks(t, tp_size, split_dim)
            if parts is None:
                codes[i] = INVALID_PARAMS
                continue
            for r, part in enumerate(parts):
                keys.append(_tp_key(k, r))
                chunks.append(part)
                owner.append(i)
        if keys:
            for i, r in zip(owner, self._put_tensor_entries(keys, chunks, config)):
                if r != OK and codes[i] == OK:
                    codes[i] = r
        return codes

    def upsert_tensor(self, key, tensor):
        return self.upsert_pub_tensor(key, tensor, None)

    def upsert_pub_tensor(self, key, tensor, config=None):
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_upsert_tensor(self, keys, tensors_list):
        return self.batch_upsert_pub_tensor(keys, tensors_list, None)

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        """Tensor upserts (see the note on upserts)."""
        keys = list(keys)
        if self._client is None or not keys or len(keys) != len(tensors_list) or _bad_preferred(config):
            return [INVALID_PARAMS] * len(keys)
        codes, entries = [OK] * len(keys), []
        for i, t in enumerate(tensors_list):
            try:
                entries.append((i, _tensor_parts(t)))
            except _Refused as r:
                codes[i] = r.code
        if entries:
            idx = [i for i, _ in entries]
            parts = dict(entries)
            res = self._upsert([keys[i] for i in idx], lambda c, sub, **o: c.batch_put_parts(
                [keys[idx[j]] for j in sub], [parts[idx[j]] for j in sub], **o), config)
            for i, r in zip(idx, res):
                codes[i] = r
        return codes

    def put_tensor_from(self, key, buffer_ptr, size):
        """Stores size bytes already in the tensor layout (header + data) at buffer_ptr."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes):
        keys = list(keys)
        if self._client is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        good = [i for i, (p, n) in enumerate(zip(buffer_ptrs, sizes)) if _tensor_header_at(int(p), int(n))]
        codes = [INVALID_PARAMS] * len(keys)
        if good:
            res = self.batch_put_from([keys[i] for i in good], [buffer_ptrs[i] for i in good], [sizes[i] for i in good])
            for i, r in zip(good, res):
                codes[i] = r
        return codes

    def upsert_tensor_from(self, key, buffer_ptr, size):
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes):
        keys = list(keys)
        if self._client is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if any(_tensor_header_at(int(p), int(n)) is None for p, n in zip(buffer_ptrs, sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self.batch_upsert_from(keys, buffer_ptrs, sizes)

    def get_tensor(self, key):
        """The torch tensor under key (a CPU tensor owning its memory), or
        None on a miss, an error, or a value not in the tensor layout."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys):
        return [_tensor_from_bytes(v) if v is not None else None for v in self._values(keys)]

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        """The shard of rank tp_rank (key_tp_<rank>), or the whole tensor when tp_size <= 1."""
        return self.get_tensor(key if tp_size <= 1 else _tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        return self.batch_get_tensor(list(base_keys) if tp_size <= 1 else [_tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads the tensor's bytes (header included) into [buffer_ptr,
        buffer_ptr+size) and answers a tensor viewing that memory past the
        header (the caller keeps the buffer alive), or None."""
        n = self.get_into(key, buffer_ptr, size)
        return _tensor_at(int(buffer_ptr), n)

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        """One tensor (viewing its buffer) or None per key; INVALID_PARAMS
        per key when the lists differ in length (Mooncake's answer)."""
        keys = list(keys)
        if self._client is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        res = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [_tensor_at(int(p), n) for p, n in zip(buffer_ptrs, res)]

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        return self.get_tensor_into(key if tp_size <= 1 else _tp_key(key, tp_rank), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1):
        if self._client is None:
            return [None] * len(base_keys)
        keys = list(base_keys) if tp_size <= 1 else [_tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)
