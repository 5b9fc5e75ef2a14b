"""The store keys of SGLang HiCache pages (scheme ``kvpool-sglang-v1``).

SGLang names each page of a prefix by a chained SHA-256 of its tokens (``get_storage_hash_str``:
page *i*'s hash covers every token before it, seeded by the request's ``extra_key`` and cache
salt). The hash says nothing of what else makes the page's bytes differ, so the key adds it::

    namespace = SHA-256( "kvpool-sglang-v1\\0" || JSON{model, dtype, page_size, layout,
                         part_bytes, tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size} )
                [:16 bytes] as hex
    key       = "kvpool/sgl1/" namespace "/" page_hash "/" part

One namespace per model and tensor-parallel rank: each rank stores its own KV heads. An MLA
model's KV is the same on every TP rank (SGLang lets one rank write it), so its namespace leaves
the TP rank and size out (``null``) and every rank reads the same objects. Pipeline stages hold
different layers, and context-parallel ranks different slices, so both always count.

A page is stored as ``len(part_bytes)`` objects (``part`` = 0, 1, ...): the contiguous regions
that SGLang's host pool gives for one page (``HostKVCache.get_page_buffer_meta``: K and V for MHA
in the page-first layouts, one region for MLA), so that a page moves between the host pool and
kvpool with no copy. ``layout`` (SGLang's ``--hicache-mem-layout``) and ``part_bytes`` name the
byte order of those regions: pools of another layout, dtype or head geometry never match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

SCHEME = "kvpool-sglang-v1"
KEY_PREFIX = "kvpool/sgl1/"


@dataclass(frozen=True, slots=True)
class SGLangKeyScheme:
    """What makes one SGLang rank's page bytes differ from another's for the same page hash.
    ``tp_rank``/``tp_size`` are None for MLA (replicated) KV."""

    model: str
    dtype: str
    page_size: int
    layout: str
    part_bytes: tuple[int, ...]
    tp_rank: int | None
    tp_size: int | None
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def identity(self) -> dict:
        return {"model": self.model, "dtype": self.dtype, "page_size": self.page_size,
                "layout": self.layout, "part_bytes": list(self.part_bytes),
                "tp_rank": self.tp_rank, "tp_size": self.tp_size, "pp_rank": self.pp_rank,
                "pp_size": self.pp_size, "cp_rank": self.cp_rank, "cp_size": self.cp_size}

    @property
    def namespace(self) -> str:
        identity = json.dumps(self.identity, sort_keys=True)
        return hashlib.sha256(f"{SCHEME}\0{identity}".encode()).hexdigest()[:32]

    @property
    def parts(self) -> int:
        return len(self.part_bytes)

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)

    def page_keys(self, page_hash: str) -> list[str]:
        """The keys of one page's objects, in part order."""
        base = f"{KEY_PREFIX}{self.namespace}/{page_hash}/"
        return [f"{base}{p}" for p in range(self.parts)]

    def keys(self, page_hashes: Sequence[str]) -> list[str]:
        """Every object of every page, page by page (page-major, parts in order)."""
        base = f"{KEY_PREFIX}{self.namespace}/"
        return [f"{base}{h}/{p}" for h in page_hashes for p in range(self.parts)]

    def parents(self, page_hashes: Sequence[str], before: str | None) -> list[str | None]:
        """Parallel to :meth:`keys`: each object's parent in kvpool's prefix chains, the same
        part of the page before (``before``: the hash of the page before the first, or None),
        so eviction takes a prefix from its tail."""
        prev = [before, *page_hashes[:-1]]
        base = f"{KEY_PREFIX}{self.namespace}/"
        return [None if h is None else f"{base}{h}/{p}" for h in prev for p in range(self.parts)]


def present_pages(found: Sequence[bool], parts: int) -> int:
    """How many leading pages have all their objects present (``found`` page-major)."""
    n = 0
    for start in range(0, len(found) - parts + 1, parts):
        if not all(found[start:start + parts]):
            break
        n += 1
    return n
