"""DESIGN.md names the test that guards each invariant: every test and file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = (REPO / "DESIGN.md").read_text()


def _test_file(name: str) -> Path:
    found = [p for p in (REPO / "tests").rglob(Path(name).name)
             if p.as_posix().endswith(name)]
    assert len(found) == 1, f"DESIGN.md names {name}: {len(found)} files match"
    return found[0]


def test_every_test_named_in_design_md_exists():
    # "test_x.py::test_y" and the "::test_z" that follow it in the same cell refer to test_x.py
    named = 0
    for cell in re.split(r"[|\n]\s*[|\n]", DESIGN):
        current = None
        for m in re.finditer(r"`([\w/]*test_\w+\.py)?(?:::(test_\w+))?`", cell):
            path, test = m.groups()
            if path:
                current = _test_file(path)
            if test:
                assert current is not None, f"::{test} without a file before it"
                assert re.search(rf"def {test}\b", current.read_text()), \
                    f"DESIGN.md names {current.name}::{test}, which does not exist"
                named += 1
    assert named >= 20


def test_every_module_named_in_design_md_exists():
    for path in re.findall(r"`((?:common|net|rpc|master|store_node|client|tools)/[\w/]+\.py)`",
                           DESIGN):
        assert (REPO / path).is_file(), f"DESIGN.md names {path}, which does not exist"
