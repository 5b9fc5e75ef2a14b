"""The object index: entries by key, PENDING from PutStart, COMPLETE from PutEnd, with the
versions that tell one object of a key from the next."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.common import checksum
from kvpool.common.errors import KVPoolError, NotPending, ObjectNotFound
from kvpool.common.tenants import validate_stored_key as validate_key  # keys as stored
from kvpool.common.types import Extent, ObjectRecord, ObjectState
from kvpool.master.quotas import TenantUsage

PENDING, COMPLETE = ObjectState.PENDING, ObjectState.COMPLETE


# (segment id, size): what an entry's first replica shares with every other entry of that
# size in that segment (KV blocks mostly have one size): one tuple, not two slots each.
Place = tuple[str, int]
_places: dict[Place, Place] = {}
_MAX_PLACES = 1 << 16


def _place(segment_id: str, size: int) -> Place:
    place = (segment_id, size)
    shared = _places.get(place)
    if shared is None:
        if len(_places) >= _MAX_PLACES:
            return place   # not shared: correct, 64 bytes more for this entry
        shared = _places[place] = place
    return shared


class ObjectEntry:
    """One index entry, kept small: a master indexes millions of them. The first replica lives
    inline (``place``: its segment id and the size, shared; ``offset``; every replica is
    ``size`` bytes long); the index keeps further ones aside (``ObjectIndex.more``) and builds
    the Extents on demand (``ObjectIndex.replicas``)."""

    # ``seal``: PENDING until PutEnd seals the object with its checksum: the CRC-32C of the
    # bytes as the writer computed it, None if it did not. One slot says both (``state``,
    # ``checksum``): a PENDING object has no checksum yet. ``lease``: its read lease, (cap,
    # end), one tuple shared by the objects a lookup leased (master/leases.py); None: none.
    # A slot of its own: a lookup reads it with the entry (in a dict beside the index, a
    # lookup's probes of it and the closing of leases missed the cache twice more a key).
    # No slot for what few objects have, each kept aside by its owner: further replicas
    # (ObjectIndex.more), the block this one extends (from PutStart to PutEnd only:
    # ObjectIndex.parents), a hard pin (master/pins.py). A slot costs every object 8 bytes,
    # and pymalloc rounds an entry up to 16: six slots are 80.
    __slots__ = ("key", "place", "version", "offset", "seal", "lease")

    def __init__(self, key: str, size: int, version: int, segment_id: str, offset: int,
                 seal: int | None | ObjectState = PENDING) -> None:
        self.key, self.version, self.offset, self.seal = key, version, offset, seal
        self.place = _place(segment_id, size)
        self.lease: tuple[float, float] | None = None

    @property
    def size(self) -> int:
        return self.place[1]

    @property
    def segment_id(self) -> str:
        """The first replica's segment ("" once every replica is gone)."""
        return self.place[0]

    def __repr__(self) -> str:
        return (f"ObjectEntry({self.key!r}, size={self.size}, version={self.version}, "
                f"segment_id={self.segment_id!r}, offset={self.offset}, seal={self.seal!r})")

    @property
    def state(self) -> ObjectState:
        return PENDING if self.seal is PENDING else COMPLETE

    @property
    def checksum(self) -> int | None:
        seal = self.seal
        return None if seal is PENDING else seal

    def record(self, e: Extent, parent: str | None, pinned: bool) -> ObjectRecord:
        """What the manifest of ``e``'s node holds of this object (``parent``: the key it
        extends, named so that a restarted master links the chain again; ``pinned``: whether
        it is hard-pinned)."""
        return ObjectRecord(self.key, e.segment_id, e.offset, self.size, self.checksum,
                            self.version, parent, pinned)


@dataclass(frozen=True, slots=True)
class LocatedColumns:
    """:meth:`MasterState.locate_columns`' answer: per key (in request order) its size,
    version, encoded checksum (common/checksum.py) and replica count, all 0 for a key in
    ``errors``; then per replica, key by key, its segment id and offset."""

    errors: dict[int, KVPoolError]   # position in the request -> why that key was not found
    sizes: list[int]
    versions: list[int]
    checksums: list[int]
    counts: list[int]
    segment_ids: list[str]
    offsets: list[int]
    # How long the shortest lease granted by this lookup runs (a lease capped by max_lease_s
    # runs less than lease_ttl_s: master/leases.py); None: lease_ttl_s.
    lease_s: float | None = None


class ObjectIndex:
    """Entries by key, the count of PENDING ones, and the read counters."""

    def __init__(self, tenants: TenantUsage | None = None) -> None:
        self.objects: dict[str, ObjectEntry] = {}
        self.tenants = tenants if tenants is not None else TenantUsage()
        self.pending = 0
        self.hits = self.misses = 0
        self.hit_bytes = 0                 # sizes of the objects found by lookups
        self.committed = self.committed_bytes = 0   # puts completed (PutEnd), their sizes
        self._versions = itertools.count(1)
        # PENDING entry -> the key of the block it extends, from PutStart until PutEnd hands
        # it to the eviction policy (take_parent) or the entry leaves the index.
        self.parents: dict[ObjectEntry, str] = {}
        # Entry -> its replicas past the first, for the objects that have several.
        self.more: dict[ObjectEntry, tuple[Extent, ...]] = {}

    def replicas(self, obj: ObjectEntry) -> list[Extent]:
        """``obj``'s extents, in mounted segments only: dropped segments are stripped."""
        sid, size = obj.place
        if not sid:
            return []
        first = Extent(sid, obj.offset, size)
        more = self.more.get(obj) if self.more else None
        return [first, *more] if more else [first]

    def set_replicas(self, obj: ObjectEntry, extents: Sequence[Extent]) -> None:
        first = extents[0] if extents else Extent("", 0, obj.size)
        obj.place, obj.offset = _place(first.segment_id, obj.size), first.offset
        if len(extents) > 1:
            self.more[obj] = tuple(extents[1:])
        elif self.more:
            self.more.pop(obj, None)

    def add(self, key: str, size: int, extents: Sequence[Extent], version: int | None = None,
            state: ObjectState = PENDING, checksum: int | None = None,
            parent: str | None = None, fresh_version: int | None = None) -> ObjectEntry:
        """Index ``key`` at ``extents`` with a new version, or with ``version`` (announced
        after a restart: new ones come after it), or with ``fresh_version`` (one that
        :meth:`new_version` handed out, shared by the objects of one PutStart)."""
        if fresh_version is not None:
            version = fresh_version
        elif version is None:
            version = next(self._versions)
        else:
            self._versions = itertools.count(max(next(self._versions), version + 1))
        obj = self.objects[key] = ObjectEntry(key, size, version, extents[0].segment_id,
                                              extents[0].offset,
                                              PENDING if state is PENDING else checksum)
        if len(extents) > 1:
            self.more[obj] = tuple(extents[1:])
        if state is PENDING:
            self.pending += 1
        if parent:
            self.parents[obj] = parent
        self.tenants.added(key, size)
        return obj

    def take_parent(self, obj: ObjectEntry) -> str | None:
        """The parent ``obj`` was put with (None: none), forgotten from now on."""
        return self.parents.pop(obj, None) if self.parents else None

    def new_version(self) -> int:
        return next(self._versions)

    def rename(self, obj: ObjectEntry, key: str, size: int) -> None:
        """A PENDING slot is ``key``'s object of ``size`` bytes from now on (its writer filled
        it: MasterState.put_end ``as_keys``)."""
        del self.objects[obj.key]
        self.tenants.removed(obj.key, obj.size)
        obj.key, obj.place = key, _place(obj.segment_id, size)
        self.objects[key] = obj
        self.tenants.added(key, size)

    def commit(self, obj: ObjectEntry, checksum: int | None) -> None:
        obj.seal = checksum
        self.pending -= 1
        self.committed += 1
        self.committed_bytes += obj.place[1]

    def discard(self, obj: ObjectEntry) -> None:
        """Forget ``obj`` (its replicas too: read them first)."""
        del self.objects[obj.key]
        self.tenants.removed(obj.key, obj.size)
        if self.more:
            self.more.pop(obj, None)
        if obj.state is PENDING:
            self.pending -= 1
            if self.parents:
                self.parents.pop(obj, None)

    def complete(self, key: str) -> ObjectEntry:
        """The COMPLETE entry of ``key``; ObjectNotFound (readers never see PENDING ones)."""
        return self._in_state(key, COMPLETE, ObjectNotFound, "not found")

    def pending_entry(self, key: str) -> ObjectEntry:
        """The PENDING entry of ``key`` (a put in progress); NotPending otherwise."""
        return self._in_state(key, PENDING, NotPending,
                              "is not being put (timed out, revoked or complete)")

    def _in_state(self, key: str, state: ObjectState, error: type[KVPoolError], what: str
                  ) -> ObjectEntry:
        obj = self.objects.get(key) if isinstance(key, str) else None
        if obj is None or obj.state is not state:
            if obj is None:
                validate_key(key)   # only a miss can be malformed: indexed keys were validated
            raise error(f"{key!r} {what}")
        return obj

    def get_many(self, keys: Sequence[str]) -> list[ObjectEntry | None]:
        """Each key's entry (None: not indexed), as ``list(map(objects.get, keys))`` but
        faster on a request's fresh strs: their hashes are computed first, in a loop of their
        own, so the probes then run back to back and the CPU overlaps their cache misses
        (index slot, entry, stored key, object: at 1M objects a key's probe is memory
        misses). A lookup of 256 keys at 1M objects: 245-297 -> 137-191 us, each call
        after 64 MiB of other memory traffic. TypeError if a key is unhashable."""
        deque(map(hash, keys), 0)   # computed once, kept in each str
        return list(map(self.objects.get, keys))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [isinstance(k, str) and (o := self.objects.get(k)) is not None
                and o.state is COMPLETE for k in keys]

    def columns(self, objs: list[ObjectEntry | None], found: list[ObjectEntry],
                errors: dict[int, KVPoolError], lease_s: float | None = None
                ) -> LocatedColumns:
        """``objs`` (None where ``errors`` explains a miss; ``found``: the others) in columns,
        by comprehensions, not a tuple per key: a lookup of a prompt is hundreds."""
        present = checksum.PRESENT   # checksum.encode, inlined
        # Every object found is COMPLETE: its seal is its checksum (read as the slot, not the
        # property, on this path).
        places = [o.place for o in found]   # the slots, not the properties, on this path
        if errors:   # a miss holds zeros (and no replica) in its slot
            sizes = [0 if o is None else o.place[1] for o in objs]
            versions = [0 if o is None else o.version for o in objs]
            sums = [0 if o is None or o.seal is None else present | o.seal for o in objs]
        else:
            sizes = [p[1] for p in places]
            versions = [o.version for o in found]
            sums = [0 if o.seal is None else present | o.seal for o in found]
        more = self.more
        if more and any(o in more for o in found):   # extra replicas (rare): key by key
            counts = [0 if o is None else 1 + len(more.get(o, ())) for o in objs]
            segment_ids, offsets = [], []
            for o in found:
                segment_ids.append(o.segment_id)
                offsets.append(o.offset)
                segment_ids += [e.segment_id for e in more.get(o, ())]
                offsets += [e.offset for e in more.get(o, ())]
        else:
            counts = [0 if o is None else 1 for o in objs] if errors else [1] * len(found)
            segment_ids = [p[0] for p in places]
            offsets = [o.offset for o in found]
        return LocatedColumns(errors, sizes, versions, sums, counts, segment_ids, offsets,
                              lease_s)
