"""mooncake.store served by tierkv (tierkv.mooncake_compat)."""
from tierkv.mooncake_compat import *  # noqa: F401,F403
from tierkv.mooncake_compat import (BufferPool, MooncakeDistributedStore, RegisteredBufferPool,  # noqa: F401
                                    ReplicateConfig, SoftPinAction, bind_to_numa_node)
