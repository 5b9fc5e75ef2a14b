"""Mooncake Store's error codes (mooncake-store/include/types.h, ``enum class ErrorCode``) and
the one table from kvpool's exceptions to them."""

from __future__ import annotations

from enum import IntEnum

from kvpool.common.errors import (
    AlreadyExists,
    ClientClosed,
    CorruptObject,
    InvalidArgument,
    KVPoolError,
    MasterUnavailable,
    NodeUnavailable,
    NoSpace,
    ObjectNotFound,
    TransportError,
)


class ErrorCode(IntEnum):
    """The codes the compat layer returns (a subset of Mooncake's; same numbers)."""
    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200      # no space
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_READ = -701
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    TRANSFER_FAIL = -800
    RPC_FAIL = -900


# First match wins: NoSpace before InvalidArgument (ValueTooLarge is both: Mooncake answers
# a value no segment can hold with "no handle").
_TABLE: tuple[tuple[type[KVPoolError], ErrorCode], ...] = (
    (AlreadyExists, ErrorCode.OBJECT_ALREADY_EXISTS),
    (ObjectNotFound, ErrorCode.OBJECT_NOT_FOUND),
    (NoSpace, ErrorCode.NO_AVAILABLE_HANDLE),
    (InvalidArgument, ErrorCode.INVALID_PARAMS),
    (CorruptObject, ErrorCode.INVALID_READ),
    (ClientClosed, ErrorCode.ILLEGAL_CLIENT),
    (MasterUnavailable, ErrorCode.RPC_FAIL),
    (NodeUnavailable, ErrorCode.TRANSFER_FAIL),
    (TransportError, ErrorCode.TRANSFER_FAIL),
)


def code_of(error: BaseException | None) -> int:
    """0 for None, else the Mooncake code of a kvpool error (INTERNAL_ERROR if unlisted)."""
    if error is None:
        return ErrorCode.OK
    for kind, code in _TABLE:
        if isinstance(error, kind):
            return int(code)
    return int(ErrorCode.INTERNAL_ERROR)
