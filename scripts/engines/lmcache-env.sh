#!/usr/bin/env bash
# Print the path of a Python that imports LMCache (its storage backends and remote connectors,
# `mooncakestore` among them) on CPU, with kvpool importable (editable, from THIS checkout). The
# venv is built once (~3 min, ~2 GB) and cached outside the repository, under $KVPOOL_ENV_CACHE
# (default /var/cache/kvpool), in a folder named by the hash of
# scripts/engines/lmcache-requirements.txt and the Python version. Every call then brings kvpool's
# own runtime dependencies up to date and reinstalls kvpool with `pip install --no-deps -e REPO`
# (seconds). The version pins and why protobuf and grpcio are raised past LMCache's declared
# bounds: lmcache-requirements.txt. LMCache's engine integration (vLLM's) does not run here: this
# is for its storage classes, driven by tests/compat/test_lmcache.py through kvpool's mooncake shim.
#
# Safe when several runs race (an exclusive flock; a venv counts as built once `.complete` is
# written). Progress goes to stderr; stdout carries only the Python path:
#   PY=$(bash scripts/engines/lmcache-env.sh)
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
base_python="${KVPOOL_BASE_PYTHON:-python3}"
cache="${KVPOOL_ENV_CACHE:-/var/cache/kvpool}"
reqs="$here/lmcache-requirements.txt"

log() { echo "lmcache-env: $*" >&2; }
# pip repeats a warning per package for local index folders that lack it, and complains of
# the bounds lmcache-requirements.txt raises on purpose: drop that noise.
quiet() { grep -v "is ignored: it is neither a file nor a directory\| requires protobuf\| requires grpcio\|dependency resolver\|dependency conflicts" || true; }

command -v "$base_python" >/dev/null || { log "no $base_python on PATH (set KVPOOL_BASE_PYTHON)"; exit 2; }
deps="$("$base_python" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
)"
pyver="$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
key="$( { grep -v '^\s*#' "$reqs"; echo "python$pyver"; } | sha256sum | cut -c1-12)"
venv="$cache/lmcache-env-$key"

mkdir -p "$cache"
exec 9>"$venv.lock"
if ! flock -n 9; then
    log "another run is building or updating $venv; waiting for it"
    flock 9
fi

if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    log "building $venv (once; ~3 min, ~2 GB; needs PyPI)"
    "$base_python" -m venv "$venv"
    echo "torch==2.13.0" > "$venv/constraints.txt"
    pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q
         -c "$venv/constraints.txt")
    fail() { log "FAILED: $1 (is PyPI reachable?)"; rm -rf "$venv"; exit 1; }
    "${pip[@]}" --upgrade pip "setuptools>=68" wheel 2> >(quiet >&2) >&2 || fail "pip/setuptools upgrade"
    while read -r req; do
        case "$req" in ''|'#'*) continue ;; esac
        log "pip install $req"
        # shellcheck disable=SC2086  # a line holds several requirements and options
        "${pip[@]}" $req 2> >(quiet >&2) >&2 || fail "pip install $req"
    done < "$reqs"
    log "checking: import LMCache's mooncakestore connector and its CPU backend"
    "$venv/bin/python" -W ignore -c '
import lmcache, torch
from lmcache.v1.storage_backend.connector.mooncakestore_connector import MooncakestoreConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
print("lmcache", lmcache.__version__, "torch", torch.__version__)' >&2 || fail "import lmcache"
    touch "$venv/.complete"
    log "built $venv"
fi

# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --disable-pip-version-check -q -c "$venv/constraints.txt" $deps \
    2> >(quiet >&2) >&2 || { log "FAILED: pip install kvpool's dependencies (is PyPI reachable?)"; exit 1; }
PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation \
    -e "$repo" >&2 || { log "FAILED: pip install -e $repo"; exit 1; }
echo "$venv/bin/python"
