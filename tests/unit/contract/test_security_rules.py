"""Security rules that need no server: key parsing and lookup, tenant scoping, the KV salt,
event ownership, NATS permissions, and settings errors that name the variable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from talaria.services.gateway.auth import KeyStore, Unauthenticated, client_session, kv_scope, scoped_session
from talaria.shared.api_keys import hash_key, read_key_file, write_key_file
from talaria.shared.events import CallCompleted, CallRouted, CallSubmitted
from talaria.shared.nats_auth import (
    ANSWERING_ROLES,
    SENDER_HEADER,
    STREAMING_ROLES,
    client_options,
    generate_users,
    owner_sender,
    permissions,
    reply_allowed,
    sent_by,
    trusted,
)
from talaria.shared.subjects import Deployment

tokens = Deployment().tokens
from talaria.shared.settings import GatewaySettings, Settings, SettingsError, redact_url
from talaria.shared.tokenizer import block_hashes


def test_keys_are_stored_hashed_and_bound_to_one_tenant(tmp_path):
    store = KeyStore.from_settings(GatewaySettings(api_keys=("acme:acme-key-0123456789",
                                                      f"beta:{hash_key('beta-key-0123456789')}")))
    assert "acme-key-0123456789" not in str(store.tenants)
    assert store.tenant_for({"Authorization": "Bearer acme-key-0123456789"}) == "acme"
    assert store.tenant_for({"x-api-key": "beta-key-0123456789"}) == "beta"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}, {"x-api-key": ""}):
        with pytest.raises(Unauthenticated):
            store.tenant_for(headers)
    assert KeyStore().tenant_for({}) == ""  # no keys configured: open, tenant ""
    path = tmp_path / "keys"
    write_key_file(path, [("acme", hash_key("k" * 20))])
    assert path.stat().st_mode & 0o777 == 0o600 and "k" * 20 not in path.read_text()
    assert read_key_file(path) == [("acme", hash_key("k" * 20))]


def test_session_ids_and_kv_are_scoped_by_tenant():
    assert scoped_session("a", "s") != scoped_session("b", "s")
    assert client_session("a", scoped_session("a", "x:y")) == "x:y" and scoped_session("", "s") == "s"
    ids = list(range(64))
    same = block_hashes(ids, 16, scope=kv_scope("tenant", "a", "a:s1"))
    assert same == block_hashes(ids, 16, scope=kv_scope("tenant", "a", "a:s2"))  # a tenant's sessions share
    assert not set(same) & set(block_hashes(ids, 16, scope=kv_scope("tenant", "b", "b:s1")))
    assert block_hashes(ids, 16, scope=kv_scope("global", "a", "a:s")) == block_hashes(ids, 16)
    assert kv_scope("session", "a", "a:s1") != kv_scope("session", "a", "a:s2")


def _msg(sender):
    return SimpleNamespace(headers={"Talaria-Sender": sender} if sender else None)


def test_events_are_trusted_only_from_their_owning_service():
    call = CallSubmitted("c", "s", "qwen3-tiny", [1], [], 1, 0.0)
    routed = CallRouted(call, 0, "agent-0", "talaria", 0.0)
    done = CallCompleted("c", "s", 0, "qwen3-tiny", "agent-0", 1, 1, "stop", 0.0, 0.0, 0.0, 0.0)
    assert trusted(_msg("talaria-router"), routed)
    assert not trusted(_msg("talaria-agent-agent-0"), routed) and not trusted(_msg(None), routed)
    assert trusted(_msg("talaria-agent-agent-0"), done)
    assert not trusted(_msg("talaria-agent-agent-1"), done)  # one agent cannot claim another's call
    assert not trusted(_msg("talaria-gateway"), done) and trusted(_msg("talaria-gateway"), call)
    assert trusted(_msg(owner_sender(done)), done) and trusted(_msg(owner_sender(routed)), routed)


def test_nats_clients_may_only_call_the_api_and_read_their_inboxes():
    client = permissions("client")
    # a call, and a cancel of a call by its id (issue 11; ids are random unless the client set them)
    assert client["publish"]["allow"] == ["talaria.api.call", "talaria.api.cancel"]
    assert not any(s.startswith(("talaria.evt", "$JS")) for s in client["subscribe"]["allow"])
    assert "talaria.evt.call.routed.*" in permissions("router")["publish"]["allow"]
    agent = permissions("agent", instance_id="agent-0")["publish"]["allow"]
    assert "talaria.telemetry.agent-0" in agent and not any("routed" in s or "submitted" in s for s in agent)
    with pytest.raises(ValueError):
        permissions("agent")
    # A tenant's client reads only its tenant's inboxes and token streams.
    acme = permissions("client", tenant="acme")
    assert acme["subscribe"]["allow"] == ["_INBOX.acme.>", "talaria.tokens.acme.>", "talaria.health.*"]
    assert acme["publish"] == client["publish"]
    blue = [s for role in ("gateway", "router", "telemetry", "client") for kind in ("publish", "subscribe")
            for s in permissions(role, "blue")[kind]["allow"]]
    assert not any(s.startswith("talaria.") or "TALARIA_EVENTS" in s for s in blue)  # deployments disjoint
    assert not any("STREAM.DELETE" in s or "STREAM.PURGE" in s or s == "$JS.API.>" for s in blue)


@pytest.mark.parametrize("env, variable", [
    ({"TALARIA_NATS_USER": "u"}, "TALARIA_NATS_PASSWORD"),
    ({"TALARIA_NATS_PASSWORD": "p"}, "TALARIA_NATS_USER"),
    ({"TALARIA_NATS_USER": "u", "TALARIA_NATS_PASSWORD": "p", "TALARIA_NATS_TOKEN": "t"}, "TALARIA_NATS_TOKEN"),
    ({"TALARIA_NATS_CREDS": "/no/such/file"}, "TALARIA_NATS_CREDS"),
    ({"TALARIA_API_KEYS": "acme:short"}, "TALARIA_API_KEYS"),
    ({"TALARIA_API_KEYS": "bad tenant:k-0123456789abcdef"}, "TALARIA_API_KEYS"),
    ({"TALARIA_API_KEYS": "acme:sha256:xyz"}, "TALARIA_API_KEYS"),
    ({"TALARIA_PREFIX_SHARING": "everyone"}, "TALARIA_PREFIX_SHARING"),
])
def test_security_settings_errors_name_the_variable(env, variable):
    with pytest.raises(SettingsError) as err:
        Settings.from_env(env)
    assert err.value.variable == variable
    assert "0123456789abcdef" not in str(err.value)  # a key never lands in an error message


def test_nats_credentials_reach_the_client_and_passwords_are_redacted():
    s = Settings.from_env({"TALARIA_NATS_USER": "router", "TALARIA_NATS_PASSWORD": "pw"})
    assert s.common.nats_options() == {"user": "router", "password": "pw"}
    assert Settings.from_env({"TALARIA_NATS_TOKEN": "t"}).common.nats_options() == {"token": "t"}
    assert redact_url("postgresql://talaria:secret@h:5/db") == "postgresql://talaria:***@h:5/db"


def test_nats_config_command_writes_private_users_for_an_external_nats(tmp_path):
    import json

    from talaria.cli import main

    assert main(["nats-config", str(tmp_path), "--agents", "a0"]) == 0
    conf = json.loads((tmp_path / "auth.conf").read_text())
    names = {u["user"] for u in conf["authorization"]["users"]}
    assert names == {"talaria-gateway", "talaria-router", "talaria-telemetry", "talaria-admin", "talaria-client",
                     "talaria-agent-a0"}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in tmp_path.iterdir())
    assert "TALARIA_NATS_USER=talaria-router" in (tmp_path / "router.env").read_text()


def test_with_tenants_every_nats_client_user_is_a_tenants_own():
    users = generate_users(["agent-0"], ["acme", "globex"])
    clients = {k: u for k, u in users.items() if u.role == "client"}
    assert set(clients) == {"client-acme", "client-globex"}  # no shared user that reads everyone's
    assert clients["client-acme"].options()["inbox_prefix"] == "_INBOX.acme"
    assert client_options("nats://talaria-client-acme:pw@127.0.0.1:4222") == {"inbox_prefix": "_INBOX.acme"}
    assert client_options("nats://127.0.0.1:4222") == {}
    assert tokens("acme", "c1") == "talaria.tokens.acme.c1" and tokens("", "c1") == "talaria.tokens._.c1"
    assert set(generate_users([])) == {"gateway", "router", "telemetry", "admin", "client"}  # open gateway: one client user


def test_only_the_admin_user_may_ask_the_routers_to_drain_and_it_reads_only_its_own_answers():
    admin, router = permissions("admin"), permissions("router")
    assert admin["publish"]["allow"] == ["talaria.admin.drain"] and admin["subscribe"]["allow"] == ["_TALARIA_ADMIN.>"]
    assert "talaria.admin.drain" in router["subscribe"]["allow"] and "_TALARIA_ADMIN.>" in router["publish"]["allow"]
    for role in ("gateway", "telemetry", "client"):
        assert "talaria.admin.drain" not in permissions(role)["publish"]["allow"]
    assert "talaria.admin.drain" not in permissions("agent", instance_id="a0")["publish"]["allow"]


def test_the_gateway_answers_only_in_the_callers_own_inbox_space():
    """Issue 25: a request naming another tenant's inbox, a kept answer or a token stream as its
    reply subject is not answered; NATS itself lets the gateway publish only into inboxes."""
    assert reply_allowed("acme", "_INBOX.acme.x1.2")
    assert not reply_allowed("acme", "_INBOX.acme2.x1.2")  # a tenant whose name extends acme's
    assert not reply_allowed("acme", "_INBOX.beta.x1.2")
    assert not reply_allowed("acme", "talaria.reply.gateway.idem.0123456789abcdef-c1")
    assert not reply_allowed("acme", tokens("acme", "c1"))
    assert not reply_allowed("acme", "_INBOX.acme")  # the prefix itself is no inbox
    assert not reply_allowed("acme", None)
    assert reply_allowed("", "_INBOX.x1.2") and not reply_allowed("", "_TALARIA_INBOX.x1.2")
    gateway = permissions("gateway")
    assert not gateway.get("allow_responses")  # would let any request name any reply subject
    assert not any(s.startswith(("talaria.reply", "talaria.tokens")) for s in gateway["publish"]["allow"])


def test_answers_and_tokens_are_taken_only_from_the_services_that_send_them():
    router, agent = {SENDER_HEADER: "talaria-router"}, {SENDER_HEADER: "talaria-agent-agent-0"}
    gateway, client = {SENDER_HEADER: "talaria-gateway"}, {SENDER_HEADER: "talaria-client-mallory"}
    assert sent_by(router, ANSWERING_ROLES) and sent_by(agent, ANSWERING_ROLES)
    assert not any(sent_by(h, ANSWERING_ROLES) for h in (gateway, client, {}, None))
    assert sent_by(agent, STREAMING_ROLES) and not sent_by(router, STREAMING_ROLES)


def test_malformed_authorization_is_a_401_never_a_500():
    """Issue 25: invalid UTF-8 in the header (aiohttp keeps the bytes as surrogates) raised
    UnicodeEncodeError while hashing: an unauthenticated 500."""
    store = KeyStore.from_settings(GatewaySettings(api_keys=("acme:acme-key-0123456789",)))
    bad = b"Bearer \xff\xfe-key".decode("utf-8", "surrogateescape")
    for headers in ({"Authorization": bad}, {"x-api-key": "\udcff"}, {"Authorization": "Basic abc"},
                    {"Authorization": "Bearer"}):
        with pytest.raises(Unauthenticated):
            store.tenant_for(headers)


def test_no_api_key_or_password_reaches_a_log_line():
    import logging

    from talaria.shared.logs import RedactSecrets

    record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request: %s",
                               ("Invalid header line b'Authorization: Bearer tk-SECRETSECRETSECRET'",), None)
    RedactSecrets().filter(record)
    assert "SECRET" not in record.getMessage() and "[redacted]" in record.getMessage()
    for line in ("x-api-key: k-0123456789abcdef", "nats://talaria-gateway:pw0123@127.0.0.1:4222"):
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, line, (), None)
        RedactSecrets().filter(record)
        assert "0123" not in record.getMessage(), record.getMessage()
