"""KV events: what a serving instance tells the master about its own cache (vLLM-compatible).

Shared by the master's routing index, the client's event publisher and the vLLM ZMQ bridge.
``tier`` is the instance's cache tier: "gpu" (vLLM medium "GPU" or unset) or "cpu" (any other
medium: the instance's host-memory or disk offload).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

GPU, CPU = "gpu", "cpu"
LOCAL_TIERS = (GPU, CPU)


def tier_of_medium(medium: str | None) -> str:
    """vLLM's ``medium`` field -> our instance tier: unset or GPU is "gpu", any offload "cpu"."""
    return GPU if not medium or str(medium).upper() == "GPU" else CPU


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: tuple[Hashable, ...]
    tier: str = GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[Hashable, ...]
    tier: str = GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
