"""API-key rules, one per test (services/gateway/auth.py): each test breaks when its rule
alone is broken, and where two checks guard the same input, each is tested on an input only
it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from talaria.services.gateway.auth import KeyStore, Unauthenticated, client_session, kv_scope, scoped_session
from talaria.shared.api_keys import InvalidKeyEntry, hash_key, parse_key_entry, read_key_file, write_key_file

KEY = "acme-key-0123456789"  # valid, at least 16 characters
DIGEST = hash_key(KEY)


def test_an_entry_is_tenant_colon_key_or_tenant_colon_hash():
    assert parse_key_entry(f"acme:{KEY}") == ("acme", DIGEST)
    assert parse_key_entry(f"  acme:{DIGEST} ") == ("acme", DIGEST)


def test_an_entry_without_a_separator_is_refused():
    with pytest.raises(InvalidKeyEntry, match="entries"):
        parse_key_entry(KEY)  # (partition leaves rest "" too: `not rest` alone would refuse it)


def test_an_entry_with_an_empty_key_is_refused():
    with pytest.raises(InvalidKeyEntry, match="entries"):
        parse_key_entry("acme:")  # sep present, rest empty: only `not rest` refuses it


def test_an_empty_tenant_name_is_refused():
    with pytest.raises(InvalidKeyEntry, match="tenant name"):
        parse_key_entry(f":{DIGEST}")
    with pytest.raises(InvalidKeyEntry, match="tenant name"):
        parse_key_entry(f":{KEY}")


def test_a_tenant_name_outside_the_pattern_is_refused():
    with pytest.raises(InvalidKeyEntry, match="tenant name"):
        parse_key_entry(f"a b:{KEY}")
    assert parse_key_entry(f"{'t' * 64}:{KEY}")[0] == "t" * 64
    with pytest.raises(InvalidKeyEntry, match="tenant name"):
        parse_key_entry(f"{'t' * 65}:{KEY}")


def test_a_malformed_hash_is_refused_not_hashed_as_a_key():
    with pytest.raises(InvalidKeyEntry, match="64 lowercase hex"):
        parse_key_entry("acme:sha256:" + "A" * 64)


def test_a_plaintext_key_needs_16_characters_exactly_at_the_boundary():
    assert parse_key_entry("acme:" + "k" * 16) == ("acme", hash_key("k" * 16))
    with pytest.raises(InvalidKeyEntry, match="at least 16"):
        parse_key_entry("acme:" + "k" * 15)


def test_a_key_file_skips_comments_and_blank_lines_and_names_the_bad_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# keys\n\n  \nacme {DIGEST}  # the first\nbeta {hash_key('b' * 16)}\n")
    assert read_key_file(path) == [("acme", DIGEST), ("beta", hash_key("b" * 16))]
    path.write_text(f"acme {DIGEST}\n\nbeta sha256:nothex\n")
    with pytest.raises(InvalidKeyEntry, match=r"keys:3: "):
        read_key_file(path)


def test_write_key_file_creates_the_folder_owner_only(tmp_path):
    path = tmp_path / "new" / "keys"
    write_key_file(path, [("acme", DIGEST)])
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    write_key_file(path, [("acme", DIGEST)])  # an existing file keeps no looser mode
    assert path.stat().st_mode & 0o777 == 0o600


def test_keys_from_settings_and_the_file_both_count(tmp_path):
    path = tmp_path / "keys"
    write_key_file(path, [("beta", hash_key("b" * 16))])
    store = KeyStore.from_settings(SimpleNamespace(api_keys=(f"acme:{KEY}",), api_keys_file=path))
    assert store.tenants == {DIGEST: "acme", hash_key("b" * 16): "beta"}


def test_an_authorization_scheme_other_than_bearer_is_refused_even_with_a_valid_key():
    store = KeyStore({DIGEST: "acme"})
    assert store.tenant_for({"Authorization": f"bearer {KEY}"}) == "acme"  # the scheme is case-insensitive
    for value in (f"Basic {KEY}", f"Token {KEY}", "Bearer ", "Bearer"):
        with pytest.raises(Unauthenticated, match="must be `Bearer <key>`"):
            store.tenant_for({"Authorization": value})


def test_either_spelling_of_either_header_carries_the_key():
    store = KeyStore({DIGEST: "acme"})
    for headers in ({"x-api-key": KEY}, {"X-Api-Key": KEY}, {"Authorization": f"Bearer {KEY}"},
                    {"authorization": f"Bearer {KEY}"}):
        assert store.tenant_for(headers) == "acme", headers


def test_missing_and_unknown_keys_say_which():
    store = KeyStore({DIGEST: "acme"})
    with pytest.raises(Unauthenticated, match="missing API key") as missing:
        store.tenant_for({})
    assert missing.value.message.startswith("missing API key")
    with pytest.raises(Unauthenticated, match="invalid API key") as unknown:
        store.tenant_for({"x-api-key": "nope-nope-nope-nope"})
    assert str(unknown.value) == unknown.value.message == "invalid API key"
    assert KeyStore().tenant_for({"x-api-key": "anything"}) == ""  # no keys configured: open


def test_client_session_strips_only_its_own_tenant_prefix():
    assert client_session("a", "a:s") == "s"
    assert client_session("a", "b:s") == "b:s"  # another tenant's prefix is part of the id
    assert client_session("", ":s") == ":s"  # no tenant: nothing to strip, even a leading ':'
    assert scoped_session("a", "s") == "a:s"


def test_kv_scope_per_sharing_mode():
    assert kv_scope("global", "a", "a:s") == ""
    assert kv_scope("session", "a", "a:s") == "session:a:s"
    assert kv_scope("tenant", "a", "a:s") == "tenant:a"
    assert kv_scope("tenant", "", "s") == ""


def test_a_key_header_sent_twice_is_a_400_whichever_copy_is_valid():
    from multidict import CIMultiDict

    store = KeyStore({DIGEST: "acme"})
    for name, good in (("Authorization", f"Bearer {KEY}"), ("x-api-key", KEY)):
        for pair in ((good, "Bearer nope"), ("Bearer nope", good)):
            with pytest.raises(Unauthenticated, match="more than once") as info:
                store.tenant_for(CIMultiDict([(name, pair[0]), (name.upper(), pair[1])]))
            assert info.value.status == 400
    assert store.tenant_for(CIMultiDict([("Authorization", f"Bearer {KEY}")])) == "acme"
