"""The exception tree, and the one table from wire status codes to exceptions.

Every error the SDK raises is a ``KVPoolError``; callers that only want to degrade gracefully
(recompute instead of load) catch that one class.
"""

from __future__ import annotations

from kvpool.protos.kvpool.v1 import master_pb2 as pb


class KVPoolError(Exception):
    """Root of every kvpool error."""


class InvalidArgument(KVPoolError, ValueError):
    """The request itself is wrong (empty key, oversized key, empty value, bad buffer...)."""


class ObjectNotFound(KVPoolError, KeyError):
    """No complete object is stored under this key."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the message as written
        return str(self.args[0]) if self.args else "object not found"


class AlreadyExists(KVPoolError):
    """The key is already stored (or being stored): keys are immutable, nothing was written."""


class NoSpace(KVPoolError):
    """The cluster has no room for the object, even after eviction."""


class QuotaExceeded(NoSpace):
    """The object would take its tenant past its byte quota (common/tenants.py): nothing was
    placed or evicted."""


class ValueTooLarge(NoSpace, InvalidArgument):
    """The value is larger than any mounted segment: it can never be stored."""


class CorruptObject(KVPoolError):
    """Every replica read failed its checksum: the object's bytes are damaged. The damaged
    replicas were reported: each node re-checks its own and drops it if it is damaged there;
    no data was returned."""


class Conflict(KVPoolError):
    """An announced object contradicts the master's index (overlapping extent, other version)."""


class NotPending(KVPoolError):
    """PutEnd / PutRevoke on a key that is not being put (it timed out, or was never started)."""


class NodeUnavailable(KVPoolError):
    """No store node holding the object could be reached."""


class UnknownNode(KVPoolError):
    """The master does not know this store node (declared dead, or the master restarted)."""


class MasterUnavailable(KVPoolError):
    """The master could not be reached within the deadline."""


class ClientClosed(KVPoolError):
    """The client was used after ``close()``."""


class LimitExceeded(KVPoolError):
    """A configured limit refuses this (the message names the limit and its flag)."""


class HashSpecMismatch(KVPoolError):
    """The client's block size or block-hash spec differs from the cluster's: its keys could
    never match anyone else's, so the master refuses it rather than let it mis-key silently."""


class Unauthenticated(KVPoolError):
    """The master does not know who this is: no credentials, or ones its CA did not sign
    (gRPC UNAUTHENTICATED). SECURITY.md says where a process finds its credentials."""


class PermissionDenied(KVPoolError):
    """The caller's role may not make this call, or a store node named another node than
    itself (gRPC PERMISSION_DENIED); the message names the caller and what it may do."""


class TransportError(KVPoolError, OSError):
    """Moving bytes to or from a store node failed (connection lost, refused, malformed reply)."""


class NodeRefused(TransportError):
    """A store node answered and refused the operation (no grant for it, an extent outside
    its segments, a peer it does not trust): it is reachable, so a client does not route
    around it as it does around a node that did not answer."""


class SegmentBoundsError(NodeRefused):
    """A store node refused a request outside its mounted segments (or, on the tcp data
    port, without a grant for it)."""


_STATUS_TO_ERROR: dict[int, type[KVPoolError]] = {
    pb.STATUS_NOT_FOUND: ObjectNotFound,
    pb.STATUS_ALREADY_EXISTS: AlreadyExists,
    pb.STATUS_NO_SPACE: NoSpace,
    pb.STATUS_TOO_LARGE: ValueTooLarge,
    pb.STATUS_INVALID_ARGUMENT: InvalidArgument,
    pb.STATUS_NOT_PENDING: NotPending,
    pb.STATUS_UNKNOWN_NODE: UnknownNode,
    pb.STATUS_CONFLICT: Conflict,
    pb.STATUS_QUOTA_EXCEEDED: QuotaExceeded,
}

_ERROR_TO_STATUS: dict[type[KVPoolError], int] = {
    ObjectNotFound: pb.STATUS_NOT_FOUND,
    AlreadyExists: pb.STATUS_ALREADY_EXISTS,
    NoSpace: pb.STATUS_NO_SPACE,
    ValueTooLarge: pb.STATUS_TOO_LARGE,
    InvalidArgument: pb.STATUS_INVALID_ARGUMENT,
    NotPending: pb.STATUS_NOT_PENDING,
    UnknownNode: pb.STATUS_UNKNOWN_NODE,
    Conflict: pb.STATUS_CONFLICT,
    QuotaExceeded: pb.STATUS_QUOTA_EXCEEDED,
}


def error_for_status(status: int, key: str | None = None) -> KVPoolError | None:
    """The exception for a per-key wire status, or None for STATUS_OK."""
    if status == pb.STATUS_OK:
        return None
    cls = _STATUS_TO_ERROR.get(status, KVPoolError)
    name = pb.Status.Name(status) if status in pb.Status.values() else str(status)
    what = name.removeprefix("STATUS_").lower().replace("_", " ")
    return cls(f"{key!r}: {what}" if key is not None else what)


def status_for_error(exc: KVPoolError) -> int:
    """The wire status for a domain exception (most specific class wins)."""
    for cls in type(exc).__mro__:
        if cls in _ERROR_TO_STATUS:
            return _ERROR_TO_STATUS[cls]
    raise TypeError(f"no wire status for {type(exc).__name__}")
