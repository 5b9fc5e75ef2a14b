"""``kvpool kv-events``: bridge one vLLM instance's ZMQ KV-event stream to the master's Router."""

from __future__ import annotations

import argparse
import os
import signal
import threading

from kvpool.common.hashing import HashSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Subscribe to a vLLM instance's KV-event publisher (vLLM: --kv-events-config "
        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://*:5557\"}'), re-hash its blocks with kvpool's spec from their token ids and "
        "stream them to the master, so Route knows what the instance's own cache holds. Prints "
        "`kv-events: INSTANCE` once connected; Ctrl-C stops.")
    env = os.environ.get("KVPOOL_MASTER")
    p.add_argument("--master", default=env, required=env is None, metavar="HOST:PORT",
                   help="the master's address (default: $KVPOOL_MASTER)")
    p.add_argument("--endpoint", required=True, metavar="tcp://HOST:PORT",
                   help="the vLLM instance's ZMQ publisher, e.g. tcp://10.0.0.5:5557")
    p.add_argument("--instance-id", required=True,
                   help="the name the router knows the instance by (what Route returns)")
    p.add_argument("--block-size", type=int, required=True,
                   help="the engine's block size in tokens (must match the cluster's)")
    p.add_argument("--model", required=True,
                   help="the served model's name: the hash namespace every client of this "
                        "model uses (HashSpec extra key `model`)")
    p.add_argument("--topic", default="", help="ZMQ topic (default: all)")
    p.add_argument("--url", default="", metavar="http://HOST:PORT",
                   help="the instance's OpenAI server, announced to the master with its events "
                        "so that `kvpool gateway --discover` serves it (default: not announced)")
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="what the instance serves as, announced with --url: both (colocated), "
                        "prefill (vLLM kv_role kv_producer) or decode (kv_consumer) "
                        "(default: both)")


def run(args) -> int:
    from kvpool.client.vllm_events import ZMQEventBridge
    spec = HashSpec.of(args.block_size, model=args.model)
    url = args.url.rstrip("/")
    if url and "://" not in url:
        url = "http://" + url
    bridge = ZMQEventBridge(args.endpoint, args.instance_id, args.master, spec,
                            topic=args.topic, url=url, role=args.role if url else "").start()
    print(f"kv-events: {args.instance_id} <- {args.endpoint}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if bridge.error is not None:
            break
    applied = bridge.stop()
    print(f"kv-events: stopped after {bridge.batches} batches, {applied} events applied", flush=True)
    return 0
