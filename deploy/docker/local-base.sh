#!/usr/bin/env bash
# A base image for deploy/docker/Dockerfile made without any image registry: Debian bookworm by
# debootstrap (python3 and python3-venv on minbase; CPython 3.11 as python:3.11-slim-bookworm
# has), then `docker import`. Prints the image's name on stdout.
#
#   bash deploy/docker/local-base.sh        needs root (debootstrap), a Debian mirror, docker
#
# Cached twice: the image is kept while its label matches what it is made of, and the root file
# system's tarball is kept in $KVPOOL_IMAGE_CACHE (default /var/cache/kvpool-docker), so a new
# daemon imports it in seconds instead of a minute's debootstrap.
# The recipe: /work/shared/reference/docker-netns/build-base-image.sh (adapted, credited).
set -euo pipefail
if [ -z "${KVPOOL_IMAGE_CACHE:-}" ]; then   # root's cache is the machine's (CI's), kept across runs
    if [ "$(id -u)" = 0 ]; then KVPOOL_IMAGE_CACHE=/var/cache/kvpool-docker
    else KVPOOL_IMAGE_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvpool-docker"; fi
fi
: "${KVPOOL_BASE_IMAGE:=kvpool-base:bookworm}"
: "${KVPOOL_DEBIAN_MIRROR:=http://deb.debian.org/debian}"
suite=bookworm
include=python3,python3-venv
docker="${DOCKER:-docker}"
say() { echo "local-base: $*" >&2; }

[ "$(id -u)" = 0 ] || { say "must run as root (debootstrap)"; exit 1; }
command -v debootstrap >/dev/null || { say "no debootstrap (apt-get install debootstrap)"; exit 1; }
key="$(echo "$suite $include" | sha256sum | cut -c1-12)"
tarball="$KVPOOL_IMAGE_CACHE/base-$suite-$key.tar"
label=org.kvpool.base-key

if [ "$("$docker" image inspect -f "{{ index .Config.Labels \"$label\" }}" "$KVPOOL_BASE_IMAGE" \
        2>/dev/null)" = "$key" ]; then
    echo "$KVPOOL_BASE_IMAGE"
    exit 0
fi
mkdir -p "$KVPOOL_IMAGE_CACHE"
if [ ! -s "$tarball" ]; then
    root="$(mktemp -d "$KVPOOL_IMAGE_CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$root"' EXIT
    say "debootstrap --variant=minbase --include=$include $suite (once, about a minute)"
    # In a private mount namespace: what debootstrap mounts inside the new system goes with it,
    # however it ends, so removing the folder never reaches the host's /proc or /dev.
    unshare -m debootstrap --variant=minbase --include="$include" "$suite" "$root" \
        "$KVPOOL_DEBIAN_MIRROR" >"$root.log" 2>&1 \
        || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
    rm -f "$root.log"
    # What an image does not need: package caches and lists, documentation; the runtime
    # provides /etc/resolv.conf, /etc/hostname, /dev, /proc and /sys.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
        "$root"/var/log/*.log "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old
    : >"$root/etc/resolv.conf"
    : >"$root/etc/hostname"
    tar --numeric-owner --xattrs -C "$root" --exclude='./dev/*' --exclude='./proc/*' \
        --exclude='./sys/*' -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
fi
"$docker" import --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL $label=$key" --change 'CMD ["python3"]' \
    - "$KVPOOL_BASE_IMAGE" <"$tarball" >/dev/null
say "imported $KVPOOL_BASE_IMAGE from $tarball"
echo "$KVPOOL_BASE_IMAGE"
