"""The block-hash spec against its published vectors and an independent reading of its text."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.common.errors import InvalidArgument
from kvpool.common.hashing import HashSpec, block_hash, block_key

VECTORS = json.loads((Path(__file__).parent / "hash_vectors.json").read_text())["vectors"]


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_published_vectors(v):
    spec = HashSpec(v["block_size"], tuple(v["extra_keys"].items()))
    assert spec.root().hex() == v["root"]
    assert [h.hex() for h in spec.hashes(v["tokens"])] == v["block_hashes"]
    assert spec.keys(v["tokens"]) == v["keys"]


def _spec_as_written(block_size, extra, tokens):
    """The docstring's formula, re-implemented from its text with nothing but hashlib."""
    u32 = lambda n: struct.pack("<I", n)
    pairs = sorted(extra.items())
    root = b"kvpool.root.v1\0" + u32(block_size) + u32(len(pairs))
    for k, val in pairs:
        root += u32(len(k.encode())) + k.encode() + u32(len(val.encode())) + val.encode()
    parent, out = hashlib.sha256(root).digest(), []
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(b"kvpool.block.v1\0" + parent + u32(len(blk))
                                + b"".join(map(u32, blk))).digest()
        out.append(parent.hex())
    return out


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vectors_follow_the_documented_formula(v):
    assert _spec_as_written(v["block_size"], v["extra_keys"], v["tokens"]) == v["block_hashes"]


def test_chain_shares_exactly_the_common_prefix():
    spec = HashSpec.of(4, model="m")
    a = spec.hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = spec.hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 11, 12])
    assert a[:2] == b[:2] and a[2] != b[2]
    # Same tokens after a different prefix: a different hash (the chain covers the past).
    assert spec.hashes([9, 9, 9, 9, 5, 6, 7, 8])[1] != a[1]


def test_extra_keys_and_block_size_namespace_every_block():
    tokens = list(range(8))
    assert HashSpec.of(4, model="a").hashes(tokens)[0] != HashSpec.of(4, model="b").hashes(tokens)[0]
    assert HashSpec.of(4).hashes(tokens)[0] != HashSpec.of(8).hashes(tokens)[0]
    # Order of extra keys does not matter: they are canonicalised.
    assert HashSpec.of(4, a="1", b="2").root() == HashSpec.of(4, b="2", a="1").root()


def test_independent_of_the_interpreter_hash_seed():
    code = ("from kvpool.common.hashing import HashSpec;"
            "print(HashSpec.of(4, model='m').hashes([1, 2, 3, 4])[0].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], ["a"]])
def test_bad_token_ids_are_refused(tokens):
    with pytest.raises(InvalidArgument, match="token id"):
        block_hash(HashSpec(1).root(), tokens)


def test_bad_specs_are_refused():
    with pytest.raises(InvalidArgument, match="block size"):
        HashSpec(0)
    with pytest.raises(InvalidArgument, match="unknown hash spec"):
        HashSpec(16, name="vllm-builtin")
    with pytest.raises(InvalidArgument, match="twice"):
        HashSpec(16, (("model", "a"), ("model", "b")))


def test_block_key_is_a_valid_store_key():
    key = block_key(HashSpec(2).hashes([1, 2])[0])
    assert key.startswith("kvpool/b1/") and len(key) == 10 + 64
