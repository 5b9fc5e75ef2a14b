"""``mooncake.store`` on kvpool: see kvpool/compat/mooncake.py."""

from kvpool.compat.mooncake import (  # noqa: F401  (re-exported)
    BufferHandle,
    MooncakeDistributedStore,
    ReplicateConfig,
)
