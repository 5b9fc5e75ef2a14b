"""``kvpool master``: run the master (the global index, allocator, leases, eviction)."""

from __future__ import annotations

import argparse
import gc

from kvpool.common.config import EVICTION_POLICIES, ConfigError, MasterConfig, load
from kvpool.tools.argtypes import count_type, duration_type, fraction_type, log_arg, port_type

DEFAULT_PORT = 50051


def gc_for_a_large_index() -> None:
    """Keep the cycle collector off the index. The index holds millions of long-lived tracked
    objects (an ``ObjectEntry`` each) and makes no cycles of them, but every object a young
    collection leaves alive moves up a generation, and the older collections walk all of their
    generation: at 10M objects under puts a generation-1 collection took ~180 ms every ~17 s,
    and a full one (at CPython's default thresholds, every few hundred thousand lookups) ~3.5
    s. So what survives a generation-1 collection is frozen (``gc.freeze``: no collection
    walks it again; freed by its reference count as before): each object is walked twice,
    young, and never again. Generation-1 collections run after 2 young ones (each after 50,000
    allocations), so each walks at most what survived those (the longest in the bench's
    master: 36 ms at 1M objects, 60 ms at 10M; DESIGN.md). A cycle still alive at a
    generation-1 collection that dies later is not collected; the master makes few (a request's
    exception and its frames, in flight at that instant: ``scripts/gc_leak.py`` measures
    them)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 2, 100)
    if _freeze_the_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_the_survivors)


def _freeze_the_survivors(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] >= 1:
        gc.freeze()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Run the master. Prints `master: HOST:PORT` once serving (then, with "
                     "--metrics-port, `metrics: HOST:PORT`).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; "
                   "0.0.0.0 for a multi-host cluster)")
    p.add_argument("--port", type=port_type, default=DEFAULT_PORT,
                   help=f"gRPC port (default: {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--lookup-port", type=port_type, default=0, metavar="PORT",
                   help="also answer lookups (GetReplicas, the master call of every read) here, "
                        "over plain tcp: a few times cheaper than gRPC, and named in gRPC answers, "
                        "so clients find it (default: 0 = any free port; open it to clients "
                        "beside --port, or they keep using gRPC)")
    p.add_argument("--no-lookup-port", action="store_true",
                   help="answer lookups over gRPC only")
    p.add_argument("--metrics-port", type=port_type, metavar="PORT",
                   help="serve Prometheus metrics (/metrics) and probes (/healthz, /readyz) "
                        "over HTTP on this port of --host; 0 = any free port (default: off)")
    p.add_argument("--config", metavar="FILE", help="YAML file of master settings (the long "
                   "option names with _ for -, e.g. put_timeout_s: 30s); flags override it")
    p.add_argument("--put-timeout", type=duration_type, metavar="DURATION",
                   help="reclaim a put not completed within this (default: 30s)")
    p.add_argument("--lease-ttl", type=duration_type, metavar="DURATION",
                   help="protect an object from eviction/removal this long after a read is "
                        "granted (default: 5s)")
    p.add_argument("--node-ttl", type=duration_type, metavar="DURATION",
                   help="declare a store node dead after this long without a heartbeat (default: 10s)")
    p.add_argument("--quarantine", type=duration_type, metavar="DURATION",
                   help="keep space of a reclaimed put unused this long (default: 30s)")
    p.add_argument("--high-watermark", type=fraction_type, metavar="FRACTION",
                   help="evict when a segment is fuller than this (default: 0.95)")
    p.add_argument("--low-watermark", type=fraction_type, metavar="FRACTION",
                   help="evict down to this (default: 0.85)")
    p.add_argument("--replicas", type=count_type, help="copies per object unless a client asks "
                   "otherwise (default: 1)")
    p.add_argument("--promote-window", type=duration_type, metavar="DURATION",
                   help="promote a disk-tier object back to DRAM when it is read again within "
                        "this long of its previous read (default: 60s)")
    p.add_argument("--pin-quota", type=fraction_type, metavar="FRACTION",
                   help="the share of the cluster's capacity that hard pins (never evicted) "
                        "may hold (default: 0.5)")
    p.add_argument("--max-pending", type=fraction_type, metavar="FRACTION",
                   help="the share of the cluster's capacity that puts started and not ended "
                        "(with the quarantine of those timed out) may hold; a put past it is "
                        "refused with NoSpace (default: 0.5)")
    p.add_argument("--tenant-quotas", metavar="NAME=SIZE,...",
                   help="each tenant's byte quota (its objects' sizes, each once, whatever "
                        "their replicas); a put past it is refused with QuotaExceeded before "
                        "anything is evicted. '*' for every tenant not named, e.g. "
                        "'tenant-a=10GiB,*=1GiB'. A tenant is what its client's credentials "
                        "name (SECURITY.md; 'default' for kvpool's own clients). Default: "
                        "none, each tenant bounded by the cluster's capacity only")
    p.add_argument("--max-lease", type=duration_type, metavar="DURATION",
                   help="a read lease ends this long after it began however often the object "
                        "is re-read; reads then grant none for --lease-ttl (default: 60s)")
    p.add_argument("--eviction", choices=EVICTION_POLICIES,
                   help="what a full segment gives up first: 'prefix' evicts KV prefix chains "
                        "from the tail (blocks name their parent; shared prefixes go last, "
                        "LRU for objects without one, a read counted when eviction reaches the "
                        "block: a second chance, not a touch per read), 'lru' is exact "
                        "least-recently-used and indexes each object in ~170 fewer bytes "
                        "(default: prefix)")
    p.add_argument("--namespace-depth", type=int, metavar="N",
                   help="count lookups per key namespace, a key's first N '/'-separated parts, "
                        "in kvpool_master_namespace_lookups_total (default: 3, the vLLM "
                        "connector's 'kvpool/vllm1/<model>'; 0: off)")
    p.add_argument("--max-routing-instances", type=count_type, metavar="N",
                   help="serving instances the routing index keeps from KV events; another "
                        "is refused until one goes silent (default: 1024)")
    p.add_argument("--max-routing-instances-per-tenant", type=count_type, metavar="N",
                   help="of those, the most one tenant's KV events may name, so one tenant's "
                        "publishers cannot take every other's room (default: 256)")
    p.add_argument("--max-routing-blocks-per-instance", type=count_type, metavar="N",
                   help="blocks the routing index keeps per instance (its GPU and CPU tiers); "
                        "events past it are dropped and counted (default: 1000000)")
    p.add_argument("--max-routing-blocks", type=count_type, metavar="N",
                   help="blocks the routing index keeps in all, ~75 bytes each "
                        "(default: 4000000)")
    p.add_argument("--lookup-session-ttl", type=duration_type, metavar="DURATION",
                   help="with --credentials: how long a lookup-port session lasts (its peer "
                        "opens the next before; a restart ends them all) (default: 1h)")
    p.add_argument("--max-lookup-sessions-per-identity", type=count_type, metavar="N",
                   help="with --credentials: lookup-port sessions one identity may hold at "
                        "once; a newer one drops its oldest (default: 1024)")
    p.add_argument("--ha", metavar="etcd[s]://HOST:PORT[,HOST:PORT][/CLUSTER]",
                   help="run as one of several standby masters electing a leader on etcd "
                        "(CLUSTER names the election, default 'default'); standbys refuse "
                        "calls, naming the leader; clients use the same URL as --master. "
                        "etcds://: etcd over TLS, each process authenticating with its own "
                        "credentials (SECURITY.md)")
    p.add_argument("--advertise", metavar="HOST[:PORT]",
                   help="with --ha: the address clients and nodes dial to reach this master "
                        "(default: --host and the bound port; required with --host 0.0.0.0)")
    p.add_argument("--ha-lease-ttl", type=duration_type, default=5.0, metavar="DURATION",
                   help="with --ha: the leader's etcd lease; a dead leader is replaced within "
                        "about this long (default: 5s; etcd's minimum is 2s)")
    p.add_argument("--credentials", metavar="FILE",
                   help="this master's credentials file (ca, cert, key; SECURITY.md): gRPC "
                        "and the lookup port then take only peers with certificates of that "
                        "CA, each call checked against its role (default: none: plain text, "
                        "allowed on a loopback --host only)")
    p.add_argument("--tokens", metavar="FILE",
                   help="with --credentials: also serve gRPC on --token-port to clients "
                        "that hold a bearer token instead of a certificate; FILE lists each "
                        "token's SHA-256 with its role and name (SECURITY.md). Prints "
                        "`tokens: HOST:PORT`")
    p.add_argument("--token-port", type=port_type, default=0, metavar="PORT",
                   help="with --tokens: the token port (default: 0 = any free port)")
    p.add_argument("--insecure", action="store_true",
                   help="serve plain text, trusting every caller, on a non-loopback --host "
                        "without credentials (refused otherwise); logs a warning")
    log_arg(p)


def run(args: argparse.Namespace) -> int:
    from kvpool.common import loops
    from kvpool.common.logging import configure
    from kvpool.master.server import serve
    configure(args.log_level, component="master", fmt=args.log_format)
    config = load(MasterConfig, args.config, put_timeout_s=args.put_timeout,
                  lease_ttl_s=args.lease_ttl, node_ttl_s=args.node_ttl,
                  quarantine_s=args.quarantine, high_watermark=args.high_watermark,
                  low_watermark=args.low_watermark, default_replicas=args.replicas,
                  eviction=args.eviction, promote_window_s=args.promote_window,
                  pin_quota_fraction=args.pin_quota, namespace_depth=args.namespace_depth,
                  max_pending_fraction=args.max_pending, max_lease_s=args.max_lease,
                  max_routing_instances=args.max_routing_instances,
                  max_routing_instances_per_tenant=args.max_routing_instances_per_tenant,
                  max_routing_blocks_per_instance=args.max_routing_blocks_per_instance,
                  max_routing_blocks=args.max_routing_blocks,
                  lookup_session_ttl_s=args.lookup_session_ttl,
                  max_lookup_sessions_per_identity=args.max_lookup_sessions_per_identity,
                  tenant_quotas=args.tenant_quotas)
    def announce(address: str, metrics: str | None) -> None:
        print(f"master: {address}", flush=True)
        if metrics:
            print(f"metrics: {metrics}", flush=True)

    if args.ha:   # a wildcard --host needs --advertise: said before anything else
        from kvpool.master.ha import advertised
        advertised(args.host, args.port or 1, args.advertise)
    credentials = _credentials(args)
    tokens = None
    if args.tokens:
        from kvpool.common.security import Tokens
        if credentials is None:
            raise ConfigError("--tokens needs --credentials (tokens travel over TLS only)")
        tokens = Tokens.load(args.tokens)
    lookup_port = None if args.no_lookup_port else args.lookup_port
    gc_for_a_large_index()
    if args.ha:
        from kvpool.common.addresses import parse_etcd_url
        from kvpool.common.logging import get_logger
        from kvpool.master.ha import serve_ha
        url = parse_etcd_url(args.ha)
        if url.tls and credentials is None:
            raise ConfigError("--ha etcds:// (etcd over TLS) needs --credentials: the master "
                              "authenticates to etcd with its certificate (SECURITY.md)")
        if credentials is not None and not url.tls:
            get_logger("kvpool.master").warning(
                "etcd_plain_text", etcd=args.ha,
                why="the election and the leader's address travel to etcd in plain text; use "
                    "etcds:// with etcd serving TLS (SECURITY.md \"etcd\")")
        loops.run(serve_ha(config, args.host, args.port, url, advertise=args.advertise,
                             lease_ttl_s=max(1, round(args.ha_lease_ttl)), on_started=announce,
                             lookup_port=lookup_port, metrics_port=args.metrics_port,
                             credentials=credentials, tokens=tokens,
                             token_port=args.token_port))
        return 0
    if args.advertise:
        raise ConfigError("--advertise is for standby masters: give --ha etcd://HOST:PORT too")
    loops.run(serve(config, args.host, args.port, on_started=announce,
                      lookup_port=lookup_port, metrics_port=args.metrics_port,
                      credentials=credentials, tokens=tokens, token_port=args.token_port))
    return 0


def _credentials(args: argparse.Namespace):
    """The master's credentials, or None where serving without is allowed (see --insecure)."""
    from kvpool.common import security
    from kvpool.common.logging import get_logger
    path = args.credentials
    if path:
        if args.insecure:
            raise ConfigError("--insecure and credentials together: choose one")
        creds = security.load(path)
        if creds.identity.role != "master":
            raise ConfigError(f"{path} holds {creds.identity}'s credentials, not a master's")
        return creds
    if args.insecure:
        get_logger("kvpool.master").warning(
            "insecure_master", host=args.host,
            why="--insecure: no credentials; any peer that reaches this port may put, read, "
                "remove and pin any key and mount or unmount store nodes (SECURITY.md)")
    elif not security.is_loopback(args.host):
        raise ConfigError(f"a master on {args.host} (reachable from other hosts) needs "
                          "--credentials FILE (SECURITY.md; `kvpool up` makes its own) or an "
                          "explicit --insecure")
    return None
