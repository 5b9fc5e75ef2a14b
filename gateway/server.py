"""The gateway's HTTP server (aiohttp): OpenAI's endpoints in front of the engines.

``POST /v1/completions`` and ``/v1/chat/completions``: tokenize the prompt (``prompts.py``; on
the event loop when small, on a worker thread when large), choose an engine (``routing.py``:
Route on the master's lookup port, from the loop), forward (``upstream.py``), record. A
request whose engine fails before answering goes to another engine (the failed ones excluded)
until its deadline; the engine is marked down until a probe finds it healthy. ``GET
/v1/models`` (the served model), ``/health`` (200 while an engine is up), ``/metrics``.

Colocated serving: each request goes to one engine. The steps of a request are in
``_serve``: plan, then ``_try`` per engine.

Disaggregated serving (engines given as prefill and decode, ``kvpool gateway --prefill ...
--decode ...``): a request goes first to a prefill engine (a ``kv_producer``), chosen by Route
as a colocated engine is (prefix affinity and load), with ``max_tokens: 1``, not streamed, and
``kv_transfer_params: {"kvpool_prefill": true}``: it computes the prompt, stores its KV in
kvpool and answers ``kv_transfer_params: {"kvpool_blocks": N}``. Then the request as the client
sent it, carrying those ``kv_transfer_params``, goes to the least busy decode engine (a
``kv_consumer``), which loads the prompt's blocks from kvpool (waiting a bounded time for puts
still landing: ``client/connectors/vllm.py``), computes the prompt's last token, and generates
every output token; its answer (a stream passed through as it arrives) is the client's. A
prefill engine that fails is replaced by another before the decode hop; a decode engine that
fails before answering is replaced by another decode engine (the KV is in kvpool by then).

Why the client's stream starts with the decode engine's first token rather than the prefill's
(vLLM's disaggregated proxy examples do the same): the decode engine must compute the
prompt's last token anyway (its KV is never loaded: vLLM needs that token's logits), and that
one forward step yields the first token, so sending the prefill's token ahead would save one
decode step of TTFT at the cost of rewriting the engines' streams (chat role chunks, merged
events, usage) and, when sampling, of a first token the decode's continuation did not follow.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from kvpool.client.router import Candidate
from kvpool.common.logging import get_logger
from kvpool.gateway.discovery import EngineDiscovery
from kvpool.gateway.engines import EnginePool, EngineSpec
from kvpool.gateway.errors import APIError, BadRequest, ModelNotFound, NoEngine, NotFound
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.probes import EngineProber
from kvpool.gateway.prompts import PromptTokenizer
from kvpool.gateway.routing import Choice, EngineRouter
from kvpool.gateway.upstream import (
    ClientGone,
    DeadlineExceeded,
    EngineFailed,
    EngineFailedMidStream,
    Outcome,
    call,
    forward,
)
from kvpool.master.calibration import CostCalibrator, Rates
from kvpool.master.routing import CostModel
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = get_logger(__name__)
# A request body up to this size is tokenized on the event loop (at most ~0.5 ms of it);
# a larger one on a worker thread, so that a long prompt does not hold other requests' streams.
INLINE_TOKENIZE_BYTES = 2048


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    engines: Sequence[EngineSpec]
    model_dir: str
    served_model_name: str
    master: str | None = None
    policy: str = ""                     # the master's default ("kvpool")
    hash_model: str | None = None        # the `model` extra key of the hashes; default: served name
    request_timeout_s: float = 600.0     # a request's deadline, all its tries together
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0         # a stream silent this long: the engine is hung
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 5.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # Measure each engine's prefill and store-load rates from its first tokens and send them
    # with Route's candidates (master/calibration.py); off: the master's cost model alone.
    calibrate: bool = True
    # Engines also found through the master's routing index (gateway/discovery.py).
    discover: bool = False
    discover_interval_s: float = 2.0


class Gateway:
    def __init__(self, config: GatewayConfig, *, tokenizer: PromptTokenizer | None = None):
        self.config = config
        # The prior is the master's default cost model: until the calibrator has samples the
        # candidates carry no rates and the master's own model decides.
        prior = CostModel()
        calibrator = CostCalibrator(Rates(1 / prior.prefill_s_per_token,
                                          1 / prior.store_s_per_token)) \
            if config.calibrate else None
        self.pool = EnginePool(config.engines, backoff_s=config.backoff_s,
                               max_backoff_s=config.max_backoff_s, calibrator=calibrator)
        self.metrics = GatewayMetrics(self.pool)
        self.tokenizer = tokenizer or PromptTokenizer(config.model_dir)
        self.router = EngineRouter(config.master, policy=config.policy,
                                   model=config.hash_model or config.served_model_name)
        self._plans = ThreadPoolExecutor(4, thread_name_prefix="gateway-plan")
        self._ids = itertools.count(1)
        self._warned_no_kv: set[str] = set()      # prefill engines that stored no KV
        self._created = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self._prober: EngineProber | None = None
        self.discovery: EngineDiscovery | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle --
    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_openai], client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port``; return the port (``port=0``: a free one)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False)
        self._prober = EngineProber(self.pool, self._session, self.metrics,
                                    interval_s=self.config.probe_interval_s,
                                    timeout_s=self.config.probe_timeout_s).start()
        if self.config.discover:
            self.discovery = EngineDiscovery(self.pool, self.router.list_instances,
                                             interval_s=self.config.discover_interval_s)
            await self.discovery.refresh()     # engines known before the first request
            self.discovery.start()
        # handler_cancellation: a client that disconnects cancels its handler, and with it the
        # engine request (aiohttp's default since 3.9 lets the handler run on).
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.discovery is not None:
            await self.discovery.stop()
        if self._prober is not None:
            await self._prober.stop()
        if self._session is not None:
            await self._session.close()
        self._plans.shutdown(wait=False)
        self.router.close()

    # -- endpoints --
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions", self.tokenizer.completion)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat/completions", self.tokenizer.chat)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.config.served_model_name, "object": "model", "created": self._created,
            "owned_by": "kvpool", "root": self.config.model_dir}]})

    async def _health(self, request: web.Request) -> web.Response:
        engines = {i: e.up for i, e in self.pool.engines.items()}
        return web.json_response({"engines": engines},
                                 status=200 if any(engines.values()) else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- one request --
    async def _serve(self, request: web.Request, endpoint: str,
                     to_tokens: Callable[[dict], list[int]]) -> web.StreamResponse:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.request_timeout_s
        raw = await request.read()
        body = _json_object(raw)
        model = body.get("model")
        if model is not None and model != self.config.served_model_name:
            raise ModelNotFound(str(model))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("`stream` must be true or false", param="stream")
        rid = next(self._ids)
        tokens: list[int] | None = None
        tried: list[str] = []
        record = {"request": rid, "endpoint": endpoint, "stream": stream}
        if self.pool.disaggregated:
            prefilled = await self._prefill_hop(request, endpoint, body, deadline, to_tokens,
                                                record, t0)
            if isinstance(prefilled, web.StreamResponse):
                return prefilled          # the prefill engine's own error answer
            tokens, params = prefilled
            if params is not None:
                raw = json.dumps({**body, "kv_transfer_params": params}).encode()
        while True:
            if self.pool.disaggregated:
                choice = self._decode_choice(tokens, tried)
            else:
                tokens, choice = await self._plan(body, raw, to_tokens, tokens,
                                                  self.pool.candidates(exclude=tried))
            if choice is None:
                self._count(endpoint, "", 503)
                raise NoEngine(("every engine failed this request: " + ", ".join(tried))
                               if tried else "no engine is up")
            record["plan_s"] = round(time.perf_counter() - t0, 5)
            self.metrics.route.labels(choice.policy).observe(choice.route_s)
            try:
                outcome = await self._try(request, endpoint, raw, stream, deadline, tokens,
                                          choice, record.get("prefill_engine"))
            except EngineFailed as e:
                self._engine_failed(choice.instance_id, "request", str(e))
                tried.append(choice.instance_id)
                self.metrics.retries.inc()
                continue
            except DeadlineExceeded as e:
                self._count(endpoint, choice.instance_id, 504)
                if e.outcome is not None:
                    return e.outcome.response
                raise self._deadline_error() from None
            except EngineFailedMidStream as e:
                self._engine_failed(choice.instance_id, "stream", str(e))
                self._record(record, choice, tokens, e.outcome, t0, tried, "failed_mid_stream")
                return e.outcome.response
            except (ClientGone, asyncio.CancelledError) as e:
                # The client left; its engine request was dropped with it (upstream.py).
                self._count(endpoint, choice.instance_id, 499)
                log.info("request_cancelled", engine=choice.instance_id, **record)
                if isinstance(e, ClientGone):
                    return e.response or web.Response(status=499)
                raise
            self._record(record, choice, tokens, outcome, t0, tried, "ok")
            return outcome.response

    def _deadline_error(self) -> APIError:
        return APIError(f"no answer within the request's deadline "
                        f"({self.config.request_timeout_s:g} s)", status=504, code="timeout")

    async def _prefill_hop(self, request: web.Request, endpoint: str, body: dict,
                           deadline: float, to_tokens: Callable[[dict], list[int]],
                           record: dict, t0: float
                           ) -> tuple[list[int], dict | None] | web.StreamResponse:
        """A disaggregated request's first hop: the prompt computed on a prefill engine
        (chosen by Route, replaced by another if it fails), its KV stored in kvpool. Returns
        the prompt's tokens and the ``kv_transfer_params`` for the decode engine, or the
        prefill engine's own answer when it refused the request (a 4xx: the client's)."""
        prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        prefill.update(max_tokens=1, stream=False, kv_transfer_params={"kvpool_prefill": True})
        prefill.pop("min_tokens", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        raw = json.dumps(prefill).encode()
        tokens: list[int] | None = None
        tried: list[str] = []
        while True:
            tokens, choice = await self._plan(body, raw, to_tokens, tokens,
                                              self.pool.candidates(exclude=tried,
                                                                   role="prefill"))
            if choice is None:
                self._count(endpoint, "", 503)
                raise NoEngine(("every prefill engine failed this request: " + ", ".join(tried))
                               if tried else "no prefill engine is up")
            self.metrics.route.labels(choice.policy).observe(choice.route_s)
            engine = self.pool[choice.instance_id]
            ticket = self.pool.sent(choice.instance_id, len(tokens) - choice.hit_tokens,
                                    choice.store_tokens)
            try:
                status, answer = await call(
                    self._session, request, f"{engine.spec.url}/v1/{endpoint}", raw,
                    deadline=deadline, connect_timeout_s=self.config.connect_timeout_s)
                self.pool.first_token(choice.instance_id, ticket)   # its answer is one token
            except EngineFailed as e:
                self._engine_failed(choice.instance_id, "request", str(e))
                tried.append(choice.instance_id)
                self.metrics.retries.inc()
                continue
            except DeadlineExceeded:
                self._count(endpoint, choice.instance_id, 504)
                raise self._deadline_error() from None
            finally:
                self.pool.done(choice.instance_id, ticket)
            break
        record.update(prefill_engine=choice.instance_id, prefill_policy=choice.policy,
                      prefill_s=round(time.perf_counter() - t0, 4),
                      prefill_hits_gpu=choice.hit_blocks["gpu"],
                      prefill_hits_store=choice.hit_blocks["store"])
        if status != 200:
            self._count(endpoint, choice.instance_id, status)
            log.info("request_refused_by_prefill", status=status, **record)
            return web.Response(body=answer, status=status,
                                headers={"Content-Type": "application/json",
                                         "X-Kvpool-Prefill-Engine": choice.instance_id})
        try:
            params = json.loads(answer).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or "kvpool_blocks" not in params:
            # Not an error for the client (the decode engine computes the prompt itself), but
            # the set-up is wrong: said once per engine.
            if choice.instance_id not in self._warned_no_kv:
                self._warned_no_kv.add(choice.instance_id)
                log.warning("prefill_engine_stored_no_kv", engine=choice.instance_id,
                            fix="run it with the kvpool connector and kv_role kv_producer "
                                "(or kv_both)")
            params = None
        record["prefill_blocks"] = None if params is None else params["kvpool_blocks"]
        return tokens, params

    def _decode_choice(self, tokens: list[int], tried: list[str]) -> Choice | None:
        """The least busy decode engine: it loads the prompt (all but its last token) from
        kvpool, wherever it runs, so only its load matters."""
        t = time.perf_counter()
        instance_id = self.pool.least_busy("decode", exclude=tried)
        if instance_id is None:
            return None
        return Choice(instance_id, "decode_least_busy", {"gpu": 0, "cpu": 0, "store": 1},
                      max(0, len(tokens) - 1), time.perf_counter() - t)

    async def _plan(self, body: dict, raw: bytes, to_tokens: Callable[[dict], list[int]],
                    tokens: list[int] | None, candidates: list[Candidate]
                    ) -> tuple[list[int], Choice | None]:
        """Tokenize (once per request: a bad prompt is a 400 even with no engine up), then
        choose an engine (None: no candidate left). A small prompt is tokenized on the loop
        (~1 us a token, less than a hop to a worker thread), a larger one on a worker."""
        if tokens is None:
            try:
                if len(raw) <= INLINE_TOKENIZE_BYTES:
                    tokens = to_tokens(body)
                else:
                    tokens = await asyncio.get_running_loop().run_in_executor(
                        self._plans, to_tokens, body)
            except (ValueError, TypeError, OverflowError) as e:   # the tokenizer's complaint
                raise BadRequest(f"the prompt cannot be tokenized: {e}") from None
        return tokens, await self.router.choose(tokens, candidates) if candidates else None

    async def _try(self, request: web.Request, endpoint: str, raw: bytes, stream: bool,
                   deadline: float, tokens: list[int], choice: Choice,
                   prefill_engine: str | None = None) -> Outcome:
        engine = self.pool[choice.instance_id]
        # A whole answer at once hides its first token: no calibration, load as generating.
        ticket = self.pool.sent(choice.instance_id, len(tokens) - choice.hit_tokens,
                                choice.store_tokens, seen=stream)
        try:
            return await forward(
                self._session, request, f"{engine.spec.url}/v1/{endpoint}", raw,
                stream=stream, deadline=deadline,
                connect_timeout_s=self.config.connect_timeout_s,
                read_timeout_s=self.config.read_timeout_s,
                headers={"X-Kvpool-Engine": choice.instance_id,
                         **({"X-Kvpool-Prefill-Engine": prefill_engine}
                            if prefill_engine else {})},
                on_first_chunk=lambda: self.pool.first_token(choice.instance_id, ticket))
        finally:
            self.pool.done(choice.instance_id, ticket)

    def _engine_failed(self, instance_id: str, reason: str, error: str) -> None:
        self.metrics.failures.labels(instance_id, reason).inc()
        if self.pool.failed(instance_id):
            log.warning("engine_down", engine=instance_id, reason=reason, error=error)

    def _count(self, endpoint: str, engine: str, status: int) -> None:
        self.metrics.requests.labels(endpoint, engine, str(status)).inc()

    def _record(self, record: dict, choice: Choice, tokens: list[int], outcome: Outcome,
                t0: float, tried: list[str], result: str) -> None:
        engine = choice.instance_id
        latency_s = time.perf_counter() - t0
        ttft_s = outcome.first_chunk_s - t0 if outcome.streamed and outcome.first_chunk_s \
            else None
        m = self.metrics
        self._count(record["endpoint"], engine, outcome.status)
        m.latency.labels(engine).observe(latency_s)
        if ttft_s is not None:
            m.ttft.labels(engine).observe(ttft_s)
        m.prompt_tokens.labels(engine).inc(len(tokens))
        for tier, blocks in choice.hit_blocks.items():
            m.hit_blocks.labels(engine, tier).inc(blocks)
        log.info("request_served", engine=engine, policy=choice.policy, status=outcome.status,
                 result=result, prompt_tokens=len(tokens),
                 hits_gpu=choice.hit_blocks["gpu"], hits_cpu=choice.hit_blocks["cpu"],
                 hits_store=choice.hit_blocks["store"],
                 ttft_s=None if ttft_s is None else round(ttft_s, 4),
                 latency_s=round(latency_s, 4), route_s=round(choice.route_s, 5),
                 failed_engines=",".join(tried) or None, **record)


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


@web.middleware
async def _errors_as_openai(request: web.Request, handler) -> web.StreamResponse:
    """The gateway's own errors, aiohttp's (unknown path, wrong method, body too large) and
    anything unexpected, all as OpenAI error bodies."""
    try:
        return await handler(request)
    except APIError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = NotFound(f"no such endpoint: {request.method} {request.path}") \
            if e.status == 404 else APIError(e.reason, status=e.status)
        return web.json_response(err.body(), status=e.status, headers=_allow(e))
    except Exception:   # a bug: logged with its traceback, answered 500
        log.exception("request_crashed", path=request.path)
        err = APIError("the gateway failed on this request (see its log)", status=500)
        err.type = "internal_error"
        return web.json_response(err.body(), status=500)


def _allow(e: web.HTTPException) -> dict[str, str]:
    return {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
