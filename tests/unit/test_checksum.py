"""Checksums: many buffers' CRC-32C, a helper thread and the caller's thread sharing the work."""

from __future__ import annotations

import os

import crc32c
import numpy as np
from kvpool.common.checksum import Checksums, checksum, decode, encode


def test_each_buffer_gets_its_own_crc_in_order_inline_and_with_the_helper():
    small = [os.urandom(n) for n in (1, 100, 4096)]
    large = [np.frombuffer(os.urandom(1 << 20), dtype=np.uint8) for _ in range(12)]
    for buffers in (small, large):   # 12 MiB: above the helper thread's threshold
        with Checksums(buffers) as job:
            assert job.result() == [crc32c.crc32c(b) for b in buffers]


def test_leaving_early_stops_the_helper():
    buffers = [os.urandom(1 << 20) for _ in range(16)]
    with Checksums(buffers) as job:
        pass
    assert job._helper is None or not job._helper.is_alive()


def test_wire_encoding_round_trips_and_zero_means_none():
    crc = checksum(b"kvpool")
    assert decode(encode(crc)) == crc and crc == crc32c.crc32c(b"kvpool")
    assert encode(None) == 0 and decode(0) is None and decode(encode(0)) == 0
