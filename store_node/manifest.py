"""A store node's manifest: the committed objects its segments hold, as the master told it.

The master pushes what it committed in and dropped from the node's segments on the node's
manifest stream (``ManifestDelta``; master/manifest_watch.py), and a put is answered once the
node has applied its commit. When a master restarts with an empty index, the node re-announces
the manifest and the master indexes the objects again at exactly these extents.

The manifest lives in the node's memory, next to the segments it describes: it has to survive
a master restart, not a node restart (the segments are anonymous shared memory and go with the
node). What it can miss: a commit the master answered without the node's acknowledgement (the
node took longer than MAX_WAIT_S) and then died; such an object is lost as a cache entry,
never served wrong.

It also keeps the master's reservations (``Reservation``): space handed to a put still being
written, or freed while a reader may still copy from it. A restarted master learns them with
the announcement and keeps that space out of reuse until each ends, so a writer or reader of
the master that died never meets an object of the new one.

A writer hands the node its put too, on the data path (net/data_port.py RESERVE and SEAL), so
that the master need not wait for this node's acknowledgement before answering: before writing,
the writer reserves its extent (refused unless the grant's master epoch is the node's current
master's: a late writer of a dead master is fenced here, never in reused space); after writing,
it seals the record, checked against the bytes' CRC-32C. A sealed record is a commit pending the
master's word: it is announced like a committed one (a restarted master indexes it, so a put
acknowledged without this node's acknowledgement is not lost), and becomes committed when the
master's commit arrives or a restarted master indexes it. It never ends by time alone (a
master may be down longer than any hold): a seal the master never committed (its put timed
out) goes when its space is given to another object (a reservation or record overlapping it),
or when a restarted master refuses it.

A trusted shm writer seals a slot put on its seal board instead (net/seal_board.py): the cell
it names in the slot's RESERVE is bound here to the slot's place, and a filled cell is taken as
a SEAL when it must be (before the epoch changes, when the cell is bound again, when its
writer's connection closes); the master's commit at that place, or a reservation there, voids
it.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.common.types import ObjectRecord, Reservation
from kvpool.net import seal_board
from kvpool.net.shm_index import IndexWriter

PRUNE_EVERY_S = 1.0


class StaleEpoch(Exception):
    """A writer's reservation or seal granted by a master that is not this node's current one."""


class SealConflict(Exception):
    """A seal refused: its space was released (the master quarantined it), or it fills a slot
    with a key this node holds another record of."""


class Board:
    """One writer connection's seal board as the node holds it: its memfd, the shared
    mapping, and the cells bound to slots (index -> _Cell)."""

    def __init__(self, fd: int, buf) -> None:
        self.fd, self.buf = fd, buf
        self.cells: dict[int, _Cell] = {}

    def close(self) -> None:
        self.buf.close()
        os.close(self.fd)


@dataclass(slots=True)
class _Cell:
    board: Board
    index: int
    epoch: int      # of the master that granted the slot
    version: int    # the slot's, which its put seals
    segment_id: str
    offset: int
    size: int       # the slot's: a seal longer than that is not taken


class Manifest:
    """Thread-safe ``key -> ObjectRecord`` of one node, one record per (segment, offset)."""

    def __init__(self, clock=time.monotonic, index: IndexWriter | None = None) -> None:
        self._lock = threading.Lock()
        # The committed records in shared memory, for same-host gets (net/shm_index.py):
        # kept here, under this lock, so that an entry is void before the node acknowledges
        # or answers anything that lets its space be written.
        self.index = index
        self._by_key: dict[str, ObjectRecord] = {}
        self._by_place: dict[tuple[str, int], str] = {}
        self._bytes: dict[str, int] = {}   # segment id -> bytes of its committed objects
        # Space a restarted master must not reuse yet, by place (``until`` on ``clock``).
        self._reserved: dict[tuple[str, int], Reservation] = {}
        self._clock = clock
        self._pruned = clock()
        # Sealed records the master has not confirmed yet, by key, and by segment as sorted
        # (offset, key) (confirmations come in batches: thousands may wait at a time).
        self._sealed: dict[str, ObjectRecord] = {}
        self._sealed_at: dict[str, list[tuple[int, str]]] = {}
        # The current master's epoch (MountSegmentResponse.epoch); 0 until a master is known.
        self._epoch = 0
        # Seal-board cells bound to slots, by the slot's place.
        self._cells: dict[tuple[str, int], _Cell] = {}

    def set_epoch(self, epoch: int) -> None:
        """The node mounted on a master of this epoch: writers of any other are refused from
        now on. Under the lock that :meth:`reservations` takes, so that what a recovering
        node announces holds every reservation taken under the previous epoch, and every
        seal filled on a board under it."""
        with self._lock:
            if epoch != self._epoch:
                for board in {id(c.board): c.board for c in self._cells.values()}.values():
                    self._take_board(board, unbind=True)
            self._epoch = epoch

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self._epoch or not epoch:
            raise StaleEpoch(f"granted by master epoch {epoch:#x}; this node's master is "
                             f"{self._epoch:#x}")

    def reserve(self, epoch: int, res: Reservation, version: int = 0,
                cell: tuple[Board, int] | None = None) -> None:
        """A writer's reservation of its extent (``until`` on this manifest's clock), taken
        before it writes; StaleEpoch if its master is not the current one. A committed record
        at the same place is stale (its removal was lost), as is a sealed one overlapping.
        ``cell``: (board, index) the writer will seal this slot's put in (of ``version``)."""
        with self._lock:
            self._check_epoch(epoch)
            place = (res.segment_id, res.offset)
            self._reserved[place] = res
            if self.index is not None:
                self.index.overwritten(res.segment_id, res.offset, res.size)
            stale = self._by_place.get(place)
            if stale is not None and stale != res.key:
                self._drop(stale)
            self._drop_sealed_overlapping(res.segment_id, res.offset, res.size, res.key)
            self._void_cell(place)
            if cell is not None:
                board, index = cell
                self._take_board(board)   # the cell's last seal among them, if it had one
                if (bound := board.cells.get(index)) is not None:
                    self._void_cell((bound.segment_id, bound.offset))
                seal_board.clear(board.buf, index)
                board.cells[index] = self._cells[place] = _Cell(
                    board, index, epoch, version, res.segment_id, res.offset, res.size)

    def release_board(self, board: Board) -> None:
        """The board's writer is gone (its connection closed): its filled cells are seals."""
        with self._lock:
            self._take_board(board, unbind=True)

    def _take_board(self, board: Board, unbind: bool = False) -> None:
        """Take every filled cell of ``board`` as a seal (the same rules), in the order its
        writer filled them (a duplicate put of a key is refused only after the first one);
        ``unbind``: every other cell too."""
        filled = []
        for cell in list(board.cells.values()):
            got = seal_board.read(board.buf, cell.index)
            if got is not None:
                filled.append((got, cell))
            elif unbind:
                self._void_cell((cell.segment_id, cell.offset))
        for (_, key, length, crc, parent), cell in sorted(filled, key=lambda f: f[0][0]):
            self._void_cell((cell.segment_id, cell.offset))
            if 0 < length <= cell.size:
                with contextlib.suppress(StaleEpoch, SealConflict):
                    self._seal(cell.epoch, ObjectRecord(key, cell.segment_id, cell.offset,
                                                        length, crc, cell.version, parent))

    def _void_cell(self, place: tuple[str, int]) -> None:
        """The master's word on this place (its commit, or the space given again): a cell
        bound to it says nothing more."""
        cell = self._cells.pop(place, None)
        if cell is not None:
            del cell.board.cells[cell.index]
            seal_board.clear(cell.board.buf, cell.index)

    def seal(self, epoch: int, record: ObjectRecord) -> None:
        """A writer's record of the put it finished writing (its bytes checked by the caller),
        kept as a commit pending the master's word; StaleEpoch if its master is not the
        current one."""
        with self._lock:
            self._seal(epoch, record)

    def _seal(self, epoch: int, record: ObjectRecord) -> None:
        self._check_epoch(epoch)
        now = self._by_key.get(record.key)
        if now is not None and record.key not in self._sealed and \
                (now.version, now.segment_id, now.offset) == \
                (record.version, record.segment_id, record.offset):
            return   # the master's commit came first (a PutEnd sent beside the seal)
        res = self._reserved.get((record.segment_id, record.offset))
        if res is not None and res.key != record.key:
            if not res.key:
                raise SealConflict(f"{record.key!r}: the master released this space")
            # A slot, reserved under its placeholder: the master checks the key only as
            # the writer fills it (beside this seal). Another record of the key here
            # (another writer's) is not dropped for a put that may be refused.
            if now is not None and now.version != record.version:
                raise SealConflict(f"{record.key!r}: this node holds another record of "
                                   f"it (version {now.version})")
        self._drop_sealed_overlapping(record.segment_id, record.offset, record.size,
                                      record.key)
        self._add(record)
        self._sealed[record.key] = record
        bisect.insort(self._sealed_at.setdefault(record.segment_id, []),
                      (record.offset, record.key))

    def confirm(self, records: Iterable[ObjectRecord]) -> None:
        """A master indexed these records (announced): sealed ones are committed now."""
        with self._lock:
            for r in records:
                if self._by_key.get(r.key) == r and r.key in self._sealed:
                    self._unseal(r.key)
                    self._indexed(r)

    def sealed(self) -> list[ObjectRecord]:
        """The sealed records the master has not confirmed (yet)."""
        with self._lock:
            return list(self._sealed.values())

    def _drop_sealed_overlapping(self, segment_id: str, offset: int, size: int,
                                 key: str) -> None:
        places = self._sealed_at.get(segment_id)
        if not places:
            return
        # Seals do not overlap each other: only the one before ``offset`` can reach into it.
        i = max(bisect.bisect_left(places, (offset, "")) - 1, 0)
        hit = []
        while i < len(places) and places[i][0] < offset + size:
            other = places[i][1]
            r = self._sealed[other]
            if other != key and offset < r.offset + r.size:
                hit.append(other)
            i += 1
        for other in hit:
            self._drop(other)

    def _unseal(self, key: str) -> None:
        r = self._sealed.pop(key, None)
        if r is not None:
            places = self._sealed_at[r.segment_id]
            i = bisect.bisect_left(places, (r.offset, key))
            if i < len(places) and places[i] == (r.offset, key):
                del places[i]

    def __len__(self) -> int:
        return len(self._by_key)

    def apply(self, committed: Iterable[ObjectRecord], removed: Iterable[tuple[str, int]],
              reserved: Iterable[Reservation] = ()) -> None:
        """Apply one heartbeat's delta: reservations (a newer one at a place replaces the
        older), commits (each ends its put's reservation), then removals of the version named
        (so a key committed, removed and committed again in one interval keeps the last)."""
        with self._lock:
            for res in reserved:
                self._reserved[(res.segment_id, res.offset)] = res
                if self.index is not None:
                    self.index.overwritten(res.segment_id, res.offset, res.size)
                if self._sealed:
                    self._drop_sealed_overlapping(res.segment_id, res.offset, res.size, res.key)
                if self._cells:
                    self._void_cell((res.segment_id, res.offset))
            self._prune_reserved()
            for r in committed:
                if self._cells:
                    self._void_cell((r.segment_id, r.offset))
                res = self._reserved.get((r.segment_id, r.offset))
                if res is not None and res.key == r.key:
                    del self._reserved[(r.segment_id, r.offset)]
                self._add(r)   # the master's word: a sealed record is confirmed
                self._indexed(r)
            for key, version in removed:
                r = self._by_key.get(key)
                if r is not None and r.version == version:
                    self._drop(key)

    def close_index(self) -> None:
        """The node stops: its shm index is closed (between two changes), and no reader
        trusts it any more."""
        if self.index is not None:
            with self._lock:
                self.index.close()

    def _indexed(self, r: ObjectRecord) -> None:
        if self.index is not None:
            self.index.put(r.key, r.segment_id, r.offset, r.size, r.version, r.checksum)

    def held(self, segment_id: str, offset: int, within: int, version: int
             ) -> tuple[tuple[int, int], int] | None:
        """A READ_HELD's check (net/data_port.py): ``(token, size)`` if this node holds
        ``version`` of a key committed at ``offset`` of this segment, at most ``within`` bytes
        long, in a segment its index covers (the index's entries are the records no
        reservation has overlapped since), else None; :meth:`still_held` tells, given the
        token, whether it stood all along."""
        if self.index is None:
            return None
        with self._lock:
            key = self._by_place.get((segment_id, offset))
            return None if key is None else \
                self.index.holding(key, segment_id, offset, within, version)

    def still_held(self, token: tuple[int, int]) -> bool:
        return self.index is not None and self.index.unchanged(token)

    def overwriting(self, segment_id: str, offset: int, size: int) -> None:
        """The node itself is about to write this range (a move's destination): no index entry
        may stand there."""
        if self.index is not None:
            with self._lock:
                self.index.overwritten(segment_id, offset, size)

    def _add(self, r: ObjectRecord) -> None:
        self._drop(r.key)
        if self._sealed:   # a seal under a record of another key lost its space (revoked)
            self._drop_sealed_overlapping(r.segment_id, r.offset, r.size, r.key)
        # A record at the same place is stale: the master reused the space, so that
        # object's removal was lost (e.g. with a master that died).
        stale = self._by_place.get((r.segment_id, r.offset))
        if stale is not None:
            self._drop(stale)
        self._by_key[r.key] = r
        self._by_place[(r.segment_id, r.offset)] = r.key
        self._bytes[r.segment_id] = self._bytes.get(r.segment_id, 0) + r.size

    def forget(self, keys: Iterable[str]) -> None:
        """Drop these keys (the master refused them when they were announced)."""
        with self._lock:
            for key in keys:
                self._drop(key)

    def forget_records(self, records: Iterable[ObjectRecord]) -> None:
        """Drop these records, each only while it is the key's current one (a key committed
        again since keeps its new record)."""
        with self._lock:
            for r in records:
                if self._by_key.get(r.key) == r:
                    self._drop(r.key)

    def forget_segments(self, segment_ids: Iterable[str]) -> None:
        """Drop every record in these segments (their memory is gone)."""
        ids = set(segment_ids)
        with self._lock:
            for key in [k for k, r in self._by_key.items() if r.segment_id in ids]:
                self._drop(key)
            for place in [p for p in self._reserved if p[0] in ids]:
                del self._reserved[place]
            for place in [p for p in self._cells if p[0] in ids]:
                self._void_cell(place)

    def reservation_at(self, segment_id: str, offset: int) -> Reservation | None:
        """The reservation starting at ``offset`` of ``segment_id`` (a writer's slot: the
        data server checks a write or seal into it against it), or None."""
        return self._reserved.get((segment_id, offset))

    def reservations(self) -> list[Reservation]:
        """The reservations still running (``until`` on this manifest's clock)."""
        with self._lock:
            self._prune_reserved(force=True)
            return list(self._reserved.values())

    def _prune_reserved(self, force: bool = False) -> None:
        now = self._clock()
        if force or now - self._pruned >= PRUNE_EVERY_S:
            self._pruned = now
            for place in [p for p, r in self._reserved.items() if r.until <= now]:
                del self._reserved[place]

    def bytes_by_segment(self) -> dict[str, int]:
        """Bytes of the committed objects in each segment (object sizes, not aligned)."""
        with self._lock:
            return {sid: n for sid, n in self._bytes.items() if n}

    def get(self, key: str) -> ObjectRecord | None:
        """The record of ``key``, or None."""
        return self._by_key.get(key)

    def records(self) -> list[ObjectRecord]:
        """A snapshot, ordered by segment and offset."""
        with self._lock:
            return sorted(self._by_key.values(), key=lambda r: (r.segment_id, r.offset))

    def batches(self, size: int) -> list[Sequence[ObjectRecord]]:
        """The snapshot in batches of at most ``size`` records (one AnnounceObjects each)."""
        records = self.records()
        return [records[i:i + size] for i in range(0, len(records), size)]

    def _drop(self, key: str) -> None:
        self._unseal(key)
        if self.index is not None:
            self.index.remove(key)
        r = self._by_key.pop(key, None)
        if r is not None:
            self._by_place.pop((r.segment_id, r.offset), None)
            self._bytes[r.segment_id] -= r.size
