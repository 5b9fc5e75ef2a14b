"""The pyverbs glue shared by the rdma transport and the store node: devices, memory regions,
RC queue pairs. Imports pyverbs at import time, so import this module only where RDMA is wanted
(``kvpool.client`` never imports it eagerly); :func:`probe` answers "is there RDMA here?"
without raising.

Written against Debian bookworm's python3-pyverbs (rdma-core 44), whose enums module is
``pyverbs.enums``; newer rdma-core renamed it ``pyverbs.libibverbs_enums`` (same names).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

try:
    import pyverbs.enums as e
except ImportError:   # rdma-core >= ~50
    import pyverbs.libibverbs_enums as e

from kvpool.common.errors import InvalidArgument, TransportError

LOCAL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE
REMOTE_ACCESS = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
                 | e.IBV_ACCESS_REMOTE_WRITE)
# A granted region (store_node/rdma.py): remote reads only, or remote writes only (verbs asks
# local write of any region remote writes may reach).
REMOTE_READ_ONLY = e.IBV_ACCESS_REMOTE_READ
REMOTE_WRITE_ONLY = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
# RC retransmission: local ACK timeout 4.096 us * 2**17 ~= 0.54 s per try, 7 retries. Generous
# because soft-RoCE under emulation can stall for hundreds of ms; a dead node is detected
# sooner through the handshake connection's EOF (see rdma.py), not through these retries.
ACK_TIMEOUT = 17
RETRY_COUNT = 7
RNR_RETRY = 7
MAX_RD_ATOMIC = 16      # outstanding RDMA READs per QP, each direction (rxe allows up to 128)
MIN_RNR_TIMER = 12

# Work-completion statuses that mean "the remote side refused this address or key": the
# descriptor is wrong (bad rkey, range outside the region), not the node.
REMOTE_REFUSALS = frozenset({e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_REM_INV_REQ_ERR})
FLUSHED = e.IBV_WC_WR_FLUSH_ERR      # not executed: an earlier WR put the QP in error
SUCCESS = e.IBV_WC_SUCCESS
RDMA_READ = e.IBV_WR_RDMA_READ
RDMA_WRITE = e.IBV_WR_RDMA_WRITE
SIGNALED = e.IBV_SEND_SIGNALED


def _name(dev) -> str:
    return dev.name.decode() if isinstance(dev.name, bytes) else dev.name


def device_names() -> list[str]:
    """The RDMA devices on this host, [] where there are none (or no RDMA in the kernel)."""
    try:
        return [_name(d) for d in get_device_list()]
    except PyverbsError:
        return []


def probe() -> str:
    """"" if RDMA can be used here, else why not (for skip reasons and log lines)."""
    return "" if device_names() else "no RDMA device on this host"


def buffer_address(view: memoryview) -> int:
    """The address of a contiguous, non-empty buffer's first byte (read-only buffers too)."""
    # numpy resolves any buffer's address; ctypes.from_buffer refuses read-only ones.
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@dataclass(frozen=True, slots=True)
class QPInfo:
    """One side of the queue-pair handshake (see kvpool.net.data_port CONNECT_QP)."""

    qp_num: int
    psn: int
    gid: str
    mtu: int      # verbs enum: 1..5 = 256..4096 bytes


class Device:
    """An opened RDMA device port: context, protection domain, GID. Not thread-safe to close."""

    def __init__(self, name: str | None = None, *, port: int = 1,
                 gid_index: int | None = None) -> None:
        names = device_names()
        if not names:
            raise TransportError("no RDMA device on this host")
        if name is not None and name not in names:
            raise InvalidArgument(f"RDMA device {name!r} not found; devices here: "
                                  f"{', '.join(names)}")
        self.name = name or names[0]
        self.port = port
        self.ctx = Context(name=self.name)
        try:
            attr = self.ctx.query_port(port)
            self.mtu = int(attr.active_mtu)
            self.max_msg_bytes = int(attr.max_msg_sz)   # rxe: 8 MiB
            self.gid_index, self.gid = _pick_gid(self.ctx, port, attr.gid_tbl_len, gid_index)
            self.pd = PD(self.ctx)
        except BaseException:
            self.ctx.close()
            raise

    def register(self, address: int, length: int, access: int = REMOTE_ACCESS) -> MR:
        """Register caller-owned memory (pinned until the MR is closed)."""
        return MR(self.pd, length, access, address=address)

    def register_dmabuf(self, fd: int, length: int, access: int = REMOTE_ACCESS,
                        offset: int = 0) -> MR:
        """Register ``length`` bytes of a dma-buf (e.g. GPU memory exported by its driver)
        from ``offset``. pyverbs passes the dma-buf offset as the region's I/O virtual
        address: remote reads and writes address the dma-buf's byte k as ``k`` (from
        ``offset`` on). Raises PyverbsError where the device or its driver cannot
        (EOPNOTSUPP on soft-RoCE, and on NICs without peer-memory support)."""
        from pyverbs.mr import DmaBufMR
        return DmaBufMR(self.pd, length, access, dmabuf=fd, offset=offset)

    def create_qp(self, depth: int) -> tuple[QP, CQ]:
        """An RC queue pair (in RESET) with its own completion queue of ``depth`` entries."""
        cq = CQ(self.ctx, depth)
        try:
            cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
        except BaseException:
            cq.close()
            raise
        return qp, cq

    def local_info(self, qp: QP) -> QPInfo:
        return QPInfo(qp.qp_num, random.randrange(1 << 24), self.gid, self.mtu)

    def connect(self, qp: QP, local: QPInfo, remote: QPInfo) -> None:
        """RESET -> INIT -> RTR -> RTS, towards ``remote``."""
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=self.port)
        attr.pkey_index = 0
        attr.qp_access_flags = REMOTE_ACCESS
        qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT
                  | e.IBV_QP_ACCESS_FLAGS)
        attr = QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT,
                      path_mtu=min(self.mtu, remote.mtu))
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = MAX_RD_ATOMIC
        attr.min_rnr_timer = MIN_RNR_TIMER
        route = GlobalRoute(dgid=GID(remote.gid), sgid_index=self.gid_index, hop_limit=64)
        attr.ah_attr = AHAttr(gr=route, is_global=1, port_num=self.port)
        qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
                  | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
        attr = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RTR)
        attr.sq_psn = local.psn
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_COUNT
        attr.rnr_retry = RNR_RETRY
        attr.max_rd_atomic = MAX_RD_ATOMIC
        qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT
                  | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)

    def close(self) -> None:
        """Close the PD and context (pyverbs closes their QPs, CQs and MRs first)."""
        self.ctx.close()


_MAX_GIDS_SCANNED = 128   # rxe reports 1024 entries; the populated ones come first


def _pick_gid(ctx: Context, port: int, table_len: int, wanted: int | None) -> tuple[int, str]:
    """The GID to use: ``wanted`` if given, else the first IPv4-mapped (RoCE v2) one, else the
    first non-zero one."""
    gids = []
    for index in range(min(table_len, _MAX_GIDS_SCANNED)):
        try:
            gid = str(ctx.query_gid(port, index))
        except PyverbsError:
            continue
        if gid.replace("0", "").replace(":", ""):
            gids.append((index, gid))
    if wanted is not None:
        found = dict(gids).get(wanted)
        if found is None:
            raise InvalidArgument(f"GID index {wanted} is not populated on port {port}")
        return wanted, found
    for index, gid in gids:
        if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return index, gid
    if not gids:
        raise TransportError(f"port {port} has no GID (is the link up?)")
    return gids[0]


def post_rdma(qp: QP, wr_id: int, opcode: int, local_addr: int, length: int, lkey: int,
              remote_addr: int, rkey: int) -> None:
    """Post one signaled RDMA READ or WRITE work request."""
    wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(local_addr, length, lkey)],
                send_flags=SIGNALED)
    wr.set_wr_rdma(rkey, remote_addr)
    qp.post_send(wr)
