"""The lookup port's sessions (net/lookup_port.py, "Sessions"): a random id and key that a
peer gets over authenticated gRPC (``OpenLookupSession``) and then opens lookup connections
with, acting as the identity that opened it. Kept in the master's memory only: a restarted
master (or another one, after a failover) knows none, and its clients open new ones."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.common.security import Identity
from kvpool.net import lookup_port


@dataclass(slots=True)
class LookupSession:
    identity: Identity
    key: bytes = field(repr=False)
    ends_at: float    # on the master's monotonic clock


class LookupSessions:
    """The open sessions, each lasting ``ttl_s``, at most ``per_identity`` of one identity's
    (opening another drops its oldest; connections already open on that one last until its
    end: every client process opens one per master and renews it before its end);
    ``clock``: monotonic seconds (MasterConfig ``lookup_session_ttl_s``,
    ``max_lookup_sessions_per_identity``)."""

    def __init__(self, ttl_s: float, per_identity: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self._per_identity, self._clock = ttl_s, per_identity, clock
        self._by_id: dict[bytes, LookupSession] = {}
        # Each identity's session ids, oldest first.
        self._of: dict[Identity, OrderedDict[bytes, None]] = {}

    def open(self, identity: Identity) -> tuple[bytes, LookupSession]:
        """A new session of ``identity``: (its id, the session)."""
        now = self._clock()
        ids = self._of.setdefault(identity, OrderedDict())
        while ids:   # its ended sessions first, then its oldest past the bound
            oldest = next(iter(ids))
            if self._by_id[oldest].ends_at > now and len(ids) < self._per_identity:
                break
            del ids[oldest], self._by_id[oldest]
        session_id = os.urandom(lookup_port.SESSION_ID_BYTES)
        session = LookupSession(identity, os.urandom(32), now + self.ttl_s)
        self._by_id[session_id], ids[session_id] = session, None
        return session_id, session

    def find(self, session_id: bytes) -> LookupSession | None:
        """The session of this id if it has not ended, else None."""
        session = self._by_id.get(session_id)
        return session if session is not None and session.ends_at > self._clock() else None

    def ended(self, session: LookupSession) -> bool:
        return session.ends_at <= self._clock()
