"""KVPoolConnector: vLLM's KV cache shared across engine processes through kvpool.

Load it out of tree (needs ``pip install 'kvpool[vllm]'``)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.client.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"master": "10.0.0.1:50051"}}'

``kv_connector_extra_config`` options: ``master`` (``host:port``, standbys ``a:1,b:2`` or
``etcd://...``; default ``$KVPOOL_MASTER``), ``transports`` (list or comma-separated schemes,
e.g. ``"shm,tcp"`` to leave RDMA out; default every transport available), ``verify`` (check each
loaded block against the checksum taken when it was stored; default true), ``replicas`` (copies
per block, 0 = the master's default), ``timeout_s`` (per master call, default 5), ``retry_s``
(after the store was unreachable, how long the connector leaves it alone before trying again;
default 10), ``model_id`` (the key namespace's model name; default the served model name: set
it when engines load the same weights from different paths), ``metrics`` (count the
connector's keys, bytes and call times as ``kvpool_client_*`` in prometheus-client's default
registry, which vLLM's ``/metrics`` serves, its worker processes' too through its
multiprocess collector; default true), ``load_wait_s`` (a ``kv_consumer``'s bound on waiting for
KV its prefill engine is still committing; default 5), ``key_scheme`` (``vllm2``, the default, or
``vllm1``), ``layerwise`` (default true), ``load_timeout_s`` (default 10): see below.

``kv_role`` (vLLM's ``KVTransferConfig``): ``kv_both`` loads and stores, ``kv_producer`` (a
prefill engine of a disaggregated pair) only stores, ``kv_consumer`` (a decode engine) only
loads. The prefill-to-decode hand-off, as ``kvpool gateway --prefill ... --decode ...`` makes
it (vLLM's own disaggregated proxies pass ``kv_transfer_params`` the same way): the prefill
request carries ``kv_transfer_params: {"kvpool_prefill": true}``; when it finishes, the producer
answers ``{"kvpool_blocks": N}`` (the prompt's blocks it stored or found stored; the puts may
still be in flight); the decode request carries that back, and the consumer waits, up to
``load_wait_s`` from its first look, until the store holds those blocks (answering vLLM "ask me
again" meanwhile, so the engine's other requests run on), then loads what is there and vLLM
recomputes the rest. A request without ``kvpool_blocks`` never waits.

Scheduler side: for a new request, the longest prefix of its blocks (``request.block_hashes``,
beyond what the engine's own cache holds) whose every object is in kvpool, found with one
``batch_exists``; never the prompt's last token. Worker side, key scheme ``vllm2`` (the
default: one object per block and TP rank, all layers in it): ``register_kv_caches`` reads
each layer's paged layout from its tensor (CPU or CUDA; ``(num_blocks, ...)`` or ``(2,
num_blocks, ...)``, any strides) and bytes move through host staging buffers registered with
the client (pinned for CUDA), copied on a CUDA stream of the connector's own (on CPU the same
code, the copies run by the load and save threads). A load: ``start_load_kv`` hands the step's
blocks to a load thread (one GetReplicas, then layer by layer a ranged read of each object's
slice and a copy into the paged blocks); ``wait_for_layer_load(layer)`` waits for that layer
only, up to ``load_timeout_s`` (default 10) from the start, after which the load is cancelled
and its blocks count as failed. A save: at a step's first ``save_kv_layer`` the save thread
reserves every object the step completes (one PutStart); each layer's blocks are copied out as
``save_kv_layer`` is called for it and written at its offset in each object; one PutEnd
commits them after the last layer; a finished request's blocks are held until that is done.
``layerwise: false`` loads every layer before the forward pass and saves after it (the same
code, for comparison). ``key_scheme: vllm1`` keeps the old scheme (one object per layer, CPU
caches only, one ``batch_get_into`` before the forward pass and one ``batch_put`` after it).
A block that fails to load (missing, node down, checksum mismatch, too slow) is reported
through ``get_block_ids_with_load_errors`` and vLLM recomputes it (with
``kv_load_failure_policy: recompute``; vLLM's default ``fail`` fails the request instead). If
the master cannot be reached, requests run as if the store were empty. Logs go to
``vllm.kvpool``. Key scheme: ``kvpool.client.connectors.vllm_keys``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.client.connectors.store import LazyStore
from kvpool.client.connectors.vllm_keys import VLLMKeyScheme, loadable_blocks, present_prefix
from kvpool.client.connectors.vllm_layers import CopyStream, LayerLayout, StagingPool
from kvpool.client.connectors.vllm_layerwise import LayerSet, LoadJob, SaveJob
from kvpool.common.errors import AlreadyExists, KVPoolError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's own logger tree, so vLLM's handler and level apply.
log = logging.getLogger("vllm.kvpool")


@dataclass
class BlockMove:
    """One request's blocks to move in this step: parallel hashes and paged block ids;
    ``parent`` is the hash of the block before the first (None for a prompt's first block)."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    parent: bytes | None = None


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[BlockMove] = field(default_factory=list)
    saves: list[BlockMove] = field(default_factory=list)
    preempted: bool = False


@dataclass
class _RequestState:
    """The scheduler's view of one request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    present_upto: int = 0       # leading blocks known to be stored (found, or loaded)
    saved_upto: int = 0         # leading blocks stored or handed to a save
    load: tuple[int, int] | None = None   # (first block, count) planned by the last lookup
    has_saves: bool = False
    wait_until: float | None = None   # a consumer's deadline for KV its producer is committing
    next_look: float = 0.0            # the consumer's next store lookup while waiting


@dataclass(frozen=True)
class _Options:
    master: str
    transports: list[str] | None
    verify: bool
    replicas: int
    timeout_s: float
    retry_s: float
    model_id: str | None
    metrics: bool = True
    load_wait_s: float = 5.0
    key_scheme: int = 2
    layerwise: bool = True
    load_timeout_s: float = 10.0

    @classmethod
    def read(cls, kv_transfer_config) -> _Options:
        get = kv_transfer_config.get_from_extra_config
        master = get("master", None) or os.environ.get("KVPOOL_MASTER")
        if not master:
            raise ValueError("KVPoolConnector needs the kvpool master's address: set "
                             "kv_connector_extra_config.master (host:port) or $KVPOOL_MASTER")
        transports = get("transports", None)
        if isinstance(transports, str):
            transports = [t.strip() for t in transports.split(",") if t.strip()]
        scheme = str(get("key_scheme", "vllm2"))
        if scheme not in ("vllm1", "vllm2"):
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.key_scheme must be "
                             f"vllm2 (one object per block) or vllm1 (one per layer); got "
                             f"{scheme!r}")
        return cls(master=str(master), transports=transports,
                   verify=_as_bool(get("verify", True)), replicas=int(get("replicas", 0)),
                   timeout_s=float(get("timeout_s", 5.0)), retry_s=float(get("retry_s", 10.0)),
                   model_id=get("model_id", None), metrics=_as_bool(get("metrics", True)),
                   load_wait_s=_non_negative("load_wait_s", get("load_wait_s", 5.0)),
                   key_scheme=int(scheme[-1]), layerwise=_as_bool(get("layerwise", True)),
                   load_timeout_s=_non_negative("load_timeout_s", get("load_timeout_s", 10.0)))


def _non_negative(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = -1.0
    if not v >= 0:
        raise ValueError(f"KVPoolConnector: kv_connector_extra_config.{name} must be a number "
                         f"of seconds >= 0; got {value!r}")
    return v


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)


class KVPoolConnector(KVConnectorBase_V1):
    """A vLLM V1 KV connector backed by a kvpool cluster (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._options = _Options.read(self._kv_transfer_config)
        self._store = LazyStore(self._options.master, replicas=self._options.replicas,
                                transports=self._options.transports,
                                timeout_s=self._options.timeout_s,
                                retry_s=self._options.retry_s, log=log,
                                metrics=_registry() if self._options.metrics else None)
        self._block_size = vllm_config.cache_config.block_size
        self._scheme = _key_scheme(vllm_config, kv_cache_config, self._options.model_id,
                                   self._options.key_scheme)
        role_config = self._kv_transfer_config
        self._loads = role_config.is_kv_consumer    # kv_consumer or kv_both
        self._stores = role_config.is_kv_producer   # kv_producer or kv_both
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        # worker side
        self._layers: list[torch.Tensor] = []
        self._tp_rank = 0
        self._load_errors: set[int] = set()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save") \
            if role == KVConnectorRole.WORKER else None
        self._saves: dict[str, list[Future]] = {}      # req_id -> its puts in flight
        # worker side, key scheme vllm2: layer by layer through staging (vllm_layerwise.py)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load") \
            if role == KVConnectorRole.WORKER and self._scheme.version == 2 else None
        self._by_layer: LayerSet | None = None
        self._layer_index: dict[str, int] = {}
        self._stream: CopyStream | None = None
        self._pool: StagingPool | None = None
        self._load_job: LoadJob | None = None
        self._save_job: SaveJob | None = None
        self._finished_waiting: set[str] = set()      # finished, saves still in flight
        if role == KVConnectorRole.SCHEDULER and \
                getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") != "recompute":
            log.warning("kvpool_failure_policy_fail: a block kvpool cannot load fails its "
                        "request; set kv_load_failure_policy=recompute in --kv-transfer-config "
                        "to recompute it instead")
        if role == KVConnectorRole.SCHEDULER and self._loads:
            self._store.connect_soon()      # its first look up needs the client
        log.info("kvpool_connector_started role=%s kv_role=%s master=%s verify=%s namespace=%s "
                 "layers=%d key_scheme=vllm%d layerwise=%s", role.name.lower(),
                 role_config.kv_role, self._options.master, self._options.verify,
                 self._scheme.namespace, len(self._scheme.layer_names), self._scheme.version,
                 self._options.layerwise)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load and save_kv_layer run between the layers: a full CUDA graph
        # would replay the layers without them (vLLM then captures piecewise).
        return str(extra_config.get("key_scheme", "vllm2")) == "vllm2" \
            and _as_bool(extra_config.get("layerwise", True))

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a save lost to preemption is just a later miss.
        return False

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        bs = self._block_size
        st = self._requests.get(request.request_id)
        if st is None:
            st = self._requests[request.request_id] = _RequestState(request)
        first = num_computed_tokens // bs
        st.present_upto = max(st.present_upto, first)
        st.load = None
        if not self._loads:     # kv_producer: computes its prompts, only stores
            return 0, False
        last = loadable_blocks(request.num_tokens, len(request.block_hashes), bs)
        if last <= first:
            return 0, False
        expected = min(last, _expected_blocks(request))
        now = time.monotonic()
        if expected > first and st.wait_until is None:
            st.wait_until = now + self._options.load_wait_s
        waiting = st.wait_until is not None and now < st.wait_until
        if waiting and now < st.next_look:
            return None, False          # vLLM asks again at a later step
        kv = self._store.client()
        if kv is None:
            return 0, False
        try:
            found = kv.batch_exists(self._scheme.prefix_keys(request.block_hashes[first:last]))
        except KVPoolError as e:
            self._store.failed(e)
            return 0, False
        hit = present_prefix(found, self._scheme.objects_per_block)
        if waiting and first + hit < expected:
            # The prefill engine said it stored these blocks; its puts are still landing.
            st.next_look = now + _WAIT_POLL_S
            return None, False
        if st.wait_until is not None:
            waited_s = self._options.load_wait_s - (st.wait_until - now)
            if first + hit < expected:
                log.warning("kvpool_load_wait_expired req=%s expected_blocks=%d found_blocks=%d "
                            "waited_s=%.3f (the rest is recomputed)", request.request_id,
                            expected, first + hit, waited_s)
            elif waited_s > 0:
                log.info("kvpool_load_waited req=%s blocks=%d waited_s=%.4f", request.request_id,
                         expected, waited_s)
        st.wait_until = None
        st.present_upto = max(st.present_upto, first + hit)
        if hit == 0:
            return 0, False
        st.load = (first, hit)
        log.info("kvpool_prefix_hit req=%s blocks=%d tokens=%d local_blocks=%d",
                 request.request_id, hit, hit * bs, first)
        return hit * bs, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0 or st.load is None:
            st.load = None
            return
        # vLLM may take fewer tokens than offered; what it takes is a whole-block prefix.
        first, _ = st.load
        st.load = (first, num_external_tokens // self._block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPoolConnectorMetadata:
        meta = KVPoolConnectorMetadata(preempted=bool(scheduler_output.preempted_req_ids))
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if (st := self._requests.get(new.req_id)) is not None:
                st.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (st := self._requests.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done_before in computed.items():
            st = self._requests[req_id]
            hashes = st.request.block_hashes
            if st.load is not None:
                first, n = st.load
                st.load = None
                meta.loads.append(BlockMove(req_id, list(hashes[first:first + n]),
                                            st.block_ids[first:first + n]))
            if not self._stores:   # kv_consumer: loads only
                continue
            # Blocks full once this step has run, that the store does not hold yet.
            done = done_before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(done // self._block_size, len(hashes), len(st.block_ids))
            start = max(st.saved_upto, st.present_upto)
            if full > start:
                meta.saves.append(BlockMove(req_id, list(hashes[start:full]),
                                            st.block_ids[start:full],
                                            parent=hashes[start - 1] if start else None))
                st.saved_upto = full
                st.has_saves = True
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        st = self._requests.pop(request.request_id, None)
        # What a decode engine's consumer waits for (see the module docstring): the prompt's
        # blocks this producer stored, or found already stored.
        params = None
        if st is not None and self._stores and (request.kv_transfer_params or {}).get(
                "kvpool_prefill"):
            params = {"kvpool_blocks": max(st.saved_upto, st.present_upto)}
        # Keep the blocks until the worker's put of them is done (it reports the request in
        # get_finished), so a freed block is never overwritten while it is being read.
        return (st is not None and st.has_saves), params

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self._scheme.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"KVPoolConnector: no KV cache for layers {missing}")
        layers = [kv_caches[n] for n in self._scheme.layer_names]
        # Connected while vLLM finishes starting, not on the first request (buffers registered
        # below reach the client whenever it is made).
        self._store.connect_soon()
        if self._scheme.version == 2:
            self._register_layerwise(layers)
            return
        for name, t in zip(self._scheme.layer_names, layers):
            if t.device.type != "cpu":
                raise ValueError(f"KVPoolConnector moves KV between the store and CPU memory; "
                                 f"layer {name} is on {t.device} (GPU caches are not supported "
                                 "yet)")
            if not t.is_contiguous() or not t[0].is_contiguous():
                raise ValueError(f"KVPoolConnector needs each block of layer {name} to be "
                                 f"contiguous (block-major layout); got shape {tuple(t.shape)} "
                                 f"strides {t.stride()}")
        self._layers = layers
        self._tp_rank = _tp_rank()
        for t in layers:
            self._store.register(t)
        log.info("kvpool_kv_caches_registered layers=%d block_bytes=%d tp_rank=%d",
                 len(layers), sum(t[0].numel() * t.element_size() for t in layers), self._tp_rank)

    def _register_layerwise(self, layers: list[torch.Tensor]) -> None:
        """Key scheme vllm2: each layer's layout read from its tensor; the caches stay where
        they are (CPU or CUDA) and bytes stage through pinned host buffers."""
        names = self._scheme.layer_names
        devices = {t.device for t in layers}
        if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise ValueError(f"KVPoolConnector needs every layer's KV cache on one CPU or CUDA "
                             f"device; got {sorted(map(str, devices))}")
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        if not num_blocks:
            raise ValueError("KVPoolConnector needs vLLM's kv_cache_config.num_blocks")
        layouts = [LayerLayout.of(n, t, num_blocks) for n, t in zip(names, layers)]
        self._layers = layers
        self._by_layer = LayerSet(layouts, layers)
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._stream = CopyStream(next(iter(devices)))
        self._pool = StagingPool(self._stream, self._store.register)
        self._tp_rank = _tp_rank()
        log.info("kvpool_kv_caches_registered layers=%d block_bytes=%d tp_rank=%d device=%s "
                 "layout=%s", len(layers), self._by_layer.block_bytes, self._tp_rank,
                 self._stream.device, ",".join(sorted({f"dim{lay.block_dim}:{lay.row_shape}"
                                                       for lay in layouts})))

    def _views(self, move: BlockMove) -> tuple[list[str], list, list[int]]:
        """Keys, paged-block views and the block id of each, for every layer of every block."""
        keys, views, owners = [], [], []
        for h, b in zip(move.hashes, move.block_ids):
            keys += self._scheme.block_keys(h, self._tp_rank)
            views += [t[b] for t in self._layers]
            owners += [b] * len(self._layers)
        return keys, views, owners

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVPoolConnectorMetadata) or not meta.loads:
            return
        if self._by_layer is not None:
            self._start_load_layerwise(meta)
            return
        t0 = time.perf_counter()
        keys, views, owners = [], [], []
        for move in meta.loads:
            k, v, o = self._views(move)
            keys += k
            views += v
            owners += o
        kv = self._store.client()
        if kv is None:
            results: list = [KVPoolError("kvpool unreachable")] * len(keys)
        else:
            try:
                results = kv.batch_get_into(keys, views, verify=self._options.verify)
            except KVPoolError as e:
                self._store.failed(e)
                results = [e] * len(keys)
        failed = {b for b, r in zip(owners, results) if isinstance(r, KVPoolError)}
        self._load_errors |= failed
        moved = sum(r for r in results if isinstance(r, int))
        if failed:
            reasons = sorted({type(r).__name__ for r in results if isinstance(r, KVPoolError)})
            log.warning("kvpool_load_failed blocks=%d of=%d reasons=%s", len(failed),
                        len(set(owners)), ",".join(reasons))
        log.info("kvpool_kv_loaded requests=%d blocks=%d failed_blocks=%d bytes=%d seconds=%.4f",
                 len(meta.loads), len(set(owners)) - len(failed), len(failed), moved,
                 time.perf_counter() - t0)

    def _start_load_layerwise(self, meta: KVPoolConnectorMetadata) -> None:
        keys, block_ids = [], []
        for move in meta.loads:
            for h, b in zip(move.hashes, move.block_ids):
                keys += self._scheme.block_keys(h, self._tp_rank)
                block_ids.append(b)
        job = LoadJob(keys, block_ids, self._by_layer, self._stream, self._pool,
                      verify=self._options.verify, timeout_s=self._options.load_timeout_s,
                      requests=len(meta.loads))
        self._load_job = job
        self._loader.submit(job.run, self._store)
        if not self._options.layerwise:
            job.wait_all()   # every layer in place before the forward pass starts

    def wait_for_layer_load(self, layer_name: str) -> None:
        # vllm1: start_load_kv loaded every layer before the forward pass.
        if self._load_job is not None and (i := self._layer_index.get(layer_name)) is not None:
            self._load_job.wait_layer(i)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        # vllm1: all layers at once, after the forward pass (wait_for_save).
        if self._by_layer is None or not self._options.layerwise \
                or (i := self._layer_index.get(layer_name)) is None:
            return
        if (job := self._save_job or self._start_save()) is not None:
            job.stage(i, in_forward=True)

    def _start_save(self) -> SaveJob | None:
        """This step's SaveJob, handed to the save thread (which reserves every object while
        the forward pass goes on); None when the step saves nothing."""
        meta = self._connector_metadata
        if not isinstance(meta, KVPoolConnectorMetadata) or not meta.saves:
            return None
        keys, parents, block_ids = [], [], []
        for move in meta.saves:
            prev = None if move.parent is None else \
                self._scheme.block_keys(move.parent, self._tp_rank)[0]
            for h, b in zip(move.hashes, move.block_ids):
                [key] = self._scheme.block_keys(h, self._tp_rank)
                keys.append(key)
                parents.append(prev)
                block_ids.append(b)
                prev = key
        job = self._save_job = SaveJob(keys, parents, block_ids, self._by_layer, self._stream,
                                       self._pool)
        reqs = [m.req_id for m in meta.saves]
        future = self._saver.submit(self._run_save, job, reqs)
        for r in reqs:
            self._saves.setdefault(r, []).append(future)
        return job

    def _run_save(self, job: SaveJob, reqs: list[str]) -> None:
        t0 = time.perf_counter()
        job.run(self._store)
        if job.errors:
            log.warning("kvpool_save_failed req=%s objects=%d of=%d reasons=%s", ",".join(reqs),
                        len(job.errors), len(job.keys),
                        ",".join(sorted({type(e).__name__ for e in job.errors})))
            return
        log.info("kvpool_kv_saved req=%s blocks=%d bytes=%d seconds=%.4f "
                 "layers_in_forward=%d reserved_again=%s %s", ",".join(reqs), len(job.keys),
                 job.stored, time.perf_counter() - t0, job.staged_in_forward,
                 job.reserved_again, " ".join(f"{k}_s={v:.4f}" for k, v in job.phases.items()))

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._by_layer is not None:
            # Layers the forward pass did not hand to save_kv_layer (or all of them, without
            # layerwise) are copied now; the save thread finishes the put.
            if (job := self._save_job or self._start_save()) is not None:
                job.stage_all()
            self._save_job = None
            return
        if not isinstance(meta, KVPoolConnectorMetadata) or not meta.saves or not self._layers:
            return
        for move in meta.saves:
            # The blocks are complete and vLLM will not free them before get_finished says
            # the put is done, so the background thread reads stable memory.
            self._saves.setdefault(move.req_id, []).append(self._saver.submit(self._save, move))

    def _save(self, move: BlockMove) -> None:
        kv = self._store.client()
        if kv is None:
            return
        keys, views, _ = self._views(move)
        n = len(self._layers)
        prev = [None] * n if move.parent is None else \
            self._scheme.block_keys(move.parent, self._tp_rank)
        parents = prev + keys[:-n]   # each layer's block extends the same layer's previous block
        t0 = time.perf_counter()
        try:
            results = kv.batch_put(keys, views, parents=parents)
        except KVPoolError as e:
            self._store.failed(e)
            return
        except Exception:   # a save must never take the engine down
            log.exception("kvpool_save_crashed req=%s", move.req_id)
            return
        errors = [r for r in results if r is not None and not isinstance(r, AlreadyExists)]
        stored = sum(v.numel() * v.element_size()
                     for v, r in zip(views, results) if r is None)
        if errors:
            log.warning("kvpool_save_failed req=%s objects=%d of=%d reasons=%s", move.req_id,
                        len(errors), len(keys), ",".join(sorted({type(e).__name__
                                                                 for e in errors})))
            return
        log.info("kvpool_kv_saved req=%s blocks=%d bytes=%d seconds=%.4f", move.req_id,
                 len(move.hashes), stored, time.perf_counter() - t0)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are freed now and may be overwritten next: finish
        # reading them first.
        if isinstance(kv_connector_metadata, KVPoolConnectorMetadata) \
                and kv_connector_metadata.preempted:
            self._wait_saves()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        self._finished_waiting |= {r for r in finished_req_ids if r in self._saves}
        done = {r for r in self._finished_waiting if all(f.done() for f in self._saves[r])}
        for r in done:
            self._finished_waiting.discard(r)
            del self._saves[r]
        # A request still running keeps its list; drop the futures already done.
        for r, futures in self._saves.items():
            futures[:] = [f for f in futures if not f.done()]
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if (job := self._load_job) is not None:
            self._load_job = None
            failed = job.failed_blocks()
            self._load_errors |= failed
            if failed:
                log.warning("kvpool_load_failed blocks=%d of=%d reasons=%s", len(failed),
                            len(job.keys), ",".join(sorted(job.reasons)))
            log.info("kvpool_kv_loaded requests=%d blocks=%d failed_blocks=%d bytes=%d "
                     "seconds=%.4f waited_s=%.4f", job.requests, len(job.keys) - len(failed),
                     len(failed), job.bytes, job.seconds, job.waited_s)
        failed, self._load_errors = self._load_errors, set()
        return failed

    def _wait_saves(self, timeout_s: float | None = None) -> None:
        futures = [f for fs in self._saves.values() for f in fs]
        for f in futures:
            with contextlib.suppress(Exception):   # _save logs its own failures
                f.result(timeout=timeout_s)

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        if self._saver is not None:
            self._wait_saves(timeout_s=30.0)
            self._saver.shutdown(wait=True)
        self._store.close()


# How often a waiting consumer looks in the store again (each look is one batch_exists).
_WAIT_POLL_S = 0.005


def _expected_blocks(request: Request) -> int:
    """The blocks a producer said it stored for this request (0: nothing expected)."""
    params = request.kv_transfer_params or {}
    try:
        return max(0, int(params.get("kvpool_blocks", 0)))
    except (TypeError, ValueError):
        return 0


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError):   # no parallel group: a single process
        return 0


def _natural(name: str) -> list:
    """A sort key putting ``layers.2`` before ``layers.10``: the forward pass's order, so a
    vllm2 object's layers are written and read in the order the engine reaches them."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _key_scheme(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                model_id: str | None, version: int = 2) -> VLLMKeyScheme:
    """The key namespace and layer order, the same in the scheduler and in every worker."""
    if kv_cache_config is None:
        raise ValueError("KVPoolConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
    groups = kv_cache_config.kv_cache_groups
    layer_names = tuple(sorted((n for g in groups for n in g.layer_names),
                               key=_natural if version == 2 else None))
    dtype = str(groups[0].kv_cache_spec.dtype).removeprefix("torch.") if groups else "none"
    model_config = vllm_config.model_config
    model = model_id or getattr(model_config, "served_model_name", None) or model_config.model
    if isinstance(model, (list, tuple)):
        model = model[0]
    return VLLMKeyScheme(model=str(model), kv_dtype=dtype,
                         block_size=vllm_config.cache_config.block_size,
                         tp_size=vllm_config.parallel_config.tensor_parallel_size,
                         hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
                         layer_names=layer_names, version=version)


def _registry():
    """prometheus-client's default registry: what vLLM's /metrics serves."""
    from prometheus_client import REGISTRY
    return REGISTRY
