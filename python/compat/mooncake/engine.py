"""mooncake.engine served by tierkv (tierkv.mooncake_engine)."""
from tierkv.mooncake_engine import *  # noqa: F401,F403
from tierkv.mooncake_engine import TransferEngine, TransferNotify, TransferOpcode  # noqa: F401
