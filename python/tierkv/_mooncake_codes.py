"""Mooncake's error codes and how tierkv's statuses map to them, shared by
the modules behind tierkv.mooncake_compat."""

from . import Error

# Mooncake's ErrorCode values (mooncake-store/include/types.h).
ERROR_CODES = {
    "OK": 0,
    "INTERNAL_ERROR": -1,
    "BUFFER_OVERFLOW": -10,
    "SEGMENT_NOT_FOUND": -101,
    "NO_AVAILABLE_HANDLE": -200,
    "INVALID_KEY": -400,
    "WRITE_FAIL": -500,
    "INVALID_PARAMS": -600,
    "INVALID_WRITE": -700,
    "INVALID_READ": -701,
    "REPLICA_IS_NOT_READY": -703,
    "OBJECT_NOT_FOUND": -704,
    "OBJECT_ALREADY_EXISTS": -705,
    "OBJECT_HAS_LEASE": -706,
    "LEASE_EXPIRED": -707,
    "REPLICA_NOT_FOUND": -710,
    "TRANSFER_FAIL": -800,
    "CHECKSUM_MISMATCH": -801,
    "RPC_FAIL": -900,
    "RPC_TIMEOUT": -901,
    "UNAVAILABLE_IN_CURRENT_STATUS": -1010,
    "UNAVAILABLE_IN_CURRENT_MODE": -1011,
}
globals().update(ERROR_CODES)
__all__ = list(ERROR_CODES) + ["ERROR_CODES", "_FROM_ABSL", "_Refused", "_code"]

# absl status code -> Mooncake code.
_FROM_ABSL = {
    0: OK,
    3: INVALID_PARAMS,         # INVALID_ARGUMENT (also: buffer too small)
    4: TRANSFER_FAIL,          # DEADLINE_EXCEEDED
    5: OBJECT_NOT_FOUND,
    6: OBJECT_ALREADY_EXISTS,
    8: NO_AVAILABLE_HANDLE,    # RESOURCE_EXHAUSTED: no room in the cluster
    9: OBJECT_HAS_LEASE,       # FAILED_PRECONDITION: leased (being read)
    11: TRANSFER_FAIL,         # OUT_OF_RANGE
    14: RPC_FAIL,              # UNAVAILABLE
    15: TRANSFER_FAIL,         # DATA_LOSS: checksum mismatch, not data
}


class _Refused(Exception):
    """A call refused before reaching the store; carries the Mooncake code."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


def _code(status):
    """A Mooncake code from an absl code, an Error, or None (OK)."""
    if status is None:
        return OK
    if isinstance(status, Error):
        status = status.code
    return _FROM_ABSL.get(int(status), INTERNAL_ERROR)
