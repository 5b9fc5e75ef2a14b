"""What several ``kvpool`` subcommands share: argparse value types (clear messages, never a
traceback) and the --master and --log-level arguments."""

from __future__ import annotations

import argparse
import os

from kvpool.common.config import LOG_FORMATS, ConfigError, parse_duration, parse_size


def size_type(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_or_off_type(text: str) -> int:
    """A size, or 0 for "off"."""
    return 0 if text.strip() == "0" else size_type(text)


def duration_type(text: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def duration_or_off_type(text: str) -> float:
    """A duration, or 0 for "off"."""
    return 0.0 if text.strip() == "0" else duration_type(text)


def fraction_type(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"invalid fraction {text!r}: expected 0 < x <= 1, e.g. 0.9")
    return value


def port_type(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: expected 0-65535 (0 = any free port)")
    return int(text)


def count_type(text: str, minimum: int = 1) -> int:
    if not text.isdigit() or int(text) < minimum:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected a whole number "
                                         f">= {minimum}")
    return int(text)


def master_arg(p: argparse.ArgumentParser, required: bool = True) -> None:
    env = os.environ.get("KVPOOL_MASTER")
    p.add_argument("--master", default=env, required=required and env is None, metavar="HOST:PORT",
                   help="the master's address (default: $KVPOOL_MASTER); with standby masters, "
                        "their list HOST:PORT,HOST:PORT,... or the etcd they elect on, "
                        "etcd://HOST:PORT[/CLUSTER]: the leader is found and followed")


def log_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity on stderr (default: info)")
    p.add_argument("--log-format", default="console", choices=LOG_FORMATS,
                   help="one event per line on stderr: 'timestamp level event key=value' "
                        "(console), or a JSON object for a log collector (json) (default: "
                        "console)")
