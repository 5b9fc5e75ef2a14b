#!/usr/bin/env bash
# Run kvpool's RDMA tests for real, on soft-RoCE inside a throwaway VM; exit with their status.
#
#   bash scripts/softroce/test.sh [PYTEST_ARGS...]
#
# Builds the VM image if the cache lacks it (build-image.sh), boots it (run-vm.sh) and runs
# vm-tests.sh inside: the pyverbs smoke test, then the rdma-marked tests (tests/rdma and the
# transport contract suite over rdma). Extra arguments go to pytest (e.g. -k contract -x).
# Python in the emulated VM is ~10x slower than here: only RDMA tests belong in it.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
exec "$HERE/run-vm.sh" -t "${SOFTROCE_TIMEOUT_S:-900}" -- bash scripts/softroce/vm-tests.sh "$@"
