"""Mooncake Store's Python API (``mooncake.store.MooncakeDistributedStore``) on kvpool.

    store = MooncakeDistributedStore()
    store.setup("10.0.0.5", "P2PHANDSHAKE", 4 << 30, 0, "tcp", "", "10.0.0.1:50051")
    store.put("key", b"value")          # 0
    store.get("key")                    # b"value"; b"" if missing

Method names, argument forms and return conventions are Mooncake's (checked against
mooncake-transfer-engine 0.3.13's ``store.so`` and mooncake-store/include/types.h): ints, 0 for
success and Mooncake's negative ``ErrorCode`` otherwise (compat/codes.py), ``b""`` / ``None``
for a missing key where Mooncake returns that. Deliberate differences, each also said on its
method:

- ``master_server_addr`` names a kvpool master; ``metadata_server``, ``local_buffer_size``,
  ``protocol``, ``rdma_devices`` and ``engine`` are accepted and unused (kvpool's client picks
  shm, then rdma, then tcp per replica by itself, and needs no metadata server nor staging).
- ``remove`` does not refuse an object that is being read (Mooncake: OBJECT_HAS_LEASE): kvpool's
  readers holding a lease finish their read; ``force`` is accepted and unused.
- ``remove_all`` removes the objects this store object put, not every object in the cluster:
  kvpool's master has no call that lists or drops all keys.
- ``ReplicateConfig``: ``replica_num`` and ``with_hard_pin`` are honoured; the preferred-segment
  fields are accepted and unused (the master places).
- The tensor helpers store a header of their own (dtype, shape) before the bytes: a tensor put
  here is read back here, not by Mooncake's own client.
- Calls before ``setup`` or after ``close`` return ILLEGAL_CLIENT (-601) (or b"" / None).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

import numpy as np
from kvpool.client.buffers import address_of, byte_view, view_at
from kvpool.client.kv_client import KVClient
from kvpool.common.errors import (
    AlreadyExists,
    InvalidArgument,
    KVPoolError,
    MasterUnavailable,
)
from kvpool.common.logging import get_logger
from kvpool.compat import tensors
from kvpool.compat.codes import ErrorCode, code_of
from kvpool.embedded import ContributingClient
from kvpool.rpc.master_client import MasterClient

log = get_logger(__name__)

_OK = int(ErrorCode.OK)
_INVALID = int(ErrorCode.INVALID_PARAMS)
_NOT_SET_UP = int(ErrorCode.ILLEGAL_CLIENT)
# setup()'s positional order, as Mooncake's pybind11 signature has it.
_SETUP_ARGS = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
               "protocol", "rdma_devices", "master_server_addr", "engine",
               "enable_ssd_offload", "ssd_offload_path", "tenant_id",
               "enable_client_http_server", "client_http_port")
_REQUIRED = _SETUP_ARGS[:7]
# Mooncake's and SGLang's size parsers read "GB" as 2**30 (kvpool's own "GB" is 10**9):
# the compat layer reads sizes as Mooncake does.
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ReplicateConfig:
    """Mooncake's per-put options. ``replica_num``: copies (kvpool's ``replicas``);
    ``with_hard_pin``: pin the object once stored (never evicted). The others are accepted and
    unused: kvpool's master chooses the segments."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False

    def __repr__(self) -> str:
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, "
                f"with_hard_pin: {int(self.with_hard_pin)}, "
                f"preferred_segment: {self.preferred_segment!r} }}")


class BufferHandle(bytes):
    """A value read by ``get_buffer`` / ``batch_get_buffer``: the bytes themselves (so
    ``memoryview(handle)`` and ``torch.frombuffer(handle, ...)`` work), with Mooncake's
    ``ptr()`` and ``size()``."""

    def ptr(self) -> int:
        return address_of(memoryview(self)) if self else 0

    def size(self) -> int:
        return len(self)


def parse_size(value) -> int:
    """A byte count from an int or a string such as ``"3355443200"``, ``"4GB"``, ``"512MiB"``
    (binary units, as Mooncake reads them). ValueError for anything else."""
    if isinstance(value, bool):   # an int to Python, never a size
        raise ValueError(f"invalid size {value!r}")  # noqa: TRY004  (setup returns INVALID_PARAMS)
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"invalid size {value!r}: expected bytes or a number with a unit "
                             "(KB, MB, GB, TB: binary, as in Mooncake)")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size < 0:
        raise ValueError(f"invalid size {value!r}: negative")
    return size


class MooncakeDistributedStore:
    """Mooncake Store's client, speaking to a kvpool cluster. See the module docstring for
    what differs from Mooncake's; each method says its own."""

    def __init__(self, *, transports: Sequence[str] | None = None) -> None:
        """``transports``: kvpool's, not Mooncake's (whose constructor takes nothing): the
        schemes the client may use (e.g. ``["tcp"]``; default: every one available, shm
        preferred on the same host). Mooncake's ``protocol`` setup argument is not used."""
        self._transports = list(transports) if transports is not None else None
        self._kv: KVClient | None = None
        self._meta: MasterClient | None = None   # get_size: a locate without the read
        self._hostname = ""
        self._registered: dict[int, memoryview] = {}   # address -> view, as registered
        self._put_keys: set[str] = set()   # what remove_all removes
        self._lock = threading.Lock()

    # -- lifecycle --
    def setup(self, *args, **kwargs) -> int:
        """Connect to the kvpool master ``master_server_addr`` (``host:port``). Either
        Mooncake's positional form ``setup(local_hostname, metadata_server,
        global_segment_size, local_buffer_size, protocol, rdma_devices, master_server_addr,
        engine=None, ...)`` or its dict form ``setup({"local_hostname": ..., ...})`` (values
        may be strings; ``master_server_address`` is read too, as LMCache passes it).
        ``global_segment_size > 0``: this process contributes a segment of that size (an
        embedded store node; its objects are lost with the process, as in Mooncake), unmounted
        by ``close``; 0: a pure client. Sizes: bytes or e.g. ``"4GB"``.
        ``local_hostname``: the address the segment's tcp server binds and advertises.
        Unused: ``metadata_server``, ``local_buffer_size``, ``protocol``, ``rdma_devices``,
        ``engine``. Refused (INVALID_PARAMS): SSD offload and a tenant other than
        ``default`` (kvpool has neither). Returns 0, INVALID_PARAMS for a bad argument or a
        second setup, RPC_FAIL when the master does not answer."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            options = dict(args[0])
            if "master_server_addr" not in options and "master_server_address" in options:
                options["master_server_addr"] = options["master_server_address"]
            options.setdefault("global_segment_size", 16 << 20)   # Mooncake's default
        else:
            if len(args) > len(_SETUP_ARGS):
                raise TypeError(f"setup() takes at most {len(_SETUP_ARGS)} arguments")
            options = dict(zip(_SETUP_ARGS, args))
            for name, value in kwargs.items():
                if name not in _SETUP_ARGS or name in options:
                    raise TypeError(f"setup() got an unexpected or repeated argument {name!r}")
                options[name] = value
            missing = [n for n in _REQUIRED if n not in options]
            if missing:
                raise TypeError(f"setup() missing arguments: {', '.join(missing)}")
        with self._lock:
            if self._kv is not None:
                log.error("mooncake_compat_setup_twice")
                return _INVALID
            try:
                return self._setup(options)
            except (ValueError, InvalidArgument) as e:
                log.error("mooncake_compat_setup_refused", reason=str(e))
                return _INVALID

    def _setup(self, options: dict) -> int:
        master = str(options.get("master_server_addr") or "")
        if not master:
            raise ValueError("master_server_addr (the kvpool master's host:port) is required")
        if str(options.get("enable_ssd_offload", "")).lower() in ("1", "true"):
            raise ValueError("SSD offload is not supported: use a kvpool node's disk tier")
        if str(options.get("tenant_id") or "default") != "default":
            raise ValueError("kvpool has no tenants: tenant_id must be 'default'")
        segment = parse_size(options.get("global_segment_size", 0))
        hostname = str(options.get("local_hostname") or "127.0.0.1")
        host = hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname
        host = "127.0.0.1" if host == "localhost" else host
        try:
            kv = ContributingClient(master, host_bytes=segment, host=host,
                                    transports=self._transports) if segment \
                else KVClient(master, transports=self._transports)
        except MasterUnavailable as e:
            log.error("mooncake_compat_setup_failed", master=master, reason=str(e))
            return int(ErrorCode.RPC_FAIL)
        except (KVPoolError, OSError) as e:
            log.error("mooncake_compat_setup_failed", master=master, reason=str(e))
            return code_of(e) if isinstance(e, KVPoolError) else int(ErrorCode.INTERNAL_ERROR)
        try:
            kv.stats()   # the master answers: Mooncake's setup fails without one too
        except KVPoolError as e:
            kv.close()
            log.error("mooncake_compat_setup_failed", master=master, reason=str(e))
            return code_of(e)
        self._kv = kv
        self._hostname = kv.segment.tcp_endpoint if segment else hostname
        return _OK

    def close(self) -> int:
        """Close the client and unmount this process's segment, if any. Returns 0; safe to
        call again."""
        with self._lock:
            kv, meta, self._kv, self._meta = self._kv, self._meta, None, None
            self._registered.clear()
        if meta is not None:
            meta.close()
        if kv is not None:
            kv.close()
        return _OK

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 the master does not answer (as Mooncake)."""
        kv = self._kv
        if kv is None:
            return 1
        try:
            kv.stats()
        except KVPoolError:
            return 2
        return 0

    def get_hostname(self) -> str:
        """``host:port`` of this process's segment server when it contributes one, else the
        ``local_hostname`` given to setup (Mooncake: its transfer engine's ``host:port``)."""
        return self._hostname

    # -- bytes in, bytes out --
    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes or any buffer). 0 also when ``key`` is already stored, as in
        Mooncake (kvpool's own put raises AlreadyExists): the stored value is kept."""
        kv = self._kv
        if kv is None:
            return _NOT_SET_UP
        return self._put(kv, [key], [value], config)[0]

    def put_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (buffers) under ``key``; as :meth:`put`."""
        try:
            value = b"".join(byte_view(p, writable=False) for p in parts)
        except InvalidArgument:
            return _INVALID
        return self.put(key, value, config)

    def put_batch(self, keys: Sequence[str], values: Sequence,
                  config: ReplicateConfig | None = None) -> int:
        """Store each value under its key. 0 when every key is stored (already stored counts),
        else the first key's error code (Mooncake returns one int too)."""
        kv = self._kv
        if kv is None:
            return _NOT_SET_UP
        if len(keys) != len(values):
            return _INVALID
        return next((c for c in self._put(kv, keys, values, config) if c), _OK)

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when it is missing or cannot be read (as Mooncake)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Each key's value, ``b""`` for a missing or unreadable one."""
        kv = self._kv
        if kv is None:
            return [b""] * len(keys)
        return [b"" if isinstance(v, KVPoolError) else v for v in kv.batch_get(list(keys))]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value as a :class:`BufferHandle`, None when it is missing."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """:meth:`get_buffer` for each key."""
        kv = self._kv
        if kv is None:
            return [None] * len(keys)
        return [None if isinstance(v, KVPoolError) else BufferHandle(v)
                for v in kv.batch_get(list(keys))]

    def get_size(self, key: str) -> int:
        """The value's size in bytes, or OBJECT_NOT_FOUND (-704) and the like."""
        kv = self._kv
        if kv is None:
            return _NOT_SET_UP
        try:
            with self._lock:
                if self._meta is None:
                    self._meta = MasterClient(kv.master_address)
                meta = self._meta
            found = meta.locate([key]).view(0)
        except KVPoolError as e:
            return code_of(e)
        return code_of(found) if isinstance(found, KVPoolError) else found.size

    # -- existence and removal --
    def is_exist(self, key: str) -> int:
        """1 if stored, 0 if not, a negative code on error (as Mooncake)."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """:meth:`is_exist` for each key."""
        kv = self._kv
        if kv is None:
            return [_NOT_SET_UP] * len(keys)
        try:
            return [int(b) for b in kv.batch_exists(list(keys))]
        except KVPoolError as e:
            return [code_of(e)] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        """0, or OBJECT_NOT_FOUND. Unlike Mooncake, an object being read is removed all the
        same (its readers finish under their lease); ``force`` is accepted and unused."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """:meth:`remove` for each key."""
        kv = self._kv
        if kv is None:
            return [_NOT_SET_UP] * len(keys)
        try:
            codes = [code_of(e) for e in kv.batch_remove(list(keys))]
        except KVPoolError as e:
            return [code_of(e)] * len(keys)
        with self._lock:
            self._put_keys.difference_update(keys)
        return codes

    def remove_all(self, force: bool = False) -> int:
        """Remove the objects this store object put and has not removed; returns how many
        were removed. Unlike Mooncake's, objects other clients put stay: kvpool's master has
        no call that lists or drops every key. ``force`` is accepted and unused."""
        if self._kv is None:
            return _NOT_SET_UP
        with self._lock:
            keys = list(self._put_keys)
        return sum(c == _OK for c in self.batch_remove(keys, force)) if keys else 0

    # -- registered memory, by address --
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``buffer_ptr`` with the transports that use memory in
        place (rdma). 0, or INVALID_PARAMS for a bad range or an address already registered
        (as Mooncake). Not needed by put_from / get_into: they take any address."""
        kv = self._kv
        if kv is None:
            return _NOT_SET_UP
        if buffer_ptr <= 0 or size <= 0:
            return _INVALID
        with self._lock:
            if buffer_ptr in self._registered:
                return _INVALID
            view = view_at(buffer_ptr, size)
            try:
                kv.register_buffer(view)
            except KVPoolError as e:
                return code_of(e)
            self._registered[buffer_ptr] = view
        return _OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Undo :meth:`register_buffer`; INVALID_PARAMS for an address not registered."""
        kv = self._kv
        if kv is None:
            return _NOT_SET_UP
        with self._lock:
            view = self._registered.pop(buffer_ptr, None)
        if view is None:
            return _INVALID
        try:
            kv.unregister_buffer(view)
        except KVPoolError as e:
            return code_of(e)
        return _OK

    # -- zero copy, by address --
    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Store the ``size`` bytes at ``buffer_ptr``; as :meth:`put`."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None
                       ) -> list[int]:
        """Store each ``sizes[i]`` bytes at ``buffer_ptrs[i]`` under ``keys[i]``; per key 0
        (already stored counts, as in Mooncake) or the error code."""
        kv = self._kv
        if kv is None:
            return [_NOT_SET_UP] * len(keys)
        values = _buffers(buffer_ptrs, sizes, len(keys))
        if values is None:
            return [_INVALID] * len(keys)
        return self._put(kv, keys, values, config)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read the value into the ``size`` bytes at ``buffer_ptr``: the bytes read, or
        INVALID_PARAMS when it does not fit, OBJECT_NOT_FOUND, ..."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """:meth:`get_into` for each key."""
        kv = self._kv
        if kv is None:
            return [_NOT_SET_UP] * len(keys)
        buffers = _buffers(buffer_ptrs, sizes, len(keys))
        if buffers is None:
            return [_INVALID] * len(keys)
        try:
            got = kv.batch_get_into(keys, buffers)
        except KVPoolError as e:
            return [code_of(e)] * len(keys)
        if set(map(type, got)) <= {int}:   # every key read: no Python step per key
            return got
        return [r if type(r) is int else code_of(r) for r in got]

    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Store, under each key, the concatenation of its buffers (gathered into one value:
        a copy, where Mooncake writes the pieces in place)."""
        if len(all_buffer_ptrs) != len(keys) or len(all_sizes) != len(keys):
            return [_INVALID] * len(keys)
        try:
            values = [b"".join(view_at(p, s) for p, s in zip(ptrs, ss, strict=True))
                      for ptrs, ss in zip(all_buffer_ptrs, all_sizes)]
        except ValueError:
            return [_INVALID] * len(keys)
        kv = self._kv
        return [_NOT_SET_UP] * len(keys) if kv is None else self._put(kv, keys, values, config)

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Read each value and scatter it over its buffers, in order; per key the bytes read
        or the error code (INVALID_PARAMS when the value's size is not the buffers' total)."""
        if len(all_buffer_ptrs) != len(keys) or len(all_sizes) != len(keys):
            return [_INVALID] * len(keys)
        kv = self._kv
        if kv is None:
            return [_NOT_SET_UP] * len(keys)
        out = []
        for value, ptrs, ss in zip(kv.batch_get(list(keys)), all_buffer_ptrs, all_sizes):
            if isinstance(value, KVPoolError):
                out.append(code_of(value))
            elif len(value) != sum(ss) or len(ptrs) != len(ss):
                out.append(_INVALID)
            else:
                at = 0
                for p, s in zip(ptrs, ss):
                    view_at(p, s)[:] = value[at:at + s]
                    at += s
                out.append(len(value))
        return out

    # -- tensors --
    def put_tensor(self, key: str, tensor) -> int:
        """Store a contiguous CPU torch tensor (dtype and shape kept; see the module
        docstring: kvpool's own header, not Mooncake's). 0 or the error code."""
        return self.batch_put_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence) -> list[int]:
        """:meth:`put_tensor` for each key."""
        kv = self._kv
        if kv is None:
            return [_NOT_SET_UP] * len(keys)
        if len(keys) != len(tensors_list):
            return [_INVALID] * len(keys)
        try:
            values = [tensors.encode(t) for t in tensors_list]
        except InvalidArgument:
            return [_INVALID] * len(keys)
        return self._put(kv, keys, values, None)

    def get_tensor(self, key: str):
        """The tensor :meth:`put_tensor` stored, or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list:
        """:meth:`get_tensor` for each key."""
        out = []
        for value in self.get_batch(keys):
            try:
                out.append(tensors.decode(value) if value else None)
            except InvalidArgument:
                out.append(None)
        return out

    # -- internals --
    def _put(self, kv: KVClient, keys: Sequence[str], values: Sequence,
             config: ReplicateConfig | None) -> list[int]:
        replicas = None if config is None else max(0, int(config.replica_num))
        try:
            errors = kv.batch_put(keys, values, replicas=replicas)
        except KVPoolError as e:
            return [code_of(e)] * len(keys)
        if errors.count(None) == len(errors):   # the common case, without a step per key
            codes, stored = [_OK] * len(errors), list(keys)
        else:
            # A stored key is success in Mooncake's API (its value is kept, not replaced).
            codes = [0 if e is None or isinstance(e, AlreadyExists) else code_of(e)
                     for e in errors]
            stored = [k for k, e in zip(keys, errors) if e is None]
        if stored:
            with self._lock:
                self._put_keys.update(stored)
            if config is not None and config.with_hard_pin:
                for i, err in zip([i for i, e in enumerate(errors) if e is None],
                                  kv.batch_pin(stored)):
                    codes[i] = code_of(err)
        return codes


def _buffers(ptrs: Sequence[int], sizes: Sequence[int], n: int):
    """Views of ``sizes[i]`` bytes at ``ptrs[i]``: where the buffers are back-to-back rows of
    one size, one 2-D array over them (kvpool's batch calls then move rows without a view
    each: the compat layer costs what the native call costs); None for a bad argument."""
    if len(ptrs) != n or len(sizes) != n:
        return None
    if n > 1:
        first, row = ptrs[0], sizes[0]
        # Compared as lists (C loops): cheaper than numpy for a few thousand Python ints.
        if type(first) is int and type(row) is int and first > 0 and row > 0 \
                and list(sizes) == [row] * n \
                and list(ptrs) == list(range(first, first + n * row, row)):
            return np.frombuffer(view_at(first, n * row), np.uint8).reshape(n, row)
    out = []
    for p, s in zip(ptrs, sizes):
        if p <= 0 or s <= 0:
            out.append(_Bad())
        else:
            out.append(view_at(p, s))
    return out


class _Bad:
    """A buffer that kvpool refuses per key (InvalidArgument), as Mooncake refuses a null
    pointer or a zero size for that key alone."""


__all__ = ["BufferHandle", "ErrorCode", "MooncakeDistributedStore", "ReplicateConfig",
           "parse_size"]
