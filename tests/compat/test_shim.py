"""The opt-in ``mooncake`` shim: with its folder first on PYTHONPATH, ``import mooncake.store``
is kvpool's, except where the real Mooncake is installed: then it refuses, saying where, unless
KVPOOL_MOONCAKE_SHIM=force. (Its positive path in a Python without Mooncake is proven by the
SGLang and LMCache tests beside this one.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = "import mooncake.store as s; print(s.MooncakeDistributedStore.__module__)"
_spec = importlib.util.find_spec("mooncake")
real_mooncake = _spec is not None


def run(shim, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE], env=shim(**env),
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_shim_folder_is_printed_by_the_module():
    r = subprocess.run([sys.executable, "-m", "kvpool.compat"], capture_output=True, text=True,
                       timeout=60, check=True)
    assert (Path(r.stdout.strip()) / "mooncake" / "store.py").is_file()


@pytest.mark.skipif(not real_mooncake, reason="Mooncake is not installed in this Python "
                    "(kvpool[bench] installs it on Linux x86-64)")
def test_it_refuses_to_shadow_an_installed_mooncake_and_says_where(shim):
    r = run(shim)
    assert r.returncode != 0
    # where Mooncake is: site-packages here, dist-packages under Debian's python3
    assert "refusing to shadow it" in r.stderr and _spec.origin in r.stderr
    assert "KVPOOL_MOONCAKE_SHIM=force" in r.stderr


@pytest.mark.skipif(not real_mooncake, reason="Mooncake is not installed in this Python")
def test_force_shadows_it_and_warns(shim):
    r = run(shim, KVPOOL_MOONCAKE_SHIM="force")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "kvpool.compat.mooncake"
    assert "shadowing" in r.stderr


def test_without_the_shim_on_the_path_nothing_changes():
    probe = "import importlib.util as u; s = u.find_spec('mooncake'); print(s and s.origin)"
    r = subprocess.run([sys.executable, "-c", probe],
                       capture_output=True, text=True, timeout=60, check=True)
    assert "kvpool" not in r.stdout and "compat/shim" not in r.stdout
