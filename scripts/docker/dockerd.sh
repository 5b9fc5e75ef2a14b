#!/usr/bin/env bash
# A dockerd of kvpool's own, for the docker tests (tests/docker) and for trying the image and the
# compose file by hand on a machine whose own Docker must not be touched. It runs in a network
# namespace with no route out: dockerd's iptables rules stay inside it (the host's firewall and
# ip_forward are never changed), and nothing a container does reaches the outside world. The
# host reaches published ports at the namespace's address (10.215.0.2) and containers' addresses
# through a route to docker's pool, which goes into the namespace and nowhere else.
#
#   eval "$(bash scripts/docker/dockerd.sh start)"   start it in the background; prints exports
#   bash scripts/docker/dockerd.sh run               the same in the foreground (dockerd's pid
#                                                    is this script's: a supervisor stops it)
#   bash scripts/docker/dockerd.sh env               print the exports again
#   bash scripts/docker/dockerd.sh stop [--purge]    stop everything it started, remove the
#                                                    namespace; --purge: images and caches too
#
# Needs root, and Debian's docker.io, iproute2 and iptables (bash scripts/setup.sh --tests).
# Recipe, with what was tried and measured: /work/shared/reference/docker-netns (setup-netns-
# docker.sh and teardown.sh there; this is their adaptation, credited). Settings: env.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=env.sh
. "$here/env.sh"

usage() { echo "usage: bash scripts/docker/dockerd.sh start|run|env|stop [--purge]" >&2; exit 2; }

exports() {
    # testcontainers reads these at import. It takes this machine for a container (/.dockerenv)
    # and would otherwise aim at a docker gateway; and ryuk's image cannot be pulled here.
    cat <<EOT
export DOCKER_HOST=unix://$KVPOOL_DOCKER_SOCK
export KVPOOL_DOCKER_NS_IP=$KVPOOL_DOCKER_NS_IP
export TESTCONTAINERS_RYUK_DISABLED=true
export TESTCONTAINERS_HOST_OVERRIDE=$KVPOOL_DOCKER_NS_IP
export TESTCONTAINERS_CONNECTION_MODE=docker_host
EOT
}

prepare() {
    [ "$(id -u)" = 0 ] || { say "must run as root (network namespaces, dockerd)"; exit 3; }
    local tool
    for tool in dockerd ip iptables; do
        command -v "$tool" >/dev/null \
            || { say "no $tool (bash scripts/setup.sh --tests installs docker.io, iproute2, iptables)"; exit 3; }
    done
    if [ -s "$KVPOOL_DOCKER_PIDFILE" ] && pid_alive "$(cat "$KVPOOL_DOCKER_PIDFILE")"; then
        say "a dockerd is running already (pid $(cat "$KVPOOL_DOCKER_PIDFILE")); stop it first"
        exit 1
    fi
    # A dockerd that was killed leaves containerd, shims and containers behind, and a fresh one
    # then fails ("timeout waiting for containerd to start"): they go first, with its state.
    local left
    left="$(our_pids)"
    if [ -n "${left// /}" ]; then
        say "killing what a previous dockerd left: $left"
        # shellcheck disable=SC2086
        kill_pids KILL $left || { say "leftover processes would not die: $(our_pids)"; exit 1; }
    fi
    rm -rf "$KVPOOL_DOCKER_PIDFILE" "$KVPOOL_DOCKER_SOCK" "$KVPOOL_DOCKER_RUN/exec"
    mkdir -p "$KVPOOL_DOCKER_RUN" "$KVPOOL_DOCKER_DATA"

    ip netns list | awk '{print $1}' | grep -qx "$KVPOOL_DOCKER_NS" \
        || ip netns add "$KVPOOL_DOCKER_NS" \
        || { say "cannot create network namespace $KVPOOL_DOCKER_NS"; exit 3; }
    ip link show "$KVPOOL_DOCKER_VETH_HOST" >/dev/null 2>&1 \
        || ip link add "$KVPOOL_DOCKER_VETH_HOST" type veth peer name "$KVPOOL_DOCKER_VETH_NS" \
            netns "$KVPOOL_DOCKER_NS"
    sysctl -qw "net.ipv6.conf.$KVPOOL_DOCKER_VETH_HOST.disable_ipv6=1" 2>/dev/null || true
    ip addr replace "$KVPOOL_DOCKER_HOST_CIDR" dev "$KVPOOL_DOCKER_VETH_HOST"
    ip link set "$KVPOOL_DOCKER_VETH_HOST" up
    ip -n "$KVPOOL_DOCKER_NS" link set lo up
    ip -n "$KVPOOL_DOCKER_NS" addr replace "$KVPOOL_DOCKER_NS_CIDR" dev "$KVPOOL_DOCKER_VETH_NS"
    ip -n "$KVPOOL_DOCKER_NS" link set "$KVPOOL_DOCKER_VETH_NS" up
    # No default route in the namespace (containers reach nothing outside); on the host, docker's
    # pool goes into it, so no address a test dials can leave through the host's default route.
    ip route replace "$KVPOOL_DOCKER_POOL" via "$KVPOOL_DOCKER_NS_IP" dev "$KVPOOL_DOCKER_VETH_HOST"
    [ -f "$KVPOOL_DOCKER_RUN/daemon.json" ] || echo '{}' >"$KVPOOL_DOCKER_RUN/daemon.json"
}

# `ip netns exec` gives its command a private mount namespace with a fresh /sys, which hides
# /sys/fs/cgroup: the host's cgroup hierarchies are mounted again (same types and options, so the
# same hierarchies) before dockerd starts. Its overlay mounts stay in that mount namespace.
exec_dockerd() {
    local cg inner
    cg="$(awk '$2 == "/sys/fs/cgroup" || $2 ~ "^/sys/fs/cgroup/" {print $3, $2, $4}' /proc/self/mounts)"
    # shellcheck disable=SC2016
    inner='set -e
printf "%s\n" "$CG_MOUNTS" | while read -r fstype target opts; do
    [ -n "$fstype" ] || continue
    mkdir -p "$target"
    mount -t "$fstype" -o "$opts" "$fstype" "$target"
done
exec "$@"'
    CG_MOUNTS="$cg" exec ip netns exec "$KVPOOL_DOCKER_NS" sh -c "$inner" kvpool-dockerd \
        dockerd --host "unix://$KVPOOL_DOCKER_SOCK" --data-root "$KVPOOL_DOCKER_DATA" \
            --exec-root "$KVPOOL_DOCKER_RUN/exec" --pidfile "$KVPOOL_DOCKER_PIDFILE" \
            --config-file "$KVPOOL_DOCKER_RUN/daemon.json" \
            --cgroup-parent "$KVPOOL_DOCKER_CGROUP" --bip "$KVPOOL_DOCKER_BIP" \
            --default-address-pool "base=$KVPOOL_DOCKER_POOL,size=24" \
            --storage-driver overlay2 --iptables=true --ip-forward=true --log-level warn \
            </dev/null >>"$KVPOOL_DOCKER_RUN/dockerd.log" 2>&1
}

stop() {
    local purge=0 dpid ids left d
    case "${1:-}" in "") ;; --purge) purge=1 ;; *) usage ;; esac
    if [ -s "$KVPOOL_DOCKER_PIDFILE" ] && pid_alive "$(cat "$KVPOOL_DOCKER_PIDFILE")"; then
        dpid="$(cat "$KVPOOL_DOCKER_PIDFILE")"
        ids="$(timeout 20 "$DOCKER" ps -q 2>/dev/null || true)"
        # shellcheck disable=SC2086
        [ -z "$ids" ] || timeout 60 "$DOCKER" rm -f $ids >/dev/null 2>&1 || true
        kill -TERM "$dpid" 2>/dev/null || true
        local end=$((SECONDS + 30))
        while [ $SECONDS -lt $end ] && pid_alive "$dpid"; do sleep 0.2; done
        pid_alive "$dpid" && { say "dockerd $dpid ignored SIGTERM for 30 s: SIGKILL"; kill -KILL "$dpid"; }
    fi
    left="$(our_pids)"
    if [ -n "${left// /}" ]; then
        # shellcheck disable=SC2086
        kill_pids TERM $left || kill_pids KILL $left || say "processes survived SIGKILL: $(our_pids)"
    fi
    # Deleting one end of the veth deletes both, and the route through it.
    ! ip link show "$KVPOOL_DOCKER_VETH_HOST" >/dev/null 2>&1 || ip link del "$KVPOOL_DOCKER_VETH_HOST"
    ! ip netns list | awk '{print $1}' | grep -qx "$KVPOOL_DOCKER_NS" || ip netns del "$KVPOOL_DOCKER_NS"
    for d in /sys/fs/cgroup/*/"$KVPOOL_DOCKER_CGROUP" /sys/fs/cgroup/"$KVPOOL_DOCKER_CGROUP"; do
        [ -d "$d" ] || continue
        find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || say "could not remove cgroup $d"
    done
    rm -rf "$KVPOOL_DOCKER_RUN"
    if [ $purge = 1 ]; then
        rm -rf "$KVPOOL_DOCKER_DATA" "$KVPOOL_DOCKER_CACHE"
        say "removed $KVPOOL_DOCKER_DATA and $KVPOOL_DOCKER_CACHE"
    fi
}

case "${1:-}" in
    start)
        if [ -s "$KVPOOL_DOCKER_PIDFILE" ] && pid_alive "$(cat "$KVPOOL_DOCKER_PIDFILE")" \
                && docker_answers; then
            exports
            exit 0
        fi
        mkdir -p "$KVPOOL_DOCKER_RUN"
        setsid bash "$0" run </dev/null >>"$KVPOOL_DOCKER_RUN/dockerd.log" 2>&1 &
        for _ in $(seq 1 600); do
            docker_answers && break
            pid_alive $! || { say "dockerd exited:"; tail -n 15 "$KVPOOL_DOCKER_RUN/dockerd.log" >&2; exit 1; }
            sleep 0.1
        done
        docker_answers || { say "dockerd did not answer in 60 s"; exit 1; }
        exports ;;
    run) prepare; exec_dockerd ;;
    env) exports ;;
    stop) shift; stop "$@" ;;
    *) usage ;;
esac
