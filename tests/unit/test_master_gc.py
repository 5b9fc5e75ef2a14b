"""The master's cycle collector (tools/master_cmd.py ``gc_for_a_large_index``): what outlives
a generation-1 collection is frozen, so no collection walks the index again; and the master's
batch answers make no cycles that freezing would keep forever."""

from __future__ import annotations

import subprocess
import sys

from kvpool.common.errors import AlreadyExists, ObjectNotFound

from .test_state import make_state, mount, put

_LONG_LIVED = """
import gc
from kvpool.tools.master_cmd import gc_for_a_large_index
gc_for_a_large_index()
kept = {i: [i] for i in range(300_000)}      # an index's entries: tracked, long-lived
for _ in range(30):   # requests' short-lived objects (each lot made before the last one dies)
    garbage = [[j] for j in range(60_000)]
print(gc.get_freeze_count(), len(gc.get_objects(generation=2)))
"""


def test_what_outlives_a_generation_1_collection_is_frozen_out_of_every_later_collection():
    out = subprocess.run([sys.executable, "-c", _LONG_LIVED], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    frozen, old = map(int, out.split())
    assert frozen >= 300_000      # the kept lists (and their dict), walked young, then frozen
    assert old < 50_000           # the oldest generation holds none of them: a full collection
                                  # walks what is younger than the last freeze only


def test_a_batch_answers_errors_carry_no_traceback_to_make_a_cycle_with(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    put(state, "k", 64)
    [stored] = state.put_start(["k"], [64])
    [missing] = state.remove(["nothing"])
    assert isinstance(stored, AlreadyExists) and isinstance(missing, ObjectNotFound)
    assert stored.__traceback__ is None and missing.__traceback__ is None
