"""The kvpool client SDK: ``from kvpool.client import KVClient``."""

from kvpool.client.kv_client import KVClient
from kvpool.common.errors import (
    AlreadyExists,
    ClientClosed,
    InvalidArgument,
    KVPoolError,
    MasterUnavailable,
    NodeUnavailable,
    NoSpace,
    ObjectNotFound,
    TransportError,
    ValueTooLarge,
)

__all__ = [
    "AlreadyExists",
    "ClientClosed",
    "InvalidArgument",
    "KVClient",
    "KVPoolError",
    "MasterUnavailable",
    "NoSpace",
    "NodeUnavailable",
    "ObjectNotFound",
    "TransportError",
    "ValueTooLarge",
]
