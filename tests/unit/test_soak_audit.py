"""The soak auditor's reading of "not found" answers around master kills (tools/soak.py)."""

from kvpool.tools.soak import triage_misses

KILL = (10.0, 12.5)   # a master killed at 10.0 s, recovered by 12.5 s


def test_a_remove_cut_by_a_master_kill_is_no_loss_and_no_longer_checked():
    # The killed master removed it; the retry on its successor answered "not found".
    missing = {"k": {"t0": 9.0, "asked_at": 9.9, "missing_at": 10.4}}
    back, cut = triage_misses(missing, [KILL])
    assert (back, cut, missing) == ({}, 1, {})


def test_a_miss_while_the_master_recovers_is_audited_as_live():
    record = {"t0": 9.0, "asked_at": 11.0, "missing_at": 11.0}
    missing = {"k": record}
    back, cut = triage_misses(missing, [KILL])
    assert (back, cut, missing) == ({"k": record}, 0, {})


def test_a_miss_away_from_any_kill_stays_a_loss_to_check():
    for asked_at, missing_at in ((5.0, 5.2), (13.0, 13.0), (12.6, 12.9)):
        missing = {"k": {"t0": 1.0, "asked_at": asked_at, "missing_at": missing_at}}
        assert triage_misses(missing, [KILL]) == ({}, 0)
        assert "k" in missing
