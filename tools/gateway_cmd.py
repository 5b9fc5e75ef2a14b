"""``kvpool gateway``: an OpenAI-compatible, cache-aware HTTP gateway in front of engines."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import sys

from kvpool.common import loops
from kvpool.master.routing import DEFAULT_POLICY, POLICIES
from kvpool.tools.argtypes import duration_type, log_arg, master_arg, port_type

# What the gateway needs beyond kvpool's own dependencies: `pip install 'kvpool[gateway]'`.
_EXTRA = {"aiohttp": "aiohttp", "transformers": "transformers"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serve OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) in front of engines (vLLM's OpenAI server): each request's prompt is "
        "tokenized with the model's own tokenizer and chat template and routed by the master's "
        "Route to the engine where its prefix is cheapest to get, given each engine's load. "
        "Disaggregated prefill and decode: --prefill and --decode instead of --engines; each "
        "request is computed on a prefill engine (vLLM with the kvpool connector, kv_role "
        "kv_producer), which stores its KV in kvpool, then generated on the least busy decode "
        "engine (kv_role kv_consumer), which loads that KV from kvpool. "
        "Prints `gateway: http://HOST:PORT` once it serves; Ctrl-C stops. Needs the gateway "
        "extra: pip install 'kvpool[gateway]'.")
    master_arg(p)
    p.add_argument("--engines", metavar="[ID=]URL,...",
                   help="colocated engines (each prefills and decodes), e.g. "
                        "http://10.0.0.5:8000,http://10.0.0.6:8000; ID is the instance id the "
                        "engine's KV events are published under (`kvpool kv-events "
                        "--instance-id ID`), default the URL's HOST:PORT")
    p.add_argument("--prefill", metavar="[ID=]URL,...",
                   help="disaggregated serving: the prefill engines (kv_role kv_producer), "
                        "chosen per request by Route (prefix affinity and load); needs --decode")
    p.add_argument("--decode", metavar="[ID=]URL,...",
                   help="disaggregated serving: the decode engines (kv_role kv_consumer), "
                        "chosen per request by load; needs --prefill")
    p.add_argument("--discover", action="store_true",
                   help="also serve the engines the master knows: the instances whose KV-event "
                        "bridge announces its OpenAI server (`kvpool kv-events --url URL "
                        "[--role prefill|decode]`), polled every 2 s; engines that stop "
                        "publishing are dropped (needs --master)")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="the model's local folder: its tokenizer and chat template")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send and the engines serve (default: DIR as "
                        "given, as vLLM names it)")
    p.add_argument("--hash-model", metavar="NAME",
                   help="the model name the engines' KV events are hashed under (`kvpool "
                        "kv-events --model NAME`) (default: the served model name)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=list(POLICIES),
                   help=f"the routing policy Route applies (default: {DEFAULT_POLICY})")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="send Route no measured rates: the master's cost model alone (default: "
                        "each engine's prefill and store-load rates are measured from its first "
                        "tokens and sent with its load)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=port_type, default=8080,
                   help="listen port (default: 8080; 0 = any free port)")
    p.add_argument("--request-timeout", type=duration_type, default=600.0, metavar="DURATION",
                   help="a request's deadline, every try on every engine together (default: 600s)")
    p.add_argument("--read-timeout", type=duration_type, default=60.0, metavar="DURATION",
                   help="a stream silent this long means a hung engine: marked down (default: 60s)")
    p.add_argument("--connect-timeout", type=duration_type, default=2.0, metavar="DURATION",
                   help="connecting to an engine (default: 2s)")
    p.add_argument("--probe-interval", type=duration_type, default=1.0, metavar="DURATION",
                   help="how often each engine's load is read from its /metrics (default: 1s)")
    log_arg(p)


def _missing_extra() -> str | None:
    missing = []
    for module, package in _EXTRA.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return ", ".join(missing) if missing else None


def run(args: argparse.Namespace) -> int:
    if (missing := _missing_extra()) is not None:
        print(f"kvpool gateway: error: needs {missing}; install the gateway extra: "
              "pip install 'kvpool[gateway]'", file=sys.stderr)
        return 1
    from kvpool.common.logging import configure
    from kvpool.gateway.engines import EngineSpecError
    from kvpool.gateway.server import GatewayConfig
    configure(args.log_level, component="gateway", fmt=args.log_format)
    try:
        engines = _engines(args)
    except EngineSpecError as e:
        print(f"kvpool gateway: error: {e}", file=sys.stderr)
        return 2
    config = GatewayConfig(
        engines=engines, model_dir=args.model, master=args.master, policy=args.policy,
        served_model_name=args.served_model_name or args.model, hash_model=args.hash_model,
        request_timeout_s=args.request_timeout, read_timeout_s=args.read_timeout,
        connect_timeout_s=args.connect_timeout, probe_interval_s=args.probe_interval,
        calibrate=args.calibrate, discover=args.discover)
    return loops.run(_serve(config, args.host, args.port))


def _engines(args: argparse.Namespace) -> list:
    """The engines from --engines, or --prefill and --decode; EngineSpecError says what is
    wrong with them."""
    from kvpool.gateway.engines import EngineSpecError, check_roles, parse_engines
    if args.engines and (args.prefill or args.decode):
        raise EngineSpecError("--engines (colocated) cannot be combined with --prefill/--decode "
                              "(disaggregated): give one or the other")
    if args.discover and not args.master:
        raise EngineSpecError("--discover finds engines through the master: give --master "
                              "HOST:PORT (or $KVPOOL_MASTER)")
    if args.engines:
        return parse_engines(args.engines)
    if not args.prefill and not args.decode:
        if args.discover:
            return []
        raise EngineSpecError("no engines: give --engines URL,... (colocated), or --prefill "
                              "URL,... and --decode URL,... (disaggregated), or --discover")
    specs = []
    for role, text in (("prefill", args.prefill), ("decode", args.decode)):
        if text:
            specs += parse_engines(text, role)
    return check_roles(specs)


async def _serve(config, host: str, port: int) -> int:
    from kvpool.gateway.server import Gateway
    try:
        gateway = Gateway(config)
    except ValueError as e:     # the model folder has no usable tokenizer
        print(f"kvpool gateway: error: {e}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await gateway.start(host, port)
        shown = f"[{host}]" if ":" in host else host
        print(f"gateway: http://{shown}:{port}", flush=True)
        await stop.wait()
    finally:
        await gateway.stop()
    return 0
