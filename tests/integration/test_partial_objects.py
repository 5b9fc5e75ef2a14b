"""client/partial.py against a real cluster: objects written and read piece by piece."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.partial import PartialGet, PartialPut
from kvpool.common.errors import CorruptObject, InvalidArgument, ObjectNotFound

PIECES = 4
PIECE = 4096


def _objects(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, (n, PIECES * PIECE), dtype=np.uint8)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pieces_written_in_order_read_back_in_ranges(cluster, transport):
    data = _objects(6)
    keys = [f"partial/{i}" for i in range(len(data))]
    with KVClient(cluster.master, transports=[transport]) as kv:
        put = PartialPut(kv, keys, [row.nbytes for row in data])
        # Byte ranges over shm; a tcp node serves only the whole extent it was granted.
        assert put.piecewise == (transport == "shm")
        pieces = PIECES if put.piecewise else 1
        size = PIECES * PIECE // pieces
        # Nothing is readable before the commit.
        assert kv.batch_exists(keys) == [False] * len(keys)
        for p in range(pieces):
            put.write(p * size, [row[p * size:(p + 1) * size] for row in data])
        assert kv.batch_exists(keys) == [False] * len(keys)
        assert put.commit() == [None] * len(keys)
        # A whole-object read agrees, and so does the checksum chained over the pieces.
        assert [kv.get(k, verify=True) for k in keys] == [row.tobytes() for row in data]

        got = PartialGet(kv, [*keys, "partial/missing"], verify=True)
        assert got.piecewise == (transport == "shm")
        out = np.zeros((len(keys) + 1, PIECES * PIECE), dtype=np.uint8)
        for p in reversed(range(pieces)):   # any order; only in-order reads are verified
            got.read(p * size, [row[p * size:(p + 1) * size] for row in out])
        results = got.finish()
        assert results[:-1] == [None] * len(keys)
        assert isinstance(results[-1], ObjectNotFound)
        assert (out[:-1] == data).all()


def test_a_key_not_written_in_full_is_revoked_not_committed(cluster):
    data = _objects(2)
    keys = ["partial/full", "partial/short"]
    with KVClient(cluster.master, transports=["shm"]) as kv:
        put = PartialPut(kv, keys, [row.nbytes for row in data])
        put.write(0, [data[0][:PIECE], data[1][:PIECE]])
        put.write(PIECE, [data[0][PIECE:], None])
        results = put.commit()
        assert results[0] is None and isinstance(results[1], InvalidArgument)
        assert kv.batch_exists(keys) == [True, False]
        with pytest.raises(InvalidArgument, match="in order"):
            PartialPut(kv, ["partial/x"], [PIECE * 2]).write(PIECE, [data[0][:PIECE]])


def test_damage_is_caught_when_the_pieces_cover_the_object(cluster):
    data = _objects(1)
    with KVClient(cluster.master, transports=["shm"]) as kv:
        put = PartialPut(kv, ["partial/d"], [data[0].nbytes])
        for p in range(PIECES):
            put.write(p * PIECE, [data[0][p * PIECE:(p + 1) * PIECE]])
        # The checksum given at commit is of other bytes: what is read must fail it.
        put._crc[0] ^= 1
        assert put.commit() == [None]
        got = PartialGet(kv, ["partial/d"], verify=True)
        out = np.zeros_like(data)
        for p in range(PIECES):
            got.read(p * PIECE, [out[0][p * PIECE:(p + 1) * PIECE]])
        assert isinstance(got.finish()[0], CorruptObject)
