#!/usr/bin/env bash
# Runs INSIDE the soft-RoCE VM (see test.sh), in the project share at /mnt/project.
set -uo pipefail
t0=$(date +%s)
echo "=== pyverbs smoke test (2 processes, one-sided READ/WRITE on rxe0)"
timeout 300 python3 scripts/softroce/pyverbs_smoke.py || { echo "pyverbs smoke test FAILED"; exit 1; }
echo "=== kvpool rdma tests (pytest -m rdma)"
# -p no:cacheprovider: the share is the host's working tree; leave no .pytest_cache in it.
export KVPOOL_FIGURES_FILE=/tmp/rdma-figures.jsonl   # measured figures (tests/rdma/conftest.py)
python3 -m pytest -p no:cacheprovider -o asyncio_default_fixture_loop_scope=function \
    -m rdma -q --timeout 300 tests/rdma tests/transport "$@"
rc=$?
[ -f "$KVPOOL_FIGURES_FILE" ] && { echo "=== figures measured in the VM (emulated)"; cat "$KVPOOL_FIGURES_FILE"; }
echo "=== rdma suite: exit $rc in $(( $(date +%s) - t0 ))s (VM wall time, smoke test included)"
exit $rc
