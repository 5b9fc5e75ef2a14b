"""kvpool's stand-in for Mooncake's ``mooncake`` package: ``mooncake.store`` is
``kvpool.compat.mooncake``. Opt-in: this folder is put first on ``PYTHONPATH`` by hand
(``PYTHONPATH=$(python3 -m kvpool.compat)``), never installed into site-packages.

It refuses to shadow a real Mooncake: where another ``mooncake`` package is on ``sys.path``,
importing this one raises ImportError saying where it is, unless ``KVPOOL_MOONCAKE_SHIM=force``
(then it warns on stderr and shadows it).
"""

import importlib.machinery
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _real_mooncake() -> str | None:
    """Where another ``mooncake`` package is found on sys.path, or None."""
    for entry in sys.path:
        folder = Path(entry or ".").resolve()
        if folder == _HERE.parent:
            continue
        spec = importlib.machinery.PathFinder.find_spec("mooncake", [str(folder)])
        if spec is not None:
            return spec.origin or str(folder / "mooncake")
    return None


_real = _real_mooncake()
if _real is not None:
    if os.environ.get("KVPOOL_MOONCAKE_SHIM") != "force":
        raise ImportError(
            f"kvpool's mooncake shim ({_HERE}) is on PYTHONPATH, but Mooncake itself is "
            f"installed ({_real}): refusing to shadow it. Remove the shim from PYTHONPATH to use "
            "Mooncake, or set KVPOOL_MOONCAKE_SHIM=force to use kvpool in its place.")
    print(f"kvpool: KVPOOL_MOONCAKE_SHIM=force: `mooncake` is kvpool's shim, shadowing {_real}",
          file=sys.stderr)

__version__ = "kvpool-shim"
