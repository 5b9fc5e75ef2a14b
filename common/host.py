"""Facts about the host this process runs on, and mapping its shared memory."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# madvise: fault pages in writable now (Linux 5.14+; Python names it from 3.12 on).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_libc = ctypes.CDLL(None, use_errno=True)      # a foreign call releases the GIL
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


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


def map_populated(fd: int, length: int) -> mmap.mmap:
    """A shared, writable mapping of ``fd`` with its page tables filled in now, rather than a
    fault per 4 KiB page on first use: a store node's own segments (a client faults in only
    the ranges it copies: client/transport/shm.py, _Mapping). MAP_POPULATE alone maps the
    pages read-only, so the first write to each still faults (a 512 MiB put into a part of a segment not written yet
    took up to twice as long, through the client's mapping over shm as through the node's over
    tcp); MADV_POPULATE_WRITE (Linux 5.14+) does both at MAP_POPULATE's cost. Older kernels
    get MAP_POPULATE, the best there is."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    mm = mmap.mmap(fd, length, mmap.MAP_SHARED, prot)
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
        return mm
    except OSError:
        mm.close()
    return mmap.mmap(fd, length, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)


def advise(address: int, length: int, advice: int) -> None:
    """``madvise(2)`` on ``[address, address + length)`` (``address`` page-aligned) with the GIL
    released: ``mmap.madvise`` holds it, and faulting 512 MiB in takes ~0.15 s here, which
    stalls every other thread of the process for as long. OSError where the kernel refuses
    (an advice it does not know: EINVAL before Linux 5.14)."""
    if _libc.madvise(address, length, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
