"""The rules of Idempotency-Key (services/gateway/idempotency.py): which keys are accepted,
what makes two requests the same call, how keys are scoped, and what a request does with a
key another request already claimed."""

import json

import pytest

from talaria.shared.catalog import BUILTIN_MODELS
from talaria.services.gateway.http_api import parse_request
from talaria.services.gateway.idempotency_rules import (
    ORPHANED,
    REPUBLISH_WITHIN_S,
    KeyDecision,
    IdempotencyRecord,
    check_key,
    decide,
    fingerprint,
    is_outcome_subject,
    key_from,
    key_subject,
    orphan_cancelled,
    outcome_subject,
    reply_call_id,
    waiting_subject,
)
from talaria.services.gateway.prepare import RequestError
from talaria.services.gateway.validation import decode
from talaria.shared import messages as m
from talaria.shared.wire import replace
from talaria.shared import subjects
from talaria.shared.nats_auth import permissions
from talaria.shared.settings import GatewaySettings, Settings, SettingsError
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names


def chat_call(headers=None, tenant="acme", **body):
    payload = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
               "temperature": 0, **body}
    parsed = parse_request(BUILTIN_MODELS, json.dumps(payload).encode(), True, headers or {}, tenant)
    assert not isinstance(parsed, m.ErrorReply), parsed
    return parsed[0]


@pytest.mark.parametrize("key", ["stainless-python-retry-1b4e28ba-2fa1-11d2-883f-0016d3cca427", "k", "x" * 255,
                                 "a key with spaces & {punctuation}: ok"])
def test_printable_bounded_keys_are_accepted(key):
    assert check_key(key) == key


@pytest.mark.parametrize("key", ["", "x" * 256, "nul\x00", "tab\t", "line\nbreak", "k\u00e9y", "\u2028", "del\x7f"])
def test_empty_long_or_unprintable_keys_are_a_400_naming_the_header(key):
    with pytest.raises(RequestError) as err:
        check_key(key)
    assert err.value.reply.status == 400 and err.value.reply.param == "Idempotency-Key"
    assert err.value.reply.code == "invalid_idempotency_key"


def test_the_header_is_read_case_insensitively_and_is_optional():
    assert key_from({"idempotency-key": "abc"}) == "abc"
    assert key_from({"Idempotency-Key": "abc"}) == "abc"
    assert key_from({"X-Session-Id": "s"}) is None


def test_the_nats_field_follows_the_same_rule():
    ok = decode(m.CALL_REQUEST_DECODER, b'{"model": "qwen3-tiny", "prompt": "x", "idempotency_key": "k-1"}')
    assert ok.idempotency_key == "k-1"
    for bad in ('""', '"nul\\u0000"', json.dumps("x" * 256)):
        with pytest.raises(RequestError) as err:
            decode(m.CALL_REQUEST_DECODER, b'{"model": "qwen3-tiny", "prompt": "x", "idempotency_key": %s}'
                   % bad.encode())
        assert err.value.reply.param == "idempotency_key" and err.value.reply.status == 400


def test_a_retry_has_the_fingerprint_of_its_original():
    """Ids, times, anonymous sessions and the delivery form are the gateway's, not the request's."""
    a, b = chat_call(), chat_call(stream=True)
    assert a.call_id != b.call_id and a.session_id != b.session_id  # two anonymous sessions
    assert fingerprint(a) == fingerprint(b)
    named = chat_call({"X-Session-Id": "s1"})
    assert fingerprint(named) == fingerprint(chat_call({"X-Session-Id": "s1"}))


@pytest.mark.parametrize("change", [
    {"messages": [{"role": "user", "content": "bye"}]}, {"max_tokens": 5}, {"temperature": 0.5}, {"seed": 7},
    {"stop": ["\n"]}, {"model": "gpt2-tiny"}, {"logit_bias": {"5": 1.0}}, {"logprobs": True},
])
def test_any_change_the_client_made_is_another_request(change):
    assert fingerprint(chat_call(**change)) != fingerprint(chat_call())


def test_a_named_session_and_the_api_are_part_of_the_request():
    assert fingerprint(chat_call({"X-Session-Id": "s1"})) != fingerprint(chat_call({"X-Session-Id": "s2"}))
    assert fingerprint(chat_call()) != fingerprint(replace(chat_call(), api="anthropic"))


def test_keys_are_scoped_to_the_tenant_and_hashed_into_one_subject_token():
    assert key_subject(DEP, "acme", "k") != key_subject(DEP, "globex", "k")
    assert key_subject(DEP, "acme", "k") == key_subject(DEP, "acme", "k")
    token = key_subject(DEP, "acme", "a.b *>\x00").rsplit(".", 1)[1]
    assert subjects.valid_token(token) and len(token) == 64
    assert key_subject(DEP, "acme", "a.b").startswith(f"{DEP.idempotency_keys}.")


def test_kept_replies_are_reply_subjects_apart_from_every_gateway_inbox():
    s = outcome_subject(DEP, "tenant-a", "c1")
    assert is_outcome_subject(s) and s.startswith(f"{DEP.reply_prefix}.gateway.")
    assert not is_outcome_subject(DEP.reply_inbox("gateway", "0123abcd") + ".c1")
    assert not is_outcome_subject(None)


RECORD = IdempotencyRecord("c1", "fp", deadline_at=1000.0, created_at=900.0)
RESULT = m.CallResult("c1", "s", 0, "qwen3-tiny", "agent-0", "hi", "stop", m.Usage(1, 1, 2), m.Timings())


def test_a_different_request_under_a_claimed_key_is_refused_even_after_it_completed():
    assert decide(RECORD, "other", None, 910.0) is KeyDecision.MISMATCH
    assert decide(RECORD, "other", RESULT, 910.0) is KeyDecision.MISMATCH


def test_a_completed_call_is_replayed_even_after_its_deadline():
    assert decide(RECORD, "fp", RESULT, 910.0) is KeyDecision.REPLAY
    assert decide(RECORD, "fp", RESULT, 5000.0) is KeyDecision.REPLAY


def test_a_failed_attempt_is_taken_over():
    failed = m.ErrorReply(503, "instance_lost", "gone", retry_after_s=1.0, call_id="c1")
    assert decide(RECORD, "fp", failed, 910.0) is KeyDecision.TAKE_OVER
    assert decide(RECORD, "fp", None, RECORD.deadline_at) is KeyDecision.TAKE_OVER  # no answer by its deadline


def test_a_cancelled_attempt_is_taken_over_never_replayed():
    """A call cancelled because its clients left (or on a cancel) never completed: a retry runs it
    anew instead of getting the 499, even well before the deadline."""
    for reason in (ORPHANED, "client disconnected"):
        cancelled = m.ErrorReply(m.CANCELLED_STATUS, "cancelled", f"cancelled: {reason}", call_id="c1")
        assert decide(RECORD, "fp", cancelled, RECORD.created_at + 1.0) is KeyDecision.TAKE_OVER


def test_a_cancel_for_want_of_waiters_is_told_apart_from_other_ends():
    """The agent answers `cancelled: <reason>`; only the orphan's reason sends a retry that had
    attached just too late back to claim the key again."""
    assert orphan_cancelled(m.ErrorReply(m.CANCELLED_STATUS, "cancelled", f"cancelled: {ORPHANED}"))
    assert not orphan_cancelled(m.ErrorReply(m.CANCELLED_STATUS, "cancelled", "cancelled: client disconnected"))
    assert not orphan_cancelled(m.ErrorReply(503, "instance_lost", ORPHANED))
    assert not orphan_cancelled(RESULT)
    assert subjects.valid_token(waiting_subject(DEP, "tenant-a", "c1").rsplit(".", 1)[1])
    assert not is_outcome_subject(waiting_subject(DEP, "tenant-a", "c1"))  # core NATS: not kept by the stream


def test_the_orphan_grace_defaults_above_the_sdks_longest_retry_and_is_never_negative():
    # openai / anthropic SDKs: backoff at most 8 s, then a 5 s connect timeout
    assert GatewaySettings().idempotent_orphan_s >= 8.0 + 5.0
    assert Settings.from_env({"TALARIA_IDEMPOTENT_ORPHAN_S": "0.5"}).gateway.idempotent_orphan_s == 0.5
    with pytest.raises(SettingsError) as err:
        Settings.from_env({"TALARIA_IDEMPOTENT_ORPHAN_S": "-1"})
    assert err.value.variable == "TALARIA_IDEMPOTENT_ORPHAN_S"


def test_a_running_call_is_attached_to_and_a_young_claim_resubmitted():
    assert decide(RECORD, "fp", None, RECORD.created_at + 1.0) is KeyDecision.ATTACH_REPUBLISH
    old = RECORD.created_at + REPUBLISH_WITHIN_S
    assert decide(RECORD, "fp", None, old) is KeyDecision.ATTACH  # outside JetStream's duplicate window: never


def test_the_window_must_outlast_the_call_timeout():
    with pytest.raises(SettingsError) as err:
        Settings.from_env({"TALARIA_CALL_TIMEOUT_S": "600", "TALARIA_IDEMPOTENCY_WINDOW_S": "600"})
    assert err.value.variable == "TALARIA_IDEMPOTENCY_WINDOW_S"
    assert Settings.from_env({"TALARIA_IDEMPOTENCY_WINDOW_S": "3600"}).gateway.idempotency_window_s == 3600


def test_only_the_gateway_may_claim_keys_and_read_kept_replies():
    gateway = permissions("gateway")
    assert "talaria.idem.key.*" in gateway["publish"]["allow"]
    assert "$JS.API.STREAM.MSG.GET.TALARIA_IDEMPOTENCY" in gateway["publish"]["allow"]
    # who waits for a keyed call: gateways answer probes there and probe it
    assert "talaria.idem.waiting.*" in gateway["publish"]["allow"]
    assert "talaria.idem.waiting.*" in gateway["subscribe"]["allow"]
    for role in ("router", "telemetry", "client"):
        allowed = permissions(role)["publish"]["allow"] + permissions(role)["subscribe"]["allow"]
        assert not any("idem" in s or "IDEMPOTENCY" in s for s in allowed), role
    assert not any("TALARIA_" in s for s in permissions("gateway", "blue")["publish"]["allow"]
                   if not s.startswith("_TALARIA_INBOX."))  # services' inboxes are shared by name


def test_a_kept_answer_and_its_waiters_are_scoped_to_the_tenant():
    """Clients may choose call ids: tenant b reusing tenant a's id must neither overwrite a's kept
    answer (a's retry would replay b's) nor answer the probes for a's call."""
    assert outcome_subject(DEP, "tenant-a", "c1") != outcome_subject(DEP, "tenant-b", "c1")
    assert waiting_subject(DEP, "tenant-a", "c1") != waiting_subject(DEP, "tenant-b", "c1")
    assert outcome_subject(DEP, "tenant-a", "c1") == outcome_subject(DEP, "tenant-a", "c1")


def test_a_reply_names_its_call_on_an_inbox_and_on_a_kept_subject():
    assert reply_call_id(DEP.reply_inbox("gateway", "0123abcd") + ".c-1") == "c-1"
    assert reply_call_id(outcome_subject(DEP, "tenant-a", "c-1")) == "c-1"
