"""Bounded waits, as STYLE.md practice 17 asks.

A test that needs something to happen polls the condition it means with
wait_for, which names what it waited for when the deadline passes; a test
whose point is that something does not happen within a window watches it
with stays_false. These two are the only place python/tests pauses: the
poll interval starts short and grows, so a quick condition costs
milliseconds and a slow one a few polls a second.
"""

import time

FIRST_INTERVAL = 0.005  # seconds before the second poll
MAX_INTERVAL = 0.1  # the interval grows by GROWTH per poll up to this
GROWTH = 1.5


def _polls(seconds):
    """Yields once per poll over `seconds`: at once, then at growing
    intervals, the last poll at the end of the span."""
    end = time.monotonic() + seconds
    interval = FIRST_INTERVAL
    while True:
        yield
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(interval, left))
        interval = min(interval * GROWTH, MAX_INTERVAL)


def _detail(detail):
    """The extra text for a failure: `detail` itself, or what it returns if callable."""
    text = detail() if callable(detail) else detail
    return f"\n{text}" if text else ""


def wait_for(what, condition, timeout=20, *, detail=None, ignore=()):
    """Polls condition() until it is truthy and returns that value.

    Past `timeout` seconds raises AssertionError "waited <timeout>s for
    <what>", followed by `detail` (a string, or a callable called only on
    failure, e.g. a process's logs). Exceptions of the types in `ignore`
    (e.g. OSError from a server still starting) count as not yet; the last
    one is named in the failure.
    """
    error = None
    for _ in _polls(timeout):
        try:
            value = condition()
        except ignore as e:
            value, error = None, e
        else:
            error = None
        if value:
            return value
    last = f" (last poll raised {error!r})" if error is not None else ""
    raise AssertionError(f"waited {timeout:g}s for {what}{last}{_detail(detail)}")


def stays_false(what, condition, window, *, detail=None):
    """Polls condition() for `window` seconds; it must stay falsy throughout.

    The moment it is truthy raises AssertionError naming `what` (the thing
    that happened, e.g. "the daemon unmounted"), when, and the value seen,
    followed by `detail` as for wait_for.
    """
    start = time.monotonic()
    for _ in _polls(window):
        value = condition()
        if value:
            raise AssertionError(f"{what} after {time.monotonic() - start:.2f}s, within the {window:g}s "
                                 f"it must not: {value!r}{_detail(detail)}")
