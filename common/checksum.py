"""The object checksum: CRC-32C (Castagnoli) of an object's bytes.

CRC-32C because it is what storage systems use for exactly this (iSCSI, ext4, RocksDB), and the
``crc32c`` package computes it with the CPU's CRC instructions: ~90 us per 2 MiB block here
(~22 GB/s), against ~750 us for zlib.crc32. On the wire a checksum is ``(1 << 32) | crc`` and 0
means "none recorded", so that a field of proto3's default value is never taken for a CRC.
"""

from __future__ import annotations

import crc32c as _crc32c

_PRESENT = 1 << 32


def checksum(data) -> int:
    """CRC-32C of a bytes-like object (bytes, memoryview, numpy array...)."""
    return _crc32c.crc32c(data)


def encode(crc: int | None) -> int:
    """A checksum (or None) as it travels in protobuf."""
    return 0 if crc is None else _PRESENT | crc


def decode(value: int) -> int | None:
    """The inverse of :func:`encode`."""
    return value & 0xFFFFFFFF if value & _PRESENT else None
