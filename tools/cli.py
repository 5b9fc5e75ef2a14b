"""The ``kvpool`` command line: run a master, a store node, a whole local cluster, inspect it.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``. A module is
imported only for the subcommand named on the command line (to run it or print its help), so
``kvpool --help`` and ``kvpool master --help`` import no benchmark, soak or replay code, torch,
numpy or matplotlib: a command pays only for its own imports.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from types import ModuleType

# name -> (the line `kvpool --help` shows, the module that defines and runs the command)
COMMANDS: dict[str, tuple[str, str]] = {
    "master": ("run the master (global index, allocator, leases, eviction)",
               "kvpool.tools.master_cmd"),
    "store-node": ("run a store node that pools memory segments", "kvpool.tools.store_node_cmd"),
    "up": ("run a local cluster (a master and store nodes) until Ctrl-C", "kvpool.tools.up_cmd"),
    "credentials": (("make a cluster's CA and issue certificates for masters, store nodes, "
                     "clients and admins"), "kvpool.tools.credentials_cmd"),
    "stat": ("show segments, usage, objects, hits and misses", "kvpool.tools.stat_cmd"),
    "top": ("a live view of the cluster: nodes, tiers, hit rate, ops/s, bytes/s",
            "kvpool.tools.top_cmd"),
    "demo": ("a shared-prefix serving workload on a local cluster", "kvpool.tools.demo"),
    "bench": ("measure put/get throughput and latency against memcpy, raw TCP and Redis",
              "kvpool.tools.bench"),
    "replay": ("replay a Mooncake trace through the router; reuse and TTFT per policy",
               "kvpool.tools.replay"),
    "gateway": ("an OpenAI-compatible HTTP gateway that routes requests to engines by cache "
                "and load", "kvpool.tools.gateway_cmd"),
    "kv-events": ("feed a vLLM instance's KV events (ZMQ) to the master's routing index",
                  "kvpool.tools.kv_events_cmd"),
    "soak": ("load + node crashes + eviction on a local cluster, then a strict audit",
             "kvpool.tools.soak"),
}


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    """The parser, with ``command``'s arguments filled in (the others listed by name and help
    line only), and ``command``'s module (None if it names no command)."""
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a cluster-wide KV-cache store for LLM serving. A master indexes KV "
                    "blocks; store nodes pool DRAM segments; engines put and get blocks by hash.",
        epilog="Start here: `kvpool demo` runs a local cluster and a shared-prefix workload; "
               "`kvpool up` runs a local cluster until Ctrl-C.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    module = None
    for name, (summary, module_name) in COMMANDS.items():
        p = sub.add_parser(name, help=summary)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # SIGINT stops every command (KeyboardInterrupt, exit 130), also one started by a script in
    # the background, which a shell starts with SIGINT ignored (kept across exec): `kill -INT`
    # and a supervisor's SIGINT must not be lost. Commands that wait for it install their own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The command is the first word that is not an option: `kvpool` itself takes only -h.
    parser, module = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    from kvpool.common.config import ConfigError
    from kvpool.common.errors import KVPoolError
    try:
        return module.run(args)
    except (KVPoolError, ConfigError, OSError) as e:
        print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
