"""The gateway's engine list and engine pool (load, down and up again), and its reading of vLLM's
/metrics: pure, on a fake clock."""

from __future__ import annotations

import dataclasses

import pytest
from kvpool.client.router import Candidate
from kvpool.gateway.engines import (
    EnginePool,
    EngineSpec,
    EngineSpecError,
    check_roles,
    parse_engines,
)
from kvpool.gateway.probes import reported_queue
from kvpool.gateway.routing import least_loaded
from kvpool.master.calibration import CostCalibrator, Rates
from kvpool.master.routing import Candidate as MasterCandidate
from kvpool.master.routing import RouteQuery, RoutingIndex, make_policy


def test_engines_are_named_by_their_id_or_their_host_and_port():
    assert parse_engines("a=http://10.0.0.5:8000, 10.0.0.6:8001,http://[::1]:9000/") == [
        EngineSpec("a", "http://10.0.0.5:8000"),
        EngineSpec("10.0.0.6:8001", "http://10.0.0.6:8001"),
        EngineSpec("[::1]:9000", "http://[::1]:9000")]


@pytest.mark.parametrize("text, message", [
    ("", "no engines given"),
    ("http://host", "expected [ID=]http://HOST:PORT"),
    ("ftp://host:1", "expected [ID=]http://HOST:PORT"),
    ("http://host:1/v1", "expected [ID=]http://HOST:PORT"),
    ("http://host:99999", "expected [ID=]http://HOST:PORT"),
    ("a=http://h:1,a=http://h:2", "an engine id is listed twice"),
    ("http://h:1,b=http://h:1", "an engine URL is listed twice"),
])
def test_bad_engine_lists_are_explained(text, message):
    with pytest.raises(EngineSpecError, match=message.replace("[", r"\[")):
        parse_engines(text)


def disaggregated(prefill: str, decode: str) -> list[EngineSpec]:
    return check_roles(parse_engines(prefill, "prefill") + parse_engines(decode, "decode"))


def test_prefill_and_decode_engines_keep_their_roles():
    assert [(s.instance_id, s.role) for s in disaggregated("p=h:1,h:2", "d=h:3")] == [
        ("p", "prefill"), ("h:2", "prefill"), ("d", "decode")]


@pytest.mark.parametrize("specs, message", [
    (lambda: parse_engines("h:1", "prefill"),
     "needs both prefill and decode engines: prefill engines given, no --decode"),
    (lambda: parse_engines("h:1", "decode"), "no --prefill engines"),
    (lambda: parse_engines("h:1") + parse_engines("h:2", "prefill")
     + parse_engines("h:3", "decode"), "cannot be mixed"),
    (lambda: parse_engines("a=h:1", "prefill") + parse_engines("b=h:1", "decode"),
     "an engine URL is listed twice: http://h:1 .*colocated"),
    (lambda: parse_engines("a=h:1", "prefill") + parse_engines("a=h:2", "decode"),
     "an engine id is listed twice: a"),
])
def test_bad_prefill_and_decode_lists_are_explained(specs, message):
    with pytest.raises(EngineSpecError, match=message):
        check_roles(specs())


def test_decode_engines_are_chosen_by_their_requests_and_route_sees_prefill_engines(clock):
    p = EnginePool(disaggregated("p0=h:1,p1=h:2", "d0=h:3,d1=h:4"), clock=clock)
    assert p.disaggregated and not pool(clock).disaggregated
    assert [c.instance_id for c in p.candidates(role="prefill")] == ["p0", "p1"]
    t = p.sent("d0", 0)
    p.first_token("d0", t)          # still generating: busy, though its prefill is done
    assert p.least_busy("decode") == "d1"
    p.reported("d1", 3)             # other clients' requests there
    assert p.least_busy("decode") == "d0"
    p.failed("d0")
    assert p.least_busy("decode") == "d1"
    assert p.least_busy("decode", exclude=["d1"]) is None


def pool(clock, n=2):
    return EnginePool([EngineSpec(f"e{i}", f"http://h:{i + 1}") for i in range(n)],
                      backoff_s=1.0, max_backoff_s=4.0, clock=clock)


def test_load_counts_requests_in_flight_and_prompt_tokens_until_their_first_token(clock):
    p = pool(clock)
    t1 = p.sent("e0", 300)
    t2 = p.sent("e0", 100)
    assert p.candidates() == [Candidate("e0", 2, 400), Candidate("e1", 0, 0)]
    p.first_token("e0", t1)            # prefilled: its prompt is done, it still runs there
    assert p.candidates()[0] == Candidate("e0", 2, 100, decoding_requests=1)
    assert p["e0"].inflight == 2
    p.done("e0", t1)
    p.done("e0", t2)                   # ended before a first token (an error): gone too
    assert p.candidates()[0] == Candidate("e0", 0, 0) and p["e0"].inflight == 0


def test_the_engines_own_report_counts_when_it_sees_more(clock):
    p = pool(clock)
    p.sent("e0", 10)
    p.reported("e0", 5)        # other clients' requests too (not waiting on the gateway)
    assert p.candidates()[0].queue_depth == 5
    assert p.candidates()[0].decoding_requests == 4
    p.reported("e0", 0)        # a scrape older than the gateway's own request
    assert p.candidates()[0].queue_depth == 1


def test_requests_generating_on_one_engine_send_the_next_to_another(clock):
    """Both engines done prefilling: the one with a request still generating is the busier
    (they tied before, and Route's tie-break sent every request to the first engine)."""
    p = pool(clock)
    t = p.sent("e0", 50)
    p.first_token("e0", t)
    assert least_loaded(p.candidates()).instance_id == "e1"


def test_a_request_not_streamed_counts_as_generating_and_teaches_no_rate(clock):
    """Its answer comes whole, so its first token is never seen: while it runs it counts as
    generating (it may be), and its end is not a first token to calibrate from."""
    calibrator = CostCalibrator(Rates(8000.0, 80000.0), clock=clock)
    p = EnginePool([EngineSpec("e0", "http://h:1")], clock=clock, calibrator=calibrator)
    t = p.sent("e0", 10, seen=False)
    assert p.candidates()[0] == Candidate("e0", 1, 10, decoding_requests=1)
    clock.advance(3.0)                 # 450 tokens generated
    p.first_token("e0", t)
    p.done("e0", t)
    assert calibrator.estimate("e0").accepted == 0
    assert p.candidates()[0] == Candidate("e0", 0, 0)


def test_the_masters_policy_sends_the_next_request_past_one_generating(clock):
    """e0 measured a little faster at prefill (calibration noise on two equal engines) and
    busy generating: the master's default policy sends a short prompt to the idle e1 (it sent it
    to e0 before: the faster score won among scores within the slack)."""
    calibrator = CostCalibrator(Rates(8000.0, 80000.0), clock=clock)
    p = EnginePool([EngineSpec(f"e{i}", f"http://h:{i + 1}") for i in range(2)], clock=clock,
                   calibrator=calibrator)
    for _ in range(20):                     # 500 tokens/s and 550 tokens/s
        calibrator.observe("e0", 55, 0, 0.1)
        calibrator.observe("e1", 50, 0, 0.1)
    t = p.sent("e0", 50)
    p.first_token("e0", t)
    index = RoutingIndex(clock)
    query = RouteQuery(tuple(range(3)), 40, 16)
    candidates = [MasterCandidate(**dataclasses.asdict(c)) for c in p.candidates()]
    assert candidates[0].prefill_tokens_per_s > candidates[1].prefill_tokens_per_s > 0
    assert index.route(query, candidates, make_policy("kvpool")).instance_id == "e1"
    # Without the generating request e0 wins on its score: what decides is the count.
    idle = [dataclasses.replace(c, queue_depth=0, decoding_requests=0) for c in candidates]
    assert index.route(query, idle, make_policy("kvpool")).instance_id == "e0"


def test_a_failed_engine_is_offered_to_no_request_until_a_probe_finds_it_healthy(clock):
    p = pool(clock)
    assert p.failed("e0") is True
    assert p.failed("e0") is False     # already down: not announced twice
    assert [c.instance_id for c in p.candidates()] == ["e1"]
    assert [c.instance_id for c in p.candidates(exclude=["e1"])] == []
    assert p.due_for_probe() == []
    clock.advance(2.0)                 # the second failure doubled the back-off to 2 s
    assert p.due_for_probe() == ["e0"]
    p.failed("e0")                     # the probe failed: 4 s (the maximum) before the next
    clock.advance(3.9)
    assert p.due_for_probe() == []
    clock.advance(0.1)
    assert p.due_for_probe() == ["e0"]
    assert p.healthy("e0") is True and p.healthy("e0") is False
    assert [c.instance_id for c in p.candidates()] == ["e0", "e1"]
    p.failed("e0")                     # a new failure starts from the first back-off again
    assert p["e0"].retry_at == clock.now + 1.0


def test_vllm_metrics_give_running_plus_waiting_over_every_rank():
    page = b"\n".join([
        b"# HELP vllm:num_requests_running Number of requests in model execution batches.",
        b'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        b'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0',
        b'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
        b'vllm:num_requests_waiting{engine="1",model_name="m"} nonsense',
    ])
    assert reported_queue(page) == 6
    assert reported_queue(b"") == 0
