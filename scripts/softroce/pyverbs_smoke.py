#!/usr/bin/env python3
"""Smoke test of the VM's RDMA stack, independent of kvpool: one-sided READ/WRITE over pyverbs.

Run first by ``scripts/softroce/test.sh`` inside the VM, so that a broken image (kernel module,
rdma-core, pyverbs) is told apart from a kvpool bug, and to measure what the emulated fabric
does (``RESULT {...}`` line: MiB/s per op and message size; emulated, so correctness, not speed).

The client process spawns the server process (same script, --role server),
both open the RDMA device, allocate a PD, register an MR (32 MiB by default)
(LOCAL_WRITE|REMOTE_READ|REMOTE_WRITE), create an RC QP, exchange QP info
(qpn, psn, gid, MR addr/rkey) over a TCP socket, then the client does
RDMA READ and RDMA WRITE against the server's MR and verifies the bytes.
Finally it measures RDMA READ/WRITE throughput for 1 MiB and 4 MiB messages.
Verified with Debian bookworm python3-pyverbs (rdma-core 44). The enums fallback
matches rdma-core 59 (PyPI pyverbs 59.0), whose module was renamed.
"""
import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

try:
    import pyverbs.enums as e  # rdma-core <= ~50 (Debian bookworm: 44)
except ImportError:
    import pyverbs.libibverbs_enums as e  # newer rdma-core / PyPI pyverbs 59: same IBV_* names

MiB = 1 << 20
ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
RD_ATOMIC = 16


def log(role, *a):
    print(f"[{role} {time.monotonic():9.3f}]", *a, flush=True)


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def pick_gid(ctx, port=1):
    want = os.environ.get('RDMA_GID_INDEX')
    tbl = ctx.query_port(port).gid_tbl_len
    gids = []
    for i in range(tbl):
        try:
            g = str(ctx.query_gid(port, i))
        except Exception:  # noqa: BLE001, S112 - probe: an unreadable GID index is just skipped
            continue
        if g and g.replace('0', '').replace(':', ''):
            gids.append((i, g))
    if want is not None:
        return int(want), dict(gids)[int(want)]
    for i, g in gids:                  # prefer the IPv4-mapped (RoCEv2) GID
        if g.startswith('0000:0000:0000:0000:0000:ffff:'):
            return i, g
    return gids[0]


class Endpoint:
    def __init__(self, role, dev_name, size):
        self.role = role
        self.size = size
        names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in get_device_list()]
        if not names:
            raise SystemExit("no RDMA devices found")
        self.dev = dev_name or names[0]
        self.ctx = Context(name=self.dev)
        self.pd = PD(self.ctx)
        t0 = time.monotonic()
        self.mr = MR(self.pd, size, ACCESS)
        log(role, f"dev={self.dev} MR {size // MiB} MiB registered in {time.monotonic() - t0:.3f}s "
                  f"addr=0x{self.mr.buf:x} lkey=0x{self.mr.lkey:x} rkey=0x{self.mr.rkey:x}")
        self.cq = CQ(self.ctx, 256)
        cap = QPCap(max_send_wr=64, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.port_attr = self.ctx.query_port(1)
        self.gid_index, self.gid = pick_gid(self.ctx)
        self.psn = random.randrange(1 << 24)
        log(role, f"qpn={self.qp.qp_num} gid[{self.gid_index}]={self.gid} active_mtu={self.port_attr.active_mtu}")

    def info(self):
        return {"qpn": self.qp.qp_num, "psn": self.psn, "gid": self.gid, "addr": self.mr.buf,
                "rkey": self.mr.rkey, "size": self.size,
                "mtu": int(self.port_attr.active_mtu)}

    def connect(self, remote):
        a = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=1)
        a.pkey_index = 0
        a.qp_access_flags = ACCESS
        self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)

        a = QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT,
                   path_mtu=min(int(self.port_attr.active_mtu), remote['mtu']))
        a.dest_qp_num = remote['qpn']
        a.rq_psn = remote['psn']
        a.max_dest_rd_atomic = RD_ATOMIC
        a.min_rnr_timer = 12
        gr = GlobalRoute(dgid=GID(remote['gid']), sgid_index=self.gid_index, hop_limit=64)
        a.ah_attr = AHAttr(gr=gr, is_global=1, port_num=1)
        self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN |
                       e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)

        a = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RTR)
        a.sq_psn = self.psn
        a.timeout = 18          # 4.096us * 2^18 ~= 1s: generous, the VM runs under TCG
        a.retry_cnt = 7
        a.rnr_retry = 7
        a.max_rd_atomic = RD_ATOMIC
        self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT |
                       e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)
        log(self.role, "QP in RTS")

    # --- one-sided ops (client side) ----------------------------------------
    def post(self, opcode, wr_id, loff, roff, length, remote):
        sge = SGE(self.mr.buf + loff, length, self.mr.lkey)
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(remote['rkey'], remote['addr'] + roff)
        self.qp.post_send(wr)

    def wait(self, n, timeout=120.0):
        done, deadline = 0, time.monotonic() + timeout
        while done < n:
            k, wcs = self.cq.poll(num_entries=min(16, n - done))
            for wc in wcs[:k]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"WC error: status={wc.status} wr_id={wc.wr_id} vendor_err={wc.vendor_err}")
            done += k
            if k == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"only {done}/{n} completions")
        return done

    def transfer(self, opcode, length, remote, nbytes_total, chunk):
        """Move nbytes_total with WRs of `chunk` bytes, one after another."""
        off = 0
        while off < nbytes_total:
            n = min(chunk, nbytes_total - off)
            self.post(opcode, 0, off, off, n, remote)
            self.wait(1)
            off += n

    def bandwidth(self, opcode, msg, remote, seconds, depth):
        slots = max(1, min(self.size // msg, depth))
        posted = completed = 0
        t0 = time.monotonic()
        t_end = t0 + seconds
        while True:
            now = time.monotonic()
            while posted - completed < depth and (now < t_end or posted < 4):
                slot = posted % slots
                self.post(opcode, posted, slot * msg, slot * msg, msg, remote)
                posted += 1
            if completed == posted:
                break
            k, wcs = self.cq.poll(num_entries=16)
            for wc in wcs[:k]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"WC error status={wc.status}")
            completed += k
        dt = time.monotonic() - t0
        return completed, completed * msg / dt / MiB, dt


def send_json(sock, obj):
    sock.sendall((json.dumps(obj) + "\n").encode())


def recv_json(f):
    line = f.readline()
    if not line:
        raise ConnectionError("peer closed")
    return json.loads(line)


def server(args):
    ep = Endpoint('server', args.dev, args.size)
    t0 = time.monotonic()
    ep.mr.write(pattern(1, args.size), args.size, 0)
    log('server', f"filled MR with pattern(seed=1) in {time.monotonic() - t0:.2f}s")
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(('127.0.0.1', args.port))
    ls.listen(1)
    print("LISTENING", flush=True)
    s, _ = ls.accept()
    f = s.makefile('r')
    remote = recv_json(f)
    send_json(s, ep.info())
    ep.connect(remote)
    send_json(s, {"ready": True})
    while True:
        cmd = recv_json(f)
        if cmd['op'] == 'verify':
            t0 = time.monotonic()
            ok = ep.mr.read(cmd['len'], cmd['off']) == pattern(cmd['seed'], cmd['len'])
            log('server', f"verify write off={cmd['off']} len={cmd['len']}: {'OK' if ok else 'MISMATCH'} "
                          f"({time.monotonic() - t0:.2f}s)")
            send_json(s, {"ok": ok})
        elif cmd['op'] == 'done':
            send_json(s, {"bye": True})
            return 0


def client(args):
    srv = subprocess.Popen([sys.executable, os.path.abspath(__file__), '--role', 'server',
                            '--port', str(args.port), '--size', str(args.size)] +
                           (['--dev', args.dev] if args.dev else []),
                           stdout=subprocess.PIPE, text=True)
    for line in srv.stdout:                 # forward server output until it listens
        if line.strip() == "LISTENING":
            break
        print(line, end='', flush=True)
    threading.Thread(target=lambda: [print(l, end='', flush=True) for l in srv.stdout], daemon=True).start()

    ep = Endpoint('client', args.dev, args.size)
    s = socket.create_connection(('127.0.0.1', args.port))
    f = s.makefile('r')
    send_json(s, ep.info())
    remote = recv_json(f)
    ep.connect(remote)
    assert recv_json(f).get('ready')
    size = args.size
    failures = 0

    # 1) RDMA READ of the whole remote MR, one WR, verify
    t0 = time.monotonic()
    ep.transfer(e.IBV_WR_RDMA_READ, size, remote, size, size)
    dt = time.monotonic() - t0
    ok = ep.mr.read(size, 0) == pattern(1, size)
    failures += not ok
    log('client', f"RDMA READ  {size // MiB} MiB (1 WR): {'OK' if ok else 'MISMATCH'} in {dt:.2f}s = {size / dt / MiB:.1f} MiB/s")

    # 2) RDMA READ at an odd offset / odd length, verify
    off, ln = 12345, 3 * MiB + 77
    ep.mr.write(b'\0' * ln, ln, 0)
    ep.post(e.IBV_WR_RDMA_READ, 7, 0, off, ln, remote); ep.wait(1)
    ok = ep.mr.read(ln, 0) == pattern(1, size)[off:off + ln]
    failures += not ok
    log('client', f"RDMA READ  unaligned off={off} len={ln}: {'OK' if ok else 'MISMATCH'}")

    # 3) RDMA WRITE of the whole MR with a new pattern, server verifies
    ep.mr.write(pattern(2, size), size, 0)
    t0 = time.monotonic()
    ep.transfer(e.IBV_WR_RDMA_WRITE, size, remote, size, 4 * MiB)
    dt = time.monotonic() - t0
    send_json(s, {"op": "verify", "off": 0, "len": size, "seed": 2})
    ok = recv_json(f)['ok']
    failures += not ok
    log('client', f"RDMA WRITE {size // MiB} MiB (4 MiB WRs): {'OK' if ok else 'MISMATCH'} in {dt:.2f}s = {size / dt / MiB:.1f} MiB/s")

    # 4) throughput
    results = {}
    for opname, opcode in (('READ', e.IBV_WR_RDMA_READ), ('WRITE', e.IBV_WR_RDMA_WRITE)):
        for msg in args.msg_sizes:
            n, bw, dt = ep.bandwidth(opcode, msg, remote, args.seconds, args.depth)
            results[f"{opname}_{msg // 1024}KiB"] = round(bw, 1)
            log('client', f"BW RDMA {opname:5s} msg={msg // 1024:5d} KiB depth={args.depth}: "
                          f"{n} ops in {dt:.2f}s = {bw:.1f} MiB/s")
    send_json(s, {"op": "done"}); recv_json(f)
    srv.wait(timeout=30)
    print("RESULT " + json.dumps({"failures": failures, "bandwidth_MiBps": results}), flush=True)
    print("PYVERBS_RW_TEST " + ("PASSED" if failures == 0 and srv.returncode == 0 else "FAILED"), flush=True)
    return 1 if failures or srv.returncode else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--role', choices=['client', 'server'], default='client')
    p.add_argument('--dev', default=None)
    p.add_argument('--port', type=int, default=18515)
    p.add_argument('--size', type=int, default=32 * MiB)
    p.add_argument('--seconds', type=float, default=2.0)
    p.add_argument('--depth', type=int, default=8)
    p.add_argument('--msg-sizes', type=lambda s: [int(x) * 1024 for x in s.split(',')], default=[MiB, 4 * MiB],
                   help='KiB, comma separated')
    args = p.parse_args()
    sys.exit(server(args) if args.role == 'server' else client(args))


if __name__ == '__main__':
    main()
