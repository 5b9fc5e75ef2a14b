"""The loop supervisor (common/loops.py) with real threads, a real asyncio loop and, for the
end of a process, a real process."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import structlog
from kvpool.common.loops import EXIT_STATUS, RESTART, LoopCrashed, OnCrash, Supervisor

FAST = OnCrash(first_backoff_s=0.0005, max_backoff_s=0.002)


class Fatal:
    """A ``fatal`` hook that records instead of ending the test process."""

    def __init__(self):
        self.errors: list[LoopCrashed] = []
        self.called = threading.Event()

    def __call__(self, error: LoopCrashed) -> None:
        self.errors.append(error)
        self.called.set()


def crashes(logs, event="loop_crashed"):
    return [e for e in logs if e["event"] == event]


def run_thread(supervisor, loop, on_crash, stopping=None, timeout_s=10.0):
    t = supervisor.start_thread("test-loop", loop, on_crash, stopping or threading.Event())
    t.join(timeout_s)
    assert not t.is_alive(), "the supervised thread did not end"
    return t


def test_a_crashed_thread_loop_is_logged_with_its_traceback_and_runs_again():
    runs = []

    def loop():
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            raise RuntimeError("boom")

    fatal = Fatal()
    with structlog.testing.capture_logs() as logs:
        run_thread(Supervisor(fatal), loop, FAST)
    assert runs == ["test-loop", "test-loop"]      # restarted, on the thread it named
    [crash] = crashes(logs)
    assert crash["loop"] == "test-loop" and crash["then"] == "restart"
    assert crash["log_level"] == "error"
    error = crash["exc_info"]
    assert isinstance(error, RuntimeError) and error.__traceback__ is not None
    assert not fatal.errors


def test_a_loop_that_returns_is_not_run_again():
    runs = []
    with structlog.testing.capture_logs() as logs:
        run_thread(Supervisor(Fatal()), lambda: runs.append(1), RESTART)
    assert runs == [1] and not logs


def test_identical_crashes_are_logged_once_and_a_new_one_again():
    runs = []

    def loop():
        runs.append(1)
        if len(runs) == 50:
            raise ValueError("elsewhere")    # another line: another crash
        if len(runs) < 100:
            raise RuntimeError(f"boom {len(runs)}")   # same place, message varies

    with structlog.testing.capture_logs() as logs:
        run_thread(Supervisor(Fatal()), loop, FAST)
    assert len(runs) == 100
    assert [type(c["exc_info"]) for c in crashes(logs)] == [RuntimeError, ValueError]
    assert not crashes(logs, "loop_crashed_again")      # within quiet_s (60 s)


def test_repeats_are_one_short_line_per_quiet_period_with_a_count():
    clock = [0.0]
    runs = []

    def loop():
        runs.append(1)
        clock[0] += 1.0      # each run lasts 1 s (by the supervisor's clock)
        if len(runs) <= 12:
            raise RuntimeError("boom")

    policy = OnCrash(first_backoff_s=1e-5, max_backoff_s=5.0)   # runs of 1 s: not healthy
    with structlog.testing.capture_logs() as logs:
        run_thread(Supervisor(Fatal(), clock=lambda: clock[0], quiet_s=5.0), loop, policy)
    assert len(crashes(logs)) == 1
    again = crashes(logs, "loop_crashed_again")
    # Crashes at t=1..12: the first with its traceback (t=1), then one line at t=6 for the
    # 5 since and one at t=11 for the 5 after.
    assert [a["times"] for a in again] == [5, 5]
    assert all("exc_info" not in a and a["error"] == "RuntimeError: boom" for a in again)


def test_a_failing_loop_backs_off_instead_of_spinning():
    runs = []
    stopping = threading.Event()

    def loop():
        runs.append(time.monotonic())
        raise RuntimeError("boom")

    policy = OnCrash(first_backoff_s=0.01, max_backoff_s=0.08)
    t = Supervisor(Fatal()).start_thread("spin", loop, policy, stopping)
    time.sleep(0.6)
    stopping.set()
    t.join(5)
    assert not t.is_alive()
    # Back-offs 0.01, 0.02, 0.04, then 0.08 each: about 10 runs in 0.6 s (a spin: thousands).
    assert 4 <= len(runs) <= 12
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert gaps[0] >= 0.009 and min(gaps[3:]) >= 0.075


def test_stopping_ends_a_back_off_at_once():
    stopping = threading.Event()
    ran = threading.Event()

    def loop():
        ran.set()
        raise RuntimeError("boom")

    t = Supervisor(Fatal()).start_thread("slow", loop, OnCrash(first_backoff_s=30.0),
                                         stopping)
    assert ran.wait(5)
    started = time.monotonic()
    stopping.set()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - started < 1.0


def test_crashes_in_a_row_past_the_limit_stop_with_a_clear_message():
    runs = []

    def loop():
        runs.append(1)
        raise RuntimeError("boom")

    fatal = Fatal()
    policy = OnCrash(restarts=2, why="the node would serve stale data", first_backoff_s=0.001)
    with structlog.testing.capture_logs() as logs:
        run_thread(Supervisor(fatal), loop, policy)
    assert len(runs) == 3                    # two restarts, then no more
    [error] = fatal.errors
    assert str(error) == ("the test-loop loop crashed (RuntimeError: boom, 3 times in a row) "
                          "and cannot go on: the node would serve stale data; stopping")
    assert isinstance(error.__cause__, RuntimeError)
    [crash] = crashes(logs)
    assert crash["then"] == "restart"


def test_a_loop_without_restarts_stops_at_its_first_crash():
    fatal = Fatal()

    def loop():
        raise KeyError("k")

    with structlog.testing.capture_logs() as logs:
        run_thread(Supervisor(fatal), loop, OnCrash(restarts=0, why="the index may be torn"))
    assert [str(e) for e in fatal.errors] == [(
        "the test-loop loop crashed (KeyError: 'k') and cannot go on: the index may be torn; "
        "stopping")]
    [crash] = crashes(logs)
    assert crash["then"] == "stop" and crash["backoff_s"] is None


def test_healthy_runs_between_crashes_reset_the_streak():
    clock = [0.0]
    runs = []

    def loop():
        runs.append(1)
        clock[0] += 10.0     # each run lasts max_backoff_s: healthy, then crashes
        if len(runs) <= 5:
            raise RuntimeError("boom")

    fatal = Fatal()
    policy = OnCrash(restarts=1, first_backoff_s=0.001, max_backoff_s=10.0)
    with structlog.testing.capture_logs() as logs:
        run_thread(Supervisor(fatal, clock=lambda: clock[0]), loop, policy)
    assert len(runs) == 6 and not fatal.errors
    assert {c["backoff_s"] for c in crashes(logs)} == {0.001}


def test_an_async_loop_is_restarted_on_a_real_event_loop():
    runs = []

    async def loop():
        runs.append(1)
        await asyncio.sleep(0)
        if len(runs) < 3:
            raise RuntimeError("boom")

    fatal = Fatal()
    with structlog.testing.capture_logs() as logs:
        asyncio.run(asyncio.wait_for(Supervisor(fatal).run("tick", loop, FAST), 10))
    assert len(runs) == 3 and not fatal.errors
    [crash] = crashes(logs)
    assert crash["loop"] == "tick" and isinstance(crash["exc_info"], RuntimeError)


def test_an_async_loop_that_may_not_go_on_calls_fatal_once():
    runs = []

    async def loop():
        runs.append(1)
        raise RuntimeError("torn")

    fatal = Fatal()
    asyncio.run(asyncio.wait_for(
        Supervisor(fatal).run("tick", loop, OnCrash(restarts=0, why="x")), 10))
    assert len(runs) == 1
    assert [str(e) for e in fatal.errors] == [
        "the tick loop crashed (RuntimeError: torn) and cannot go on: x; stopping"]


def test_cancelling_a_supervised_task_cancels_its_back_off():
    async def main():
        ran = asyncio.Event()

        async def loop():
            ran.set()
            raise RuntimeError("boom")

        task = asyncio.create_task(
            Supervisor(Fatal()).run("tick", loop, OnCrash(first_backoff_s=30.0)))
        await asyncio.wait_for(ran.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 1)

    asyncio.run(main())


def test_the_default_fatal_ends_the_process_with_the_message_and_the_traceback(tmp_path):
    """The real thing: a process whose loop may not go on exits with EXIT_STATUS, its log
    saying which loop, why, and where it crashed."""
    script = textwrap.dedent("""
        import threading, time
        from kvpool.common.logging import configure
        from kvpool.common.loops import OnCrash, Supervisor
        configure("info", component="test")

        def heartbeat():
            raise RuntimeError("injected")

        Supervisor().start_thread("heartbeat", heartbeat,
                                  OnCrash(restarts=0, why="it would serve stale data"),
                                  threading.Event())
        time.sleep(30)
        print("still running")
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                       timeout=30)
    assert p.returncode == EXIT_STATUS, p.stderr
    assert "still running" not in p.stdout
    assert "loop_crashed" in p.stderr and "loop=heartbeat" in p.stderr
    assert "Traceback" in p.stderr and "RuntimeError: injected" in p.stderr
    assert "process_stopping" in p.stderr
    assert ("the heartbeat loop crashed (RuntimeError: injected) and cannot go on: it would "
            "serve stale data; stopping") in p.stderr
