"""Mooncake's Python transfer engine (mooncake.engine) over tierkv's.

Prefill-to-decode code written against Mooncake's `TransferEngine` (SGLang's
`--disaggregation-transfer-backend mooncake`, vLLM's MooncakeConnector) runs
unchanged:

    from tierkv.mooncake_engine import TransferEngine   # or mooncake.engine via python/compat
    te = TransferEngine()
    te.initialize("10.0.0.2", "P2PHANDSHAKE", "tcp", "")
    session = f"10.0.0.2:{te.get_rpc_port()}"           # what peers pass as target_hostname
    te.batch_register_memory([kv_ptr], [kv_bytes])
    te.batch_transfer_sync_write(peer_session, [src], [peer_dst], [n])   # 0, or -1

Conventions are Mooncake's: names, argument order and return values match
its binding; calls return 0 or -1 (batch ids: 0 on failure; a single
submit: 2**64-1) and never raise on a network or peer error; every call
releases the GIL and may run from any number of threads. A peer's memory is
named by absolute address; a range outside every buffer it registered is
refused (-1) with nothing written. A transfer ends by MC_TRANSFER_TIMEOUT
seconds (default 30, at least 5) plus 1 ns per byte. MC_FORCE_TCP (set at
all) keeps it to tcp; otherwise same-host peers go by shm (memory from
allocate_managed_buffer) or cuda, others by rdma where `device_name` names
NICs, else tcp.

Only "P2PHANDSHAKE" is served as metadata_server: tierkv's engines find
each other's buffers from the peers themselves. A port inside
`local_hostname` is ignored (the engine picks one; get_rpc_port tells)
unless MC_LEGACY_RPC_PORT_BINDING is set.
"""

import ctypes
import enum
import logging
import os

from ._tierkv import PeerEngine

log = logging.getLogger("tierkv.mooncake_engine")

_FAILED_SUBMIT = 2**64 - 1


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: delivered to the peer after a transfer's data."""

    def __init__(self, name="", msg=""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _timeout():
    try:
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        return 30.0


def _split_host(local_hostname):
    """(host, port) of "host", "host:port" or "[v6]:port"; port 0 when absent."""
    h = local_hostname.strip()
    port = ""
    if h.startswith("["):
        host, _, rest = h[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif h.count(":") == 1:
        host, port = h.split(":", 1)
    else:
        host = h
    return host, int(port) if port.isdigit() else 0


class TransferEngine:
    TransferOpcode = TransferOpcode

    def __init__(self):
        self._engine = None
        self._timeout = _timeout()
        self._hostname = ""

    # --- setup

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """0, or -1 (the reason is logged)."""
        if self._engine is not None:
            log.error("initialize: this engine is already initialized")
            return -1
        if metadata_server != "P2PHANDSHAKE":
            log.error("initialize: metadata server %r: tierkv's engine serves only P2PHANDSHAKE", metadata_server)
            return -1
        host, port = _split_host(local_hostname)
        # As Mooncake, the port is the engine's choice, unless
        # MC_LEGACY_RPC_PORT_BINDING asks for the one given (here in peer
        # mode too: a restarted peer keeps its session id).
        if "MC_LEGACY_RPC_PORT_BINDING" not in os.environ:
            port = 0
        # Chosen automatically, rdma and cuda sit out where no NIC or GPU
        # is usable; MC_FORCE_TCP (set at all, as Mooncake reads it) keeps to tcp.
        transports = ["tcp"] if "MC_FORCE_TCP" in os.environ else []
        devices = [d for d in (device_name or "").split(",") if d]
        try:
            self._engine = PeerEngine(host, port, transports, devices, workers=8)
        except RuntimeError as e:
            log.error("initialize: %s", e)
            return -1
        self._hostname = host
        log.info("transfer engine at %s (protocol %s)", self._engine.session_id, protocol)
        return 0

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self):
        return self._engine.port if self._engine else -1

    def get_engine(self):
        """This engine; tierkv's MooncakeDistributedStore.setup accepts it."""
        return self

    def get_engine_ptr(self):
        return id(self._engine) if self._engine else 0

    def get_local_topology(self, device_name=None):
        return self._engine.topology() if self._engine else "{}"

    # --- memory

    def register_memory(self, buffer_addr, capacity, location="*"):
        return self._engine.register_memory(buffer_addr, capacity, location) if self._engine else -1

    def unregister_memory(self, buffer_addr):
        return self._engine.unregister_memory(buffer_addr) if self._engine else -1

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        if self._engine is None or len(buffer_addresses) != len(capacities):
            return -1
        done = []
        for addr, cap in zip(buffer_addresses, capacities):
            if self._engine.register_memory(addr, cap, location) != 0:
                for a in done:  # all or nothing, so a retry starts clean
                    self._engine.unregister_memory(a)
                return -1
            done.append(addr)
        return 0

    def batch_unregister_memory(self, buffer_addresses):
        if self._engine is None:
            return -1
        rc = 0
        for addr in buffer_addresses:
            if self._engine.unregister_memory(addr) != 0:
                rc = -1
        return rc

    def allocate_managed_buffer(self, length):
        return self._engine.allocate(length) if self._engine else 0

    def free_managed_buffer(self, buffer_addr, length):
        return self._engine.free(buffer_addr, length) if self._engine else -1

    def write_bytes_to_buffer(self, dest_address, src_ptr, length):
        data = bytes(src_ptr)
        if length > len(data):
            return -1
        ctypes.memmove(dest_address, data, length)
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        return ctypes.string_at(source_address, length)

    # --- transfers

    def _move(self, target, buffers, peers, lengths, opcode, notify=None):
        if self._engine is None:
            return -1
        rc, why = self._engine.transfer(target, int(opcode), list(buffers), list(peers), list(lengths), self._timeout)
        if rc != 0:
            log.debug("transfer to %s failed: %s", target, why)
            return -1
        if notify is not None:
            # As Mooncake: the data landed, so the call succeeds even when
            # the notification cannot be delivered (it is logged).
            msg = notify.msg.encode() if isinstance(notify.msg, str) else bytes(notify.msg)
            nrc, nwhy = self._engine.notify(target, notify.name, msg, self._timeout)
            if nrc != 0:
                log.warning("notification %r to %s not delivered: %s", notify.name, target, nwhy)
        return 0

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        return self._move(target_hostname, [buffer], [peer_buffer_address], [length], Write)

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        return self._move(target_hostname, [buffer], [peer_buffer_address], [length], Read)

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode, notify=None,
                      transport_hint=""):
        return self._move(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        return self._move(target_hostname, buffers, peer_buffer_addresses, lengths, Write)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        return self._move(target_hostname, buffers, peer_buffer_addresses, lengths, Read)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify=None,
                            transport_hint=""):
        return self._move(target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                             transport_hint=""):
        """A batch id for get_batch_transfer_status; 0 when nothing started."""
        if self._engine is None:
            return 0
        return self._engine.submit(target_hostname, int(opcode), list(buffers), list(peer_buffer_addresses),
                                   list(lengths), self._timeout)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                   transport_hint=""):
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, Write)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, Read)

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch; 0 when all landed, else -1. Frees the ids."""
        if self._engine is None:
            return -1
        return self._engine.wait_all(list(batch_ids))

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        if self._engine is None:
            return _FAILED_SUBMIT
        bid = self._engine.submit(target_hostname, int(Write), [buffer], [peer_buffer_address], [length],
                                  self._timeout)
        return bid if bid != 0 else _FAILED_SUBMIT

    def transfer_check_status(self, batch_id):
        """1 done, 0 still moving, -1 failed (or unknown id), -2 timed out."""
        if self._engine is None:
            return -1
        rc = self._engine.check(batch_id)
        return -1 if rc == -3 else rc

    # --- peers and notifications

    def send_probe(self, peer_server_name):
        """0 when the peer answers (a failed peer may then be used again)."""
        if self._engine is None:
            return -1
        return 0 if self._engine.probe(peer_server_name, min(self._timeout, 5.0)) >= 0 else -1

    def get_first_buffer_address(self, segment_name):
        if self._engine is None:
            return 0
        return max(0, self._engine.probe(segment_name, min(self._timeout, 5.0)))

    def get_notifies(self):
        """Every notification received since the last call, oldest first."""
        if self._engine is None:
            return []
        out = []
        for name, msg, _sender in self._engine.take_notifications():
            try:
                text = msg.decode()
            except UnicodeDecodeError:
                text = msg.decode("latin-1")
            out.append(TransferNotify(name, text))
        return out

    def coalesced_entries(self):
        """tierkv's own: entries moved inside a neighbour's run so far."""
        return self._engine.coalesced() if self._engine else 0


__all__ = ["Read", "TransferEngine", "TransferNotify", "TransferOpcode", "Write"]
