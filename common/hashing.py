"""The block-hash spec ``kvpool-sha256-v1``: chained, engine-independent KV block hashes.

A prompt is cut into full blocks of ``block_size`` tokens (a trailing partial block is never
hashed: its KV is not reusable as a unit). Block *i*'s hash covers every token before it, so two
prompts share block *i*'s hash exactly when they share their first ``(i + 1) * block_size``
tokens under the same extra keys::

    root     = SHA-256( b"kvpool.root.v1\\0" || u32(block_size) || u32(n)
                        || for each (name, value) in sorted(extra_keys):
                               u32(len(name)) || name || u32(len(value)) || value )
    block_0  = SHA-256( b"kvpool.block.v1\\0" || root || u32(len(tokens)) || u32(t) for t in tokens )
    block_i  = SHA-256( b"kvpool.block.v1\\0" || block_{i-1} || u32(len(tokens)) || u32(t) ... )

``u32`` is a 4-byte little-endian unsigned integer; names and values are UTF-8; token ids must
be in ``[0, 2**32)``. Extra keys are whatever else changes the KV of the same tokens: the model
name, the LoRA adapter, a cache salt. They enter once, through the root, so a different model
never matches another's blocks. Nothing depends on ``PYTHONHASHSEED``, the process or the
machine: the published vectors in ``tests/unit/hash_vectors.json`` pin the spec, and an engine in
another language can reproduce them with any SHA-256.

The store key of a block is ``"kvpool/b1/" + hash.hex()`` (:func:`block_key`).

vLLM's KV connector stores under a second scheme, ``kvpool-vllm-v1``
(``client/connectors/vllm_keys.py``): vLLM's own chained SHA-256 block hashes, namespaced by
model, KV dtype, block size, TP size and hash algorithm, one object per layer and TP rank
(``kvpool/vllm1/<namespace>/<block hash>/<layer>/<tp rank>``), so loads land straight in the
engine's paged cache. Matching follows the same rule: a block only as part of its prefix.

Clients register ``(spec name, block size)`` with the master (``Router.RegisterClient``); the
master refuses a client whose block size or spec differs from the cluster's, because its keys
could never match anyone else's.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvpool.common.errors import InvalidArgument

SPEC_NAME = "kvpool-sha256-v1"
KEY_PREFIX = "kvpool/b1/"
HASH_BYTES = 32
_ROOT_TAG = b"kvpool.root.v1\0"
_BLOCK_TAG = b"kvpool.block.v1\0"
_MAX_TOKEN = 2**32


@dataclass(frozen=True, slots=True)
class HashSpec:
    """How a client cuts and hashes token sequences. ``extra_keys`` (model, LoRA, salt) are
    per-deployment namespaces; ``name`` and ``block_size`` must match cluster-wide."""

    block_size: int
    extra_keys: tuple[tuple[str, str], ...] = ()
    name: str = SPEC_NAME

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidArgument(f"block size {self.block_size!r}: expected a whole number >= 1")
        if self.name != SPEC_NAME:
            raise InvalidArgument(f"unknown hash spec {self.name!r}: this kvpool knows "
                                  f"{SPEC_NAME!r}")
        object.__setattr__(self, "extra_keys", _canonical(self.extra_keys))

    @classmethod
    def of(cls, block_size: int, **extra_keys: str | int) -> HashSpec:
        """``HashSpec.of(16, model="llama-3-8b", lora="0")``."""
        return cls(block_size, tuple((k, str(v)) for k, v in extra_keys.items()))

    def root(self) -> bytes:
        """The parent hash of a sequence's first block."""
        return root_hash(self.block_size, self.extra_keys)

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        """The chained hash of each *full* block of ``tokens``."""
        return block_hashes(tokens, self.block_size, self.root())

    def keys(self, tokens: Sequence[int]) -> list[str]:
        """The store key of each full block of ``tokens``."""
        return [block_key(h) for h in self.hashes(tokens)]


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _canonical(extra_keys: Iterable[tuple[str, str]] | Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    items = extra_keys.items() if isinstance(extra_keys, Mapping) else extra_keys
    out = tuple(sorted((str(k), str(v)) for k, v in items))
    names = [k for k, _ in out]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"extra keys name the same key twice: {names}")
    return out


def root_hash(block_size: int, extra_keys: Iterable[tuple[str, str]] = ()) -> bytes:
    """The chain's root: block size and the canonical (sorted) extra keys."""
    pairs = _canonical(extra_keys)
    h = hashlib.sha256(_ROOT_TAG + _u32(block_size) + _u32(len(pairs)))
    for name, value in pairs:
        for part in (name.encode(), value.encode()):
            h.update(_u32(len(part)))
            h.update(part)
    return h.digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """One link of the chain: the hash of ``tokens`` following the block hashed ``parent``."""
    if len(parent) != HASH_BYTES:
        raise InvalidArgument(f"parent hash of {len(parent)} bytes; expected {HASH_BYTES}")
    try:
        packed = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t < _MAX_TOKEN), None)
        raise InvalidArgument(f"token id {bad!r}: expected an integer in [0, 2**32)") from None
    return hashlib.sha256(_BLOCK_TAG + parent + _u32(len(tokens)) + packed).digest()


def block_hashes(tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens`` (a trailing partial block is skipped)."""
    out: list[bytes] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        out.append(parent)
    return out


def block_key(h: bytes) -> str:
    """The store key under which a block's KV bytes live."""
    return KEY_PREFIX + h.hex()
