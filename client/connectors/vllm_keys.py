"""The store keys of vLLM's KV blocks (schemes ``kvpool-vllm-v2`` and ``-v1``), and prefix matching.

vLLM names each full block of a request by a chained SHA-256 (``request.block_hashes``): block
*i*'s hash covers every token before it, plus what vLLM knows changes the KV of the same tokens
(LoRA adapter, multimodal inputs, cache salt). With the default ``sha256`` algorithm the chain's
seed is fixed, so the same prompt gets the same hashes in every vLLM process (a non-cryptographic
algorithm without a shared ``PYTHONHASHSEED`` seeds per process: such engines simply never match).
A vLLM block hash does not cover what else makes its bytes differ, so the key adds it.
``kvpool-vllm-v2`` (the connector's default) stores one object per (block, tensor-parallel
rank), holding every attention layer::

    namespace = SHA-256( "kvpool-vllm-v2\\0" || JSON{model, kv dtype, block_size, tp_size,
                                                   hash_algo, layers} )[:16 bytes] as hex
    key       = "kvpool/vllm2/" namespace "/" block_hash.hex() "/" tp_rank
    bytes     = layer 0's block || layer 1's block || ...   (``layers`` order)

where a layer's block is its bytes exactly as the engine's paged cache holds them, piece by
piece when the block is not contiguous (K then V where the layout splits them). The layer names
are in the namespace because they fix each layer's offset in the object. The object is written
layer by layer into space reserved at the first layer and read layer by layer
(``kvpool.client.partial``). A 32-layer model's 4K-token prompt (256 blocks of 16) is 256
objects on one TP rank, where ``-v1`` made 8,192.

``kvpool-vllm-v1`` stored one object per (block, attention layer, tensor-parallel rank)::

    key       = "kvpool/vllm1/" namespace "/" block_hash.hex() "/" layer_name "/" tp_rank

with the namespace above without ``layers`` and with ``kvpool-vllm-v1``. Neither scheme ever
matches the other's keys. Because block hashes chain, a block is only ever matched as part of
its prefix: :func:`present_prefix` counts the leading blocks *all* of whose objects are stored
and stops at the first block missing any.

These keys are not kvpool's own token-block keys (``common/hashing.py``, ``kvpool/b1/...``):
those hash token ids only and name one value per block; the router's KV-event bridge
(``kvpool kv-events``) translates vLLM's events into that spec for cache-aware routing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

SCHEME = "kvpool-vllm-v1"
KEY_PREFIX = "kvpool/vllm1/"
SCHEME_V2 = "kvpool-vllm-v2"
KEY_PREFIX_V2 = "kvpool/vllm2/"


@dataclass(frozen=True, slots=True)
class VLLMKeyScheme:
    """What makes one engine's KV bytes differ from another's for the same block hash."""

    model: str
    kv_dtype: str
    block_size: int
    tp_size: int
    hash_algo: str
    layer_names: tuple[str, ...]
    version: int = 1    # 2: one object per block and TP rank, all layers in it

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise ValueError(f"vLLM key scheme version {self.version!r}: 1 or 2")

    @property
    def namespace(self) -> str:
        identity = {"model": self.model, "kv_dtype": self.kv_dtype,
                    "block_size": self.block_size, "tp_size": self.tp_size,
                    "hash_algo": self.hash_algo}
        if self.version == 2:
            identity["layers"] = list(self.layer_names)
        scheme = SCHEME if self.version == 1 else SCHEME_V2
        text = json.dumps(identity, sort_keys=True)
        return hashlib.sha256(f"{scheme}\0{text}".encode()).hexdigest()[:32]

    def block_keys(self, block_hash: bytes, tp_rank: int) -> list[str]:
        """A block's keys on one TP rank: one per layer (``layer_names`` order) in version 1,
        the one object of every layer in version 2."""
        if self.version == 2:
            return [f"{KEY_PREFIX_V2}{self.namespace}/{block_hash.hex()}/{tp_rank}"]
        base = f"{KEY_PREFIX}{self.namespace}/{block_hash.hex()}/"
        return [f"{base}{layer}/{tp_rank}" for layer in self.layer_names]

    def prefix_keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """Every object of every block, block by block (all layers, all TP ranks): what must
        all be stored for the blocks to load on every rank."""
        return [k for h in block_hashes for r in range(self.tp_size) for k in self.block_keys(h, r)]

    @property
    def objects_per_block(self) -> int:
        return (1 if self.version == 2 else len(self.layer_names)) * self.tp_size


def present_prefix(found: Sequence[bool], objects_per_block: int) -> int:
    """How many leading blocks have all their objects present (``found`` is block-major, as
    :meth:`VLLMKeyScheme.prefix_keys` orders it)."""
    n = 0
    for start in range(0, len(found) - objects_per_block + 1, objects_per_block):
        if not all(found[start:start + objects_per_block]):
            break
        n += 1
    return n


def loadable_blocks(num_tokens: int, num_hashes: int, block_size: int) -> int:
    """The most leading full blocks a request may take from the store: every full block whose
    hash vLLM has, but never the request's last token, which vLLM must compute itself to
    produce the next token's logits."""
    return max(0, min(num_hashes, (num_tokens - 1) // block_size))
