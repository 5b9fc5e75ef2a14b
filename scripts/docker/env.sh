# Settings and helpers of scripts/docker (sourced, never run): a dockerd for kvpool's docker
# tests, in a network namespace of its own. Adapted from the verified recipe in
# /work/shared/reference/docker-netns (kvdock.env), with names, addresses and folders of its own
# so that it never meets the reference's `kvdock` or scripts/fresh-machine-check.sh's
# `kvpfresh`. Every value can be overridden from the environment.

: "${KVPOOL_DOCKER_NS:=kvptest}"                  # the network namespace dockerd runs in
: "${KVPOOL_DOCKER_VETH_HOST:=kvptest0}"          # veth end in the host's namespace ...
: "${KVPOOL_DOCKER_VETH_NS:=kvptest1}"            # ... and the one moved into kvptest
: "${KVPOOL_DOCKER_HOST_CIDR:=10.215.0.1/30}"
: "${KVPOOL_DOCKER_NS_CIDR:=10.215.0.2/30}"       # published ports are reached here
: "${KVPOOL_DOCKER_POOL:=10.216.0.0/16}"          # every docker network is carved from this
: "${KVPOOL_DOCKER_BIP:=10.216.0.1/24}"           # ... docker0 included
: "${KVPOOL_DOCKER_RUN:=/run/kvpool-docker}"      # socket, pid file, exec-root, log
: "${KVPOOL_DOCKER_DATA:=/var/lib/kvpool-docker}" # data-root: images survive, the build cache
: "${KVPOOL_DOCKER_CGROUP:=kvpool-docker}"        # containers' cgroup parent
: "${KVPOOL_DOCKER_CACHE:=/var/cache/kvpool-docker}" # base tarball, wheelhouse, compose plugin

KVPOOL_DOCKER_SOCK="$KVPOOL_DOCKER_RUN/docker.sock"
KVPOOL_DOCKER_PIDFILE="$KVPOOL_DOCKER_RUN/dockerd.pid"
KVPOOL_DOCKER_NS_IP="${KVPOOL_DOCKER_NS_CIDR%/*}"
export DOCKER_HOST="unix://$KVPOOL_DOCKER_SOCK"
# Debian's client matches Debian's daemon; any newer docker on PATH works as well.
if [ -z "${DOCKER:-}" ]; then
    if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
fi

say() { echo "${0##*/}: $*" >&2; }

# pid_alive PID: running (a zombie not reaped yet counts as gone)
pid_alive() {
    [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
    [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

# Our processes: everything in the namespace (dockerd, containerd, shims, docker-proxy) and the
# containers' processes, which have network namespaces of their own but our cgroup parent.
our_pids() {
    {
        ip netns pids "$KVPOOL_DOCKER_NS" 2>/dev/null || true
        find /sys/fs/cgroup/*/"$KVPOOL_DOCKER_CGROUP" /sys/fs/cgroup/"$KVPOOL_DOCKER_CGROUP" \
            -name cgroup.procs -exec cat {} + 2>/dev/null || true
    } | sort -un | tr '\n' ' '
}

# kill_pids SIGNAL PID...: send, then wait up to 10 s for them to go
kill_pids() {
    local sig=$1 end p alive
    shift
    [ $# -gt 0 ] || return 0
    kill "-$sig" "$@" 2>/dev/null || true
    end=$((SECONDS + 10))
    while [ $SECONDS -lt $end ]; do
        alive=0
        for p in "$@"; do pid_alive "$p" && alive=1; done
        [ $alive = 0 ] && return 0
        sleep 0.2
    done
    return 1
}

docker_answers() { timeout 10 "$DOCKER" -H "unix://$KVPOOL_DOCKER_SOCK" info >/dev/null 2>&1; }
