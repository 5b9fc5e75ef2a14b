#!/usr/bin/env bash
# Set up this checkout on a Debian 12 machine, fresh or not (the README's two commands start here):
#   bash scripts/setup.sh           kvpool, editable from this checkout, and its Python dependencies
#   bash scripts/setup.sh --tests   also what the whole test suite needs: '.[dev,torch]' and the
#                                   Debian packages the tests start or load for real
# Idempotent and quiet: apt-get runs (update included) only when a package is missing, pip only
# when kvpool is not installed from this checkout or a requirement in pyproject.toml is unmet,
# npm (--tests) only when the dashboard check's packages (scripts/dashboard) are not in place;
# with everything in place it takes under a second. Needs root (or sudo) only to install packages.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"   # iptables, ip, ldconfig: not on a plain user's PATH

case "${1:-}" in
    "") tests=0 ;;
    --tests) tests=1 ;;
    *) echo "usage: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
esac

# Debian packages: each is wanted when the file, command or library that shows it is missing.
need=()
has_lib() { ldconfig -p | grep "/$1\$" >/dev/null; }   # not grep -q: ldconfig must not get SIGPIPE
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
if [ "$tests" = 1 ]; then
    # scripts/engines/vllm-env.sh builds the vLLM venv with `python3 -m venv` (Debian: ensurepip).
    python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
    command -v etcd >/dev/null || need+=(etcd-server)            # tests/integration/test_ha.py
    command -v redis-server >/dev/null || need+=(redis-server)   # the bench's Redis baseline
    command -v ip >/dev/null || need+=(iproute2)                 # tests/chaos: namespaces ...
    command -v iptables >/dev/null || need+=(iptables)           # ... partitions, packet loss
    # tests/unit/test_alert_rules.py: promtool (its server is not started: no init system here)
    command -v promtool >/dev/null || need+=(prometheus)
    # tests/unit/test_systemd_units.py: `systemd-analyze verify` of deploy/systemd's units
    # (nothing is started; a container has no systemd, a machine has it already)
    command -v systemd-analyze >/dev/null || need+=(systemd)
    # tests/unit/test_grafana_dashboard.py: tsc (npm, below) checks the dashboard's types
    command -v node >/dev/null || need+=(nodejs)
    command -v npm >/dev/null || need+=(npm)
    # tests/docker: a dockerd of the tests' own in a network namespace (never the service), and
    # the image's base made with debootstrap where no registry is reachable
    command -v dockerd >/dev/null || need+=(docker.io)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    # The Mooncake peer's native library (mooncake/store.so) links these three.
    has_lib libibverbs.so.1 || need+=(libibverbs1)
    has_lib libnuma.so.1 || need+=(libnuma1)
    has_lib libcurl.so.4 || need+=(libcurl4)
fi

if [ "${#need[@]}" -gt 0 ]; then
    echo "setup: apt-get install ${need[*]}" >&2
    sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    log="$(mktemp)"
    policy=/usr/sbin/policy-rc.d
    cleanup() { rm -f "$log"; }
    if [ ! -e "$policy" ]; then
        # No package may start a system service (redis, etcd, docker) as it installs: the tests
        # start their own, on free ports (dockerd in a network namespace of its own).
        # policy-rc.d exiting 101 forbids it; it goes again after.
        printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
        "${sudo[@]}" chmod 755 "$policy"
        cleanup() { rm -f "$log"; "${sudo[@]}" rm -f "$policy"; }
    fi
    trap cleanup EXIT
    if ! { "${sudo[@]}" apt-get update -q && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q --no-install-recommends "${need[@]}"; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "setup: FAILED: apt-get install ${need[*]}" >&2
        exit 1
    fi
fi

if [ "$tests" = 1 ]; then
    # The Grafana dashboard check's npm packages (scripts/dashboard/check.py), pinned by
    # scripts/dashboard/package-lock.json, outside the checkout in a folder named by the lock
    # file's hash (as check.py finds it): installed once, again only when the lock file changes.
    # Built beside it and renamed, so a folder that exists is complete.
    lock=scripts/dashboard/package-lock.json
    dash="${KVPOOL_ENV_CACHE:-/var/cache/kvpool}/dashboard-check-$(sha256sum "$lock" | cut -c1-12)"
    if [ ! -d "$dash" ]; then
        echo "setup: npm ci (scripts/dashboard) into $dash" >&2
        mkdir -p "$(dirname "$dash")" 2>/dev/null && [ -w "$(dirname "$dash")" ] || {
            echo "setup: cannot write $(dirname "$dash"): run as root, or set KVPOOL_ENV_CACHE" >&2
            exit 1
        }
        tmp="$(mktemp -d "$dash.XXXXXX")"
        chmod 755 "$tmp"   # mktemp makes it 0700: the tests may run as another user
        cp scripts/dashboard/package.json "$lock" "$tmp/"
        if ! (cd "$tmp" && npm ci --no-audit --no-fund --loglevel=error) >"$tmp.log" 2>&1; then
            tail -n 20 "$tmp.log" >&2
            rm -rf "$tmp" "$tmp.log"
            echo "setup: FAILED: npm ci (scripts/dashboard)" >&2
            exit 1
        fi
        rm -f "$tmp.log"
        mv -T "$tmp" "$dash"
    fi
fi

extras=()
[ "$tests" = 1 ] && extras=(dev torch)
# Nothing for pip to do when kvpool is installed editable from this very checkout and every
# requirement is met (pip itself would take ~10 s to find that out, and need an index).
# -P: the checkout's own kvpool.egg-info (left by the editable build) must not be found first.
if ! python3 -P - "${extras[@]}" <<'PY'
import importlib.metadata as md
import json
import sys
import tomllib
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement   # pip's copy: nothing more to install

project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
wanted = project["dependencies"] + [r for e in sys.argv[1:] for r in extras[e]]
try:
    url = json.loads(md.distribution("kvpool").read_text("direct_url.json") or "{}")
    if url.get("url") != Path.cwd().as_uri() or not url.get("dir_info", {}).get("editable"):
        sys.exit(1)
    for line in wanted:
        req = Requirement(line)
        if (not req.marker or req.marker.evaluate({"extra": ""})) \
                and not req.specifier.contains(md.version(req.name), prereleases=True):
            sys.exit(1)
except md.PackageNotFoundError:
    sys.exit(1)
PY
then
    spec="."
    [ "${#extras[@]}" -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
    echo "setup: pip install -e '$spec'" >&2
    # Debian marks its python3 externally managed (PEP 668); the tests run under that python3,
    # so kvpool goes into it all the same (pip writes /usr/local, never Debian's own files).
    PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q \
        --disable-pip-version-check -e "$spec"
fi
