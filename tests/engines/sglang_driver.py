"""Drives kvpool's SGLang HiCache backend with SGLang's own host memory pool, one JSON request a
line on stdin, one ``DRIVER {json}`` answer a line on stdout. Run by the SGLang venv's Python
(scripts/engines/sglang-env.sh); tests/engines/test_sglang.py starts it.

The host pool is SGLang's ``MHATokenToKVPoolHost`` (or ``MLATokenToKVPoolHost``) over an
``MHATokenToKVPool`` (``MLATokenToKVPool``) on CPU, built as SGLang's cache controller builds
them; the backend is made by SGLang's ``StorageBackendFactory`` (``dynamic``), as
``attach_storage_backend`` does. Pages are addressed by number (host indices
``page * page_size ...``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE = 16


class Logs(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.name} {record.getMessage()}")


class Driver:
    def __init__(self):
        self.pool = None
        self.backend = None
        self.logs = Logs()
        logging.getLogger("sglang").addHandler(self.logs)
        logging.getLogger("sglang").setLevel(logging.INFO)

    def indices(self, pages):
        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64)
                          for p in pages]) if pages else torch.zeros(0, dtype=torch.int64)

    # -- requests --
    def pool_(self, layout="page_first", pages=64, mla=False, dtype="bfloat16", layers=3, heads=2,
              head_dim=8):
        dt = getattr(torch, dtype)
        tokens = pages * PAGE
        if mla:
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
            dev = MLATokenToKVPool(size=tokens, page_size=PAGE, dtype=dt, kv_lora_rank=head_dim,
                                   qk_rope_head_dim=8, layer_num=layers, device="cpu",
                                   enable_memory_saver=False)
            self.pool = MLATokenToKVPoolHost(dev._mla_buffer_info(), 1.0, 0, PAGE, layout,
                                             pin_memory=False, device="cpu",
                                             device_capacity_tokens=tokens, start_layer=0,
                                             end_layer=layers, target_layer_num=layers)
        else:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
            dev = MHATokenToKVPool(size=tokens, page_size=PAGE, dtype=dt, head_num=heads,
                                   head_dim=head_dim, layer_num=layers, device="cpu",
                                   enable_memory_saver=False, enable_alt_stream=False)
            self.pool = MHATokenToKVPoolHost(dev._mha_buffer_info(), 1.0, 0, PAGE, layout,
                                             pin_memory=False, device="cpu",
                                             device_capacity_tokens=tokens, start_layer=0,
                                             end_layer=layers)
        return {"class": type(self.pool).__name__, "layout": self.pool.layout,
                "pages": self.pool.page_num, "kv_buffer": list(self.pool.kv_buffer.shape)}

    def backend_(self, extra, tp_rank=0, tp_size=1, model="tiny-model", backend="dynamic",
                 mla=False):
        config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
            is_page_first_layout=self.pool is not None and self.pool.layout == "page_first",
            model_name=model, extra_config=dict(extra))
        started = time.monotonic()
        # As HiCacheController.attach_storage_backend: create, then register the host pool.
        self.backend = StorageBackendFactory.create_backend(backend, config, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.backend.on_host_pools_registered()
        return {"class": f"{type(self.backend).__module__}.{type(self.backend).__name__}",
                "s": time.monotonic() - started}

    def fill(self, pages, seed=0):
        g = torch.Generator().manual_seed(seed)
        for p in pages:
            page = self.pool.get_data_page(p * PAGE, flat=True)
            self.pool.set_from_flat_data_page(
                p * PAGE, torch.randn(page.shape, generator=g).to(page.dtype))
        return {}

    def zero(self, pages):
        for p in pages:
            page = self.pool.get_data_page(p * PAGE, flat=True)
            self.pool.set_from_flat_data_page(p * PAGE, torch.zeros_like(page))
        return {}

    def digest(self, pages):
        return {"digests": [hashlib.sha256(self.pool.get_data_page(p * PAGE, flat=True)
                                           .view(torch.uint8).numpy().tobytes()).hexdigest()
                            for p in pages]}

    def _extra(self, prefix):
        return HiCacheStorageExtraInfo(prefix_keys=prefix) if prefix is not None else None

    def set_v1(self, keys, pages, prefix=None):
        return {"ok": self.backend.batch_set_v1(keys, self.indices(pages), self._extra(prefix))}

    def get_v1(self, keys, pages, prefix=None):
        return {"ok": self.backend.batch_get_v1(keys, self.indices(pages), self._extra(prefix))}

    def exists(self, keys, prefix=None):
        return {"count": self.backend.batch_exists(keys, self._extra(prefix))}

    def set(self, keys, pages):
        # As HiCacheController._generic_page_set.
        data = [self.pool.get_data_page(p * PAGE) for p in pages]
        return {"ok": self.backend.batch_set(keys, data)}

    def get(self, keys, pages):
        # As HiCacheController._generic_page_get: read into dummy pages, copy into the pool.
        dst = [self.pool.get_dummy_flat_data_page() for _ in keys]
        got = self.backend.batch_get(keys, dst)
        ok = []
        for p, page in zip(pages, got):
            if page is not None:
                self.pool.set_from_flat_data_page(p * PAGE, page)
            ok.append(page is not None)
        return {"ok": ok}

    def close(self):
        if self.backend is not None and hasattr(self.backend, "close"):
            self.backend.close()
        return {}


def main() -> None:
    d = Driver()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.pop("op")
        before = len(d.logs.lines)
        started = time.monotonic()
        try:
            answer = getattr(d, op + "_" if op in ("pool", "backend") else op)(**req)
        except Exception as e:  # noqa: BLE001  (the test asserts on it)
            answer = {"error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-3000:]}
        answer["s"] = answer.get("s", time.monotonic() - started)
        answer["logs"] = d.logs.lines[before:]
        print("DRIVER " + json.dumps(answer), flush=True)
        if op == "close":
            break


if __name__ == "__main__":
    main()
