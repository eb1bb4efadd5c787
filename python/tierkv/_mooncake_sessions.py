"""Mooncake's get and put sessions for tierkv.mooncake_compat, over
tierkv's read and write sessions (tierkv.ReadSession, tierkv.WriteSession;
client/client.h says what each guarantees).

Get sessions: batch_get_session_start(keys) asks the master once and leases
one replica of each key, counted, so nothing evicts, removes or overwrites
it meanwhile; batch_get_into_multi_buffer_ranges then reads ranges of those
values with no master call, per key the bytes read, or LEASE_EXPIRED once
the lease (the master's --lease-ttl) or the session has ended, never stale
bytes and never an exception; batch_get_session_end gives the leases back
at once. A key started again moves to its new session.

Put sessions: batch_put_session_start(keys, sizes, config) grants room for
each value with one master call; batch_put_from_multi_buffer_ranges writes
ranges of them, each byte once, in any order; batch_put_session_end commits
the keys whose ranges covered their value (INVALID_WRITE for one with a
byte never written) and batch_put_session_revoke gives keys up. Nothing is
visible before the end; the master revokes a session left open past its
--put-timeout.
"""

import logging
import threading

from . import Error
from ._mooncake_codes import (INVALID_PARAMS, INVALID_WRITE, LEASE_EXPIRED, OBJECT_NOT_FOUND, OK,
                              UNAVAILABLE_IN_CURRENT_STATUS, _code, _Refused)

log = logging.getLogger("tierkv.mooncake_compat")

_ABORTED, _OUT_OF_RANGE, _FAILED_PRECONDITION, _CANCELLED = 10, 11, 9, 1


def _range_code(err):
    """A range's Mooncake code from its tierkv Error."""
    if err.code == _ABORTED:
        return LEASE_EXPIRED  # the lease or the session ended: start a new one
    if err.code == _OUT_OF_RANGE:
        return INVALID_PARAMS
    return _code(err)


def _commit_code(err):
    if err is None:
        return OK
    if err.code in (_FAILED_PRECONDITION, _CANCELLED):
        return INVALID_WRITE  # not fully written, or already ended or revoked
    return _code(err)


class _Open:
    """Keys of one store mapped to the session (and index) holding them;
    a session no key maps to any more is ended."""

    def __init__(self, end):
        self._end = end
        self._lock = threading.Lock()
        self._where = {}  # key -> (session, index)
        self._keys_of = {}  # id(session) -> number of keys mapped to it

    def add(self, key, session, index):
        with self._lock:
            old = self._where.get(key)
            self._where[key] = (session, index)
            self._keys_of[id(session)] = self._keys_of.get(id(session), 0) + 1
            done = self._drop_locked(old)
        self._finish(done)

    def get(self, key):
        with self._lock:
            return self._where.get(key)

    def pop(self, keys):
        """Unmaps keys; answers their (session, index) or None, in order."""
        out, done = [], []
        with self._lock:
            for k in keys:
                entry = self._where.pop(k, None)
                out.append(entry)
                done += self._drop_locked(entry)
        self._finish(done)
        return out

    def _drop_locked(self, entry):
        if entry is None:
            return []
        sid = id(entry[0])
        self._keys_of[sid] -= 1
        if self._keys_of[sid] > 0:
            return []
        del self._keys_of[sid]
        return [entry[0]]

    def _finish(self, sessions):
        for s in sessions:
            try:
                self._end(s)
            except Error as e:  # the client closed meanwhile: its leases went with it
                log.debug("ending a session: %s", e)


def _rows(n, all_ptrs, all_sizes, all_offsets):
    """Per key its (ptr, size, offset) rows, or None where the row's lists
    differ in length; None overall when the outer lists do."""
    if not (len(all_ptrs) == len(all_sizes) == len(all_offsets) == n):
        return None
    rows = []
    for ptrs, sizes, offsets in zip(all_ptrs, all_sizes, all_offsets):
        ok = len(ptrs) == len(sizes) == len(offsets)
        rows.append([(int(p), int(s), int(o)) for p, s, o in zip(ptrs, sizes, offsets)] if ok else None)
    return rows


class SessionCalls:
    """The session calls of MooncakeDistributedStore (which provides
    self._client, a tierkv.Client or None, and self._put_options)."""

    _open_lock = threading.Lock()

    def _open(self, kind):
        with SessionCalls._open_lock:
            opened = self.__dict__.setdefault("_open_sessions", {})
            if kind not in opened:
                opened[kind] = _Open((lambda s: s.end()) if kind == "get" else (lambda s: s.revoke()))
            return opened[kind]

    # --- get sessions ---------------------------------------------------
    def batch_get_session_start(self, keys):
        """Leases one replica of each key (one master call): per key 0, or
        a negative code (OBJECT_NOT_FOUND for a miss)."""
        keys = list(keys)
        c = self._client
        if c is None:
            return [UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        if not keys:
            return []
        try:
            session = c.read_session(keys)
        except Error as e:
            return [_code(e)] * len(keys)
        codes = [OK if isinstance(n, int) else _code(n) for n in session.sizes()]
        opened = self._open("get")
        for i, (k, code) in enumerate(zip(keys, codes)):
            if code == OK:
                opened.add(k, session, i)
        if OK not in codes:
            session.end()
        return codes

    def batch_get_into_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes, all_src_offsets):
        """Reads sizes[i][j] bytes at src_offsets[i][j] of key i's value into
        buffer_ptrs[i][j], under its session's lease: per key the bytes
        read, or a negative code (LEASE_EXPIRED: no session holds the key,
        or its lease or session ended; INVALID_PARAMS: a range past the
        value's end or lists of unequal lengths)."""
        keys = list(keys)
        return self._move_ranges("get", keys, _rows(len(keys), all_buffer_ptrs, all_sizes, all_src_offsets),
                                 LEASE_EXPIRED, lambda s, ranges: s.read_ranges(ranges), _range_code)

    def batch_get_session_end(self, keys):
        """Gives the keys' leases back (a session with no key left ends at
        once). 0."""
        self._open("get").pop(list(keys))
        return OK

    # --- put sessions ---------------------------------------------------
    def batch_put_session_start(self, keys, sizes, config=None):
        """Grants room for each key's value of sizes[i] bytes (one master
        call): per key 0, or a negative code (OBJECT_ALREADY_EXISTS: the key
        is present or being put; NO_AVAILABLE_HANDLE: no room)."""
        keys, sizes = list(keys), list(sizes)
        c = self._client
        if c is None:
            return [UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        if len(keys) != len(sizes) or any(int(n) < 0 for n in sizes):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        try:
            opts, groups = self._put_options(config, len(keys))
        except _Refused as r:
            return [r.code] * len(keys)
        try:
            session = c.write_session(keys, sizes, groups=groups, **opts)
        except Error as e:
            return [_code(e)] * len(keys)
        codes = [_code(err) for err in session.statuses()]
        opened = self._open("put")
        for i, (k, code) in enumerate(zip(keys, codes)):
            if code == OK:
                opened.add(k, session, i)
        return codes

    def batch_put_from_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes, all_dst_offsets):
        """Writes sizes[i][j] bytes from buffer_ptrs[i][j] at dst_offsets[i][j]
        of key i's value: per key the bytes written, or a negative code
        (INVALID_PARAMS: no open put session for the key, a range past the
        value's size or over one already written, lists of unequal
        lengths). A key whose write failed is never committed."""
        keys = list(keys)
        return self._move_ranges("put", keys, _rows(len(keys), all_buffer_ptrs, all_sizes, all_dst_offsets),
                                 INVALID_PARAMS, lambda s, ranges: s.write_ranges(ranges),
                                 lambda err: INVALID_PARAMS if err.code in (3, _OUT_OF_RANGE) else _code(err))

    def _move_ranges(self, kind, keys, rows, no_session, move, code_of):
        """Per key the bytes its rows moved, or a code: `no_session` for a
        key no open session of `kind` holds, code_of(err) for a failed
        range; each session's ranges go in one call."""
        if rows is None:
            return [INVALID_PARAMS] * len(keys)
        out = [0] * len(keys)
        opened = self._open(kind)
        by_session = {}  # id -> (session, ranges, owners)
        for i, (k, row) in enumerate(zip(keys, rows)):
            entry = opened.get(k)
            if row is None:
                out[i] = INVALID_PARAMS
            elif entry is None:
                log.debug("%r has no open %s session", k, kind)
                out[i] = no_session
            else:
                session, index = entry
                _, ranges, owners = by_session.setdefault(id(session), (session, [], []))
                for ptr, size, offset in row:
                    ranges.append((index, ptr, size, offset))
                    owners.append(i)
                out[i] = sum(size for _, size, _ in row)
        for session, ranges, owners in by_session.values():
            try:
                errs = move(session, ranges)
            except Error as e:  # the client was closed
                errs = [e] * len(ranges)
            for i, err in zip(owners, errs):
                if err is not None and out[i] >= 0:
                    out[i] = code_of(err)
        return out

    def batch_put_session_end(self, keys):
        """Commits the keys (one master call per session): per key 0, or a
        negative code (INVALID_WRITE: a byte of its value was never
        written, or a write failed; OBJECT_NOT_FOUND: no open put session)."""
        return self._close_puts(list(keys), commit=True)

    def batch_put_session_revoke(self, keys):
        """Gives the keys up: per key 0, or OBJECT_NOT_FOUND where no put
        session holds it."""
        return self._close_puts(list(keys), commit=False)

    def _close_puts(self, keys, commit):
        opened = self._open("put")
        # Committed before unmapped: unmapping a session's last key revokes it.
        entries = [opened.get(k) for k in keys]
        out = [OK if e is not None else OBJECT_NOT_FOUND for e in entries]
        by_session = {}
        for i, e in enumerate(entries):
            if e is not None:
                by_session.setdefault(id(e[0]), (e[0], [], []))[1].append(e[1])
                by_session[id(e[0])][2].append(i)
        for session, indices, owners in by_session.values():
            try:
                if commit:
                    for i, err in zip(owners, session.commit(indices)):
                        out[i] = _commit_code(err)
                else:
                    session.revoke(indices)
            except Error as e:
                for i in owners:
                    out[i] = _code(e)
        opened.pop([k for k, e in zip(keys, entries) if e is not None])
        return out
