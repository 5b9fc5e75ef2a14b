"""Facts about the host this process runs on."""

from __future__ import annotations

import functools

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@functools.cache
def local_boot_id() -> str:
    """The running kernel's boot id (a random UUID chosen at boot).

    Two processes with equal boot ids run on the same kernel, so they can share memory (the shm
    transport); unlike a hostname this cannot collide between hosts, and containers on one host
    see the same value. Returns "" where the file is missing (not Linux): equal only to "".
    """
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""
