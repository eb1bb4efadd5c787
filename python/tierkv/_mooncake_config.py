"""What a caller configures a tierkv.mooncake_compat store with: setup()'s
arguments (positional, keyword, or one Mooncake config dict with readable
sizes such as "4GB"), the TIERKV_* environment it reads, and ReplicateConfig
with its enums for puts."""

import enum
import logging
import os
import socket

from ._mooncake_codes import INVALID_PARAMS

log = logging.getLogger("tierkv.mooncake_compat")


class SoftPinAction(enum.IntEnum):
    """What a put (or upsert) does to the object's soft pin (Mooncake's values)."""
    PRESERVE = 0  # follow with_soft_pin (a put makes a new object: nothing to preserve)
    ENABLE = 1    # soft-pin the object
    DISABLE = 2   # do not soft-pin it



class ObjectDataType(enum.IntEnum):
    """Accepted on ReplicateConfig.data_type; tierkv stores every type alike."""
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """Mooncake's replication options for a put.

    tierkv honours replica_num, preferred_segment (or the first of
    preferred_segments; a segment name or a store's get_hostname()),
    with_soft_pin / soft_pin_action (ENABLE pins, DISABLE and PRESERVE follow
    with_soft_pin), with_hard_pin and group_ids. soft_pin_ttl_ms is checked
    (only with ENABLE) and otherwise ignored: a tierkv soft pin has no expiry,
    it only orders eviction. prefer_alloc_in_same_node, data_type and
    nof_replica_num (NVMe-oF replicas; tierkv has no such tier) are accepted
    and ignored, except that a put asking only for NVMe-oF replicas fails."""

    def __init__(self):
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = None
        self.preferred_segment = ""
        self.preferred_segments = []
        self.prefer_alloc_in_same_node = False
        self.group_ids = []
        self.nof_replica_num = 0
        self.data_type = ObjectDataType.UNKNOWN

    def __repr__(self):
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_soft_pin={self.with_soft_pin}, "
                f"with_hard_pin={self.with_hard_pin}, soft_pin_action={SoftPinAction(self.soft_pin_action).name}, "
                f"soft_pin_ttl_ms={self.soft_pin_ttl_ms}, preferred_segment={self.preferred_segment!r}, "
                f"preferred_segments={self.preferred_segments!r}, group_ids={self.group_ids!r})")

    __str__ = __repr__


_SETUP_PARAMS = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
                 "rdma_devices", "master_server_addr", "engine")
_SETUP_DEFAULTS = {"global_segment_size": 16 << 20, "local_buffer_size": 16 << 20, "protocol": "tcp",
                   "rdma_devices": "", "master_server_addr": "127.0.0.1:50051", "engine": None}


_SIZE_UNITS = (("tib", 1 << 40), ("gib", 1 << 30), ("mib", 1 << 20), ("kib", 1 << 10),
               ("tb", 1 << 40), ("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10),
               ("t", 1 << 40), ("g", 1 << 30), ("m", 1 << 20), ("k", 1 << 10), ("b", 1))


def parse_size(value):
    """Bytes from an int or a human-readable size: "4GB", "512MB", "1.5g",
    "64k", "4096" (units are powers of 1024, as in Mooncake's configs).
    Raises ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"negative size: {value}")
        return value
    text = str(value).strip().lower()
    for unit, scale in _SIZE_UNITS:
        if text.endswith(unit):
            number = text[: -len(unit)].strip()
            break
    else:
        number, scale = text, 1
    try:
        n = float(number)
    except ValueError:
        raise ValueError(f"not a size: {value!r}") from None
    if n < 0 or n != n:
        raise ValueError(f"not a size: {value!r}")
    return int(n * scale)


# setup(config) keys: setup()'s own parameter names, plus the spellings of
# Mooncake's JSON config files (device_name, master_server_address).
_CONFIG_ALIASES = {"device_name": "rdma_devices", "master_server_address": "master_server_addr"}
_CONFIG_IGNORED = ("tenant_id", "enable_ssd_offload", "ssd_offload_path", "enable_client_http_server",
                   "client_http_port", "ipc_socket_path")


def _bind_config(config):
    """setup()'s arguments from a Mooncake config dict; INVALID_PARAMS (as an
    int) where a key is missing, unknown or a size unreadable."""
    bound = {}
    for key, value in config.items():
        name = _CONFIG_ALIASES.get(key, key)
        if name in _CONFIG_IGNORED:
            log.info("setup(config): %r is not used by tierkv; ignored", key)
            continue
        if name not in _SETUP_PARAMS or name == "engine":
            log.error("setup(config): unknown key %r", key)
            return INVALID_PARAMS
        bound[name] = value
    for name in ("local_hostname", "metadata_server", "master_server_addr"):
        if name not in bound:
            log.error("setup(config): missing %r", name)
            return INVALID_PARAMS
    for name, value in _SETUP_DEFAULTS.items():
        bound.setdefault(name, value)
    return bound


def _bind_setup(args, kwargs):
    """Binds setup()'s arguments as Python would, with Python's messages:
    an unknown keyword's TypeError names only that keyword."""
    if len(args) > len(_SETUP_PARAMS):
        raise TypeError(f"setup() takes from 3 to {len(_SETUP_PARAMS) + 1} positional arguments "
                        f"but {len(args) + 1} were given")
    bound = dict(zip(_SETUP_PARAMS, args))
    for name, value in kwargs.items():
        if name not in _SETUP_PARAMS:
            raise TypeError(f"setup() got an unexpected keyword argument '{name}'")
        if name in bound:
            raise TypeError(f"setup() got multiple values for argument '{name}'")
        bound[name] = value
    for name in ("local_hostname", "metadata_server"):
        if name not in bound:
            raise TypeError(f"setup() missing 1 required positional argument: '{name}'")
    for name, value in _SETUP_DEFAULTS.items():
        bound.setdefault(name, value)
    return bound


def _env_seconds(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s", name, os.environ[name], default)
        return default


def _env_count(name, default):
    try:
        n = int(os.environ.get(name, default))
        if n >= 0:
            return n
    except ValueError:
        pass
    log.warning("%s=%r is not a count of 0 or more; using %s", name, os.environ[name], default)
    return default


def _listen_address(hostname):
    """The address the lent segment serves on: local_hostname's host part."""
    host = hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname
    if host in ("", "localhost"):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def _rdma_nic_present():
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False
