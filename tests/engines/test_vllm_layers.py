"""The vLLM connector's layer-by-layer path (connectors/vllm_layers.py, vllm_layerwise.py)
without vLLM: paged caches as torch tensors in vLLM's layouts, a real kvpool cluster between
a save and a load. On CPU here; the same tests on a CUDA device where one exists (``gpu``)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from kvpool.client.connectors.store import LazyStore
from kvpool.client.connectors.vllm_layers import CopyStream, LayerLayout, StagingPool
from kvpool.client.connectors.vllm_layerwise import LayerSet, LoadJob, SaveJob

NUM_BLOCKS = 64
LAYERS = 4
log = logging.getLogger("test")

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="gpu: no CUDA device here (torch.cuda.is_available() is False)")])]


def caches(layout: str, device: str, seed: int = 0) -> list:
    """``LAYERS`` paged KV caches of random values in one of vLLM's layouts: ``cpu``
    (num_blocks, kv_heads, block_size, 2 * head_dim), ``flash`` (2, num_blocks, block_size,
    kv_heads, head_dim), ``hnd``: flash's shape as a permuted view (a stride order)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        if layout == "cpu":
            t = torch.randn(NUM_BLOCKS, 2, 16, 64, generator=g)
        elif layout == "flash":
            t = torch.randn(2, NUM_BLOCKS, 16, 2, 32, generator=g)
        else:
            t = torch.randn(2, NUM_BLOCKS, 2, 16, 32, generator=g).transpose(2, 3)
        out.append(t.to(device))
    return out


@pytest.mark.parametrize("layout", ["cpu", "flash", "hnd"])
def test_a_block_gathered_and_scattered_is_the_block(layout):
    src, dst = caches(layout, "cpu"), [torch.zeros_like(t) for t in caches(layout, "cpu")]
    ids = torch.tensor([5, 0, 63])
    for s, d in zip(src, dst):
        lay = LayerLayout.of("l", s, NUM_BLOCKS)
        rows = torch.empty(len(ids), lay.block_bytes, dtype=torch.uint8)
        lay.gather(s, ids, rows)
        lay.scatter(d, ids, rows)
        dim = lay.block_dim
        assert torch.equal(d.index_select(dim, ids), s.index_select(dim, ids))
        others = torch.tensor([i for i in range(NUM_BLOCKS) if i not in ids.tolist()])
        assert not d.index_select(dim, others).any()   # nothing else touched


def test_an_unknown_layout_is_refused_by_shape():
    with pytest.raises(ValueError, match=r"shape \(3, 64, 16\).*\(num_blocks, \.\.\.\)"):
        LayerLayout.of("model.layers.0.attn", torch.zeros(3, NUM_BLOCKS, 16), NUM_BLOCKS)


def _stack(device: str, cs: list, master: str, num_blocks: int = NUM_BLOCKS,
           transports: list[str] | None = None
           ) -> tuple[LazyStore, LayerSet, CopyStream, StagingPool]:
    store = LazyStore(master, replicas=0, transports=transports, timeout_s=2.0, retry_s=5.0,
                      log=log)
    layouts = [LayerLayout.of(f"model.layers.{i}.attn", t, num_blocks) for i, t in enumerate(cs)]
    stream = CopyStream(torch.device(device))
    return store, LayerSet(layouts, cs), stream, StagingPool(stream, store.register)


def _save(store, layers, stream, pool, keys, block_ids) -> SaveJob:
    job = SaveJob(keys, [None] + keys[:-1], block_ids, layers, stream, pool)
    for layer in range(len(layers.layouts)):   # as the forward pass reaches each layer
        job.stage(layer, in_forward=True)
    job.run(store)
    assert job.errors == [] and job.stored == len(keys) * layers.block_bytes
    return job


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layout", "transport"),
                         [("cpu", "shm"), ("flash", "shm"), ("hnd", "shm"), ("cpu", "tcp")])
def test_blocks_saved_layer_by_layer_load_layer_by_layer_elsewhere(kv_cluster, device, layout,
                                                                   transport):
    # shm: each layer written and read as a byte range of its objects; tcp: whole objects
    # (a node serves exactly the extents the master granted), copied layer by layer.
    c = kv_cluster()
    src = caches(layout, device)
    store, layers, stream, pool = _stack(device, src, c.master, transports=[transport])
    keys = [f"kvpool/vllm2/test/{layout}/{i}/0" for i in range(12)]
    saved_ids = list(range(10, 22))
    _save(store, layers, stream, pool, keys, saved_ids)

    # Another engine: other block ids, one key never stored (reported, nothing copied).
    dst = [torch.zeros_like(t) for t in src]
    store2, layers2, stream2, pool2 = _stack(device, dst, c.master, transports=[transport])
    load_ids = [60] + list(range(40, 52))
    job = LoadJob(["kvpool/vllm2/test/missing/0", *keys], load_ids, layers2, stream2, pool2,
                  verify=True, timeout_s=10.0)
    job.run(store2)     # the load thread's work, here inline
    for layer in range(LAYERS):
        job.wait_layer(layer)
    assert job.failed_blocks() == {60}
    for s, d, lay in zip(src, dst, layers.layouts):
        got = d.index_select(lay.block_dim, torch.tensor(load_ids[1:], device=device))
        want = s.index_select(lay.block_dim, torch.tensor(saved_ids, device=device))
        assert torch.equal(got, want)
        assert not d.index_select(lay.block_dim, torch.tensor([60], device=device)).any()
    store.close()
    store2.close()


def test_a_load_from_an_unreachable_store_gives_up_at_its_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]      # nobody listens there
    dst = caches("cpu", "cpu")
    store, layers, stream, pool = _stack("cpu", dst, f"127.0.0.1:{port}")
    before = [t.clone() for t in dst]
    job = LoadJob(["kvpool/vllm2/x/0"], [3], layers, stream, pool, verify=True, timeout_s=0.3)
    threading.Thread(target=job.run, args=(store,), daemon=True).start()
    t0 = time.monotonic()
    for layer in range(LAYERS):
        job.wait_layer(layer)
    assert job.failed_blocks() == {3}
    assert time.monotonic() - t0 < 1.5
    time.sleep(2.5)    # the load thread's calls time out meanwhile: still nothing copied
    assert all(torch.equal(a, b) for a, b in zip(before, dst))
    store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="gpu: no CUDA device here (torch.cuda.is_available() "
                    "is False)")
def test_gpu_to_store_to_gpu_throughput_against_torch_device_to_host(kv_cluster):
    """One prompt's blocks (128 blocks of a 16-layer cache) GPU -> kvpool -> GPU, against
    torch's own device-to-host copy of the same bytes, in the same run (printed)."""
    c = kv_cluster()
    src = [torch.randn(2, 256, 16, 8, 64, device="cuda") for _ in range(16)]
    dst = [torch.zeros_like(t) for t in src]
    ids = list(range(128))
    store, layers, stream, pool = _stack("cuda", src, c.master, num_blocks=256)
    layers2 = LayerSet(layers.layouts, dst)
    keys = [f"kvpool/vllm2/gpu/{i}/0" for i in ids]
    nbytes = len(ids) * layers.block_bytes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = [t[:, :128].to("cpu") for t in src]
    torch.cuda.synchronize()
    d2h_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _save(store, layers, stream, pool, keys, ids)
    save_s = time.perf_counter() - t0
    job = LoadJob(keys, ids, layers2, stream, pool, verify=False, timeout_s=30.0)
    t0 = time.perf_counter()
    job.run(store)
    for layer in range(len(layers2.layouts)):
        job.wait_layer(layer)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    assert job.failed_blocks() == set()
    assert all(torch.equal(a[:, :128], b[:, :128]) for a, b in zip(src, dst))
    print(f"\n{nbytes / 2**20:.0f} MiB: torch D2H {nbytes / d2h_s / 1e9:.2f} GB/s, "
          f"GPU->kvpool {nbytes / save_s / 1e9:.2f} GB/s, kvpool->GPU "
          f"{nbytes / load_s / 1e9:.2f} GB/s")
    del host
    store.close()


def test_staging_buffers_are_reused_and_pinned_only_for_a_gpu():
    registered = []
    pool = StagingPool(CopyStream(torch.device("cpu")), registered.append)
    a, b = pool.take(3 << 20), pool.take(1 << 20)
    assert a.numel() == 3 << 20 and b.numel() == 1 << 20 and not a.is_pinned()
    pool.give_back(a)
    pool.give_back(b)
    assert pool.take(1 << 20) is b      # the smallest that fits
    assert pool.take(2 << 20) is a
    assert len(registered) == 2         # each registered with the store once


def test_a_forward_pass_longer_than_the_put_timeout_is_saved_after_it(kv_cluster):
    # The reservation made at the first layer lapses while the (slow) layers run: the
    # objects are reserved again once every layer is staged, and written from staging.
    c = kv_cluster(master_args=["--put-timeout", "1s"])
    src = caches("cpu", "cpu")
    store, layers, stream, pool = _stack("cpu", src, c.master)
    keys = [f"kvpool/vllm2/slow/{i}/0" for i in range(4)]
    job = SaveJob(keys, [None] * 4, [1, 2, 3, 4], layers, stream, pool)
    saver = threading.Thread(target=job.run, args=(store,))
    saver.start()
    job.stage(0, in_forward=True)
    time.sleep(1.5)
    for layer in range(1, LAYERS):
        job.stage(layer, in_forward=True)
    saver.join(30)
    assert job.errors == [] and job.reserved_again
    dst = [torch.zeros_like(t) for t in src]
    store2, layers2, stream2, pool2 = _stack("cpu", dst, c.master)
    load = LoadJob(keys, [1, 2, 3, 4], layers2, stream2, pool2, verify=True, timeout_s=10.0)
    load.run(store2)
    assert load.failed_blocks() == set()
    assert all(torch.equal(s[1:5], d[1:5]) for s, d in zip(src, dst))
    store.close()
    store2.close()
