#!/usr/bin/env bash
# Proves that the README's two commands work on a fresh Debian 12 machine: in a container made
# from a debootstrap base (python3, git and ca-certificates only, as a fresh install has), a
# fresh clone of this checkout's last commit runs them, and the suite must end with no failure
# and no skip but the hardware ones (rdma, gpu, hugepages) and docker's (see step 6).
#
#   bash scripts/fresh-machine-check.sh            as root, on a Debian 12 host with network
#   bash scripts/fresh-machine-check.sh --purge    the same, then delete the caches below
#
# Docker runs as in /work/shared/reference/docker-netns (KVDOCK_REF): its own dockerd in a network
# namespace of its own with no route out, so the container reaches no network at all. What a
# fresh machine would download comes from mirrors made on the host, bind-mounted read-only:
# - apt: a file repository with the .deb files (and their dependencies) that scripts/setup.sh
#   may install, fetched with `apt-get --download-only` in a chroot of the same base system;
# - pip: a wheelhouse made with `pip download` of kvpool's requirements and the vLLM, SGLang and
#   LMCache venvs' (scripts/engines/vllm-requirements.txt, sglang-requirements.txt,
#   lmcache-requirements.txt), which the container's pip uses instead of PyPI
#   (torch: the 2.13.0+cpu wheel where the host's PIP_FIND_LINKS has it, as /opt/wheels here;
#   PyPI's default build would pull ~3 GB of CUDA libraries).
# The container has root's powers (the chaos tests make network namespaces and iptables rules,
# as root on a machine can: every capability, no seccomp or AppArmor filter; not --privileged,
# whose CAP_SYS_RESOURCE this VM's root lacks, so runc fails "unable to apply caps") and runs
# under an init that reaps orphans, as a machine's does.
# Cached for reruns under /var/cache/kvpool-fresh (base tarball, mirrors; keyed by what makes
# them) and /var/lib/kvpool-fresh (the docker image). Everything started is stopped on exit,
# however it ends: the container, dockerd, the namespace and its veth (the reference's
# teardown.sh). The container's output: /tmp/kvpool-fresh-check.log (FRESH_LOG).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
ref="${KVDOCK_REF:-/work/shared/reference/docker-netns}"
purge=""
case "${1:-}" in
    "") ;;
    --purge) purge=--purge ;;
    *) echo "usage: bash scripts/fresh-machine-check.sh [--purge]" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "fresh-machine-check: must run as root" >&2; exit 1; }
[ -f "$ref/setup-netns-docker.sh" ] \
    || { echo "fresh-machine-check: no $ref (set KVDOCK_REF)" >&2; exit 1; }

# A namespace, addresses, folders and cgroup of our own: anyone else's kvdock is left alone.
export KVDOCK_NS=kvpfresh KVDOCK_VETH_HOST=kvpfresh0 KVDOCK_VETH_NS=kvpfresh1
export KVDOCK_HOST_CIDR=10.213.0.1/30 KVDOCK_NS_CIDR=10.213.0.2/30
export KVDOCK_POOL=10.214.0.0/16 KVDOCK_BIP=10.214.0.1/24
export KVDOCK_RUN=/run/kvpool-fresh KVDOCK_DATA=/var/lib/kvpool-fresh
export KVDOCK_CACHE=/var/cache/kvpool-fresh KVDOCK_CGROUP_PARENT=kvpool-fresh
# shellcheck source=/dev/null
. "$ref/kvdock.env"
cache="$KVDOCK_CACHE"
image=kvpool-fresh/debian:bookworm
container=kvpool-fresh-check
log="${FRESH_LOG:-/tmp/kvpool-fresh-check.log}"
say() { echo "fresh-machine-check: $*" >&2; }

scratch=""
finish() {
    rc=$?
    "$DOCKER" rm -f "$container" >/dev/null 2>&1 || true
    "$ref/teardown.sh" $purge || rc=1
    [ -n "$scratch" ] && rm -rf "$scratch"
    exit "$rc"
}
trap finish EXIT
mkdir -p "$cache"
scratch="$(mktemp -d "$cache/scratch.XXXXXX")"

eval "$("$ref/setup-netns-docker.sh")"

# 1. The fresh machine: debootstrap minbase with what a fresh Debian 12 install has that minbase
#    lacks and the README's commands use (python3; git and ca-certificates, to clone).
tarball="$cache/debian-bookworm-fresh.tar"
if [ ! -s "$tarball" ]; then
    say "debootstrap bookworm (once, ~1 min)"
    root="$scratch/rootfs"
    # In a private mount namespace, as the chroot below: what debootstrap mounts in the new
    # system goes with it, however it ends, so removing the folder never reaches the host's.
    unshare -m debootstrap --variant=minbase --include=python3,git,ca-certificates bookworm \
        "$root" "$KVDOCK_MIRROR" >"$scratch/debootstrap.log" 2>&1 \
        || { tail -n 20 "$scratch/debootstrap.log" >&2; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    : >"$root/etc/resolv.conf"; : >"$root/etc/hostname"
    tar --numeric-owner --xattrs -C "$root" --exclude='./dev/*' --exclude='./proc/*' \
        --exclude='./sys/*' -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
    "$DOCKER" rmi -f "$image" >/dev/null 2>&1 || true
fi
if ! "$DOCKER" image inspect "$image" >/dev/null 2>&1; then
    "$DOCKER" import --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$image" <"$tarball" >/dev/null
fi

# A throwaway copy of the fresh system, to download what it lacks with its own apt and its own
# python3 (whose version picks the wheels: redis wants async-timeout below Python 3.11.3 only).
# Run in a private mount namespace: what is mounted in it vanishes with it, however it ends.
# The host's CA certificates and PIP_FIND_LINKS folders are mounted in at the same paths.
chroot_root=""
in_chroot() {
    if [ -z "$chroot_root" ]; then
        chroot_root="$scratch/chroot"
        mkdir -p "$chroot_root"
        tar -C "$chroot_root" -xf "$tarball"
        cp /etc/resolv.conf "$chroot_root/etc/resolv.conf"
    fi
    # shellcheck disable=SC2016
    unshare -m bash -c 'set -e; root=$1; shift
        mount --bind /dev "$root/dev"; mount -t proc proc "$root/proc"
        for d in /etc/ssl/certs ${PIP_FIND_LINKS:-}; do
            [ -d "$d" ] && mkdir -p "$root$d" && mount --bind "$d" "$root$d"
        done
        exec chroot "$root" "$@"' in_chroot "$chroot_root" "$@"
}

# 2. The apt mirror: every package scripts/setup.sh may install (read from the script itself),
#    with the dependencies the fresh system lacks.
packages="$(grep -o 'need+=([a-z0-9.+-]*)' "$repo/scripts/setup.sh" | sed 's/need+=(\(.*\))/\1/' \
    | sort -u | tr '\n' ' ')"
debs="$cache/debian-$(echo "$packages" | sha256sum | cut -c1-12)"
if [ ! -s "$debs/Packages" ]; then
    say "apt mirror: downloading $packages"
    # shellcheck disable=SC2086
    { in_chroot apt-get update -q &&
      in_chroot apt-get install -y -q --download-only --no-install-recommends $packages; } \
        >"$scratch/apt.log" 2>&1 || { tail -n 20 "$scratch/apt.log" >&2; exit 1; }
    rm -rf "$debs.tmp" && mkdir -p "$debs.tmp"
    mv "$chroot_root"/var/cache/apt/archives/*.deb "$debs.tmp/"
    (cd "$debs.tmp" && dpkg-scanpackages . /dev/null >Packages 2>/dev/null)
    rm -rf "$debs" && mv "$debs.tmp" "$debs"
fi

# 3. The PyPI mirror: what `setup.sh --tests` and scripts/engines/vllm-env.sh install, resolved
#    as they resolve it (one pip call per step), as wheels only: a fresh machine has no compiler.
wheels="$cache/wheels-$(cat "$repo/pyproject.toml" "$repo/scripts/engines/vllm-requirements.txt" \
    "$repo/scripts/engines/sglang-requirements.txt" "$repo/scripts/engines/lmcache-requirements.txt" \
    | sha256sum | cut -c1-12)"
if [ ! -f "$wheels/.complete" ]; then
    say "pip mirror: downloading wheels into $wheels (once; ~1 GB)"
    python3 - "$repo/pyproject.toml" >"$scratch/requirements.txt" <<'PY'
import sys, tomllib
toml = tomllib.load(open(sys.argv[1], "rb"))
extras = toml["project"]["optional-dependencies"]
print("\n".join(toml["build-system"]["requires"] + toml["project"]["dependencies"]
                + extras["dev"] + extras["torch"]))
PY
    rm -rf "$wheels" && mkdir -p "$wheels"
    { in_chroot apt-get update -q &&
      in_chroot apt-get install -y -q --no-install-recommends python3-pip; } \
        >"$scratch/pip.log" 2>&1 || { tail -n 20 "$scratch/pip.log" >&2; exit 1; }
    mkdir -p "$chroot_root/srv/wheels"
    cp "$scratch/requirements.txt" "$chroot_root/srv/requirements.txt"
    cp "$repo/scripts/engines/vllm-requirements.txt" "$chroot_root/srv/vllm-requirements.txt"
    cp "$repo/scripts/engines/sglang-requirements.txt" "$chroot_root/srv/sglang-requirements.txt"
    cp "$repo/scripts/engines/lmcache-requirements.txt" "$chroot_root/srv/lmcache-requirements.txt"
    # In order: the vLLM venv's pip upgrade, kvpool with its test extras, the venv's lines; then
    # the SGLang venv's lines (scripts/engines/sglang-env.sh: a line may hold several
    # requirements and options, each pip call constrained to torch 2.13.0 as there).
    # shellcheck disable=SC2016
    in_chroot bash -c 'set -e
        dl() { python3 -m pip download -q --only-binary=:all: -d /srv/wheels "$@"; }
        dl pip "setuptools>=68" wheel
        dl -r /srv/requirements.txt
        grep -v "^\s*#" /srv/vllm-requirements.txt | while read -r req; do
            if [ -n "$req" ]; then dl "$req"; fi
        done
        echo "torch==2.13.0" >/srv/torch-constraint.txt
        grep -v "^\s*#" /srv/sglang-requirements.txt | while read -r req; do
            if [ -n "$req" ]; then dl -c /srv/torch-constraint.txt $req; fi
        done
        grep -v "^\s*#" /srv/lmcache-requirements.txt | while read -r req; do
            if [ -n "$req" ]; then dl -c /srv/torch-constraint.txt $req; fi
        done' >>"$scratch/pip.log" 2>&1 || { tail -n 20 "$scratch/pip.log" >&2; exit 1; }
    mv "$chroot_root"/srv/wheels/* "$wheels/"
    touch "$wheels/.complete"
fi

# 3b. The npm mirror: the dashboard check's packages (setup.sh --tests runs `npm ci` from
#     scripts/dashboard/package-lock.json), as an npm cache filled by the same `npm ci` here;
#     the container's npm reads a copy of it offline.
lock="$repo/scripts/dashboard/package-lock.json"
npm_cache="$cache/npm-$(sha256sum "$lock" | cut -c1-12)"
if [ ! -f "$npm_cache/.complete" ]; then
    say "npm mirror: filling $npm_cache"
    rm -rf "$npm_cache" && mkdir -p "$npm_cache" "$scratch/npm"
    cp "$repo/scripts/dashboard/package.json" "$lock" "$scratch/npm/"
    (cd "$scratch/npm" && npm ci --cache "$npm_cache" --no-audit --no-fund --loglevel=error) \
        >"$scratch/npm.log" 2>&1 || { tail -n 20 "$scratch/npm.log" >&2; exit 1; }
    touch "$npm_cache/.complete"
fi

# 4. The clone: this checkout's last commit, as a bundle.
[ -z "$(git -C "$repo" status --porcelain)" ] || say "uncommitted changes are not checked"
git -C "$repo" bundle create "$scratch/kvpool.bundle" HEAD >/dev/null 2>&1

# 5. The machine: apt and pip pointed at the mirrors, then a fresh clone and the README's two
#    commands, verbatim (the two code blocks of its "Two commands" section), one after the other.
cat >"$scratch/inside.sh" <<'SH'
set -e
echo "deb [trusted=yes] file:/srv/debian ./" >/etc/apt/sources.list
rm -f /etc/apt/sources.list.d/*
printf '[global]\nno-index = true\nfind-links = /srv/wheels\n' >/etc/pip.conf
cp -a /srv/npm /root/.npm && printf 'offline=true\n' >/root/.npmrc   # npm: the mirror only
git clone -q -c advice.detachedHead=false /srv/kvpool.bundle /root/kvpool
cd /root/kvpool
echo "=== commit $(git log --oneline -1)"
awk '/^## / { section = ($0 == "## Two commands") } /^```/ { block = !block; next }
     section && block' README.md >/tmp/readme-commands
[ "$(wc -l </tmp/readme-commands)" = 2 ] || { echo "README: expected two commands"; exit 1; }
while read -r command; do
    echo "=== $command"
    start=$SECONDS
    bash -c "$command" </dev/null
    echo "=== exit 0 after $((SECONDS - start)) s"
done </tmp/readme-commands
# Idempotent: a second set-up finds everything in place, says nothing and installs nothing.
start=$(date +%s%N)
again="$(bash scripts/setup.sh --tests 2>&1)"
echo "=== bash scripts/setup.sh --tests again: $(( ($(date +%s%N) - start) / 1000000 )) ms"
[ -z "$again" ] || { echo "$again"; echo "=== the second set-up was not a no-op"; exit 1; }
SH
say "running the README's two commands in a fresh container (log: $log; the suite takes a while)"
set +e
timeout "${FRESH_TIMEOUT_S:-10800}" "$DOCKER" run --name "$container" --rm --init --shm-size 8g \
    --cap-add ALL --cap-drop SYS_RESOURCE --security-opt seccomp=unconfined \
    --security-opt apparmor=unconfined -v "$debs:/srv/debian:ro" -v "$wheels:/srv/wheels:ro" \
    -v "$npm_cache:/srv/npm:ro" \
    -v "$scratch/kvpool.bundle:/srv/kvpool.bundle:ro" -v "$scratch/inside.sh:/srv/inside.sh:ro" \
    "$image" bash /srv/inside.sh >"$log" 2>&1
rc=$?
set -e
tail -n 40 "$log" >&2
[ "$rc" = 0 ] || { say "FAILED: the container's run ended with exit code $rc"; exit 1; }

# 6. No skip but for hardware: every reason in pytest's summary (-ra) names rdma, gpu or hugepages,
#    or docker: tests/docker start a dockerd of their own, which cannot run nested in this
#    container (no overlay2 on the container's overlayfs, no registry, no network to build the
#    image); CI runs them on the host, where they fail rather than skip (CI=true).
other="$(grep '^SKIPPED ' "$log" | sed 's/^SKIPPED \[[0-9]*\] [^ ]*:[0-9]*: //' \
    | grep -Ev '^(rdma|gpu|gpu and rdma|hugepages|docker): ' || true)"
if [ -n "$other" ]; then
    say "FAILED: skips that are not for hardware or docker:"
    echo "$other" >&2
    exit 1
fi
say "PASSED: both commands succeeded; skips: $(grep -c '^SKIPPED ' "$log" || true) lines, all" \
    "for hardware or docker"
