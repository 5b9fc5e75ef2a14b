"""DRAM segments in huge pages (``--hugepages``): the operator's reserved pages, refused with
what to do where there are not enough; where they exist, served like any DRAM segment."""

from __future__ import annotations

import mmap
import os

import pytest
from kvpool.common.errors import InvalidArgument
from kvpool.store_node.memory import DramSegment, check_hugepages

SIZE = 4 << 20   # two 2 MiB pages


def meminfo(tmp_path, total: int, free: int, page_kb: int = 2048) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 1000 kB\nHugePages_Total: {total}\nHugePages_Free: {free}\n"
                    f"Hugepagesize: {page_kb} kB\n")
    return str(path)


def test_check_hugepages_says_what_is_missing_and_what_to_reserve(tmp_path):
    check_hugepages([SIZE, SIZE], meminfo(tmp_path, 8, 4))               # exactly enough
    with pytest.raises(InvalidArgument, match=r"need 4 huge pages of 2 MiB and this host "
                                              r"has 3 free.*vm\.nr_hugepages=9"):
        check_hugepages([SIZE, SIZE], meminfo(tmp_path, 8, 3))
    with pytest.raises(InvalidArgument, match="not a whole number of 2 MiB huge pages"):
        check_hugepages([SIZE + 4096], meminfo(tmp_path, 8, 8))
    (tmp_path / "none").write_text("MemTotal: 1000 kB\n")
    with pytest.raises(InvalidArgument, match="reports no huge pages"):
        check_hugepages([SIZE], str(tmp_path / "none"))


def _free_pages_reason() -> str:
    try:
        check_hugepages([SIZE])
    except InvalidArgument as e:
        return str(e)
    return ""


@pytest.mark.skipif(bool(_free_pages_reason()), reason=f"hugepages: {_free_pages_reason()}")
def test_a_hugepage_segment_is_shared_through_its_fd_like_any_dram_segment():
    seg = DramSegment("n1/0-huge", SIZE, hugepages=True)
    try:
        data = os.urandom(SIZE)
        seg.buffer[:] = data
        # A same-host client maps the fd it is handed, as the shm transport does.
        client = mmap.mmap(seg.fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            assert client[:] == data
            client[:5] = b"hello"
            assert bytes(seg.buffer[:5]) == b"hello"
        finally:
            client.close()
        with open("/proc/self/smaps") as f:   # the node's own mapping: 2 MiB pages
            smaps = f.read()
        entry = smaps[smaps.index("kvpool:n1/0-huge"):]
        assert "KernelPageSize:     2048 kB" in entry[:entry.index("VmFlags")]
    finally:
        seg.close()
