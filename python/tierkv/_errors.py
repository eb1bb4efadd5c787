"""tierkv's exceptions: one class per absl status code, all subclassing Error.

The C++ module raises through from_status(code, message). Classes also
subclass the built-in exception a Python caller would expect (NotFound is a
KeyError, InvalidArgument a ValueError, Unavailable a ConnectionError,
DeadlineExceeded a TimeoutError), so generic handlers work.
"""


class Error(Exception):
    """A tierkv call failed; `code` is the absl status code (int)."""

    code = 2  # UNKNOWN

    def __init__(self, message=""):
        super().__init__(message)
        self.message = message

    def __str__(self):
        return self.message


Error.__module__ = "tierkv"

# absl::StatusCode values.
_CODES = {
    1: ("Cancelled", ()),
    2: ("Unknown", ()),
    3: ("InvalidArgument", (ValueError,)),
    4: ("DeadlineExceeded", (TimeoutError,)),
    5: ("NotFound", (KeyError,)),
    6: ("AlreadyExists", ()),
    7: ("PermissionDenied", (PermissionError,)),
    8: ("ResourceExhausted", ()),
    9: ("FailedPrecondition", ()),
    10: ("Aborted", ()),
    11: ("OutOfRange", ()),
    12: ("Unimplemented", (NotImplementedError,)),
    13: ("Internal", ()),
    14: ("Unavailable", (ConnectionError,)),
    15: ("DataLoss", ()),
    16: ("Unauthenticated", ()),
}

_BY_CODE = {}
for _code, (_name, _bases) in _CODES.items():
    _cls = type(_name, (Error,) + _bases, {"code": _code, "__module__": "tierkv",
                                           "__str__": Error.__str__})
    globals()[_name] = _cls
    _BY_CODE[_code] = _cls

CODE_NAMES = {code: name for code, (name, _) in _CODES.items()}


def from_status(code, message):
    """The exception for an absl status code (an Error for an unknown one)."""
    cls = _BY_CODE.get(int(code), Error)
    return cls(message)


__all__ = ["Error", "from_status", "CODE_NAMES"] + [name for name, _ in _CODES.values()]
