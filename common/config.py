"""Configuration: sizes ("4GiB") and durations ("10s") parsed in one place, and the defaults.

Precedence everywhere: built-in defaults <- YAML file (``--config``) <- environment
(``KVPOOL_<FIELD>``) <- command-line flags.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

# How kvpool processes write their log lines (common/logging.py; --log-format).
LOG_FORMATS = ("console", "json")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value could not be understood; the message says what was expected."""


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``4GiB``, ``512MiB``, ``1.5GB`` or ``4096`` into bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _NUMBER_UNIT.match(str(text))
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(f"invalid size {text!r}: expected a number with an optional unit "
                              "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 4GiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    size = int(value * _SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"invalid size {text!r}: must be greater than zero")
    return size


def parse_duration(text: str | float) -> float:
    """Parse a duration such as ``10s``, ``500ms``, ``2m`` or ``1.5`` (seconds) into seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _NUMBER_UNIT.match(str(text))
        if not m or m.group(2).lower() not in _DURATION_UNITS:
            raise ConfigError(f"invalid duration {text!r}: expected a number with an optional unit "
                              "(ms, s, m, h), e.g. 10s")
        value, unit = float(m.group(1)), m.group(2).lower()
    seconds = value * _DURATION_UNITS[unit]
    if seconds <= 0:
        raise ConfigError(f"invalid duration {text!r}: must be greater than zero")
    return seconds


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_quotas(text: str) -> dict[str, int]:
    """``NAME=SIZE,...`` (``*``: every tenant not named) -> {name: bytes}."""
    quotas: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in str(text or "").split(","))):
        name, sep, size = (p.strip() for p in item.partition("="))
        if not sep or not name:
            raise ConfigError(f"invalid tenant quota {item!r}: expected NAME=SIZE (e.g. "
                              "tenant-a=10GiB, or *=1GiB for every tenant not named)")
        if name in quotas:
            raise ConfigError(f"tenant {name!r} has two quotas")
        quotas[name] = parse_size(size)
    return quotas


# Names MasterConfig.eviction accepts; master/eviction.py maps each to its policy class.
EVICTION_POLICIES = ("prefix", "lru")


@dataclass(frozen=True)
class MasterConfig:
    """The master's tunables. Units are in the names."""

    put_timeout_s: float = 30.0        # a PENDING object is reclaimed this long after PutStart
    lease_ttl_s: float = 5.0           # a read is protected from eviction/removal this long
    node_ttl_s: float = 10.0           # a node silent this long is dead: segments and replicas gone
    quarantine_s: float = 30.0         # reclaimed PENDING space waits this long before reuse
    high_watermark: float = 0.95       # evict when a segment is fuller than this...
    low_watermark: float = 0.85        # ...down to this
    default_replicas: int = 1
    alignment_bytes: int = 64          # extents start on this boundary (cache line)
    # Eviction order (master/eviction.py): "prefix" (chain tails first, shared parents last,
    # LRU for objects without a parent) or "lru" (plain; ~170 bytes less per indexed object).
    eviction: str = "prefix"
    # A disk-tier object read again within this long of its previous read is promoted (copied
    # back up to its node's DRAM tier, when that has room below its high watermark).
    promote_window_s: float = 60.0
    # Hard pins (never evicted) may hold at most this fraction of the cluster's capacity.
    pin_quota_fraction: float = 0.5
    # PENDING puts (started, not ended), with the quarantine of those reclaimed, may hold at
    # most this fraction of the cluster's capacity: puts started and abandoned cannot lock
    # every other writer out for put_timeout_s + quarantine_s. A PutStart past it: NoSpace.
    max_pending_fraction: float = 0.5
    # A read lease, however often the object is re-read, ends this long after it began; reads
    # then grant none for lease_ttl_s (the object may be evicted). Readers re-check reads
    # past their lease, so this costs them a check, never a wrong byte.
    max_lease_s: float = 60.0
    # Key components that name a namespace in the per-namespace lookup counts (3: the vLLM
    # connector's "kvpool/vllm1/<model namespace>"; 0: not counted). master/reads.py.
    namespace_depth: int = 3
    # What KV events may make the routing index hold (master/routing.py RoutingLimits: blocks
    # past a cap are dropped, an instance past the limit is refused).
    max_routing_instances: int = 1024
    max_routing_instances_per_tenant: int = 256
    max_routing_blocks_per_instance: int = 1_000_000
    max_routing_blocks: int = 4_000_000
    # The lookup port's sessions (net/lookup_port.py; a master with credentials): how long one
    # lasts, and how many one identity may hold at once (a newer one drops its oldest).
    lookup_session_ttl_s: float = 3600.0
    max_lookup_sessions_per_identity: int = 1024
    # Tenants' byte quotas (master/quotas.py): "NAME=SIZE,...", "*" for every tenant not named;
    # "" (the default): none, every tenant bounded by the cluster's capacity only.
    tenant_quotas: str = ""

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy {self.eviction!r}: expected one of "
                              f"{', '.join(EVICTION_POLICIES)}")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks must satisfy 0 < low_watermark < high_watermark <= 1")
        if not 0 <= self.pin_quota_fraction <= 1:
            raise ConfigError("pin_quota_fraction must be between 0 and 1")
        if not 0 < self.max_pending_fraction <= 1:
            raise ConfigError("max_pending_fraction must be more than 0 and at most 1")
        if self.max_lease_s < self.lease_ttl_s:
            raise ConfigError(f"max_lease_s ({self.max_lease_s}) must be at least lease_ttl_s "
                              f"({self.lease_ttl_s})")
        if self.namespace_depth < 0:
            raise ConfigError("namespace_depth must be 0 or more")
        for f in ("max_routing_instances", "max_routing_instances_per_tenant",
                  "max_routing_blocks_per_instance", "max_routing_blocks",
                  "max_lookup_sessions_per_identity"):
            if getattr(self, f) < 1:
                raise ConfigError(f"{f} must be at least 1")
        parse_quotas(self.tenant_quotas)   # ConfigError if malformed
        if self.default_replicas < 1:
            raise ConfigError("default_replicas must be at least 1")
        for f in ("put_timeout_s", "lease_ttl_s", "node_ttl_s", "quarantine_s",
                  "promote_window_s", "max_lease_s", "lookup_session_ttl_s"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be greater than zero")


_PARSERS = {"_s": parse_duration, "_bytes": parse_size}


def load(cls: type, path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
         **overrides: Any) -> Any:
    """Build config dataclass ``cls`` from defaults <- YAML ``path`` <- env <- ``overrides``."""
    values: dict[str, Any] = {}
    names = {f.name for f in fields(cls)}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of settings")
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown settings in {path}: {', '.join(sorted(unknown))}")
        values.update(data)
    env = os.environ if env is None else env
    for name in names:
        if f"KVPOOL_{name.upper()}" in env:
            values[name] = env[f"KVPOOL_{name.upper()}"]
    values.update({k: v for k, v in overrides.items() if v is not None})
    for f in fields(cls):
        if f.name in values:
            values[f.name] = _coerce(f, values[f.name])
    return cls(**values)


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    for suffix, parse in _PARSERS.items():
        if f.name.endswith(suffix):
            return parse(value)
    kind = {"int": int, "float": float, "str": str}.get(str(f.type), None)
    try:
        return kind(value) if kind else value
    except ValueError:
        raise ConfigError(f"invalid value {value!r} for {f.name}: expected {f.type}") from None
