"""The lookup port's sessions (master/lookup_sessions.py) and seals (net/lookup_port.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool.common.security import Identity
from kvpool.master.lookup_sessions import LookupSessions
from kvpool.net import lookup_port

ALICE, BOB = Identity("client", "alice"), Identity("client", "bob")


def test_a_session_is_found_until_its_end_and_names_who_opened_it(clock):
    sessions = LookupSessions(ttl_s=60.0, per_identity=8, clock=clock)
    sid, session = sessions.open(ALICE)
    assert len(sid) == lookup_port.SESSION_ID_BYTES and len(session.key) == 32
    assert sessions.find(sid) is session and session.identity == ALICE
    assert sessions.find(os.urandom(lookup_port.SESSION_ID_BYTES)) is None
    clock.advance(59.9)
    assert sessions.find(sid) is session and not sessions.ended(session)
    clock.advance(0.1)
    assert sessions.find(sid) is None and sessions.ended(session)


def test_one_identity_holds_a_bounded_number_and_its_ended_ones_go(clock):
    sessions = LookupSessions(ttl_s=60.0, per_identity=3, clock=clock)
    alices = [sessions.open(ALICE)[0] for _ in range(5)]
    bob = sessions.open(BOB)[0]
    # Alice's two oldest were dropped for her newest; Bob's is not hers to lose.
    assert [sessions.find(s) is not None for s in alices] == [False, False, True, True, True]
    assert sessions.find(bob) is not None
    clock.advance(61)
    sessions.open(ALICE)
    assert len(sessions._of[ALICE]) == 1 and len(sessions._by_id) == 2   # hers ended, went


@given(bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=6))
def test_what_one_end_seals_the_other_opens_in_order_and_nothing_else(bodies):
    key, client_salt, server_salt = os.urandom(32), os.urandom(16), os.urandom(16)
    client_out, client_in = lookup_port.session_seals(key, client_salt, server_salt,
                                                      server=False)
    server_out, server_in = lookup_port.session_seals(key, client_salt, server_salt,
                                                      server=True)
    for i, body in enumerate(bodies):
        frame = client_out.seal(lookup_port.REQUEST, lookup_port.MAGIC, 1 + i % 8, body=body)
        head, sealed = frame[:lookup_port.REQUEST.size], frame[lookup_port.REQUEST.size:]
        assert lookup_port.REQUEST.unpack(head)[2] == len(body) + lookup_port.TAG_BYTES
        assert server_in.open(head, sealed) == body
        answer = server_out.seal(lookup_port.RESPONSE, 0, body=body[::-1])
        assert client_in.open(answer[:8], answer[8:]) == body[::-1]


def test_a_frame_opens_once_in_its_direction_on_its_connection_only():
    key, salts = os.urandom(32), (os.urandom(16), os.urandom(16))

    def pair():
        client = lookup_port.session_seals(key, *salts, server=False)
        return client, lookup_port.session_seals(key, *salts, server=True)

    def split(frame):
        return frame[:lookup_port.REQUEST.size], frame[lookup_port.REQUEST.size:]

    (client_out, _), (server_out, server_in) = pair()
    frame = client_out.seal(lookup_port.REQUEST, lookup_port.MAGIC, 1, body=b"x")
    assert server_in.open(*split(frame)) == b"x"
    with pytest.raises(lookup_port.Unsealed):   # the same frame again
        server_in.open(*split(frame))
    (_, _), (server_out, server_in) = pair()
    with pytest.raises(lookup_port.Unsealed):   # the other direction's
        server_in.open(*split(server_out.seal(lookup_port.REQUEST, lookup_port.MAGIC, 1,
                                              body=b"x")))
    other_out, _ = lookup_port.session_seals(key, os.urandom(16), salts[1], server=False)
    (_, _), (_, server_in) = pair()
    with pytest.raises(lookup_port.Unsealed):   # another connection's
        server_in.open(*split(other_out.seal(lookup_port.REQUEST, lookup_port.MAGIC, 1,
                                             body=b"x")))
