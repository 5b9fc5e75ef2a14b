"""The byte form of a tensor for the compat layer's ``put_tensor`` / ``get_tensor``: a small
header (dtype, shape) then the tensor's raw bytes. Not Mooncake's own layout: a tensor put
through kvpool is read back through kvpool. torch is imported only when a tensor is decoded."""

from __future__ import annotations

import struct

from kvpool.client.buffers import byte_view
from kvpool.common.errors import InvalidArgument

_MAGIC = b"KVPT"
_HEAD = struct.Struct("<4sBB")   # magic, len(dtype name), ndim; then the name, then int64 dims


def encode(tensor) -> bytes:
    """The header and bytes of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    if type(tensor).__module__.split(".")[0] != "torch":
        raise InvalidArgument(f"expected a torch tensor, not {type(tensor).__name__}")
    name = str(tensor.dtype).removeprefix("torch.").encode()
    shape = tuple(tensor.shape)
    head = _HEAD.pack(_MAGIC, len(name), len(shape)) + name + struct.pack(f"<{len(shape)}q",
                                                                          *shape)
    return head + bytes(byte_view(tensor, writable=False)) if tensor.numel() else head


def decode(data: bytes | bytearray | memoryview):
    """The tensor :func:`encode` wrote (it owns a copy of the bytes)."""
    import torch
    view = memoryview(data)
    if len(view) < _HEAD.size or bytes(view[:4]) != _MAGIC:
        raise InvalidArgument("not a tensor stored by put_tensor")
    _, name_len, ndim = _HEAD.unpack_from(view)
    at = _HEAD.size
    dtype = getattr(torch, bytes(view[at:at + name_len]).decode())
    at += name_len
    shape = struct.unpack_from(f"<{ndim}q", view, at)
    at += 8 * ndim
    body = bytearray(view[at:])
    if not body:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(body, dtype=torch.uint8).view(dtype).reshape(shape)
