"""Long-lived loops that cannot die silently.

Every loop a kvpool process runs for its whole life (a store node's heartbeat, manifest watch,
mover, scrubber and data-port acceptor; the master's tick; a bridge's event pump) runs under a
:class:`Supervisor`, in a thread (:meth:`Supervisor.start_thread`) or as an asyncio task
(:meth:`Supervisor.run`). The loop handles the errors it expects itself (a master that cannot be
reached, a client that went away); anything else is a bug, and then, instead of the thread
ending while the rest of the process goes on as if nothing happened:

- the exception is logged once with its traceback (``loop_crashed``); the same crash again
  (same type raised at the same place) is one short line at most every ``quiet_s`` with a count
  (``loop_crashed_again``), so a loop that fails at every turn cannot flood the log;
- the loop's :class:`OnCrash` decides what comes next: a restart after a back-off (doubling
  from ``first_backoff_s`` to ``max_backoff_s``, so a loop that fails at once does not spin),
  or, after ``restarts`` crashes in a row, the end of the process (``fatal``), for a loop
  without which the process must not go on serving. Each loop's policy says why where it is
  started.

A loop that returns has finished (its owner asked it to stop): it is not run again.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool.common.errors import KVPoolError
from kvpool.common.logging import get_logger

log = get_logger(__name__)

# EX_SOFTWARE (sysexits.h): an internal error. A supervisor (systemd Restart=on-failure,
# Kubernetes) restarts the process and counts the failure.
EXIT_STATUS = 70


class LoopCrashed(KVPoolError):
    """A supervised loop crashed and may not go on: the process (or the loop's owner) stops.
    ``__cause__`` is the loop's exception."""


@dataclass(frozen=True, slots=True)
class OnCrash:
    """What a loop's crash leads to. ``restarts``: how many crashes in a row are followed by
    a restart (None: every one); the next one stops the process with ``why`` (what going on
    would risk) in its message. A run that lasted ``max_backoff_s`` or more was healthy: the
    crashes before it no longer count, and the back-off starts again from ``first_backoff_s``."""

    restarts: int | None = None
    why: str = ""
    first_backoff_s: float = 0.1
    max_backoff_s: float = 30.0


RESTART = OnCrash()


def exit_process(error: LoopCrashed) -> None:
    """The default end of a process whose loop cannot go on: say why, exit with EXIT_STATUS.
    ``os._exit``, not a clean shutdown: a thread cannot end the process otherwise, and a
    process that has hit a bug should not run more of its code on the way out; kvpool is built
    to survive a process killed at any moment (a node's objects are found elsewhere or
    re-announced, a master's index is rebuilt from the nodes)."""
    log.critical("process_stopping", reason=str(error), exit_status=EXIT_STATUS)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_STATUS)


class Supervisor:
    """Runs long-lived loops so that none dies silently (see the module docstring).

    ``fatal(error)``: called when a loop may not go on (by default :func:`exit_process`); a
    library embedded in another process (the vLLM bridge) passes its own, to hand the failure
    to its owner. ``clock`` paces the log's repeats and tells healthy runs."""

    def __init__(self, fatal: Callable[[LoopCrashed], None] = exit_process,
                 clock: Callable[[], float] = time.monotonic, quiet_s: float = 60.0):
        self._fatal, self._clock, self._quiet_s = fatal, clock, quiet_s

    def start_thread(self, name: str, loop: Callable[[], None], on_crash: OnCrash,
                     stopping: threading.Event) -> threading.Thread:
        """Start a daemon thread named ``name`` running ``loop()`` under ``on_crash``. A
        back-off ends early, with the thread, once ``stopping`` is set."""
        thread = threading.Thread(target=self._run_thread, args=(name, loop, on_crash, stopping),
                                  name=name, daemon=True)
        thread.start()
        return thread

    def _run_thread(self, name: str, loop: Callable[[], None], on_crash: OnCrash,
                    stopping: threading.Event) -> None:
        crashes = _Crashes(name, on_crash, self)
        while True:
            crashes.started()
            try:
                loop()
                return
            except Exception as e:   # noqa: BLE001  (the point: whatever the loop did not expect)
                backoff_s = crashes.crashed(e)
            if backoff_s is None or stopping.wait(backoff_s):
                return

    async def run(self, name: str, loop: Callable[[], Awaitable[None]],
                  on_crash: OnCrash) -> None:
        """Await ``loop()`` under ``on_crash`` (wrap in a task to run it in the background);
        cancelling it cancels the loop or its back-off."""
        crashes = _Crashes(name, on_crash, self)
        while True:
            crashes.started()
            try:
                await loop()
                return
            except Exception as e:   # noqa: BLE001  (CancelledError is not one: it goes through)
                backoff_s = crashes.crashed(e)
            if backoff_s is None:
                return
            await asyncio.sleep(backoff_s)


class _Crashes:
    """One supervised loop's crash record: the streak, the back-off, what was logged."""

    def __init__(self, name: str, on_crash: OnCrash, supervisor: Supervisor):
        self._name, self._policy, self._sup = name, on_crash, supervisor
        self._started = 0.0
        self._streak = 0
        # crash signature -> [when last logged, crashes since then not logged]
        self._logged: dict[tuple, list] = {}

    def started(self) -> None:
        self._started = self._sup._clock()

    def crashed(self, error: Exception) -> float | None:
        """Log the crash; return the back-off before the restart, or None after calling
        ``fatal`` (the loop must not go on)."""
        now, p = self._sup._clock(), self._policy
        if now - self._started >= p.max_backoff_s:
            self._streak = 0
        self._streak += 1
        give_up = p.restarts is not None and self._streak > p.restarts
        backoff_s = None if give_up else min(p.first_backoff_s * 2 ** (self._streak - 1),
                                             p.max_backoff_s)
        self._log(error, now, backoff_s)
        if give_up:
            times = f", {self._streak} times in a row" if self._streak > 1 else ""
            why = f": {p.why}" if p.why else ""
            fatal = LoopCrashed(f"the {self._name} loop crashed ({_describe(error)}{times}) and "
                                f"cannot go on{why}; stopping")
            fatal.__cause__ = error
            self._sup._fatal(fatal)
        return backoff_s

    def _log(self, error: Exception, now: float, backoff_s: float | None) -> None:
        then = "stop" if backoff_s is None else "restart"
        # The same crash: the same type raised at the same place (the innermost frame; the
        # whole traceback would differ for one exception object raised again and again).
        where = traceback.extract_tb(error.__traceback__)[-1:]
        signature = (type(error), tuple((f.filename, f.lineno) for f in where))
        seen = self._logged.get(signature)
        if seen is None:
            self._logged[signature] = [now, 0]
            log.error("loop_crashed", loop=self._name, then=then, backoff_s=backoff_s,
                      exc_info=error)
            return
        seen[1] += 1
        if now - seen[0] >= self._sup._quiet_s:
            log.error("loop_crashed_again", loop=self._name, error=_describe(error),
                      times=seen[1], then=then, backoff_s=backoff_s)
            seen[:] = [now, 0]


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


_T = TypeVar("_T")


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(main)`` on uvloop's event loop (libuv, its TLS in Cython) where uvloop is
    installed (a dependency; on a platform without its wheels, asyncio's own loop). A server
    process's whole life runs in it: the master's round trips on the lookup port took 11-16%
    less under uvloop, TLS the most (scripts/put_phases.py, interleaved: a secure get 0.403 ->
    0.337 ms p50, a put 1.031 -> 0.922 ms)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
