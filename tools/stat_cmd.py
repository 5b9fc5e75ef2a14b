"""``kvpool stat``: the cluster's state as the master sees it."""

from __future__ import annotations

import argparse
import json

from kvpool.common.config import format_size
from kvpool.tools.argtypes import master_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Print the cluster's state as the master sees it."
    master_arg(p)
    p.add_argument("--json", action="store_true",
                   help="print it as one JSON object, for scripts (sizes in bytes)")


def run(args: argparse.Namespace) -> int:
    from kvpool.rpc.master_client import MasterClient
    mc = MasterClient(args.master, timeout_s=5.0, retries=1)
    try:
        s = mc.stats()
    finally:
        mc.close()
    if args.json:
        print(json.dumps(_as_dict(args.master, s), indent=2))
        return 0
    total = sum(g.segment.size_bytes for g in s.segments)
    used = sum(g.used_bytes for g in s.segments)
    lookups = s.hits + s.misses
    print(f"master {args.master}: {s.nodes} nodes, {len(s.segments)} segments, "
          f"{format_size(used)} used of {format_size(total)}")
    print(f"objects {s.objects} (+{s.pending_objects} pending), hits {s.hits}, misses {s.misses}"
          + (f" (hit rate {s.hits / lookups:.1%})" if lookups else "") + f", evictions {s.evictions}"
          + f", demotions {s.demotions}, promotions {s.promotions}")
    if s.segments:
        print(f"\n{'node':<20} {'segment':<36} {'size':>10} {'used':>10} {'quar.':>10} {'objects':>8}")
        for g in sorted(s.segments, key=lambda g: (g.node_id, g.segment.segment_id)):
            print(f"{g.node_id:<20} {g.segment.segment_id:<36} {format_size(g.segment.size_bytes):>10}"
                  f" {format_size(g.used_bytes):>10} {format_size(g.quarantined_bytes):>10}"
                  f" {g.objects:>8}")
        _print_tiers(s.segments)
        _print_node_transports(s.segments)
    _print_tenants(s.tenants)
    return 0


def _print_tenants(tenants) -> None:
    """One line per tenant holding objects (a client sees its own tenant only)."""
    if not tenants:
        return
    print(f"\n{'tenant':<24} {'objects':>10} {'bytes':>10} {'quota':>10} {'use%':>6}")
    for t in tenants:
        quota = t.quota_bytes if t.HasField("quota_bytes") else None
        print(f"{t.tenant:<24} {t.objects:>10} {format_size(t.bytes):>10} "
              f"{format_size(quota) if quota is not None else '-':>10} "
              f"{(f'{t.bytes / quota:.1%}' if quota else '-'):>6}")


def _as_dict(master: str, s) -> dict:
    from kvpool.rpc.wire import segment_from_pb
    fields = ("nodes", "objects", "pending_objects", "hits", "misses", "evictions", "demotions",
              "promotions", "hit_bytes", "committed", "committed_bytes")
    return {"master": master, **{f: getattr(s, f) for f in fields},
            "segments": [{"node_id": g.node_id, "segment_id": g.segment.segment_id,
                          "tier": segment_from_pb(g.segment).tier,
                          "size_bytes": g.segment.size_bytes, "used_bytes": g.used_bytes,
                          "quarantined_bytes": g.quarantined_bytes, "objects": g.objects}
                         for g in s.segments],
            "tenants": [{"tenant": t.tenant, "objects": t.objects, "bytes": t.bytes,
                         "quota_bytes": t.quota_bytes if t.HasField("quota_bytes") else None}
                        for t in s.tenants]}


def tier_rows(segments) -> list[tuple[str, str, int, int, int]]:
    """(node, tier, size, used bytes, objects) per tier per node, by node then tier (a node
    demotes from a full tier to the next one down)."""
    from kvpool.common.types import TIERS
    from kvpool.rpc.wire import segment_from_pb
    rows: dict[tuple[str, str], list[int]] = {}
    for g in segments:
        row = rows.setdefault((g.node_id, segment_from_pb(g.segment).tier), [0, 0, 0])
        row[0] += g.segment.size_bytes
        row[1] += g.used_bytes
        row[2] += g.objects
    return [(node_id, tier, *figures) for (node_id, tier), figures in sorted(
        rows.items(), key=lambda kv: (kv[0][0], TIERS.index(kv[0][1])))]


def _print_tiers(segments) -> None:
    print(f"\n{'node':<20} {'tier':<6} {'size':>10} {'used':>10} {'use%':>6} {'objects':>8}")
    for node_id, tier, size, used, objects in tier_rows(segments):
        print(f"{node_id:<20} {tier:<6} {format_size(size):>10} {format_size(used):>10} "
              f"{used / size:>6.1%} {objects:>8}")


def _print_node_transports(segments) -> None:
    """One line per node: the transports it offers (clients pick shm, then rdma, then tcp)."""
    nodes = {g.node_id: g.node for g in segments if g.HasField("node")}
    if not nodes:
        return
    print(f"\n{'node':<20} transports")
    for node_id, n in sorted(nodes.items()):
        offered = [f"tcp {n.tcp_endpoint}"] if n.tcp_endpoint else []
        if n.shm_endpoint:
            offered.append("shm (same host)")
        if n.rdma_device:
            offered.append(f"rdma {n.rdma_device} port {n.rdma_port} gid {n.rdma_gid}")
        print(f"{node_id:<20} {', '.join(offered) or 'none'}")
