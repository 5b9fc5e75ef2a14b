"""Bridge vLLM's KV-event stream (ZMQ, msgpack) to the master's Router, in kvpool's hashes.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``)
publishes multipart messages ``(topic, seq: 8-byte big-endian, payload)`` on a PUB socket; the
payload is a msgspec-msgpack ``KVEventBatch(ts, events, data_parallel_rank)`` whose events are
tagged structs ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, ...)``, ``BlockRemoved(block_hashes, medium, ...)`` and
``AllBlocksCleared()`` (vllm/distributed/kv_events.py). Older vLLM encodes structs as arrays
with the tag first (``["BlockStored", [...], ...]``); newer ones as maps with a ``"type"`` key;
both are accepted.

vLLM's block hashes are its own (sha256 or builtin, seeded per process), so they mean nothing
to other engines. :class:`VLLMEventTranslator` re-hashes each stored block with kvpool's spec
from the event's token ids and parent, remembering engine hash -> kvpool hash per tier, so the
master's index speaks one hash language for every engine. A stored block whose parent it never
saw (events missed before the bridge started) is skipped: without its prefix it can never be
matched anyway.

An engine's stream is input like any other: an event of a shape nobody expected (a string
timestamp, a map for a hash, too few fields, an unknown tag) is logged (a few lines a minute,
then counted) and skipped, alone; the bridge goes on. Only a block size other than the
cluster's ends it (HashSpecMismatch: a configuration error, not a bad event).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Self

import msgpack
from kvpool.client.router import RouterClient
from kvpool.common.errors import HashSpecMismatch, InvalidArgument, KVPoolError
from kvpool.common.hashing import HashSpec, block_hash
from kvpool.common.kv_events import (
    LOCAL_TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    tier_of_medium,
)
from kvpool.common.logging import RateLimited, get_logger
from kvpool.common.loops import LoopCrashed, OnCrash, Supervisor

log = get_logger(__name__)
_refusals = RateLimited(log)   # malformed events: a few lines a minute, then a count
# A crash (a bug, or an engine message of a shape nobody expected) costs the batch being read;
# the next ones are fine, so the bridge goes on. One that keeps coming ends the bridge like any
# error of its own: in ``error``, raised by ``stop()``. Never the process: it may be the engine's.
_ON_CRASH = OnCrash(restarts=5, why="the KV-event bridge stops")

# Field order of vLLM's array-like structs (after the tag).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


@dataclass(frozen=True, slots=True)
class VLLMBatch:
    ts: float
    events: list[dict]          # each with "type" and vLLM's field names
    data_parallel_rank: int | None


def _fields(obj, names: Sequence[str]) -> dict:
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, (list, tuple)):
        return dict(zip(names, obj))
    raise InvalidArgument(f"not a vLLM KV event struct: {obj!r:.80}")


def decode_vllm_batch(payload: bytes) -> VLLMBatch:
    """Decode one vLLM ``KVEventBatch`` payload (array-like or map encoding); InvalidArgument
    for anything else."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001  (msgpack raises many unrelated types on bad input)
        raise InvalidArgument(f"not a msgpack KV event batch: {e}") from None
    try:
        return _decode(raw)
    except InvalidArgument:
        raise
    except Exception as e:  # noqa: BLE001  (decodable, but not the shape of a batch)
        raise InvalidArgument(f"not a vLLM KV event batch: {type(e).__name__}: {e}"[:200]) \
            from None


def _decode(raw) -> VLLMBatch:
    batch = _fields(raw, _BATCH_FIELDS)
    events = []
    for ev in batch.get("events") or ():
        if isinstance(ev, (list, tuple)) and ev:
            tag, rest = ev[0], ev[1:]
            names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
            events.append({"type": tag, **dict(zip(names, rest))})
        elif isinstance(ev, dict) and "type" in ev:
            events.append(ev)
        else:
            raise InvalidArgument(f"not a vLLM KV event: {ev!r:.80}")
    ts = batch.get("ts") or 0.0
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise InvalidArgument(f"KV event batch timestamp is not a number: {ts!r:.40}")
    return VLLMBatch(float(ts), events, batch.get("data_parallel_rank"))


class VLLMEventTranslator:
    """vLLM events (engine hashes) -> kvpool events (kvpool-sha256-v1 hashes), for one
    instance. Sans-IO; ``spec.extra_keys`` must name the model like every other client does."""

    def __init__(self, spec: HashSpec):
        self.spec = spec
        self._roots: dict[str | None, bytes] = {None: spec.root()}
        self._known: dict[str, dict[Hashable, bytes]] = {t: {} for t in LOCAL_TIERS}
        self.skipped_blocks = 0
        self.malformed_events = 0   # skipped: not the shape vLLM publishes

    def _root(self, lora_name: str | None) -> bytes:
        if lora_name not in self._roots:
            self._roots[lora_name] = HashSpec(
                self.spec.block_size, self.spec.extra_keys + (("lora", lora_name),)).root()
        return self._roots[lora_name]

    def _parent(self, engine_hash) -> bytes | None:
        for known in self._known.values():
            if engine_hash in known:
                return known[engine_hash]
        return None

    def translate(self, events: Sequence[dict]) -> list[KVEvent]:
        """kvpool's events for ``events``; a malformed one is logged, counted and skipped
        (HashSpecMismatch, a configuration error, is raised)."""
        out: list[KVEvent] = []
        for ev in events:
            try:
                out += self._translate_one(ev)
            except HashSpecMismatch:
                raise
            except Exception as e:  # noqa: BLE001  (any shape an engine might send)
                self.malformed_events += 1
                _refusals.warning("vllm_event_malformed", kind=type(e).__name__,
                                  error=f"{type(e).__name__}: {e}"[:200],
                                  skipped=self.malformed_events)
        return out

    def _translate_one(self, ev: dict) -> list[KVEvent]:
        kind = ev.get("type")
        if kind == "BlockStored":
            return self._stored(ev)
        if kind == "BlockRemoved":
            tier = tier_of_medium(ev.get("medium"))
            known = self._known[tier]
            hashes = tuple(known.pop(k) for k in map(_key, ev.get("block_hashes") or ())
                           if k in known)
            return [BlockRemoved(hashes, tier)] if hashes else []
        if kind == "AllBlocksCleared":
            for known in self._known.values():
                known.clear()
            return [AllBlocksCleared()]
        raise InvalidArgument(f"unknown KV event type {kind!r:.40}")

    def _stored(self, ev: dict) -> list[KVEvent]:
        size = ev.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidArgument(f"BlockStored block_size is not an int >= 1: {size!r:.40}")
        if size != self.spec.block_size:
            raise HashSpecMismatch(
                f"the engine publishes {size}-token blocks but the cluster hashes "
                f"{self.spec.block_size}-token blocks: set the engine's --block-size to "
                f"{self.spec.block_size}")
        engine_hashes = [_key(h) for h in ev.get("block_hashes") or ()]
        tokens = list(ev.get("token_ids") or ())
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
                   for t in tokens):
            raise InvalidArgument("BlockStored token ids must be ints in [0, 2**32)")
        if len(tokens) != size * len(engine_hashes):
            raise InvalidArgument(f"BlockStored with {len(engine_hashes)} blocks of {size} "
                                  f"tokens carries {len(tokens)} token ids")
        parent_engine = ev.get("parent_block_hash")
        parent = self._root(ev.get("lora_name")) if parent_engine is None \
            else self._parent(_key(parent_engine))
        if parent is None:
            self.skipped_blocks += len(engine_hashes)
            return []
        tier = tier_of_medium(ev.get("medium"))
        ours = []
        for i, h in enumerate(engine_hashes):
            parent = block_hash(parent, tokens[i * size:(i + 1) * size])
            self._known[tier][_key(h)] = parent
            ours.append(parent)
        return [BlockStored(tuple(ours), tier)]


def _key(engine_hash) -> Hashable:
    """An engine's block hash as a dict key: msgpack gives bytes or int (a list of ints from
    some encoders becomes a tuple); anything else is not a block hash."""
    if isinstance(engine_hash, (bytes, int, str)) and not isinstance(engine_hash, bool):
        return engine_hash
    if isinstance(engine_hash, (list, tuple)) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in engine_hash):
        return tuple(engine_hash)
    raise InvalidArgument(f"not a block hash: {engine_hash!r:.40}")


class ZMQEventBridge:
    """Subscribe to one vLLM instance's ZMQ KV events and stream them, translated, to the
    master. ``start()`` / ``stop()``; a background thread does the work. An idle bridge sends
    an empty batch every ``heartbeat_s`` so the instance does not age out of the index."""

    def __init__(self, endpoint: str, instance_id: str, master: str, spec: HashSpec, *,
                 topic: str = "", heartbeat_s: float = 5.0, url: str = "", role: str = ""):
        self.endpoint, self.instance_id, self.topic = endpoint, instance_id, topic
        self.url, self.role = url, role   # announced with every batch (gateway discovery)
        self.heartbeat_s = heartbeat_s
        self._router = RouterClient(master)
        self.spec = self._router.register(spec, client_id=f"vllm-bridge:{instance_id}")
        self.translator = VLLMEventTranslator(self.spec)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.missed_batches = 0
        self.malformed_batches = 0   # not decodable as a KV event batch: skipped
        self.error: BaseException | None = None
        self._last_send = 0.0

    def start(self) -> ZMQEventBridge:
        import zmq
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sub.connect(self.endpoint)
        self._stream = self._router.event_stream(self.instance_id, url=self.url, role=self.role)
        self._stream.send([])       # announce the instance at once
        self._thread = Supervisor(fatal=self._give_up).start_thread(
            f"vllm-events-{self.instance_id}", self._run, _ON_CRASH, self._stop)
        return self

    def _run(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        last_seq = None
        try:
            while not self._stop.is_set():
                if not poller.poll(timeout=int(min(self.heartbeat_s, 0.1) * 1000)):
                    self._heartbeat_if_idle()
                    continue
                frames = self._sub.recv_multipart()
                if len(frames) != 3:
                    self.malformed_batches += 1
                    _refusals.warning("vllm_event_refused", instance=self.instance_id,
                                      error=f"{len(frames)} frames, not 3",
                                      skipped=self.malformed_batches)
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if last_seq is not None and seq > last_seq + 1:
                    self.missed_batches += seq - last_seq - 1
                    log.warning("vllm_events_missed", instance=self.instance_id,
                                batches=seq - last_seq - 1)
                last_seq = seq
                try:
                    events = self.translator.translate(decode_vllm_batch(frames[2]).events)
                except InvalidArgument as e:
                    self.malformed_batches += 1
                    _refusals.warning("vllm_event_refused", instance=self.instance_id,
                                      error=str(e)[:200], skipped=self.malformed_batches)
                    continue
                self._stream.send(events)
                self._last_send = time.monotonic()
                self.batches += 1
        except KVPoolError as e:   # re-raised by stop(): a dead bridge must not look alive
            self.error = e
            log.error("vllm_bridge_failed", instance=self.instance_id, error=str(e))

    def _give_up(self, error: LoopCrashed) -> None:
        self.error = error

    def _heartbeat_if_idle(self) -> None:
        if time.monotonic() - self._last_send >= self.heartbeat_s:
            self._stream.send([])
            self._last_send = time.monotonic()

    def stop(self) -> int:
        """Stop, close the stream; return the events the master applied. Re-raises a failure
        of the bridge thread (e.g. HashSpecMismatch for an engine with another block size)."""
        self._stop.set()
        if self._thread is None:        # never started
            self._router.close()
            return 0
        self._thread.join(timeout=5)
        applied = self._stream.close()
        self._sub.close(linger=0)
        self._ctx.term()
        self._router.close()
        if self.error is not None:
            raise self.error
        return applied

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
