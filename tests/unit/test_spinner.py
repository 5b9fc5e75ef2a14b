"""net/sockets.py Spinner: an answer is polled for a while before the caller sleeps on it, and
answers that do not come in time make the following waits sleep at once (a back-off);
LoopSpinner: a server's event loop polls a while after each answer, with the same back-off."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from kvpool.common.config import ConfigError
from kvpool.net.sockets import SPIN_ENV, LoopSpinner, Spinner, spin_default_s

SPIN_S = 0.05   # long against a loaded machine's scheduling delays


def _timed(spinner: Spinner) -> tuple[bool, float]:
    start = time.perf_counter()
    return spinner.wait(), time.perf_counter() - start


def test_an_answer_already_there_or_arriving_during_the_spin_is_caught(pair):
    a, b = pair
    spinner = Spinner(a, SPIN_S)
    b.send(b"x")
    assert spinner.wait()
    a.recv(1)
    patient = Spinner(a, 2.0)   # an answer 10 ms into a 2 s spin is caught, not slept on
    timer = threading.Timer(0.01, b.send, (b"y",))
    timer.start()
    readable, took = _timed(patient)
    timer.join()
    assert readable and took < 2.0


def test_answers_that_miss_the_spin_back_off_and_one_in_time_ends_it(pair):
    a, b = pair
    spinner = Spinner(a, SPIN_S)
    pattern = []
    for _ in range(12):
        readable, took = _timed(spinner)
        assert not readable
        pattern.append(took >= SPIN_S)
    # Spun, then 1 wait that sleeps at once, spun, 3 at once, spun, 7 at once.
    assert pattern == [True, False, True, False, False, False, True] + [False] * 5
    for _ in range(2):   # the rest of the back-off
        assert _timed(spinner) == (False, pytest.approx(0, abs=SPIN_S / 2))
    b.send(b"x")
    assert spinner.wait()   # in time: the back-off ends
    a.recv(1)
    readable, took = _timed(spinner)
    assert not readable and took >= SPIN_S    # the next miss spins in full again


def test_spinning_is_off_at_zero_and_the_environment_sets_it(pair, monkeypatch):
    a, b = pair
    b.send(b"x")
    assert Spinner(a, 0.0).wait() is False
    monkeypatch.setenv(SPIN_ENV, "0")
    assert spin_default_s() == 0.0
    monkeypatch.setenv(SPIN_ENV, "150")
    assert spin_default_s() == pytest.approx(150e-6)
    monkeypatch.delenv(SPIN_ENV)
    assert spin_default_s() == pytest.approx(200e-6)
    for bad in ("fast", "-1", "nan", "1e9"):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(ConfigError, match=SPIN_ENV):
            spin_default_s()


async def _spun(spinner: LoopSpinner) -> bool:
    """Whether an answer now keeps the loop polling; if so, waits until it stops."""
    spinner.answered(asyncio.get_running_loop())
    if not spinner.spinning:
        return False
    while spinner.spinning:
        await asyncio.sleep(0.002)
    return True


async def test_a_server_loop_keeps_polling_after_an_answer_while_serving_others():
    spinner = LoopSpinner(1.0)
    spinner.answered(asyncio.get_running_loop())
    served = []
    asyncio.get_running_loop().call_later(0.05, served.append, "timer")
    await asyncio.sleep(0.1)   # the loop runs everything else while it polls
    assert served == ["timer"] and spinner.spinning
    while spinner.spinning:
        await asyncio.sleep(0.01)


async def test_server_spins_with_no_request_in_them_back_off_and_a_request_ends_it():
    spinner = LoopSpinner(0.01)
    pattern = [await _spun(spinner) for _ in range(12)]
    # Spun (a miss), then 1 answer that does not spin, spun, 3, spun, 7.
    assert pattern == [True, False, True, False, False, False, True] + [False] * 5
    assert [await _spun(spinner) for _ in range(2)] == [False, False]   # the rest
    spinner.answered(asyncio.get_running_loop())
    spinner.heard()   # a request within the spin: no miss
    while spinner.spinning:
        await asyncio.sleep(0.002)
    assert await _spun(spinner) and await _spun(spinner) is False   # a miss again backs off
    assert not await _spun(LoopSpinner(0.0))


async def test_a_hold_a_client_asked_for_polls_that_long_backed_off_or_not():
    """A SPIN frame (net/lookup_port.py): the client's call comes after a copy of its own."""
    spinner = LoopSpinner(0.01)
    for _ in range(3):   # misses: answers stop spinning for a while
        await _spun(spinner)
    assert not await _spun(spinner)
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    spinner.hold(loop, 0.05)
    assert spinner.spinning
    while spinner.spinning:
        await asyncio.sleep(0.002)
    assert time.perf_counter() - started >= 0.05
    off = LoopSpinner(0.0)   # $KVPOOL_SPIN_US=0: no polling, asked for or not
    off.hold(loop, 0.05)
    assert not off.spinning


def _answered_after(b: socket.socket, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, b.send, (b"x",))
    timer.start()
    return timer


def _call(spinner: Spinner, a: socket.socket, b: socket.socket, delay_s: float, kind: int = 1
          ) -> tuple[bool, float, float]:
    """One call of ``kind`` answered ``delay_s`` after it is asked, as a caller makes it: wait,
    read (blocking where the wait says so), arrived. Whether the wait caught it, the call's time
    and the CPU time the waiting thread spent."""
    timer = _answered_after(b, delay_s)
    start, cpu = time.perf_counter(), time.thread_time()
    caught = spinner.wait(kind)
    a.recv(1)
    spinner.arrived()
    took, spent = time.perf_counter() - start, time.thread_time() - cpu
    timer.join()
    return caught, took, spent


def test_a_kind_of_call_learns_its_answers_time_and_naps_until_shortly_before_it(pair):
    a, b = pair
    spinner = Spinner(a, 0.01)
    caught, took, _ = _call(spinner, a, b, 0.15)
    assert not caught and took > 0.1   # unknown yet: spun 10 ms, then slept on the socket
    for _ in range(3):
        caught, took, spent = _call(spinner, a, b, 0.15)
        # Napped on a timer, then polled: the answer is caught, not slept on, at little CPU.
        assert caught and took < 0.3 and spent < 0.1
    caught, took, _ = _call(spinner, a, b, 0.002, kind=2)
    assert caught and took < 0.1   # another kind of call: not napped for kind 1's time


def test_a_late_answer_moves_the_nap_a_little_and_early_ones_shorten_it(pair):
    a, b = pair
    spinner = Spinner(a, 0.01)
    for _ in range(2):
        _call(spinner, a, b, 0.1)
    _call(spinner, a, b, 1.0)   # one answer held up: the next nap grows by an eighth at most
    caught, took, _ = _call(spinner, a, b, 0.02)
    assert 0.08 < took < 0.2    # it napped (for ~0.11 s): the answer waited for the nap's end
    times = [_call(spinner, a, b, 0.02)[1] for _ in range(12)]
    assert times[-1] < 0.06 < times[0]   # answers came during the nap: it shrank towards them


def test_waits_of_a_kind_do_not_back_off(pair):
    a, b = pair
    spinner = Spinner(a, SPIN_S)
    for _ in range(4):   # each misses (nothing is sent) and each spins in full: no back-off
        start = time.perf_counter()
        assert spinner.wait(7) is False
        assert time.perf_counter() - start >= SPIN_S


def test_answers_due_later_than_twenty_spins_are_not_napped_for(pair):
    a, b = pair
    spinner = Spinner(a, 0.01)
    _call(spinner, a, b, 0.3)   # the first answer held up: 30 spins
    caught, took, _ = _call(spinner, a, b, 0.005)
    assert caught and took < 0.1   # spun for and caught, not napped for 0.3 s
