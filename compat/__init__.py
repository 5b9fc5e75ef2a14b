"""Other stores' client APIs, spoken by kvpool, so code written for them runs on kvpool.

``kvpool.compat.mooncake``: Mooncake Store's ``MooncakeDistributedStore``. ``SHIM_PATH`` is a
folder holding a ``mooncake`` package that re-exports it: put it first on ``PYTHONPATH`` and an
unchanged program's ``from mooncake.store import MooncakeDistributedStore`` gets kvpool's (it
refuses, loudly, where the real Mooncake is installed; see shim/mooncake/__init__.py).
``python3 -m kvpool.compat`` prints that folder.
"""

from pathlib import Path

SHIM_PATH = str(Path(__file__).resolve().parent / "shim")
