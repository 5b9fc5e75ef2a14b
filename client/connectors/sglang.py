"""KVPoolHiCacheStorage: SGLang's HiCache storage tier (L3) on a kvpool cluster.

Loaded through SGLang's dynamic storage backend (needs the ``sglang`` package)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
            "module_path": "kvpool.client.connectors.sglang",
            "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
            "master": "10.0.0.1:50051"}'

``interface_v1: 1`` makes SGLang call the zero-copy batch calls (``batch_set_v1`` /
``batch_get_v1``): pages move between SGLang's host memory pool (registered with the client's
transports) and kvpool with no copy. Without it SGLang copies each page out of and into the pool
(``get_data_page`` / ``set_from_flat_data_page``) and calls ``batch_set`` / ``batch_get``; both
paths store the same objects under the same keys (``sglang_keys``).

Options in the extra config: ``master`` (``host:port``, standbys ``a:1,b:2`` or ``etcd://...``;
default ``$KVPOOL_MASTER``), ``transports`` (list or comma-separated schemes; default every
transport available), ``verify`` (check each page read against the checksum taken when it was
stored; default true), ``replicas`` (copies per object, 0 = the master's default), ``timeout_s``
(per master call, default 5), ``retry_s`` (after the store was unreachable, how long the backend
leaves it alone before trying again; default 10), ``model_id`` (the key namespace's model name;
default SGLang's model name: set it when engines load the same weights from different paths).

Host memory layouts (``--hicache-mem-layout``): ``page_first`` (SGLang's default),
``page_first_direct`` and ``page_head`` keep each page in at most two contiguous regions (K and V;
one for MLA), stored as one object each, zero-copy. ``layer_first`` scatters a page over a region
per layer, so it is stored through SGLang's copying path as one object per page, and refused
with ``interface_v1``. Refused at start, with the reason: hybrid models' extra host pools (Mamba,
SWA, sparse indexer: ``register_mem_host_pool_v2``), heterogeneous TP (``tp_lcm_size``), decode
context parallelism. The store never fails a request: a page it cannot read or write is reported
as such (``False``, or a shorter prefix from ``batch_exists``) and SGLang computes it; while the
master cannot be reached the backend answers "not stored" at once and tries again after
``retry_s``. Logs go to ``sglang.kvpool``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.client.buffers import byte_view, view_at
from kvpool.client.connectors.sglang_keys import SGLangKeyScheme, present_pages
from kvpool.client.connectors.store import LazyStore
from kvpool.common.errors import AlreadyExists, KVPoolError
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolName

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.pool_host import HostKVCache

# Under SGLang's logger tree, so its handler and level apply.
log = logging.getLogger("sglang.kvpool")

# Layouts whose page regions (get_page_buffer_meta), laid end to end, are the page's flat bytes
# (get_data_page): only these are stored zero-copy, and both paths then write the same objects.
ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct", "page_head")
# Keys SGLang itself reads from the extra config (the dynamic factory, the controller).
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
_OPTIONS = {"master", "transports", "verify", "replicas", "timeout_s", "retry_s", "model_id"}


@dataclass(frozen=True)
class _Options:
    master: str
    transports: list[str] | None
    verify: bool
    replicas: int
    timeout_s: float
    retry_s: float
    model_id: str | None
    interface_v1: bool

    @classmethod
    def read(cls, extra: dict) -> _Options:
        unknown = sorted(set(extra) - _OPTIONS - _SGLANG_KEYS)
        if unknown:
            log.warning("kvpool_unknown_options %s (known: %s)", unknown, sorted(_OPTIONS))
        master = extra.get("master") or os.environ.get("KVPOOL_MASTER")
        if not master:
            raise ValueError("kvpool HiCache storage needs the kvpool master's address: set "
                             '"master" (host:port) in --hicache-storage-backend-extra-config, '
                             "or $KVPOOL_MASTER")
        transports = extra.get("transports")
        if isinstance(transports, str):
            transports = [t.strip() for t in transports.split(",") if t.strip()]
        return cls(master=str(master), transports=transports,
                   verify=_as_bool(extra.get("verify", True)),
                   replicas=_number(extra, "replicas", 0, int),
                   timeout_s=_number(extra, "timeout_s", 5.0, float),
                   retry_s=_number(extra, "retry_s", 10.0, float),
                   model_id=extra.get("model_id"),
                   interface_v1=_as_bool(extra.get("interface_v1", False)))


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)


def _number(extra: dict, key: str, default, kind):
    value = extra.get(key, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"kvpool HiCache storage: {key} must be a number, not {value!r}") from None
    if number < 0:
        raise ValueError(f"kvpool HiCache storage: {key} must be >= 0, not {value!r}")
    return number


class KVPoolHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` backed by a kvpool cluster (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        """Called by SGLang's ``StorageBackendFactory`` for ``dynamic`` backends as
        ``cls(storage_config, kwargs)``; the host pool comes later, through
        :meth:`register_mem_pool_host`."""
        if storage_config is None:
            raise ValueError("kvpool HiCache storage needs SGLang's HiCacheStorageConfig")
        if storage_config.should_split_heads or storage_config.tp_lcm_size:
            raise NotImplementedError(
                "kvpool HiCache storage does not support heterogeneous TP (tp_lcm_size): "
                "remove tp_lcm_size from --hicache-storage-backend-extra-config")
        if storage_config.dcp_size > 1:
            raise NotImplementedError("kvpool HiCache storage does not support decode context "
                                      "parallelism (dcp_size > 1)")
        self._config = storage_config
        self._options = _Options.read(dict(storage_config.extra_config or {}))
        self._store = LazyStore(self._options.master, replicas=self._options.replicas,
                                transports=self._options.transports,
                                timeout_s=self._options.timeout_s,
                                retry_s=self._options.retry_s, log=log)
        self._scheme: SGLangKeyScheme | None = None
        self._zero_copy = False
        self.mem_pool_host = None
        log.info("kvpool_hicache_started master=%s tp_rank=%d tp_size=%d interface_v1=%s",
                 self._options.master, storage_config.tp_rank, storage_config.tp_size,
                 self._options.interface_v1)

    # -- setup --
    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Learn the host pool's page geometry (the key namespace follows from it) and
        register its memory with the client's transports."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise NotImplementedError(
                f"kvpool HiCache storage: {type(mem_pool_host).__name__} holds no KV buffer "
                "of its own (a hybrid model's logical pool); hybrid models are not supported")
        part_bytes, self._zero_copy = _page_parts(mem_pool_host)
        if self._options.interface_v1 and not self._zero_copy:
            raise NotImplementedError(
                f"kvpool HiCache storage: --hicache-mem-layout {mem_pool_host.layout} keeps a "
                "page in one region per layer, which zero-copy (interface_v1) would store as "
                "that many objects; use page_first (the default) or page_first_direct, or drop "
                '"interface_v1" to store it through SGLang\'s copying path')
        c = self._config
        mla = bool(c.is_mla_model)
        self._scheme = SGLangKeyScheme(
            model=self._options.model_id or c.model_name or "",
            dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            page_size=int(mem_pool_host.page_size), layout=str(mem_pool_host.layout),
            part_bytes=part_bytes, tp_rank=None if mla else c.tp_rank,
            tp_size=None if mla else c.tp_size, pp_rank=c.pp_rank, pp_size=c.pp_size,
            cp_rank=c.attn_cp_rank, cp_size=c.attn_cp_size)
        if not self._scheme.model:
            log.warning("kvpool_no_model_name: pages of every model share one namespace; set "
                        '"model_id" in --hicache-storage-backend-extra-config')
        if self._zero_copy:
            for buffer in _pool_buffers(mem_pool_host):
                self._store.register(buffer)
        self._store.connect_soon()
        log.info("kvpool_hicache_pool layout=%s page_size=%d part_bytes=%s zero_copy=%s "
                 "namespace=%s", mem_pool_host.layout, mem_pool_host.page_size, part_bytes,
                 self._zero_copy, self._scheme.namespace)

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name) -> None:
        if host_pool_name == PoolName.KV:   # the anchor, registered already
            return
        raise NotImplementedError(
            f"kvpool HiCache storage stores the KV pool only; a hybrid model's {host_pool_name} "
            "pool is not supported")

    # -- zero-copy batch calls (interface_v1) --
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages are stored (every part of each)."""
        if not keys:
            return 0
        scheme = self._ready()
        kv = self._store.client()
        if kv is None:
            return 0
        try:
            return present_pages(kv.batch_exists(scheme.keys(keys)), scheme.parts)
        except KVPoolError as e:
            self._store.failed(e)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store each page straight from the host pool; per page whether it is stored (a
        page stored already counts: keys are immutable and a page's hash names its bytes)."""
        views = self._page_views(keys, host_indices)
        before = _last_prefix_key(extra_info)
        return self._put(keys, views, before)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read each page straight into the host pool; per page whether it was read whole."""
        return self._get_into(keys, self._page_views(keys, host_indices))

    # -- copying calls (SGLang's generic path, without interface_v1) --
    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: list | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None) -> bool:
        """Store flat pages (``HostKVCache.get_data_page``); True if every page is stored."""
        if values is None or len(values) != len(keys):
            log.error("kvpool_batch_set_needs_values keys=%d", len(keys))
            return False
        views = [self._split(v, writable=False) for v in values]
        if any(v is None for v in views):
            return False
        return all(self._put(keys, views, None))

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """Read each page into its flat buffer (``get_dummy_flat_data_page``); per page the
        buffer, or None where the page could not be read whole."""
        if target_locations is None or len(target_locations) != len(keys):
            log.error("kvpool_batch_get_needs_buffers keys=%d", len(keys))
            return [None] * len(keys)
        views = [self._split(t, writable=True) for t in target_locations]
        if any(v is None for v in views):
            return [None] * len(keys)
        ok = self._get_into(keys, views)
        return [t if good else None for t, good in zip(target_locations, ok)]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest of the interface --
    def clear(self) -> bool:
        """kvpool has no listing: stored pages stay until evicted (or removed by key)."""
        log.warning("kvpool_clear_unsupported: pages stay in kvpool until evicted")
        return False

    def close(self) -> None:
        self._store.close()

    def get_stats(self):
        return None

    # -- internals --
    def _ready(self) -> SGLangKeyScheme:
        if self._scheme is None:
            raise RuntimeError("kvpool HiCache storage: register_mem_pool_host was not called")
        return self._scheme

    def _page_views(self, keys: list[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Each page's regions in the host pool as writable byte views (no copy)."""
        scheme = self._ready()
        if not self._zero_copy:
            raise NotImplementedError("kvpool HiCache storage: zero-copy calls on a layout "
                                      "without zero-copy pages (refused at registration)")
        page_size = self.mem_pool_host.page_size
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(f"kvpool HiCache storage: {len(keys)} pages but "
                             f"{len(host_indices)} host indices (page size {page_size})")
        if not keys:
            return []
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        parts = scheme.parts
        if len(ptrs) != len(keys) * parts or any(
                s != scheme.part_bytes[i % parts] for i, s in enumerate(sizes)):
            raise RuntimeError("kvpool HiCache storage: the host pool's page regions changed "
                               "shape since registration")
        return [[view_at(ptrs[i + p], sizes[i + p]) for p in range(parts)]
                for i in range(0, len(ptrs), parts)]

    def _split(self, tensor, *, writable: bool) -> list[memoryview] | None:
        """A flat page tensor as the views of its parts (no copy)."""
        scheme = self._ready()
        try:
            view = byte_view(tensor, writable=writable)
        except KVPoolError as e:
            log.error("kvpool_bad_page_buffer error=%r", str(e))
            return None
        if view.nbytes != scheme.page_bytes:
            log.error("kvpool_bad_page_buffer bytes=%d expected=%d", view.nbytes,
                      scheme.page_bytes)
            return None
        out, start = [], 0
        for n in scheme.part_bytes:
            out.append(view[start:start + n])
            start += n
        return out

    def _with_store(self, call):
        """``call(client)``'s per-key results; None when the store is unreachable or the call
        failed for want of it (every page then fails, and SGLang recomputes them)."""
        kv = self._store.client()
        if kv is None:
            return None
        try:
            return call(kv)
        except KVPoolError as e:
            self._store.failed(e)
            return None

    def _put(self, keys: list[str], views: list[list[memoryview]], before: str | None
             ) -> list[bool]:
        if not keys:
            return []
        scheme = self._ready()
        results = self._with_store(lambda kv: kv.batch_put(
            scheme.keys(keys), [v for page in views for v in page],
            parents=scheme.parents(keys, before)))
        if results is None:
            return [False] * len(keys)
        parts, ok, errors = scheme.parts, [], []
        for i in range(len(keys)):
            page = results[i * parts:(i + 1) * parts]
            ok.append(all(r is None or isinstance(r, AlreadyExists) for r in page))
            errors += [r for r in page if r is not None and not isinstance(r, AlreadyExists)]
        if errors:
            log.warning("kvpool_set_failed pages=%d of=%d first_error=%r",
                        ok.count(False), len(keys), str(errors[0]))
        return ok

    def _get_into(self, keys: list[str], views: list[list[memoryview]]) -> list[bool]:
        if not keys:
            return []
        scheme = self._ready()
        flat = [v for page in views for v in page]
        results = self._with_store(lambda kv: kv.batch_get_into(
            scheme.keys(keys), flat, verify=self._options.verify))
        if results is None:
            return [False] * len(keys)
        # A part read whole has exactly its size: anything else (an error, fewer bytes) fails
        # the page, and SGLang recomputes it.
        good = [not isinstance(r, KVPoolError) and r == v.nbytes for r, v in zip(results, flat)]
        parts = scheme.parts
        return [all(good[i * parts:(i + 1) * parts]) for i in range(len(keys))]


def _page_parts(pool: HostKVCache) -> tuple[tuple[int, ...], bool]:
    """The byte sizes of a page's objects, and whether they are the pool's own regions
    (zero-copy) rather than one object per flat page."""
    import torch

    flat = pool.get_dummy_flat_data_page()
    page_bytes = flat.numel() * flat.element_size()
    if pool.layout in ZERO_COPY_LAYOUTS:
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
        if 1 <= len(ptrs) <= 2 and all(isinstance(p, int) for p in ptrs) \
                and sum(sizes) == page_bytes:
            return tuple(int(s) for s in sizes), True
    return (page_bytes,), False


def _pool_buffers(pool: HostKVCache) -> list:
    """The host pool's tensors to register for zero-copy I/O (as SGLang's Mooncake backend
    finds them)."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    buffers = get() if get is not None else [pool.kv_buffer]
    return [b for b in buffers if b is not None]


def _last_prefix_key(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    prefix = getattr(extra_info, "prefix_keys", None)
    return prefix[-1] if prefix else None
