"""net/sockets.py Spinner: an answer is polled for a while before the caller sleeps on it, and
answers that do not come in time make the following waits sleep at once (a back-off)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kvpool.common.config import ConfigError
from kvpool.net.sockets import SPIN_ENV, Spinner, spin_default_s

SPIN_S = 0.05   # long against a loaded machine's scheduling delays


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


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
