#!/usr/bin/env bash
# Build kvpool's image, kvpool:VERSION (VERSION: pyproject's), from this checkout.
#
#   bash deploy/docker/build-image.sh                  FROM python:3.11-slim-bookworm
#   bash deploy/docker/build-image.sh --local-base     FROM a base made here (local-base.sh:
#                                                      debootstrap + docker import), for a daemon
#                                                      that reaches no image registry
#   options: --base IMAGE (any base with CPython 3.11 and venv), --rdma (RDMA userspace; needs
#            apt inside the build), --etcd (also kvpool-etcd:VERSION, Debian's etcd on the same
#            base, for deploy/compose where quay.io cannot be reached)
#
# On the build host (which needs pip and the network, not the build): the kvpool wheel of the
# checkout and a wheelhouse of its dependencies for CPython 3.11 on Linux, cached in
# $KVPOOL_IMAGE_CACHE (root: /var/cache/kvpool-docker, else ~/.cache/kvpool-docker) by the
# dependency list. The build then needs no network; the Dockerfile installs the dependencies in
# a layer of their own, so a change to kvpool's code rebuilds only its last layers. Prints the
# image's size in bytes.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$repo/deploy/docker"
if [ -z "${KVPOOL_IMAGE_CACHE:-}" ]; then   # root's cache is the machine's (CI's), kept across runs
    if [ "$(id -u)" = 0 ]; then KVPOOL_IMAGE_CACHE=/var/cache/kvpool-docker
    else KVPOOL_IMAGE_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvpool-docker"; fi
fi
export KVPOOL_IMAGE_CACHE
docker="${DOCKER:-docker}"
say() { echo "build-image: $*" >&2; }
usage() {
    echo "usage: bash deploy/docker/build-image.sh [--local-base | --base IMAGE] [--rdma] [--etcd]" >&2
    exit 2
}

base=python:3.11-slim-bookworm local_base=0 rdma=0 etcd=0
while [ $# -gt 0 ]; do
    case "$1" in
        --local-base) local_base=1 ;;
        --base) [ $# -gt 1 ] || usage; base="$2"; shift ;;
        --rdma) rdma=1 ;;
        --etcd) etcd=1 ;;
        *) usage ;;
    esac
    shift
done
if [ $rdma = 1 ] && [ $local_base = 1 ]; then
    say "--rdma installs rdma-core, ibverbs-providers and python3-pyverbs with apt inside the" \
        "build, and --local-base is for daemons whose builds reach no network (as in this" \
        "project's CI), where apt fails. Build --rdma where builds reach a Debian mirror:" \
        "bash deploy/docker/build-image.sh --rdma (FROM python:3.11-slim-bookworm)"
    exit 2
fi
"$docker" info >/dev/null 2>&1 || { say "no docker daemon answers at ${DOCKER_HOST:-the default socket}"; exit 1; }
start=$SECONDS
[ $local_base = 0 ] || base="$(bash "$here/local-base.sh")"
version="$(cd "$repo" && python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
tag="kvpool:$version"

mkdir -p "$KVPOOL_IMAGE_CACHE"
exec 9>"$KVPOOL_IMAGE_CACHE/build.lock"
flock 9   # one build at a time shares the cache
ctx="$(mktemp -d "$KVPOOL_IMAGE_CACHE/context.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT

# 1. The dependencies, as pyproject lists them, and their wheels for the image's Python.
(cd "$repo" && python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))') \
    >"$ctx/requirements.txt"
arch="$(uname -m)"
platforms=(--platform "manylinux_2_36_$arch" --platform "manylinux2014_$arch" --platform "linux_$arch")
key="$( { cat "$ctx/requirements.txt"; echo "${platforms[*]}"; } | sha256sum | cut -c1-12)"
wheelhouse="$KVPOOL_IMAGE_CACHE/wheelhouse-$key"
if [ ! -f "$wheelhouse/.complete" ]; then
    say "downloading the dependencies' wheels into $wheelhouse"
    rm -rf "$wheelhouse"
    python3 -m pip download -q --disable-pip-version-check --dest "$wheelhouse" \
        --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 \
        "${platforms[@]}" -r "$ctx/requirements.txt" >"$ctx/pip.log" 2>&1 \
        || { tail -n 20 "$ctx/pip.log" >&2; say "pip download failed"; exit 1; }
    touch "$wheelhouse/.complete"
    # Only the current wheelhouse is kept.
    find "$KVPOOL_IMAGE_CACHE" -maxdepth 1 -name 'wheelhouse-*' ! -path "$wheelhouse" \
        -exec rm -rf {} +
fi
cp -al "$wheelhouse" "$ctx/wheelhouse" 2>/dev/null || cp -a "$wheelhouse" "$ctx/wheelhouse"

# 2. kvpool's wheel, built from a copy (setuptools writes build/ and *.egg-info beside its
#    sources) with fixed timestamps: the same code makes the same bytes, which docker's layer
#    cache recognises, so a build with no change reuses every layer.
mkdir "$ctx/src"
tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist \
    --exclude='*.egg-info' --exclude=__pycache__ --exclude=./tests --exclude=./scripts \
    --exclude=./deploy -cf - . | tar -C "$ctx/src" -xf -
# Without build isolation where this python3 has a setuptools that can (3 s faster), else with.
wheel() {
    SOURCE_DATE_EPOCH=315532800 python3 -m pip wheel -q --disable-pip-version-check --no-deps \
        "$@" -w "$ctx" "$ctx/src" >"$ctx/wheel.log" 2>&1
}
wheel --no-build-isolation || wheel || { cat "$ctx/wheel.log" >&2; say "kvpool's wheel failed"; exit 1; }
rm -rf "$ctx/src" "$ctx/wheel.log"
cp "$here/Dockerfile" "$ctx/Dockerfile"

# 3. The image.
say "docker build $tag FROM $base (RDMA=$rdma)"
"$docker" build --build-arg "BASE=$base" --build-arg "RDMA=$rdma" -t "$tag" "$ctx" \
    >"$ctx/build.log" 2>&1 || { tail -n 40 "$ctx/build.log" >&2; say "docker build failed"; exit 1; }
# The kvpool images this tag moved away from (untagged now), not the dependencies' stage: that
# is the layer cache of the next build.
"$docker" image prune -f --filter label=org.opencontainers.image.title=kvpool >/dev/null

if [ $etcd = 1 ]; then
    # Debian's etcd (package etcd-server) from this host, on the same base: for compose.yaml's
    # KVPOOL_ETCD_IMAGE where the usual etcd image cannot be pulled.
    bin="$(command -v etcd)" || { say "--etcd: no etcd here (apt-get install etcd-server)"; exit 1; }
    etcd_version="$("$bin" --version | awk '/^etcd Version:/ {print $3}')"
    mkdir "$ctx/etcd"
    cp "$bin" "$ctx/etcd/etcd"
    cp "$here/etcd.Dockerfile" "$ctx/etcd/Dockerfile"
    "$docker" build --build-arg "BASE=$base" -t "kvpool-etcd:$etcd_version" "$ctx/etcd" \
        >"$ctx/build.log" 2>&1 || { tail -n 20 "$ctx/build.log" >&2; say "etcd image failed"; exit 1; }
    say "built kvpool-etcd:$etcd_version"
fi
size="$("$docker" image inspect -f '{{.Size}}' "$tag")"
say "built $tag in $((SECONDS - start)) s: $size bytes ($((size / 1000000)) MB)"
