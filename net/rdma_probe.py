"""Whether this process can use RDMA, without importing pyverbs where it is absent."""

from __future__ import annotations

import functools


@functools.cache
def unavailable_reason() -> str:
    """"" if this host can use RDMA, else why not (probed once per process)."""
    try:
        from kvpool.net import verbs
    except ImportError:
        return "pyverbs is not installed (Debian/Ubuntu: apt install python3-pyverbs)"
    return verbs.probe()
