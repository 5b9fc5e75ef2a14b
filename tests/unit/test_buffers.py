import numpy as np
import pytest
from kvpool.client.buffers import byte_view, unfilled_bytes
from kvpool.common.errors import InvalidArgument


def test_views_share_memory():
    ba = bytearray(b"abcdef")
    v = byte_view(ba, writable=True)
    v[0] = ord("z")
    assert ba[0] == ord("z")
    arr = np.zeros((4, 4), dtype=np.float16)
    v = byte_view(arr, writable=True)
    assert v.nbytes == arr.nbytes and v.format == "B"
    v[:2] = b"\x00\x3c"          # 1.0 in float16, little endian
    assert arr[0, 0] == 1.0
    assert byte_view(memoryview(ba)[1:4], writable=False).tobytes() == b"bcd"
    assert byte_view(b"xyz", writable=False).tobytes() == b"xyz"


def test_rejections():
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        byte_view(np.zeros((4, 4))[:, 1], writable=False)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        byte_view(ro, writable=True)
    with pytest.raises(InvalidArgument, match="read-only"):
        byte_view(b"abc", writable=True)
    with pytest.raises(InvalidArgument, match="unsupported value type"):
        byte_view("a string", writable=False)
    with pytest.raises(InvalidArgument, match="contiguous"):
        byte_view(memoryview(bytearray(8))[::2], writable=False)


def test_torch_tensors_any_dtype_zero_copy():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install '.[torch]')")
    t = torch.zeros(8, dtype=torch.bfloat16)
    v = byte_view(t, writable=True)
    assert v.nbytes == 16
    v[:2] = torch.tensor([2.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert t[0].item() == 2.0            # written through the view: no copy was made
    with pytest.raises(InvalidArgument, match="contiguous"):
        byte_view(torch.zeros(4, 4).t(), writable=False)
    with pytest.raises(InvalidArgument, match="requires grad"):
        byte_view(torch.zeros(4, requires_grad=True), writable=True)


def test_writable_rows_only_for_one_contiguous_writable_2d_array():
    from kvpool.client.buffers import writable_rows
    a = np.zeros((4, 16), dtype=np.float32)
    assert writable_rows(a) == (a.ctypes.data, 64)
    assert writable_rows(a[:, :8]) is None            # strided rows
    assert writable_rows(a.reshape(-1)) is None       # not rows
    assert writable_rows([*a]) is None                # a list of rows: one view each
    assert writable_rows(np.zeros((4, 0))) is None
    ro = a.copy()
    ro.flags.writeable = False
    assert writable_rows(ro) is None
    torch = pytest.importorskip("torch")
    t = torch.zeros((3, 5), dtype=torch.bfloat16)
    assert writable_rows(t) == (t.data_ptr(), 10)
    assert writable_rows(t.t()) is None


@pytest.mark.parametrize("nbytes", [0, 1, 4096, (1 << 20) + 3])
def test_unfilled_bytes_are_a_new_bytes_filled_through_their_view(nbytes):
    """What batch_get returns: a bytes object of its own (never a shared one, not even the
    empty singleton written into), each byte the one written through the view."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    out, view = unfilled_bytes(nbytes)
    assert type(out) is bytes and len(out) == nbytes and view.nbytes == nbytes
    assert not view.readonly
    np.frombuffer(view, dtype=np.uint8)[:] = data
    assert out == data.tobytes()
    again, _ = unfilled_bytes(nbytes)
    assert nbytes == 0 or again is not out
