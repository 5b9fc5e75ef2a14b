"""Drives LMCache's own ``mooncakestore`` remote connector, unmodified, against a kvpool cluster
through kvpool's ``mooncake`` shim. Run by the LMCache venv's Python
(scripts/engines/lmcache-env.sh) with the shim first on PYTHONPATH; tests/compat/test_lmcache.py
starts it: ``lmcache_driver.py MASTER SAVE_CHUNK_META SEGMENT`` prints one ``DRIVER {json}`` line.

The connector is made as LMCache makes it (``CreateConnector`` from a ``mooncakestore://`` URL,
with its ``LocalCPUBackend`` and engine metadata); chunks are LMCache's own memory objects,
filled with random bytes, put with ``batched_put``, checked with ``exists`` /
``batched_async_contains``, and read back with ``batched_get`` into fresh objects.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CHUNK = 16
KV_SHAPE = (2, 2, CHUNK, 2, 8)   # layers, k/v, tokens, heads, head size
CHUNKS = 6


def digest(obj) -> str:
    return hashlib.sha256(obj.byte_array).hexdigest()


def main() -> None:
    master, save_meta, segment = sys.argv[1], sys.argv[2] == "meta", sys.argv[3]
    out: dict = {}
    try:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
            remote_url=f"mooncakestore://{master}", remote_serde="naive",
            extra_config={"master_server_address": master, "local_hostname": "127.0.0.1",
                          "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                          "global_segment_size": segment, "local_buffer_size": "0",
                          "save_chunk_meta": save_meta, "transfer_timeout": 10})
        metadata = LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1,
                                   worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                                   kv_shape=KV_SHAPE, chunk_size=CHUNK)
        backend = LocalCPUBackend(config, metadata)
        loop = asyncio.new_event_loop()
        conn = CreateConnector(config.remote_url, loop, backend, config, metadata)
        inner = getattr(conn, "_connector", conn)   # LMCache wraps it to count its calls
        out["connector"] = f"{type(inner).__module__}.{type(inner).__name__}"
        store = getattr(inner, "store", None)
        out["store"] = f"{type(store).__module__}.{type(store).__name__}"
        base = 2000 if save_meta else 1000   # the two modes store different bytes per key
        keys = [CacheEngineKey("tiny", 1, 0, base + i, torch.bfloat16) for i in range(CHUNKS)]
        g = torch.Generator().manual_seed(1)
        objs, put = [], []
        shapes, dtypes = metadata.get_shapes(), metadata.get_dtypes()
        for _ in keys:
            obj = backend.allocate(shapes, dtypes)
            obj.raw_tensor.copy_(torch.randint(0, 256, obj.raw_tensor.shape, generator=g,
                                               dtype=torch.uint8).view(obj.raw_tensor.dtype))
            objs.append(obj)
            put.append(digest(obj))
        run = loop.run_until_complete
        out["exists_before"] = [bool(run(conn.exists(k))) for k in keys]
        run(conn.batched_put(keys[:4], objs[:4]))
        run(conn.put(keys[4], objs[4]))
        out["exists_after"] = [bool(run(conn.exists(k))) for k in keys]
        out["contains"] = run(conn.batched_async_contains("lookup-1", keys))
        got = run(conn.batched_get(keys))
        out["read"] = [None if o is None else digest(o) for o in got]
        out["put"] = put
        out["read_back"] = [g is not None and g == p for g, p in zip(out["read"], put)]
        run(conn.close())
    except Exception as e:  # noqa: BLE001  (the test asserts on it)
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    print("DRIVER " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
