"""The shm batch read (KVClient._read_fast: no object per key) keeps every semantic of the
generic read path: per-key results, replica fallback, typed errors, lease re-checks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.transport.shm import SHMTransport
from kvpool.common.errors import InvalidArgument, ObjectNotFound, TransportError

BLOCK = 64 << 10


class SlowSHM(SHMTransport):
    """A real shm transport whose reads start only after ``delay_s`` (a reader stalled past
    its lease): batch reads (``read_at``) and a single get's (``read``)."""

    def __init__(self, delay_s: float, started: threading.Event):
        super().__init__()
        self.delay_s, self.started = delay_s, started

    def read_at(self, *args):
        self.started.set()
        time.sleep(self.delay_s)
        return super().read_at(*args)

    def read(self, ops):
        self.started.set()
        time.sleep(self.delay_s)
        return super().read(ops)


class BrokenBatchSHM(SHMTransport):
    """A real shm transport whose batch reads always fail: only the generic path works."""

    def read_at(self, segments, which, *args):
        return dict.fromkeys(range(len(which)), TransportError("batch read refused (test)"))


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def test_one_batch_mixes_fast_keys_generic_keys_and_errors(cluster):
    src = _rows(8, 1)
    with KVClient(cluster.master, transports=["shm"]) as kv:
        keys = [f"mix/{j}" for j in range(8)]
        assert kv.batch_put(keys[:6], list(src[:6]), replicas=1) == [None] * 6
        assert kv.batch_put(keys[6:], list(src[6:]), replicas=2) == [None] * 2
        dst = np.zeros_like(src)
        small = bytearray(BLOCK // 2)
        buffers = [*dst[:3], small, *dst[4:], bytearray(BLOCK)]
        got = kv.batch_get_into([*keys, "mix/missing"], buffers)
        assert [g for j, g in enumerate(got) if j not in (3, 8)] == [BLOCK] * 7
        assert isinstance(got[3], InvalidArgument)         # buffer too small, the rest read
        assert isinstance(got[8], ObjectNotFound)
        assert np.array_equal(np.delete(dst, 3, axis=0), np.delete(src, 3, axis=0))
        assert kv.batch_get(keys[:2]) == [src[0].tobytes(), src[1].tobytes()]


def test_rows_of_one_array_are_read_without_a_view_per_key(cluster):
    """Buffers given as one 2-D array (a KV cache's blocks): the batch read computes each
    row's address; keys it cannot take (several replicas, too long for a row, missing) keep
    the generic path's results."""
    src = _rows(8, 4)
    with KVClient(cluster.master, transports=["shm"]) as kv:
        keys = [f"rows/{j}" for j in range(8)]
        assert kv.batch_put(keys[:6], list(src[:6]), replicas=1) == [None] * 6
        assert kv.batch_put(keys[6:], list(src[6:]), replicas=2) == [None] * 2
        assert kv.put("rows/long", bytes(BLOCK + 1)) is None
        dst = np.zeros((10, BLOCK), dtype=np.uint8)
        got = kv.batch_get_into([*keys, "rows/long", "rows/missing"], dst)
        assert got[:8] == [BLOCK] * 8 and np.array_equal(dst[:8], src)
        assert isinstance(got[8], InvalidArgument) and isinstance(got[9], ObjectNotFound)
        torch = pytest.importorskip("torch")
        rows = torch.zeros((8, BLOCK // 4), dtype=torch.float32)   # any dtype: bytes per row
        assert kv.batch_get_into(keys, rows) == [BLOCK] * 8
        assert np.array_equal(rows.numpy().view(np.uint8), src)


@pytest.mark.parametrize("as_array", [False, True], ids=["buffer-list", "one-array"])
def test_a_failed_batch_read_falls_back_to_the_generic_path(cluster, as_array):
    src = _rows(4, 2)
    with KVClient(cluster.master, transports=[BrokenBatchSHM()]) as kv:
        keys = [f"broken/{j}" for j in range(4)]
        assert kv.batch_put(keys, list(src)) == [None] * 4
        dst = np.zeros_like(src)
        assert kv.batch_get_into(keys, dst if as_array else list(dst)) == [BLOCK] * 4
        assert np.array_equal(dst, src)


@pytest.mark.parametrize("as_array", [False, True], ids=["buffer-list", "one-array"])
def test_batch_read_past_its_lease_is_verified(cluster, timeouts, as_array):
    src = _rows(4, 3)
    started = threading.Event()
    with KVClient(cluster.master, transports=["shm"]) as kv:
        keys = [f"lease/{j}" for j in range(4)]
        assert kv.batch_put(keys, list(src)) == [None] * 4
        with KVClient(cluster.master,
                      transports=[SlowSHM(timeouts.lease_ttl_s * 1.5, started)]) as slow:
            dst = np.zeros_like(src)
            got = slow.batch_get_into(keys, dst if as_array else list(dst))
            assert got == [BLOCK] * 4   # verified, not failed
            assert np.array_equal(dst, src)
            # Removed, its space reused, while the slow read runs: never another object's bytes.
            started.clear()
            result: list = []
            t = threading.Thread(target=lambda: result.append(slow.batch_get(keys[:1])[0]))
            t.start()
            assert started.wait(10)
            kv.remove(keys[0])          # leased: vanishes now, space freed after the lease
            time.sleep(timeouts.lease_ttl_s + 0.5)
            kv.put("lease/new", src[1])  # may reuse the space keys[0] had
            t.join()
            assert isinstance(result[0], ObjectNotFound), result[0][:8]
