"""Wire codecs: every event round-trips, unknown tags and bad fields fail clearly."""

import msgspec
import pytest

from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    CallStarted,
    CallSubmitted,
    CandidateCost,
    EVENT_DECODER,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoundSummary,
    RoutingDecision,
    SwitchDone,
)
from talaria.shared.messages import CALL_REQUEST_DECODER, ErrorReply, REPLY_DECODER
from talaria.shared.wire import encode
from talaria.shared import subjects
from talaria.shared.session_slots import slot_of
from talaria.shared.bus import event_msg_id, event_subject
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names


def submitted(**kw):
    base = dict(call_id="c1", session_id="s1", model="qwen3-tiny", prompt_ids=[256, 104, 105],
                block_hashes=[], max_tokens=8, submitted_at=1.0)
    base.update(kw)
    return CallSubmitted(**base)


EVENTS = [
    submitted(),
    CallRouted(call=submitted(), call_index=0, instance_id="agent-0", policy="talaria", routed_at=2.0),
    CallStarted("c1", "s1", "agent-0", 3.0),
    CallCompleted("c1", "s1", 0, "qwen3-tiny", "agent-0", 3, 4, "length", 1.0, 2.0, 2.5, 3.0),
    CallFailed("c1", "s1", "qwen3-tiny", "boom", "agent", 3.0),
    LeaseIssued("s1", "qwen3-tiny", "agent-0", "c1", 3.0, 4.0),
    LeaseConsumed("s1", "qwen3-tiny", "agent-0", "c2", 3.5),
    LeaseDiscarded("s1", "qwen3-tiny", "agent-0", "c2", "expired", 5.0),
    LeaseExpired("s1", "qwen3-tiny", "agent-0", 4.0),
    RoutingDecision("c1", "s1", 0, "qwen3-tiny", "talaria", "route", 2.0, chosen="agent-0",
                      candidates=[CandidateCost("agent-0", 0.1, queue_s=0.1)]),
    SwitchDone("agent-0", None, "qwen3-tiny", "host_only", 0.2, 2.0, phases={"open_weights": 0.1}),
    RoundSummary("agent-0", 1, 1.0, 0.8, 0.2, 3.0),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips_through_the_union_decoder(event):
    assert EVENT_DECODER.decode(encode(event)) == event


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_has_a_subject_under_the_stream(event):
    assert event_subject(DEP, event).startswith("talaria.evt.")


def test_routed_calls_go_to_their_instance_subject():
    routed = EVENTS[1]
    assert event_subject(DEP, routed) == DEP.call_routed("agent-0")
    assert event_msg_id(routed) == "CallRouted:c1"


def test_unknown_event_tag_is_a_decode_error_not_a_crash():
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'call.exploded'"):
        EVENT_DECODER.decode(b'{"type": "call.exploded"}')


def test_wrong_field_type_names_the_field():
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_tokens"):
        CALL_REQUEST_DECODER.decode(b'{"model": "qwen3-tiny", "prompt": "x", "max_tokens": "many"}')


def test_new_fields_have_defaults_so_old_producers_still_decode():
    old = b'{"type":"call.completed","call_id":"c","session_id":"s","call_index":0,"model":"m",' \
          b'"instance_id":"i","prompt_tokens":1,"output_tokens":1,"finish_reason":"stop",' \
          b'"submitted_at":0,"started_at":0,"first_token_at":0,"completed_at":0}'
    event = EVENT_DECODER.decode(old)
    assert event.kv_source == "none" and event.cached_tokens == 0


def test_reply_union_distinguishes_results_from_errors():
    err = ErrorReply(503, "no_capacity", "busy", retry_after_s=1.0)
    assert REPLY_DECODER.decode(encode(err)) == err


def test_subject_tokens_reject_separators_and_wildcards():
    assert subjects.valid_token("abc-123_x")
    for bad in ("a.b", "a*", ">", "a b", ""):
        assert not subjects.valid_token(bad)


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_an_events_subject_is_its_tag_under_the_deployment(event):
    """Subjects come from the message tags: the subject constants and the tags never disagree."""
    constant = {"call.submitted": DEP.event("call.submitted"), "call.started": DEP.event("call.started"),
                "call.completed": DEP.event("call.completed"), "call.failed": DEP.event("call.failed"),
                "lease.issued": DEP.event("lease.issued"), "lease.consumed": DEP.event("lease.consumed"),
                "lease.discarded": DEP.event("lease.discarded"), "lease.expired": DEP.event("lease.expired"),
                "decision": DEP.event("decision"), "switch.done": DEP.event("switch.done"),
                "round.summary": DEP.event("round.summary")}
    tag = type(event).__struct_config__.tag
    if tag == "call.routed":
        assert event_subject(DEP, event) == DEP.call_routed(event.instance_id)
    elif tag == "call.submitted":  # on its session's slot: router partitions consume slots
        assert event_subject(DEP, event) == DEP.call_submitted(slot_of(event.session_id))
    else:
        assert event_subject(DEP, event) == constant[tag]
