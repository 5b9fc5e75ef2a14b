"""``python3 -m kvpool.compat``: print the folder to put first on PYTHONPATH so that
``import mooncake.store`` resolves to kvpool (see kvpool/compat/__init__.py)."""

from kvpool.compat import SHIM_PATH

print(SHIM_PATH)
