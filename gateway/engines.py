"""The engines behind the gateway, and what the gateway knows of each: sans-IO, clock injected.

An engine is an OpenAI-compatible server (``vllm serve``) reached at ``url`` and known to the
router as ``instance_id``: the id its KV events are published under (``kvpool kv-events
--instance-id ID``), so that Route's answer names an engine the gateway can reach. Written on
the command line as ``ID=URL``, or ``URL`` alone, whose id is then the URL's ``host:port``.

Load, per engine, as Route's ``Candidate`` takes it:

- ``queue_depth``: requests there, waiting or running (a running one takes its share of every
  step a new one's prefill runs in). The gateway's own requests in flight there, or what the
  engine reported at its last scrape (``running + waiting``, which also counts requests other
  clients sent it), whichever is larger. Either alone is wrong: the scrape is up to a poll
  interval old, and the gateway does not see other clients. (Counting only the gateway's
  requests still waiting for a first token made every engine that had prefilled look idle
  between scrapes, and Route's tie-break then sent request after request to the first one.)
- ``inflight_prefill_tokens``: prompt tokens the gateway sent there that are still to be
  prefilled, i.e. its requests without a first token yet, each counted as its prompt less the
  prefix Route expected it to reuse.
- ``decoding_requests``: of ``queue_depth``, those not waiting for a first token from the
  gateway (generating), and those whose first token the gateway cannot see (not streamed: the
  whole answer comes at once), which may be generating too. The master's estimate of time to
  first token leaves them out, so among engines it scores within its slack, fewer decides (two
  long generations sent one after the other to the same engine while another idled, because
  one engine's measured prefill rate was a little faster).
- ``prefill_tokens_per_s``, ``store_tokens_per_s``: with a ``calibrator``
  (:class:`~kvpool.master.calibration.CostCalibrator`), the engine's rates as measured from
  its first tokens against what Route expected each request to recompute and load; 0 (the
  master's cost model) until the first one came back (the fleet's estimate, then the
  engine's own).

Disaggregated serving: each engine has a ``role``: ``both`` (colocated: prefill and decode),
``prefill`` (a ``kv_producer``: computes prompts, stores their KV in kvpool) or ``decode`` (a
``kv_consumer``: loads a prompt's KV from kvpool and generates); :func:`check_roles` refuses a
mix that cannot serve.

An engine that fails (refused connection, reset, timeout, a 502/503/504) is marked down and
offered to no request until a probe finds it healthy again; the probes back off from
``backoff_s`` doubling to ``max_backoff_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvpool.client.router import Candidate
from kvpool.master.calibration import CostCalibrator, Ticket


class EngineSpecError(ValueError):
    """An ``--engines`` entry that names no engine (the message says which and why)."""


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    instance_id: str
    url: str          # scheme://host:port, no trailing slash
    role: str = "both"


def parse_engines(text: str, role: str = "both") -> list[EngineSpec]:
    """``ID=URL,URL,...`` -> specs (each with ``role``); ids default to the URL's
    ``host:port``; ids and URLs must be unique. ``http://`` is assumed when a URL has no
    scheme."""
    specs = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        instance_id, sep, url = item.partition("=")
        if not sep:
            instance_id, url = "", item
        if "://" not in url:
            url = "http://" + url
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None \
                or parts.path not in ("", "/"):
            raise EngineSpecError(f"invalid engine {item!r}: expected [ID=]http://HOST:PORT")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        specs.append(EngineSpec(instance_id.strip() or f"{host}:{port}",
                                f"{parts.scheme}://{host}:{port}", role))
    if not specs:
        raise EngineSpecError("no engines given: expected [ID=]http://HOST:PORT,...")
    _check_unique(specs)
    return specs


def check_roles(specs: list[EngineSpec]) -> list[EngineSpec]:
    """Refuse engines that cannot serve together: an id or URL listed twice (in any roles: an
    engine that should both prefill and decode is a colocated one), prefill engines without
    decode engines or the reverse, colocated engines mixed with a disaggregated pair."""
    roles = {s.role for s in specs}
    if roles - set(ROLES):
        raise EngineSpecError(f"unknown engine role(s) {sorted(roles - set(ROLES))}: "
                              f"expected {', '.join(ROLES)}")
    _check_unique(specs)
    if "both" in roles and roles != {"both"}:
        raise EngineSpecError("colocated engines (--engines) cannot be mixed with "
                              "disaggregated ones (--prefill/--decode): give one or the other")
    if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
        have, lack = ("prefill", "decode") if "prefill" in roles else ("decode", "prefill")
        raise EngineSpecError(f"disaggregated serving needs both prefill and decode engines: "
                              f"{have} engines given, no --{lack} engines")
    return specs


def _check_unique(specs: list[EngineSpec]) -> None:
    for what, values in (("id", [s.instance_id for s in specs]), ("URL", [s.url for s in specs])):
        if len(set(values)) != len(values):
            twice = sorted({v for v in values if values.count(v) > 1})
            raise EngineSpecError(f"an engine {what} is listed twice: {', '.join(twice)} (an "
                                  "engine that both prefills and decodes is a colocated one: "
                                  "list it in --engines only)")


@dataclass(eq=False, slots=True)
class EngineState:
    spec: EngineSpec
    waiting_first_token: dict[int, int] = field(default_factory=dict)   # request -> tokens
    unseen: set[int] = field(default_factory=set)   # of those, requests not streamed
    inflight: int = 0                  # gateway requests there, from send to last byte
    reported_queue: int = 0            # running + waiting at the engine's last scrape
    down_since: float | None = None
    retry_at: float = 0.0
    backoff_s: float = 0.0
    failures: int = 0

    @property
    def up(self) -> bool:
        return self.down_since is None

    def candidate(self, calibrator: CostCalibrator | None = None) -> Candidate:
        rates = calibrator.measured(self.spec.instance_id) if calibrator else None
        queue = max(self.inflight, self.reported_queue)
        prefilling = len(self.waiting_first_token) - len(self.unseen)
        return Candidate(self.spec.instance_id, queue, sum(self.waiting_first_token.values()),
                         *((rates.prefill_tokens_per_s, rates.store_tokens_per_s)
                           if rates else (0.0, 0.0)),
                         decoding_requests=max(0, queue - prefilling))


class EnginePool:
    """Every engine's state. One event loop owns it: no locks."""

    def __init__(self, specs: Iterable[EngineSpec], *, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 calibrator: CostCalibrator | None = None):
        self.engines = {s.instance_id: EngineState(s) for s in specs}
        self.calibrator = calibrator
        self._calibrating: dict[int, tuple[Ticket, int, int]] = {}
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._clock = clock
        self._next_request = 0

    def add(self, spec: EngineSpec) -> None:
        """A new engine (found by discovery): down until a probe finds it healthy, so that no
        request meets an engine that does not answer yet."""
        e = self.engines[spec.instance_id] = EngineState(spec)
        e.down_since = e.retry_at = self._clock()

    def remove(self, instance_id: str) -> bool:
        """Forget an engine with no request of the gateway's in flight there; returns whether
        it was removed (an engine still serving is left for a later call)."""
        e = self.engines.get(instance_id)
        if e is None or e.inflight:
            return False
        del self.engines[instance_id]
        return True

    def __getitem__(self, instance_id: str) -> EngineState:
        return self.engines[instance_id]

    @property
    def disaggregated(self) -> bool:
        return any(e.spec.role != "both" for e in self.engines.values())

    def candidates(self, exclude: Iterable[str] = (), role: str | None = None
                   ) -> list[Candidate]:
        """The engines up (of ``role``, if given), less ``exclude`` (those a request already
        failed on), as Route candidates with their load."""
        skip = set(exclude)
        return [e.candidate(self.calibrator) for e in self.engines.values()
                if e.up and e.spec.instance_id not in skip
                and (role is None or e.spec.role == role)]

    def least_busy(self, role: str, exclude: Iterable[str] = ()) -> str | None:
        """The engine up of ``role`` with the fewest requests (the gateway's in flight there,
        or the engine's own count at its last scrape, whichever is larger): how decode engines
        are chosen, whose work is generating, not prefilling. None: no engine left."""
        skip = set(exclude)
        up = [e for e in self.engines.values()
              if e.up and e.spec.role == role and e.spec.instance_id not in skip]
        if not up:
            return None
        return min(up, key=lambda e: (max(e.inflight, e.reported_queue), e.inflight)
                   ).spec.instance_id

    # -- a request's life on an engine --
    def sent(self, instance_id: str, prefill_tokens: int, store_tokens: int = 0, *,
             seen: bool = True) -> int:
        """A request went to the engine with ``prefill_tokens`` to prefill and
        ``store_tokens`` to load from the store (Route's expectation); returns its ticket for
        ``first_token`` and ``done``. ``seen``: its first token will be seen when it comes (a
        stream, or an answer of one token); else it teaches the calibrator nothing (its first
        token's time is unknown), and counts as possibly generating."""
        self._next_request += 1
        e = self.engines[instance_id]
        e.waiting_first_token[self._next_request] = max(0, prefill_tokens)
        if not seen:
            e.unseen.add(self._next_request)
        e.inflight += 1
        if self.calibrator is not None and seen:
            self._calibrating[self._next_request] = (
                self.calibrator.sent(instance_id), max(0, prefill_tokens), max(0, store_tokens))
        return self._next_request

    def first_token(self, instance_id: str, ticket: int) -> None:
        e = self.engines[instance_id]
        e.waiting_first_token.pop(ticket, None)
        e.unseen.discard(ticket)
        seen = self._calibrating.pop(ticket, None)
        if seen is not None:
            self.calibrator.first_token(*seen)

    def done(self, instance_id: str, ticket: int) -> None:
        e = self.engines[instance_id]
        e.waiting_first_token.pop(ticket, None)
        e.unseen.discard(ticket)
        e.inflight -= 1
        self._calibrating.pop(ticket, None)   # failed before its first token: nothing learned

    # -- health --
    def failed(self, instance_id: str) -> bool:
        """The engine failed a request or a probe: down, next probe after the back-off.
        Returns True if it was up until now."""
        e, now = self.engines[instance_id], self._clock()
        was_up = e.up
        e.failures += 1
        e.backoff_s = self.backoff_s if was_up else min(2 * e.backoff_s, self.max_backoff_s)
        if was_up:
            e.down_since = now
        e.retry_at = now + e.backoff_s
        return was_up

    def healthy(self, instance_id: str) -> bool:
        """A probe found the engine healthy: up again. Returns True if it was down."""
        e = self.engines[instance_id]
        was_down = not e.up
        e.down_since, e.backoff_s = None, 0.0
        return was_down

    def due_for_probe(self) -> list[str]:
        """The down engines whose back-off has passed."""
        now = self._clock()
        return [i for i, e in self.engines.items() if not e.up and e.retry_at <= now]

    def reported(self, instance_id: str, queue: int) -> None:
        self.engines[instance_id].reported_queue = max(0, queue)
